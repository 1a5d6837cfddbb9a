"""What every route needs, hung on ``app.state.shoal``."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from fastapi import Request

from ..engine.sampling import SamplingParams
from .auth import Authenticator, KeyLimiter
from .config import ServerConfig
from .errors import APIError
from .limits import check_overload
from .metrics import Metrics
from .service import TTSService


@dataclass
class ServerState:
    service: TTSService
    config: ServerConfig
    auth: Authenticator
    limiter: KeyLimiter
    metrics: Metrics

    @property
    def overload_threshold(self) -> int:
        return self.config.max_pending or 4 * self.service.max_running

    def admit(self, request: Request):
        """Auth (401), readiness (503), overload (503) -> a per-key lease (429 when over)."""
        key = self.auth.check(request)
        if not self.service.ready:
            raise APIError(503, "the server is warming up; retry shortly",
                           {"Retry-After": str(self.config.retry_after_s)})
        check_overload(self.service, self.overload_threshold, self.config.retry_after_s)
        return self.limiter.acquire(key)

    def frames_budget(self, requested: int) -> int:
        cap = self.config.max_new_tokens_cap
        if not cap:
            return requested
        return cap if requested == 0 else min(requested, cap)


def get_state(request: Request) -> ServerState:
    return request.app.state.shoal


def sampling_params(temperature: float, top_p: float, top_k: int, repetition_penalty: float = 1.0
                    ) -> SamplingParams:
    """API sampling values -> engine params. temperature 0 or top_p 0 mean greedy decoding."""
    if temperature <= 0.0 or top_p <= 0.0:
        return SamplingParams(greedy=True, top_p=1.0, top_k=top_k, repetition_penalty=repetition_penalty)
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                          repetition_penalty=repetition_penalty)


def request_seed(seed: int | None) -> int:
    return secrets.randbits(31) if seed is None else int(seed)
