"""Request bodies: Fish ``POST /v1/tts`` and OpenAI ``POST /v1/audio/speech``.

Fish bodies arrive as MessagePack (what both SDKs send) or JSON. A msgpack ``nil`` (JSON
``null``) means "absent" for every optional field: the legacy SDK sends ``sample_rate: nil``,
``prosody: nil`` and so on. Unknown keys (``features``, ``normalize_loudness``, future fields)
are ignored. Field ranges follow the hosted API; a value outside them is a 422.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

BUILTIN_OPENAI_VOICES = frozenset({
    "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer",
    "verse", "marin", "cedar", "default",
})


def _drop_none(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None}
    return data


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _nil_is_absent(cls, data: Any) -> Any:
        return _drop_none(data)


class ReferenceIn(_Body):
    """An inline voice reference: audio bytes (msgpack bin, or base64 text in JSON) + transcript."""

    audio: bytes
    text: str = Field(max_length=10_000)

    @field_validator("audio", mode="before")
    @classmethod
    def _audio_bytes(cls, v: Any) -> Any:
        if isinstance(v, (bytes, bytearray, memoryview)):
            return bytes(v)
        if isinstance(v, str):  # JSON: base64, optionally as a data: URL
            payload = v.split(",", 1)[1] if v.startswith("data:") and "," in v else v
            try:
                return base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("audio must be bytes (msgpack bin) or base64 text") from None
        raise ValueError("audio must be bytes (msgpack bin) or base64 text")


class ProsodyIn(_Body):
    speed: float = Field(1.0, ge=0.5, le=2.0)
    volume: float = Field(0.0, ge=-20.0, le=20.0)  # dB
    normalize_loudness: bool = True  # hosted default (S2); the SDK never sends it


class TTSRequestIn(_Body):
    """``POST /v1/tts``; defaults are the hosted API's (the SDK sends its own explicitly)."""

    text: str
    chunk_length: int = Field(300, ge=100, le=300)
    format: str = "mp3"
    sample_rate: int | None = None
    mp3_bitrate: int = 128
    opus_bitrate: int = -1000
    references: list[ReferenceIn] | list[list[ReferenceIn]] = Field(default_factory=list)
    reference_id: str | list[str] | None = None
    normalize: bool = True
    latency: Literal["normal", "balanced", "low"] = "normal"
    prosody: ProsodyIn | None = None
    top_p: float = Field(0.7, ge=0.0, le=1.0)
    temperature: float = Field(0.7, ge=0.0, le=1.0)
    max_new_tokens: int = Field(1024, ge=0)
    repetition_penalty: float = Field(1.2, gt=0.0, lt=2.0)
    # accepted for compatibility; shoal's scheduler does not use them (docs/server.md)
    min_chunk_length: int = Field(50, ge=0, le=100)
    condition_on_previous_chunks: bool = True
    early_stop_threshold: float = Field(1.0, ge=0.0, le=1.0)
    features: list[str] = Field(default_factory=list)
    # shoal extensions
    seed: int | None = Field(None, ge=0, lt=2**63)
    top_k: int = Field(30, ge=1, le=4096)
    language: str | None = Field(None, max_length=16)  # for `normalize`; None = guessed

    @field_validator("format", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v

    def reference_groups(self) -> list[list[ReferenceIn]]:
        """References per speaker: a flat list is speaker i = reference i (one each)."""
        refs = self.references
        if refs and isinstance(refs[0], list):
            return [list(g) for g in refs]  # type: ignore[arg-type]
        return [[r] for r in refs]  # type: ignore[list-item]

    @property
    def multi_speaker_references(self) -> bool:
        return bool(self.references) and isinstance(self.references[0], list)

    def reference_ids(self) -> list[str]:
        rid = self.reference_id
        if rid is None or rid == "":
            return []
        return [rid] if isinstance(rid, str) else list(rid)


class VoiceRef(_Body):
    id: str


class SpeechRequestIn(_Body):
    """OpenAI ``POST /v1/audio/speech`` (plus shoal extensions via the SDK's ``extra_body``)."""

    model: str = "tts-1"
    input: str
    voice: str | VoiceRef = "alloy"
    instructions: str | None = None  # accepted, not used
    response_format: str = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    # extensions
    sample_rate: int | None = None
    references: list[ReferenceIn] = Field(default_factory=list)
    normalize: bool = True
    latency: Literal["normal", "balanced", "low"] = "balanced"
    temperature: float = Field(0.7, ge=0.0, le=1.0)
    top_p: float = Field(0.7, ge=0.0, le=1.0)
    top_k: int = Field(30, ge=1, le=4096)
    max_new_tokens: int = Field(1024, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    language: str | None = Field(None, max_length=16)

    @field_validator("response_format", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v

    def reference_id(self) -> str | None:
        """None for the built-in voice names (= the model's default voice), else a voice id."""
        if isinstance(self.voice, VoiceRef):
            return self.voice.id
        if self.voice.strip().lower() in BUILTIN_OPENAI_VOICES or not self.voice.strip():
            return None
        return self.voice
