"""Streaming audio encoders (shoal.server.audio_encode) and prosody (shoal.server.prosody).

Every format is round-tripped through a real decoder: soundfile for
wav/flac, numpy for raw pcm, PyAV (FFmpeg) for mp3/opus/aac and for
streamed FLAC (whose STREAMINFO has no total length, which libsndfile
cannot read).
"""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest
import soundfile as sf

from shoal.server.audio_encode import (
    CONTENT_TYPES,
    FORMATS,
    WAV_STREAM_DATA_SIZE,
    WAV_STREAM_RIFF_SIZE,
    default_sample_rate,
    encode_audio,
    make_encoder,
    ogg_crc,
    parse_bitrate,
)
from shoal.server.prosody import ProsodyProcessor

SR = 44100


def tone(seconds: float, sr: int = SR, freq: float = 440.0) -> np.ndarray:
    """A 440 Hz sine with a slow amplitude envelope (so alignment is unique)."""
    t = np.arange(int(round(seconds * sr))) / sr
    env = 0.45 * (0.6 + 0.4 * np.sin(2 * np.pi * 1.3 * t))
    return (env * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def ragged_chunks(x: np.ndarray, seed: int = 0):
    """Chunks of varying sizes, including empty and 1-sample chunks."""
    rng = np.random.default_rng(seed)
    sizes = [0, 1, 8192, 0, 1, 3, 257]
    i = 0
    out = []
    while i < len(x):
        n = sizes.pop(0) if sizes else int(rng.integers(0, 6000))
        out.append(x[i : i + n])
        i += n
    out.append(x[:0])
    return out


def run_encoder(enc, chunks) -> tuple[bytes, list[bytes]]:
    fed = [enc.feed(c) for c in chunks]
    tail = enc.close()
    return b"".join(fed) + tail, fed


def decode(data: bytes, fmt: str, rate: int, streaming: bool = True) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767.0, rate
    if fmt == "wav" or (fmt == "flac" and not streaming):
        y, sr = sf.read(io.BytesIO(data), dtype="float32")
        return y, sr
    with av.open(io.BytesIO(data)) as c:
        frames = [f.to_ndarray() for f in c.decode(audio=0)]
        sr = c.streams.audio[0].rate
    y = np.concatenate(frames, axis=1)[0].astype(np.float32)
    if np.issubdtype(frames[0].dtype, np.integer):
        y = y / 32768.0
    return y, sr


def fast_lag_correlation(ref: np.ndarray, y: np.ndarray, max_lag: int) -> float:
    """Like best_correlation but finds the lag by FFT first."""
    n = min(len(ref), len(y))
    a, b = ref[:n].astype(np.float64), y[:n].astype(np.float64)
    nfft = 1 << (2 * n - 1).bit_length()
    xc = np.fft.irfft(np.fft.rfft(b, nfft) * np.conj(np.fft.rfft(a, nfft)), nfft)
    lags = np.r_[np.arange(0, max_lag + 1), np.arange(-max_lag, 0)]
    vals = np.r_[xc[: max_lag + 1], xc[nfft - max_lag :]]
    lag = int(lags[np.argmax(vals)])
    if lag >= 0:
        a2, b2 = a[: n - lag], b[lag:n]
    else:
        a2, b2 = a[-lag:n], b[: n + lag]
    return float(a2 @ b2 / (np.linalg.norm(a2) * np.linalg.norm(b2) + 1e-12))


# Extra decoded length a codec may add (priming + last-frame padding), seconds at rate r.
def duration_tolerance(fmt: str, rate: int) -> float:
    slack = {"mp3": 2 * 1152, "aac": 2 * 1024}.get(fmt, 0)
    return 0.05 + slack / rate


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "buffered"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_round_trip_every_format(fmt, streaming):
    x = tone(1.5)
    enc = make_encoder(fmt, streaming=streaming)
    assert enc.content_type == CONTENT_TYPES[fmt]
    data, _ = run_encoder(enc, ragged_chunks(x))
    y, sr = decode(data, fmt, enc.sample_rate, streaming)
    expect_sr = 48000 if fmt == "opus" else SR
    assert enc.sample_rate == expect_sr and sr == expect_sr
    dur = len(y) / sr
    assert abs(dur - 1.5) <= duration_tolerance(fmt, sr), (fmt, dur)
    ref = x
    if sr != SR:
        import soxr

        ref = soxr.resample(x, SR, sr)
    if fmt in ("wav", "pcm", "flac"):
        n = min(len(ref), len(y))
        assert len(y) == len(ref)
        assert np.max(np.abs(y[:n] - ref[:n])) < 2e-4  # 16-bit quantisation only
    else:
        assert fast_lag_correlation(ref, y, max_lag=int(0.1 * sr)) > 0.9


@pytest.mark.parametrize(
    "fmt,rate", [("wav", 16000), ("pcm", 8000), ("mp3", 32000), ("aac", 24000), ("flac", 22050), ("opus", 16000)]
)
def test_explicit_sample_rate_resamples(fmt, rate):
    x = tone(1.0)
    enc = make_encoder(fmt, sample_rate=rate, streaming=False)
    assert enc.sample_rate == rate
    data, _ = run_encoder(enc, ragged_chunks(x, seed=1))
    y, sr = decode(data, fmt, rate, streaming=False)
    if fmt == "opus":  # Opus decoders output 48 kHz; the header records the encoded rate
        assert sr == 48000
        i = data.index(b"OpusHead")
        assert struct.unpack_from("<I", data, i + 12)[0] == rate
    else:
        assert sr == rate
    assert abs(len(y) / sr - 1.0) <= duration_tolerance(fmt, sr)
    import soxr

    ref = soxr.resample(x, SR, sr)
    assert fast_lag_correlation(ref, y, max_lag=int(0.1 * sr)) > 0.9


def test_resampling_is_seamless_across_chunks():
    """Streaming resampler: chunked output == one-shot output, no boundary clicks."""
    x = tone(1.0)
    e1 = make_encoder("pcm", sample_rate=16000)
    a, _ = run_encoder(e1, ragged_chunks(x, seed=3))
    e2 = make_encoder("pcm", sample_rate=16000)
    b, _ = run_encoder(e2, [x])
    ya, yb = np.frombuffer(a, "<i2"), np.frombuffer(b, "<i2")
    assert len(ya) == len(yb) == 16000
    assert np.max(np.abs(ya.astype(int) - yb.astype(int))) <= 1
    # largest sample-to-sample step stays that of a 0.45-amplitude 440 Hz sine
    assert np.max(np.abs(np.diff(ya.astype(int)))) < 0.45 * 2 * np.pi * 440 / 16000 * 32767 * 1.05


def test_pyav_wheel_has_the_encoders():
    assert {"libmp3lame", "libopus", "aac", "flac"} <= set(av.codecs_available)
    from shoal.server.audio_encode import available_formats

    assert available_formats() == FORMATS


def test_clipping_and_nan():
    x = np.array([2.0, -3.0, 0.5, np.nan, np.inf, -np.inf], np.float32)
    enc = make_encoder("pcm")
    y = np.frombuffer(enc.feed(x) + enc.close(), "<i2")
    assert y.tolist() == [32767, -32767, 16384, 0, 32767, -32767]
    # a NaN must not poison the resampler state for later chunks
    enc = make_encoder("pcm", sample_rate=16000)
    out = enc.feed(np.full(100, np.nan, np.float32)) + enc.feed(tone(0.5)) + enc.close()
    y = np.frombuffer(out, "<i2")
    assert np.abs(y[len(y) // 2 :]).max() > 10000


# ----------------------------------------------------------------------------- wav headers


def test_wav_streaming_header_placeholder_sizes():
    enc = make_encoder("wav", streaming=True)
    first = enc.feed(np.zeros(10, np.float32))
    riff, riff_size, wave = struct.unpack_from("<4sI4s", first)
    assert (riff, wave) == (b"RIFF", b"WAVE")
    assert riff_size == WAV_STREAM_RIFF_SIZE == 4294967076
    assert first[36:40] == b"data"
    assert struct.unpack_from("<I", first, 40)[0] == WAV_STREAM_DATA_SIZE == 4294967040
    assert len(first) == 44 + 20
    assert enc.feed(np.zeros(3, np.float32)) == b"\0" * 6


def test_wav_buffered_header_exact_sizes():
    x = tone(0.25)
    enc = make_encoder("wav", streaming=False, sample_rate=24000)
    fed = [enc.feed(c) for c in ragged_chunks(x)]
    assert all(b == b"" for b in fed)
    data = enc.close()
    n = struct.unpack_from("<I", data, 40)[0]
    assert n == len(data) - 44 == 2 * 6000
    assert struct.unpack_from("<I", data, 4)[0] == len(data) - 8
    assert struct.unpack_from("<I", data, 24)[0] == 24000
    info = sf.info(io.BytesIO(data))
    assert info.frames == 6000 and info.samplerate == 24000


def test_empty_stream_is_still_a_valid_file():
    enc = make_encoder("wav", streaming=False)
    data = enc.close()
    assert len(data) == 44 and struct.unpack_from("<I", data, 40)[0] == 0
    enc = make_encoder("opus")
    data = enc.close()
    assert data.startswith(b"OggS") and data.count(b"OggS") == 3  # head, tags, EOS


# ----------------------------------------------------------------------------- streaming latency


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_bytes_leave_before_close(fmt):
    x = tone(3.0)
    step = int(0.2 * SR)
    enc = make_encoder(fmt, streaming=True)
    fed = [enc.feed(x[i : i + step]) for i in range(0, len(x), step)]
    tail = enc.close()
    # the very first 0.2 s chunk already yields bytes, and almost every chunk does
    assert len(fed[0]) > 0
    assert sum(1 for b in fed if b) >= len(fed) - 1
    assert sum(map(len, fed)) > 0.7 * (sum(map(len, fed)) + len(tail))
    # the bytes of the first two feeds decode to real audio on their own
    if fmt not in ("pcm",):
        prefix = fed[0] + fed[1]
        y, sr = decode(prefix, fmt, enc.sample_rate, streaming=True)
        assert len(y) / sr > 0.1
        assert np.sqrt(np.mean(y**2)) > 0.05


def test_first_small_codec_chunk_yields_audio_packets():
    """The codec's first chunk is ~8192 samples; each format must emit audio bytes for it."""
    x = tone(8192 / SR)
    for fmt in sorted(FORMATS):
        enc = make_encoder(fmt, streaming=True)
        out = enc.feed(x)
        enc.close()
        if fmt == "opus":
            assert out.count(b"OggS") >= 3, fmt  # head + tags + an audio page
        elif fmt == "flac":
            assert len(out) > 42 + 100, fmt  # fLaC + STREAMINFO + audio frames
        else:
            assert len(out) > 100, fmt


def test_opus_ogg_pages_have_valid_crc_and_granules():
    x = tone(1.0)
    enc = make_encoder("opus", streaming=True, bitrate=32)
    data, _ = run_encoder(enc, ragged_chunks(x))
    pos, granules, flags = 0, [], []
    while pos < len(data):
        assert data[pos : pos + 4] == b"OggS"
        nseg = data[pos + 26]
        lacing = data[pos + 27 : pos + 27 + nseg]
        end = pos + 27 + nseg + sum(lacing)
        page = bytearray(data[pos:end])
        crc = struct.unpack_from("<I", page, 22)[0]
        page[22:26] = b"\0\0\0\0"
        assert ogg_crc(bytes(page)) == crc
        granules.append(struct.unpack_from("<q", data, pos + 6)[0])
        flags.append(data[pos + 5])
        pos = end
    assert flags[0] == 0x02 and flags[-1] == 0x04
    assert granules == sorted(granules)
    pre_skip = struct.unpack_from("<H", data, data.index(b"OpusHead") + 10)[0]
    assert granules[-1] == pre_skip + 48000  # end trimming to the exact length


# ----------------------------------------------------------------------------- validation


def test_parse_bitrate_units():
    assert parse_bitrate(128, "mp3") == 128_000
    assert parse_bitrate(128000, "mp3") == 128_000
    assert parse_bitrate(192, "mp3") == 192_000
    assert parse_bitrate(32, "opus") == 32_000  # what the Fish SDK sends
    assert parse_bitrate(32000, "opus") == 32_000  # what the OpenAPI lists
    assert parse_bitrate(-1000, "opus") is None  # automatic
    assert parse_bitrate(None, "opus") is None
    assert parse_bitrate(None, "mp3") == 128_000
    assert parse_bitrate(24.5, "opus") == 24_500
    assert parse_bitrate("64k", "aac") == 64_000
    assert parse_bitrate("96", "aac") == 96_000
    for fmt in ("wav", "pcm", "flac"):
        assert parse_bitrate(128, fmt) is None  # lossless: ignored


@pytest.mark.parametrize(
    "value,fmt",
    [(999, "opus"), (0, "mp3"), (-5, "mp3"), (400, "mp3"), (4, "opus"), ("fast", "mp3"), (True, "mp3"), (2_000_000, "aac")],
)
def test_parse_bitrate_rejects(value, fmt):
    with pytest.raises(ValueError):
        parse_bitrate(value, fmt)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(fmt="ogg"), "unsupported audio format"),
        (dict(fmt="mp3", sample_rate=96000), "not supported for mp3"),
        (dict(fmt="opus", sample_rate=44100), "not supported for opus"),
        (dict(fmt="aac", sample_rate=7000), "not supported for aac"),
        (dict(fmt="wav", sample_rate=4000), "not supported for wav"),
        (dict(fmt="mp3", bitrate=1000), "out of range"),
        (dict(fmt="opus", bitrate=1_000_000), "out of range"),
        (dict(fmt="opus", bitrate=510), "out of range"),
        (dict(fmt="wav", input_rate=0), "input_rate"),
        (dict(fmt="wav", sample_rate=16000.5), "whole number"),
    ],
)
def test_make_encoder_validation(kwargs, match):
    fmt = kwargs.pop("fmt")
    with pytest.raises(ValueError, match=match):
        make_encoder(fmt, **kwargs)


def test_defaults_and_case():
    assert default_sample_rate("opus") == 48000
    assert default_sample_rate("mp3") == 44100
    assert default_sample_rate("wav", 22050) == 22050
    assert default_sample_rate("mp3", 44000) == 44100
    assert make_encoder(" MP3 ").content_type == "audio/mpeg"
    enc = make_encoder("pcm")
    enc.close()
    with pytest.raises(RuntimeError):
        enc.feed(np.zeros(4, np.float32))
    with pytest.raises(ValueError):
        make_encoder("pcm").feed(np.zeros((2, 100), np.float32))


def test_encode_audio_one_shot_mp3_has_gapless_info():
    x = tone(1.0)
    data = encode_audio(x, "mp3", bitrate=64)
    assert b"Info" in data[:2000] or b"Xing" in data[:2000]
    y, sr = decode(data, "mp3", SR)
    assert abs(len(y) / sr - 1.0) < 0.03  # encoder delay trimmed via the LAME tag


# ----------------------------------------------------------------------------- prosody


def dominant_freq(y: np.ndarray, sr: int) -> float:
    spec = np.abs(np.fft.rfft(y * np.hanning(len(y)), 8 * len(y)))
    return float(np.argmax(spec)) * sr / (8 * len(y))


def run_prosody(p: ProsodyProcessor, chunks) -> np.ndarray:
    return np.concatenate([p.feed(c) for c in chunks] + [p.close()])


@pytest.mark.parametrize("speed", [0.5, 0.75, 1.5, 2.0])
def test_speed_duration_and_pitch(speed):
    x = (0.5 * np.sin(2 * np.pi * 440 * np.arange(2 * SR) / SR)).astype(np.float32)
    y = run_prosody(ProsodyProcessor(SR, speed=speed), ragged_chunks(x, seed=2))
    assert abs(len(y) / (len(x) / speed) - 1) < 0.03
    assert abs(dominant_freq(y, SR) / 440 - 1) < 0.03
    mid = y[2000:-2000]
    # a clean sine: full amplitude, no boundary clicks (steps no larger than the sine's slope)
    assert 0.45 < np.max(np.abs(mid)) < 0.55
    assert np.max(np.abs(np.diff(mid))) < 0.5 * 2 * np.pi * 440 / SR * 1.1
    # short-time level stays steady (no WSOLA phase cancellations)
    w = 441
    rms = np.sqrt(np.mean(mid[: len(mid) // w * w].reshape(-1, w) ** 2, axis=1))
    assert rms.min() > 0.8 * 0.5 / np.sqrt(2)


@pytest.mark.parametrize("speed", [0.5, 1.5])
def test_speed_chunked_equals_one_shot(speed):
    x = tone(1.5)
    a = run_prosody(ProsodyProcessor(SR, speed=speed), ragged_chunks(x, seed=5))
    b = run_prosody(ProsodyProcessor(SR, speed=speed), [x])
    assert a.shape == b.shape
    assert np.max(np.abs(a - b)) < 1e-6


def test_speed_one_is_exact_passthrough():
    x = tone(0.5)
    p = ProsodyProcessor(SR, speed=1.0)
    assert p.is_identity
    for c in ragged_chunks(x):
        out = p.feed(c)
        assert np.array_equal(out, c)  # no delay, bit-exact
    assert p.close().size == 0


def test_volume_gain():
    x = tone(0.5)
    y = run_prosody(ProsodyProcessor(SR, volume_db=6.0), ragged_chunks(x))
    assert y.shape == x.shape
    assert np.allclose(y, x * 10 ** (6 / 20), atol=1e-6)
    assert abs(np.max(np.abs(y)) / np.max(np.abs(x)) - 2.0) < 0.01
    y = run_prosody(ProsodyProcessor(SR, volume_db=-20.0), [x])
    assert np.allclose(y, x * 0.1, atol=1e-6)


@pytest.mark.parametrize("amp", [0.06, 0.3])
def test_loudness_normalisation_converges_to_target(amp):
    t = np.arange(3 * SR) / SR
    x = (amp * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    x[: SR // 4] = 0  # leading silence is left alone
    y = run_prosody(ProsodyProcessor(SR, normalize_loudness=True), ragged_chunks(x))
    assert y.shape == x.shape
    assert np.all(y[: SR // 4] == 0)
    rms_db = 20 * np.log10(np.sqrt(np.mean(y[SR:] ** 2)))
    assert abs(rms_db - (-20.0)) < 0.5
    assert np.max(np.abs(np.diff(y))) < 0.2 * 2 * np.pi * 220 / SR * 1.1  # no gain jumps


def test_loudness_gain_is_limited_and_gates_silence():
    x = (1e-4 * np.sin(2 * np.pi * 220 * np.arange(SR) / SR)).astype(np.float32)  # -83 dBFS: below the gate
    y = run_prosody(ProsodyProcessor(SR, normalize_loudness=True), [x])
    assert np.allclose(y, x)
    x = (0.01 * np.sin(2 * np.pi * 220 * np.arange(SR) / SR)).astype(np.float32)  # -43 dBFS: wants +23 dB
    y = run_prosody(ProsodyProcessor(SR, normalize_loudness=True), [x])
    assert np.max(np.abs(y)) == pytest.approx(0.01 * 10 ** (12 / 20), rel=1e-3)  # capped at +12 dB


def test_prosody_combined_and_validation():
    x = tone(1.0)
    y = run_prosody(ProsodyProcessor(SR, speed=1.25, volume_db=3.0, normalize_loudness=True), ragged_chunks(x))
    assert abs(len(y) - round(len(x) / 1.25)) <= 1
    for bad in (dict(speed=0.4), dict(speed=2.5), dict(speed=float("nan")), dict(volume_db=float("inf"))):
        with pytest.raises(ValueError):
            ProsodyProcessor(SR, **bad)
