"""Bearer-key auth and the per-key concurrency limit.

Keys come from ``--api-key`` (repeatable) and/or ``--api-keys-file`` (one key per line, blank
lines and ``#`` comments ignored). With no key configured the server is open: any token, or
none, is accepted. The concurrency limit counts in-flight synthesis requests per presented
token (the empty string for requests without one) and answers 429 with ``Retry-After``, as the
hosted API does when an account is over its concurrency tier.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Iterable
from pathlib import Path

from fastapi import Request

from .errors import APIError


def load_api_keys(keys: Iterable[str] = (), keys_file: str | Path | None = None) -> frozenset[str]:
    out = {k.strip() for k in keys if k and k.strip()}
    if keys_file is not None:
        path = Path(keys_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise ValueError(f"cannot read API keys file {path}: {e.strerror or e}") from None
        found = {ln.split("#", 1)[0].strip() for ln in lines}
        found.discard("")
        if not found:
            raise ValueError(f"API keys file {path} holds no key")
        out |= found
    return frozenset(out)


def bearer_token(request: Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``; None when the header is absent."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return ""
    return token.strip()


class Authenticator:
    def __init__(self, keys: frozenset[str]) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, request: Request) -> str:
        """The caller's identity (its token); raises 401 when keys are configured and it's wrong."""
        token = bearer_token(request)
        if not self._keys:
            return token or ""
        if not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           {"WWW-Authenticate": "Bearer"})
        given = token.encode()
        ok = False
        for key in self._keys:  # compare against every key: no early exit
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise APIError(401, "invalid API key", {"WWW-Authenticate": "Bearer"})
        return token


class Lease:
    """One in-flight request of a key; ``release`` is idempotent."""

    def __init__(self, limiter: KeyLimiter | None, key: str) -> None:
        self._limiter = limiter
        self.key = key

    def release(self) -> None:
        limiter, self._limiter = self._limiter, None
        if limiter is not None:
            limiter._release(self.key)


class KeyLimiter:
    def __init__(self, limit: int, retry_after_s: int = 1) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def in_flight(self, key: str) -> int:
        with self._lock:
            return self._counts.get(key, 0)

    def acquire(self, key: str) -> Lease:
        with self._lock:
            n = self._counts.get(key, 0)
            if self.limit and n >= self.limit:
                raise APIError(429, f"concurrency limit reached: {n} requests in flight for this key "
                                    f"(limit {self.limit})", {"Retry-After": str(self.retry_after_s)})
            self._counts[key] = n + 1
        return Lease(self, key)

    def _release(self, key: str) -> None:
        with self._lock:
            n = self._counts.get(key, 0) - 1
            if n > 0:
                self._counts[key] = n
            else:
                self._counts.pop(key, None)
