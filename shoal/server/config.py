"""Server settings (everything ``shoal serve`` takes besides the model)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerConfig:
    # auth: no keys = open server (any or no bearer token is accepted)
    api_keys: frozenset[str] = field(default_factory=frozenset)
    max_concurrency_per_key: int = 0  # in-flight synthesis requests per key; 0 = unlimited
    # limits
    max_text_length: int = 10_000  # characters of `text` / `input`
    max_body_bytes: int = 32 << 20  # request body (inline reference audio included)
    max_pending: int | None = None  # engine waiting + running + preparing; None = 4 × max_running
    max_new_tokens_cap: int | None = None  # clamp each request's frames per text batch
    retry_after_s: int = 1  # Retry-After on 429 / 503
    # OpenAI route: `pcm` is 24 kHz s16le like OpenAI's (clients assume it) unless the body
    # sets `sample_rate`; the other formats carry their rate and keep the encoder's default
    openai_pcm_sample_rate: int = 24_000
    # voice library (shoal.server.voices_api): /model + reference_id; None = no library
    voices_dir: str | None = None

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    def validate(self) -> None:
        if self.max_concurrency_per_key < 0:
            raise ValueError("max_concurrency_per_key must be >= 0")
        if self.max_text_length < 1:
            raise ValueError("max_text_length must be >= 1")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.max_pending is not None and self.max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        if self.max_new_tokens_cap is not None and self.max_new_tokens_cap < 1:
            raise ValueError("max_new_tokens_cap must be >= 1")
        if any(not k for k in self.api_keys):
            raise ValueError("API keys must be non-empty")
