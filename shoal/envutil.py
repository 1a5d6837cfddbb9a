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
