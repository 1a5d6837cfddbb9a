"""Reading the ``SHOAL_*`` tuning variables: one parser, one error message."""

from __future__ import annotations

import os


def env_int(name: str, default: int) -> int:
    """``int(os.environ[name])`` (unset or blank: ``default``); a non-integer or negative value
    raises ValueError naming the variable."""
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {v!r}") from None
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return n


def env_flag(name: str) -> bool | None:
    """An on/off variable: ``1/true/on/yes`` True, ``0/false/off/no`` False, unset or blank None
    (the caller keeps its own setting); anything else raises ValueError naming the variable."""
    v = os.environ.get(name, "").strip().lower()
    if not v:
        return None
    if v not in ("0", "1", "true", "false", "on", "off", "yes", "no"):
        raise ValueError(f"{name} must be 0 or 1, got {v!r}")
    return v in ("1", "true", "on", "yes")
