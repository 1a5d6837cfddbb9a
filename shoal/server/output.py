"""Per-request audio output: engine PCM (float32, 44.1 kHz) -> prosody -> encoder -> bytes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .audio_encode import available_formats, make_encoder
from .errors import APIError
from .prosody import SPEED_RANGE, ProsodyProcessor


@dataclass(frozen=True)
class ProsodySpec:
    speed: float = 1.0
    volume_db: float = 0.0
    normalize_loudness: bool = False

    @property
    def is_identity(self) -> bool:
        return self.speed == 1.0 and self.volume_db == 0.0 and not self.normalize_loudness


def clamp_speed(speed: float) -> float:
    """Speeds the time-stretcher supports (0.5-2.0); OpenAI allows 0.25-4.0, shoal clamps."""
    lo, hi = SPEED_RANGE
    return min(max(float(speed), lo), hi)


class AudioPipeline:
    """Not thread-safe; one per request. ``feed``/``close`` may run in a worker thread."""

    def __init__(self, fmt: str, *, input_rate: int, sample_rate: int | None, bitrate,
                 prosody: ProsodySpec | None = None) -> None:
        fmt = str(fmt).lower()
        if fmt not in available_formats():
            raise APIError(400, f"unsupported format {fmt!r}; this server produces "
                                f"{', '.join(sorted(available_formats()))}")
        try:
            self.encoder = make_encoder(fmt, input_rate=input_rate, sample_rate=sample_rate,
                                        bitrate=bitrate, streaming=True)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        self.format = fmt
        self.prosody = None
        if prosody is not None and not prosody.is_identity:
            try:
                self.prosody = ProsodyProcessor(input_rate, speed=prosody.speed, volume_db=prosody.volume_db,
                                                normalize_loudness=prosody.normalize_loudness)
            except ValueError as e:
                raise APIError(400, str(e)) from None

    @property
    def content_type(self) -> str:
        return self.encoder.content_type

    @property
    def sample_rate(self) -> int:
        return self.encoder.sample_rate

    def feed(self, pcm: np.ndarray) -> bytes:
        x = self.prosody.feed(pcm) if self.prosody is not None else pcm
        return self.encoder.feed(x) if len(x) else b""

    def close(self) -> bytes:
        out = b""
        if self.prosody is not None:
            tail = self.prosody.close()
            if len(tail):
                out += self.encoder.feed(tail)
        return out + self.encoder.close()
