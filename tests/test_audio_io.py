"""Audio file I/O: decode, mono mix, resample to 44.1 kHz, int16 output with clipping."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from shoal.codec import AudioDecodeError, load_audio, to_int16, write_wav


def _tone(sr: int, seconds: float, freq: float) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def test_stereo_48k_to_mono_44k(tmp_path):
    sr = 48000
    left = _tone(sr, 1.0, 440.0)
    right = _tone(sr, 1.0, 440.0) * 0.5  # mean = 0.75 * tone
    path = tmp_path / "stereo.wav"
    sf.write(str(path), np.stack([left, right], axis=1), sr, subtype="FLOAT")

    audio = load_audio(path)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert abs(len(audio) - 44100) <= 1
    expected = 0.75 * _tone(44100, len(audio) / 44100, 440.0)[: len(audio)]
    mid = slice(1000, len(audio) - 1000)  # ignore resampler edge effects
    assert np.abs(audio[mid] - expected[mid]).max() < 2e-3

    # bytes and file objects give the same result
    raw = path.read_bytes()
    assert np.array_equal(load_audio(raw), audio)
    assert np.array_equal(load_audio(io.BytesIO(raw)), audio)


def test_flac_44k_mono_passthrough(tmp_path):
    x = _tone(44100, 0.25, 1000.0)
    path = tmp_path / "a.flac"
    sf.write(str(path), x, 44100, subtype="PCM_24")
    y = load_audio(path)
    assert len(y) == len(x)
    assert np.abs(y - x).max() < 1e-6


def test_resample_other_rate(tmp_path):
    x = _tone(16000, 0.5, 300.0)
    path = tmp_path / "a.ogg"
    sf.write(str(path), x, 16000, format="OGG", subtype="VORBIS")
    y = load_audio(path)
    assert abs(len(y) - 22050) <= 1


def test_undecodable_and_missing(tmp_path):
    with pytest.raises(AudioDecodeError):
        load_audio(b"definitely not audio data" * 10)
    with pytest.raises(AudioDecodeError):
        load_audio(b"")
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    with pytest.raises(AudioDecodeError) as ei:
        load_audio(bad)
    assert str(bad) in str(ei.value)
    assert isinstance(ei.value, ValueError)
    with pytest.raises(FileNotFoundError):
        load_audio(tmp_path / "missing.wav")


def test_to_int16_clips_and_matches_reference_in_range():
    x = np.array([-2.0, -1.0, -0.5, 0.0, 0.25, 0.99999, 1.0, 1.5, np.nan], dtype=np.float32)
    y = to_int16(x)
    assert y.dtype == np.int16
    assert y.tolist() == [-32768, -32768, -16384, 0, 8192, 32767, 32767, 32767, 0]
    r = np.random.default_rng(0).uniform(-0.999, 0.999, 1000).astype(np.float32)
    assert np.array_equal(to_int16(r), (r * 32768).astype(np.int16))  # reference formula in range


def test_write_wav_clips(tmp_path):
    x = np.array([-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], dtype=np.float32)
    path = tmp_path / "o.wav"
    write_wav(path, x)
    info = sf.info(str(path))
    assert info.samplerate == 44100 and info.subtype == "PCM_16" and info.channels == 1
    y, _ = sf.read(str(path), dtype="int16")
    assert y.tolist() == [-32768, -32768, -16384, 0, 16384, 32767, 32767]
    # float subtype is clipped too
    write_wav(path, x, subtype="FLOAT")
    z, _ = sf.read(str(path), dtype="float32")
    assert z.min() == -1.0 and z.max() == 1.0
    # writing into a file object
    buf = io.BytesIO()
    write_wav(buf, x, sample_rate=22050)
    buf.seek(0)
    w, sr = sf.read(buf, dtype="int16")
    assert sr == 22050 and w.tolist() == y.tolist()
