"""Audio file I/O for the codec: decode + mono + resample to 44.1 kHz, and WAV/PCM output.

Deviations from the reference (documented in docs/codec.md):

* resampling uses ``soxr`` (HQ) instead of torchaudio / librosa, so encoded
  codes of non-44.1 kHz input can differ slightly from the reference's;
* int16 conversion clips to [-1, 1] first; the reference computes
  ``int16(wave · 32768)`` and wraps around at +1.0.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import BinaryIO, Union

import numpy as np
import soundfile as sf
import soxr

__all__ = [
    "AudioDecodeError",
    "AudioLimitError",
    "SAMPLE_RATE",
    "load_audio",
    "resample",
    "to_int16",
    "write_wav",
    "encode_file",
    "decode_to_wav",
]

SAMPLE_RATE = 44100

AudioSource = Union[str, os.PathLike, bytes, bytearray, memoryview, BinaryIO]


class AudioDecodeError(ValueError):
    """The audio data could not be decoded."""


class AudioLimitError(AudioDecodeError):
    """The audio decodes, but is longer or stored at a lower rate than a caller accepts."""


MIN_SAMPLE_RATE = 4000  # below telephone rates: not speech a codec at 44.1 kHz can clone from


def resample(audio: np.ndarray, orig_sr: int, target_sr: int = SAMPLE_RATE) -> np.ndarray:
    """Resample a mono float array with soxr (HQ); a no-op when the rates agree."""
    audio = np.asarray(audio, dtype=np.float32)
    if orig_sr == target_sr or audio.size == 0:
        return audio
    return soxr.resample(audio, orig_sr, target_sr, quality="HQ").astype(np.float32, copy=False)


def load_audio(source: AudioSource, sample_rate: int = SAMPLE_RATE, *,
               max_seconds: float | None = None) -> np.ndarray:
    """Read audio (wav / flac / ogg / mp3 / anything libsndfile reads) → mono float32 at ``sample_rate``.

    ``source`` is a path, raw file bytes, or a binary file object.  Channels
    are averaged; other rates are resampled with soxr (HQ).  ``max_seconds``: audio
    longer than this, or stored at under :data:`MIN_SAMPLE_RATE` Hz, is refused from its
    header, before anything is decoded or resampled (a few KB of 1 Hz audio would otherwise
    resample to gigabytes).
    """
    name = "<bytes>"
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        name = str(path)
        if not path.is_file():
            raise FileNotFoundError(f"audio file not found: {path}")
        f: object = str(path)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise AudioDecodeError("cannot decode audio: empty data")
        f = io.BytesIO(bytes(source))
    else:
        f = source
        name = getattr(source, "name", "<stream>")
    try:
        if max_seconds is not None:
            _check_header(f, name, max_seconds)
        data, sr = sf.read(f, dtype="float32", always_2d=True)
    except AudioDecodeError:
        raise
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        msg = str(e).replace(repr(f), name)  # libsndfile names the file object by its repr
        raise AudioDecodeError(f"cannot decode audio {name}: {msg}") from None
    mono = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
    return np.ascontiguousarray(resample(mono, int(sr), sample_rate), dtype=np.float32)


def _check_header(f, name: str, max_seconds: float) -> None:
    """Refuse ``f`` from its header: a duration over ``max_seconds`` or a sample rate under
    :data:`MIN_SAMPLE_RATE` (a file object is rewound for the real read)."""
    info = sf.info(f)
    if hasattr(f, "seek"):
        f.seek(0)
    if info.samplerate < MIN_SAMPLE_RATE:
        raise AudioLimitError(f"audio {name} is stored at {info.samplerate} Hz; the lowest rate "
                               f"accepted is {MIN_SAMPLE_RATE} Hz")
    seconds = info.frames / info.samplerate
    if seconds > max_seconds:
        raise AudioLimitError(f"audio {name} is {seconds:.1f} s long; the limit is {max_seconds:g} s")


def to_int16(audio) -> np.ndarray:
    """Float waveform → int16 PCM: clip to [-1, 1], scale by 32768, truncate like the reference.

    Values in (-1, 1) give exactly the reference ``int16(x · 32768)``; +1.0
    saturates at 32767 instead of wrapping to -32768.
    """
    if hasattr(audio, "detach"):
        audio = audio.detach().float().cpu().numpy()
    x = np.nan_to_num(np.asarray(audio, dtype=np.float32), nan=0.0)
    x = np.clip(x, -1.0, 1.0) * np.float32(32768.0)
    return np.clip(x, -32768.0, 32767.0).astype(np.int16)


def write_wav(path, audio, sample_rate: int = SAMPLE_RATE, subtype: str = "PCM_16") -> None:
    """Write a mono (or [N, C]) waveform; ``PCM_16`` goes through :func:`to_int16` (clipped).

    ``path`` may be a file path or a binary file object.  Float subtypes
    (``FLOAT``) are written clipped to [-1, 1] as well.
    """
    if hasattr(audio, "detach"):
        audio = audio.detach().float().cpu().numpy()
    audio = np.asarray(audio)
    if audio.ndim == 2 and audio.shape[0] == 1:
        audio = audio[0]
    if audio.ndim > 2:
        raise ValueError(f"audio must be [N] or [N, C], got shape {audio.shape}")
    if subtype == "PCM_16":
        data = audio if audio.dtype == np.int16 else to_int16(audio)
    else:
        data = np.clip(audio.astype(np.float32), -1.0, 1.0)
    fmt = None
    if not isinstance(path, (str, os.PathLike)):
        fmt = "WAV"
    sf.write(path, data, sample_rate, subtype=subtype, format=fmt)


# --------------------------------------------------------------------- CLI helpers
def encode_file(codec, path: AudioSource) -> np.ndarray:
    """Read an audio file and encode it → int64 codes [num_codebooks, T]."""
    import torch

    audio = load_audio(path, codec.sample_rate)
    if audio.size == 0:
        raise AudioDecodeError(f"no audio samples in {path if isinstance(path, (str, os.PathLike)) else '<data>'}")
    x = torch.from_numpy(audio)[None, None]
    codes, _ = codec.encode(x)
    return codes[0].cpu().numpy().astype(np.int64)


def decode_to_wav(codec, codes, path, subtype: str = "PCM_16") -> np.ndarray:
    """Decode codes [num_codebooks, T] (numpy or tensor) and write a WAV; returns the float waveform."""
    import torch

    c = torch.as_tensor(np.asarray(codes) if not isinstance(codes, torch.Tensor) else codes)
    if c.dim() == 2:
        c = c[None]
    if c.dim() != 3 or c.shape[0] != 1:
        raise ValueError(f"codes must be [{codec.num_codebooks}, T], got shape {tuple(c.shape)}")
    wave = codec.decode(c.long())[0, 0].float().cpu().numpy()
    write_wav(path, wave, codec.sample_rate, subtype=subtype)
    return wave
