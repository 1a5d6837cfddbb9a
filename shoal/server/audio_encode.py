"""Streaming audio encoders: float32 mono PCM in, container bytes out.

The codec decodes audio a few frames at a time; each chunk goes through
:meth:`StreamEncoder.feed`, which returns the bytes that are ready *now*
(possibly ``b""``), and :meth:`StreamEncoder.close` flushes the rest.  The
concatenation of every ``feed`` output and the ``close`` output is one
valid file / stream.  Nothing here knows about HTTP.

Formats (``FORMATS``) and what they produce:

======  ====================  ===============================================
format  content type          bytes
======  ====================  ===============================================
wav     ``audio/wav``         RIFF/WAVE, 16-bit PCM mono
pcm     ``audio/pcm``         raw signed 16-bit little-endian mono, no header
mp3     ``audio/mpeg``        MPEG audio frames (LAME), CBR
opus    ``audio/ogg``         Opus (libopus) in Ogg, RFC 7845
aac     ``audio/aac``         AAC-LC (FFmpeg's encoder) in ADTS frames
flac    ``audio/flac``        native FLAC, 16-bit
======  ====================  ===============================================

Processing order for every format: resample the input to the output rate
with a streaming ``soxr`` resampler (carried filter state, so chunk
boundaries are seamless), replace NaN/inf by 0, clip to [-1, 1], then
convert / encode.

Sample rates (``sample_rate=None`` picks the default):

* wav, pcm, flac: any integer rate in [8000, 192000]; default = input rate.
* mp3: the MPEG-1/2/2.5 rates LAME supports (8000 … 48000); default = input
  rate when valid, else 44100.  (Fish's docs list 32000 and 44100.)
* aac: the AAC sampling-frequency-index rates (8000 … 96000); default as mp3.
* opus: 8000, 12000, 16000, 24000, 48000 (what libopus can encode); default
  48000, as Fish does.  An explicit unsupported rate is rejected.  Note that
  Opus decoders normally *output* 48 kHz whatever the encoded rate; the
  ``OpusHead`` records the encoded rate.

Streaming vs. not (``streaming=``):

* wav, streaming: the header goes out with the first bytes and carries the
  "unknown length" placeholder sizes Fish's hosted API sends (RIFF size
  4294967076, data size 4294967040), so a client can play while it
  downloads.  Not streaming: everything is buffered and ``close`` returns
  one file with exact sizes.
* pcm: always streamed (there is no header to fix).
* mp3/aac/flac (PyAV muxers writing to an in-memory sink): streaming writes
  through a non-seekable sink with ``flush_packets`` on, so each ``feed``
  returns the frames the encoder has emitted so far; mp3 is plain frames
  (no ID3 tag, no Xing frame), flac has no padding block and an "unknown"
  total-sample count.  Not streaming: the muxer writes into a seekable
  buffer returned by ``close``, so it can go back and fix headers (mp3
  gets a Xing/LAME "Info" frame with gapless delay/padding, flac gets the
  exact total-sample count and MD5).
* opus: PyAV drives libopus, but the Ogg pages are written here
  (:class:`_OggOpusWriter`).  FFmpeg's Ogg muxer holds packets for up to a
  second (``page_duration``) and PyAV offers no way to flush it, which
  would delay the first audio by ~1 s; our writer closes a page at the end
  of every ``feed`` instead.

Bitrates are in bits per second; :func:`parse_bitrate` turns API values
into that (values below 1000 are kbps, so both Fish's ``opus_bitrate: 32``
and the OpenAPI's ``32000`` mean 32 kbps; ``-1000`` means "codec decides").
Lossless formats ignore the bitrate.
"""

from __future__ import annotations

import io
import math
import struct
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = [
    "CONTENT_TYPES",
    "FORMATS",
    "StreamEncoder",
    "default_sample_rate",
    "encode_audio",
    "make_encoder",
    "parse_bitrate",
    "supported_sample_rates",
]

FORMATS = {"wav", "pcm", "mp3", "opus", "aac", "flac"}

CONTENT_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
}

LOSSLESS = {"wav", "pcm", "flac"}

# Any integer rate in this range for the formats that can store any rate.
_FREE_RATE_RANGE = (8000, 192000)
_MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
_AAC_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
_FIXED_RATES = {"mp3": _MP3_RATES, "aac": _AAC_RATES, "opus": _OPUS_RATES}

# Accepted bitrate ranges (bps) and defaults (None = the codec's own choice).
_BITRATE_RANGE = {"mp3": (8_000, 320_000), "aac": (16_000, 512_000), "opus": (6_000, 256_000)}
_DEFAULT_BITRATE = {"mp3": 128_000, "aac": 128_000, "opus": None}
OPUS_AUTO_BITRATE = -1000

# Placeholder sizes of a streamed WAV header, as sent by Fish's hosted API.
WAV_STREAM_DATA_SIZE = 0xFFFFFF00  # 4294967040
WAV_STREAM_RIFF_SIZE = WAV_STREAM_DATA_SIZE + 36  # 4294967076


# --------------------------------------------------------------------------- validation


def _check_format(fmt: str) -> str:
    if not isinstance(fmt, str):
        raise ValueError(f"audio format must be a string, got {type(fmt).__name__}")
    f = fmt.strip().lower()
    if f not in FORMATS:
        raise ValueError(f"unsupported audio format {fmt!r}; expected one of {', '.join(sorted(FORMATS))}")
    return f


def supported_sample_rates(fmt: str) -> tuple[int, ...] | tuple[int, int]:
    """The rates ``fmt`` accepts: an explicit tuple, or for wav/pcm/flac the
    inclusive ``(min, max)`` range (any integer rate in it)."""
    f = _check_format(fmt)
    return _FIXED_RATES.get(f, _FREE_RATE_RANGE)


def _rate_ok(fmt: str, rate: int) -> bool:
    if fmt in _FIXED_RATES:
        return rate in _FIXED_RATES[fmt]
    lo, hi = _FREE_RATE_RANGE
    return lo <= rate <= hi


def default_sample_rate(fmt: str, input_rate: int = 44100) -> int:
    """Output rate when the request leaves ``sample_rate`` unset: 48000 for
    opus (as Fish does), else the input rate when the format can store it,
    else 44100."""
    f = _check_format(fmt)
    if f == "opus":
        return 48000
    if _rate_ok(f, int(input_rate)):
        return int(input_rate)
    return 44100


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{what} must be a number, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"{what} must be a number, got {value!r}") from None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{what} must be a whole number, got {value!r}")
        return int(value)
    raise ValueError(f"{what} must be a number, got {value!r}")


def parse_bitrate(value: Any, fmt: str) -> int | None:
    """Normalise an API bitrate to bits per second for ``fmt``.

    Rule: ``None`` → the format's default; ``-1000`` (Opus' OPUS_AUTO, as the
    Fish API uses) → ``None`` ("codec decides"); a positive value below 1000
    is kbps (``128`` → 128000, ``24.5`` → 24500); 1000 and above is already
    bps.  Lossless formats (wav, pcm, flac) ignore the bitrate and return
    ``None``.  Raises ``ValueError`` for a non-number, zero or another
    negative value, or a result outside the codec's range (mp3 8–320 kbps,
    aac 16–512 kbps, opus 6–256 kbps, libopus' mono limit).
    """
    f = _check_format(fmt)
    if f in LOSSLESS:
        return None
    if value is None:
        return _DEFAULT_BITRATE[f]
    if isinstance(value, bool):
        raise ValueError(f"{f} bitrate must be a number, got {value!r}")
    if isinstance(value, str):
        s = value.strip().lower()
        for suffix, mult in (("kbps", 1000), ("kb/s", 1000), ("k", 1000), ("bps", 1)):
            if s.endswith(suffix):
                s = s[: -len(suffix)].strip()
                break
        else:
            mult = None
        try:
            num = float(s)
        except ValueError:
            raise ValueError(f"{f} bitrate must be a number, got {value!r}") from None
        if mult is not None:
            num *= mult
    elif isinstance(value, (int, float, np.integer, np.floating)):
        num = float(value)
    else:
        raise ValueError(f"{f} bitrate must be a number, got {value!r}")
    if not math.isfinite(num):
        raise ValueError(f"{f} bitrate must be finite, got {value!r}")
    if num == OPUS_AUTO_BITRATE:
        return None
    if num <= 0:
        raise ValueError(f"{f} bitrate must be positive (or -1000 for automatic), got {value!r}")
    bps = int(round(num * 1000)) if num < 1000 else int(round(num))
    lo, hi = _BITRATE_RANGE[f]
    if not lo <= bps <= hi:
        raise ValueError(
            f"{f} bitrate {value!r} ({bps} bps) out of range; expected {lo // 1000}–{hi // 1000} kbps"
        )
    return bps


# --------------------------------------------------------------------------- base class


class StreamEncoder:
    """Incremental encoder for one audio stream.

    ``feed(pcm)`` takes float32 mono samples at ``input_rate`` (any length,
    including 0 and 1) and returns the bytes ready now; ``close()`` flushes
    and returns the rest.  Concatenating every output gives one valid file.
    """

    content_type: str
    sample_rate: int
    format: str

    def __init__(self, fmt: str, input_rate: int, sample_rate: int, streaming: bool):
        self.format = fmt
        self.content_type = CONTENT_TYPES[fmt]
        self.input_rate = int(input_rate)
        self.sample_rate = int(sample_rate)
        self.streaming = bool(streaming)
        self.samples_in = 0  # input-rate samples fed
        self.samples_out = 0  # output-rate samples handed to the codec
        self._closed = False
        self._resampler = None
        if self.input_rate != self.sample_rate:
            import soxr

            self._resampler = soxr.ResampleStream(
                self.input_rate, self.sample_rate, 1, dtype="float32", quality="HQ"
            )

    # -- public -------------------------------------------------------------

    def feed(self, pcm: np.ndarray) -> bytes:
        if self._closed:
            raise RuntimeError("feed() after close()")
        x = _as_mono_float32(pcm)
        self.samples_in += x.shape[0]
        if self._resampler is not None and x.shape[0]:
            # NaN/inf would poison the resampler's carried filter state
            x = self._resampler.resample_chunk(_sanitize(x), last=False)
        return self._encode(_sanitize(x))

    def close(self) -> bytes:
        if self._closed:
            return b""
        out = b""
        if self._resampler is not None:
            tail = self._resampler.resample_chunk(np.zeros(0, np.float32), last=True)
            out += self._encode(_sanitize(tail))
        out += self._finish()
        self._closed = True
        return out

    @property
    def closed(self) -> bool:
        return self._closed

    # -- subclass hooks -------------------------------------------------------

    def _encode(self, x: np.ndarray) -> bytes:  # x: float32 in [-1, 1] at sample_rate
        raise NotImplementedError

    def _finish(self) -> bytes:
        raise NotImplementedError


def _as_mono_float32(pcm: Any) -> np.ndarray:
    x = np.asarray(pcm)
    if x.ndim == 2 and 1 in x.shape:
        x = x.reshape(-1)
    elif x.ndim == 0:
        x = x.reshape(1)
    elif x.ndim != 1:
        raise ValueError(f"expected mono audio (1-D array), got shape {x.shape}")
    if x.dtype.kind == "i":  # integer PCM: scale to [-1, 1)
        x = x.astype(np.float32) / float(2 ** (8 * x.dtype.itemsize - 1))
    return np.ascontiguousarray(x, dtype=np.float32)


def _sanitize(x: np.ndarray) -> np.ndarray:
    x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    return np.clip(x, -1.0, 1.0, out=x).astype(np.float32, copy=False)


def _to_s16(x: np.ndarray) -> np.ndarray:
    return np.round(x * 32767.0).astype("<i2")


# --------------------------------------------------------------------------- wav / pcm


def wav_header(sample_rate: int, data_size: int | None, channels: int = 1, bits: int = 16) -> bytes:
    """44-byte canonical PCM WAV header; ``data_size=None`` → streaming placeholder."""
    block_align = channels * bits // 8
    if data_size is None:
        riff_size, data_size = WAV_STREAM_RIFF_SIZE, WAV_STREAM_DATA_SIZE
    else:
        riff_size = 36 + data_size
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", riff_size, b"WAVE",
        b"fmt ", 16, 1, channels, sample_rate, sample_rate * block_align, block_align, bits,
        b"data", data_size,
    )  # fmt: skip


class _PCMEncoder(StreamEncoder):
    def _encode(self, x: np.ndarray) -> bytes:
        self.samples_out += x.shape[0]
        return _to_s16(x).tobytes()

    def _finish(self) -> bytes:
        return b""


class _WAVEncoder(StreamEncoder):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._header_sent = False
        self._buf: list[bytes] = []

    def _encode(self, x: np.ndarray) -> bytes:
        self.samples_out += x.shape[0]
        data = _to_s16(x).tobytes()
        if not self.streaming:
            self._buf.append(data)
            return b""
        if not self._header_sent:
            self._header_sent = True
            return wav_header(self.sample_rate, None) + data
        return data

    def _finish(self) -> bytes:
        if self.streaming:
            return b"" if self._header_sent else wav_header(self.sample_rate, None)
        data = b"".join(self._buf)
        self._buf = []
        return wav_header(self.sample_rate, len(data)) + data


# --------------------------------------------------------------------------- PyAV codecs

_AV_CODEC = {"mp3": "libmp3lame", "aac": "aac", "flac": "flac", "opus": "libopus"}
_AV_MUXER = {"mp3": "mp3", "aac": "adts", "flac": "flac"}
_AV_SAMPLE_FMT = {"mp3": "fltp", "aac": "fltp", "flac": "s16", "opus": "flt"}
_CAP_SMALL_LAST_FRAME = 1 << 6
_CAP_VARIABLE_FRAME_SIZE = 1 << 16


def _require_av(codec: str):
    try:
        import av
    except ImportError as e:  # pragma: no cover - dependency missing
        raise RuntimeError("PyAV (`pip install av`) is required for mp3/opus/aac/flac output") from e
    if codec not in av.codecs_available:
        raise RuntimeError(f"the installed PyAV/FFmpeg build has no {codec!r} encoder")
    return av


def available_formats() -> set[str]:
    """Formats whose encoders exist in this installation."""
    out = {"wav", "pcm"}
    try:
        import av
    except ImportError:
        return out
    return out | {f for f, c in _AV_CODEC.items() if c in av.codecs_available}


class _ChunkSink:
    """Write-only, non-seekable file object collecting what the muxer writes."""

    def __init__(self):
        self._parts: list[bytes] = []

    def write(self, b) -> int:
        self._parts.append(bytes(b))
        return len(b)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts = []
        return out


class _FrameChunker:
    """Cuts a float32 stream into codec frames of ``frame_size`` samples."""

    def __init__(self, frame_size: int):
        self.frame_size = max(1, int(frame_size))
        self._carry = np.zeros(0, np.float32)

    def push(self, x: np.ndarray) -> list[np.ndarray]:
        buf = np.concatenate([self._carry, x]) if self._carry.size else x
        n = (buf.shape[0] // self.frame_size) * self.frame_size
        self._carry = buf[n:].copy()
        return [buf[i : i + self.frame_size] for i in range(0, n, self.frame_size)]

    def rest(self) -> np.ndarray:
        out, self._carry = self._carry, np.zeros(0, np.float32)
        return out


class _AVCodecMixin:
    """Shared PyAV encode loop: chunk → AudioFrame → packets."""

    def _setup_codec(self, codec_ctx, av) -> None:
        self._av = av
        self._cc = codec_ctx
        self._sample_fmt = _AV_SAMPLE_FMT[self.format]
        caps = getattr(codec_ctx.codec, "capabilities", 0) or 0
        fs = codec_ctx.frame_size or 0
        if fs <= 0 or caps & _CAP_VARIABLE_FRAME_SIZE:
            fs = fs if fs > 0 else 4096
        self._small_last = bool(caps & (_CAP_SMALL_LAST_FRAME | _CAP_VARIABLE_FRAME_SIZE))
        self._chunker = _FrameChunker(fs)
        self._pts = 0

    def _frame(self, a: np.ndarray):
        if self._sample_fmt == "s16":
            a = _to_s16(a).astype(np.int16)
        fr = self._av.AudioFrame.from_ndarray(np.ascontiguousarray(a[None, :]), format=self._sample_fmt, layout="mono")
        fr.sample_rate = self.sample_rate
        fr.pts = self._pts
        fr.time_base = Fraction(1, self.sample_rate)
        self._pts += a.shape[0]
        return fr

    def _encode_frames(self, x: np.ndarray) -> list:
        self.samples_out += x.shape[0]
        packets = []
        for a in self._chunker.push(x):
            packets.extend(self._encode_one(self._frame(a)))
        return packets

    def _flush_frames(self) -> list:
        packets = []
        rest = self._chunker.rest()
        if rest.size:
            if not self._small_last:
                rest = np.concatenate([rest, np.zeros(self._chunker.frame_size - rest.size, np.float32)])
            packets.extend(self._encode_one(self._frame(rest)))
        packets.extend(self._encode_one(None))
        return packets


class _MuxedEncoder(_AVCodecMixin, StreamEncoder):
    """mp3 / aac (ADTS) / flac through a PyAV muxer into memory."""

    def __init__(self, fmt: str, input_rate: int, sample_rate: int, streaming: bool, bitrate: int | None):
        super().__init__(fmt, input_rate, sample_rate, streaming)
        av = _require_av(_AV_CODEC[fmt])
        opts = {}
        if fmt == "mp3":
            opts["id3v2_version"] = "0"  # no ID3 tag: plain MPEG audio frames
            if streaming:
                opts["write_xing"] = "0"
        if fmt == "flac" and streaming:
            opts["metadata_header_padding"] = "0"
        if streaming:
            opts["flush_packets"] = "1"
            self._sink = _ChunkSink()
        else:
            self._sink = io.BytesIO()
        self._container = av.open(
            self._sink, mode="w", format=_AV_MUXER[fmt], container_options=opts, buffer_size=4096
        )
        self._stream = self._container.add_stream(_AV_CODEC[fmt], rate=sample_rate, layout="mono")
        cc = self._stream.codec_context
        cc.format = _AV_SAMPLE_FMT[fmt]
        if bitrate:
            cc.bit_rate = int(bitrate)
        try:
            self._container.start_encoding()
        except Exception as e:  # av.error.FFmpegError and friends
            self._container = None
            raise ValueError(f"cannot open the {fmt} encoder at {sample_rate} Hz, bitrate {bitrate}: {e}") from e
        self._setup_codec(cc, av)

    def _encode_one(self, frame) -> list:
        return self._stream.encode(frame)

    def _take(self) -> bytes:
        if self.streaming:
            return self._sink.take()
        return b""

    def _encode(self, x: np.ndarray) -> bytes:
        packets = self._encode_frames(x)
        if packets:
            self._container.mux(packets)
        return self._take()

    def _finish(self) -> bytes:
        packets = self._flush_frames()
        if packets:
            self._container.mux(packets)
        self._container.close()
        if self.streaming:
            return self._sink.take()
        return self._sink.getvalue()


# --------------------------------------------------------------------------- Ogg Opus


def _ogg_crc_table() -> list[int]:
    table = []
    for i in range(256):
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else (r << 1)
        table.append(r & 0xFFFFFFFF)
    return table


_OGG_CRC = _ogg_crc_table()


def ogg_crc(data: bytes) -> int:
    """Ogg's CRC-32 (polynomial 0x04C11DB7, not reflected, init 0, no final xor)."""
    crc = 0
    table = _OGG_CRC
    for b in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ table[((crc >> 24) ^ b) & 0xFF]
    return crc


class _OggOpusWriter:
    """Minimal Ogg page writer for one Opus logical stream (RFC 3533, RFC 7845).

    Packets are never split across pages (Opus packets are < 64 KiB); a page
    holds at most 255 lacing values.  ``pages()`` packs the queued packets
    into as few pages as needed and returns them, so every call to it closes
    the current page: that is what makes the stream low-latency.
    """

    def __init__(self, serial: int):
        self.serial = serial & 0xFFFFFFFF
        self.seq = 0
        self._queue: list[tuple[bytes, int]] = []  # (packet, granule after it)

    def page(self, packets: list[bytes], granule: int, *, bos=False, eos=False) -> bytes:
        lacing = bytearray()
        for p in packets:
            n = len(p)
            lacing += b"\xff" * (n // 255) + bytes([n % 255])
        if len(lacing) > 255:
            raise ValueError("Ogg page overflow")
        flags = (0x02 if bos else 0) | (0x04 if eos else 0)
        head = struct.pack("<4sBBqIIIB", b"OggS", 0, flags, granule, self.serial, self.seq, 0, len(lacing))
        body = head + bytes(lacing) + b"".join(packets)
        crc = ogg_crc(body)
        self.seq += 1
        return body[:22] + struct.pack("<I", crc) + body[26:]

    def queue(self, packet: bytes, granule: int) -> None:
        self._queue.append((packet, granule))

    def pages(self, *, eos: bool = False, final_granule: int | None = None) -> bytes:
        out = []
        q, self._queue = self._queue, []
        i = 0
        while i < len(q) or (eos and not out):
            group, segs = [], 0
            while i < len(q):
                need = len(q[i][0]) // 255 + 1
                if group and segs + need > 255:
                    break
                group.append(q[i])
                segs += need
                i += 1
            last = i >= len(q)
            granule = group[-1][1] if group else (final_granule or 0)
            if last and eos and final_granule is not None:
                granule = final_granule
            out.append(self.page([p for p, _ in group], granule, eos=last and eos))
        return b"".join(out)


class _OpusEncoder(_AVCodecMixin, StreamEncoder):
    def __init__(self, fmt: str, input_rate: int, sample_rate: int, streaming: bool, bitrate: int | None):
        super().__init__(fmt, input_rate, sample_rate, streaming)
        av = _require_av("libopus")
        cc = av.CodecContext.create("libopus", "w")
        cc.sample_rate = sample_rate
        cc.layout = "mono"
        cc.format = "flt"
        cc.time_base = Fraction(1, sample_rate)
        if bitrate:
            cc.bit_rate = int(bitrate)
        try:
            cc.open()
        except Exception as e:  # av.error.FFmpegError and friends
            raise ValueError(f"cannot open the opus encoder at {sample_rate} Hz, bitrate {bitrate}: {e}") from e
        head = bytes(cc.extradata or b"")
        if len(head) < 19 or head[:8] != b"OpusHead":
            raise RuntimeError("libopus did not provide an OpusHead header")
        self._pre_skip = struct.unpack_from("<H", head, 10)[0]
        self._setup_codec(cc, av)
        self._granule = 0  # 48 kHz samples of all packets so far (incl. pre-skip)
        self._ogg = _OggOpusWriter(serial=int.from_bytes(np.random.default_rng().bytes(4), "little"))
        vendor = b"shoal (libopus via FFmpeg)"
        tags = b"OpusTags" + struct.pack("<I", len(vendor)) + vendor + struct.pack("<I", 0)
        self._pending = self._ogg.page([head], 0, bos=True) + self._ogg.page([tags], 0)
        self._buf: list[bytes] = []

    def _encode_one(self, frame) -> list:
        return self._cc.encode(frame)

    def _queue(self, packets) -> None:
        for p in packets:
            dur = p.duration if p.duration else self._chunker.frame_size
            self._granule += int(round(dur * 48000 / self.sample_rate))
            self._ogg.queue(bytes(p), self._granule)

    def _emit(self, data: bytes) -> bytes:
        if self._pending:
            data, self._pending = self._pending + data, b""
        if self.streaming:
            return data
        self._buf.append(data)
        return b""

    def _encode(self, x: np.ndarray) -> bytes:
        self._queue(self._encode_frames(x))
        return self._emit(self._ogg.pages())

    def _finish(self) -> bytes:
        self._queue(self._flush_frames())
        total_48k = int(round(self.samples_out * 48000 / self.sample_rate))
        final = min(self._granule, self._pre_skip + total_48k)
        out = self._emit(self._ogg.pages(eos=True, final_granule=final))
        if self.streaming:
            return out
        data, self._buf = b"".join(self._buf), []
        return data


# --------------------------------------------------------------------------- factory


def make_encoder(
    fmt: str,
    *,
    input_rate: int = 44100,
    sample_rate: int | None = None,
    bitrate: int | None = None,
    streaming: bool = True,
) -> StreamEncoder:
    """Build a :class:`StreamEncoder` for ``fmt`` (one of :data:`FORMATS`).

    ``input_rate`` is the rate of the samples passed to ``feed``;
    ``sample_rate`` the output rate (``None`` → :func:`default_sample_rate`);
    ``bitrate`` in bps (kbps values < 1000 are also accepted, see
    :func:`parse_bitrate`; ignored by lossless formats).  Raises
    ``ValueError`` for an unknown format, an unsupported rate or an
    out-of-range bitrate.
    """
    f = _check_format(fmt)
    in_rate = _as_int(input_rate, "input_rate")
    if in_rate <= 0:
        raise ValueError(f"input_rate must be positive, got {input_rate!r}")
    if sample_rate is None:
        rate = default_sample_rate(f, in_rate)
    else:
        rate = _as_int(sample_rate, "sample_rate")
        if not _rate_ok(f, rate):
            allowed = supported_sample_rates(f)
            if f in _FIXED_RATES:
                desc = ", ".join(str(r) for r in allowed)
            else:
                desc = f"{allowed[0]}–{allowed[1]}"
            raise ValueError(f"sample_rate {sample_rate!r} is not supported for {f}; expected {desc} Hz")
    br = parse_bitrate(bitrate, f)
    if f == "pcm":
        return _PCMEncoder(f, in_rate, rate, streaming)
    if f == "wav":
        return _WAVEncoder(f, in_rate, rate, streaming)
    if f == "opus":
        return _OpusEncoder(f, in_rate, rate, streaming, br)
    return _MuxedEncoder(f, in_rate, rate, streaming, br)


def encode_audio(pcm: np.ndarray, fmt: str, **kwargs) -> bytes:
    """One-shot convenience: encode a whole signal (``streaming=False`` by default)."""
    kwargs.setdefault("streaming", False)
    enc = make_encoder(fmt, **kwargs)
    return enc.feed(pcm) + enc.close()
