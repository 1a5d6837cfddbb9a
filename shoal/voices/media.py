"""Uploaded media: audio and image formats recognised from their content, never their name.

* :func:`sniff_audio` names the container from its magic bytes (wav, flac, ogg, mp3, m4a);
  :func:`decode_audio` then decodes it (libsndfile through :func:`shoal.codec.load_audio`, with
  PyAV as the fallback, e.g. for m4a/AAC) to mono float32 at the codec rate. Anything else,
  a text file renamed ``.wav`` included, is :class:`UnsupportedMedia`.
* :func:`sniff_image` recognises cover images (png, jpeg, gif, webp).
"""

from __future__ import annotations

import io

import numpy as np

from ..codec.audio import MIN_SAMPLE_RATE, AudioDecodeError, AudioLimitError, load_audio, resample
from .errors import UnsupportedMedia

__all__ = ["AUDIO_FORMATS", "IMAGE_TYPES", "UnsupportedMedia", "decode_audio", "sniff_audio", "sniff_image"]

AUDIO_FORMATS = ("wav", "flac", "ogg", "mp3", "m4a")
AUDIO_TYPES = {"wav": "audio/wav", "flac": "audio/flac", "ogg": "audio/ogg", "mp3": "audio/mpeg",
               "m4a": "audio/mp4"}
IMAGE_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "gif": "image/gif", "webp": "image/webp"}


def sniff_audio(data: bytes) -> str | None:
    """The audio container of ``data`` from its first bytes, or None when unrecognised."""
    head = bytes(data[:16])
    if len(head) < 12:
        return None
    if head[:4] in (b"RIFF", b"RF64", b"BW64") and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[4:8] == b"ftyp":
        return "m4a"
    if head[:3] == b"ID3":
        return "mp3"
    # an MPEG audio frame header: 11 sync bits, then version, then a layer that is not 00
    # (layer 00 with the same sync is an AAC ADTS stream, which is not accepted bare)
    if head[0] == 0xFF and (head[1] & 0xE0) == 0xE0 and (head[1] & 0x06) != 0 and (head[1] & 0x18) != 0x08:
        return "mp3"
    return None


def _decode_av(data: bytes, sample_rate: int, max_seconds: float | None = None) -> np.ndarray:
    try:
        import av
    except ImportError as e:  # pragma: no cover - PyAV is a dependency
        raise AudioDecodeError(f"PyAV is needed to decode this file: {e}") from None
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None:
                raise AudioDecodeError("the file has no audio stream")
            rate = int(stream.codec_context.sample_rate or stream.rate or 0)
            if rate <= 0:
                raise AudioDecodeError("the audio stream has no sample rate")
            if rate < MIN_SAMPLE_RATE:
                raise AudioLimitError(f"the audio is stored at {rate} Hz; the lowest rate accepted is "
                                      f"{MIN_SAMPLE_RATE} Hz")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            parts: list[np.ndarray] = []
            limit = None if max_seconds is None else int(max_seconds * rate) + rate
            got = 0
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    parts.append(out.to_ndarray().reshape(-1))
                    got += parts[-1].size
                if limit is not None and got > limit:  # decoding stops once it is over the limit
                    raise AudioLimitError(f"the audio is over {max_seconds:g} s long; the limit is {max_seconds:g} s")
            for out in resampler.resample(None):
                parts.append(out.to_ndarray().reshape(-1))
    except AudioDecodeError:
        raise
    except Exception as e:  # noqa: BLE001 - PyAV raises its own error tree (FFmpegError, ...)
        raise AudioDecodeError(f"cannot decode audio: {e}") from None
    mono = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
    return np.ascontiguousarray(resample(mono, rate, sample_rate), dtype=np.float32)


def decode_audio(data: bytes, sample_rate: int, max_seconds: float | None = None) -> tuple[str, np.ndarray]:
    """``(format, mono float32 samples at sample_rate)``; :class:`UnsupportedMedia` when the bytes
    are not one of :data:`AUDIO_FORMATS` or do not decode as one. ``max_seconds``: a file whose
    header says it is longer (or stored under ``MIN_SAMPLE_RATE``) raises
    :class:`~shoal.codec.audio.AudioLimitError` before it is decoded."""
    fmt = sniff_audio(data)
    if fmt is None:
        raise UnsupportedMedia("not a supported audio file (the content is not wav, flac, ogg, mp3 or "
                               "m4a; the file name is not trusted)")
    errors = []
    decoders = (_decode_av,) if fmt == "m4a" else (load_audio, _decode_av)
    for decoder in decoders:
        try:
            samples = decoder(data, sample_rate, max_seconds=max_seconds)
        except AudioLimitError:
            raise  # the header was read: no other decoder may try (and resample) it
        except (AudioDecodeError, RuntimeError, ValueError) as e:
            errors.append(str(e))
            continue
        if not np.all(np.isfinite(samples)):
            raise UnsupportedMedia(f"the {fmt} audio decodes to non-finite samples")
        return fmt, samples
    raise UnsupportedMedia(f"looks like {fmt} but does not decode: {errors[-1] if errors else 'unknown error'}")


def sniff_image(data: bytes) -> str | None:
    """png / jpeg / gif / webp from the magic bytes, or None."""
    head = bytes(data[:16])
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return None
