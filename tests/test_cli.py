"""The command line end to end on tiny checkpoints in both real formats."""

import numpy as np
import pytest
import soundfile as sf

from shoal.cli import main
from shoal.text import build_session, load_tokenizer


def _sine(path, seconds=1.0, sr=22050, channels=2):
    t = np.arange(int(seconds * sr)) / sr
    x = 0.3 * np.sin(2 * np.pi * 220 * t)
    sf.write(path, np.stack([x] * channels, axis=1) if channels > 1 else x, sr)
    return path


@pytest.mark.parametrize("fixture", ["tiny_s2_checkpoint", "tiny_s1_checkpoint"])
def test_say_writes_audio_and_codes(fixture, request, tmp_path):
    ckpt = request.getfixturevalue(fixture)
    out, codes = tmp_path / "out.wav", tmp_path / "codes.npy"
    rc = main(["say", "Hello there, this is a test.", "-o", str(out), "--checkpoint", str(ckpt),
               "--max-new-tokens", "6", "--seed", "1", "--codes-out", str(codes)])
    assert rc == 0
    audio, sr = sf.read(out)
    c = np.load(codes)
    assert sr == 44100 and c.shape[0] == 10 and 1 <= c.shape[1] <= 6
    assert len(audio) == 2048 * c.shape[1]
    assert c[1:].max() < 1024 and c[0].max() < 4096


def test_say_is_reproducible_with_seed_and_clones_a_reference(tiny_s2_checkpoint, tmp_path):
    clip = _sine(tmp_path / "ref.wav")
    outs = []
    for i in range(2):
        codes = tmp_path / f"c{i}.npy"
        rc = main(["say", "Nice to meet you.", "-o", str(tmp_path / f"o{i}.wav"), "--checkpoint",
                   str(tiny_s2_checkpoint), "--reference", str(clip), "--reference-text", "A tone.",
                   "--max-new-tokens", "5", "--seed", "11", "--codes-out", str(codes)])
        assert rc == 0
        outs.append(np.load(codes))
    assert np.array_equal(outs[0], outs[1])


def test_say_greedy_multispeaker(tiny_s2_checkpoint, tmp_path):
    codes = tmp_path / "c.npy"
    rc = main(["say", "<|speaker:0|>Hi there friend. <|speaker:1|>Hello to you as well!", "-o",
               str(tmp_path / "o.wav"), "--checkpoint", str(tiny_s2_checkpoint), "--greedy",
               "--chunk-length", "10", "--max-new-tokens", "3", "--codes-out", str(codes)])
    assert rc == 0
    assert np.load(codes).shape == (10, 6)  # two text batches x 3 frames


def test_say_reference_count_mismatch_is_a_clear_error(tiny_s2_checkpoint, tmp_path, capsys):
    rc = main(["say", "Hi", "-o", str(tmp_path / "o.wav"), "--checkpoint", str(tiny_s2_checkpoint),
               "--reference-text", "orphan transcript"])
    assert rc == 2
    assert "--reference-text" in capsys.readouterr().err


def test_say_bad_checkpoint_is_a_clear_error(tmp_path, capsys):
    rc = main(["say", "Hi", "-o", str(tmp_path / "o.wav"), "--checkpoint", str(tmp_path)])
    assert rc == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_say_undecodable_reference(tiny_s2_checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"this is not audio")
    rc = main(["say", "Hi", "-o", str(tmp_path / "o.wav"), "--checkpoint", str(tiny_s2_checkpoint),
               "--reference", str(bad), "--reference-text", "x"])
    assert rc == 2


def test_prompt_saves_the_session_grid(tiny_s2_checkpoint, tmp_path, capsys):
    ref = np.random.default_rng(0).integers(0, 1024, size=(10, 7))
    np.save(tmp_path / "ref.npy", ref)
    rc = main(["prompt", "How are you?", "--checkpoint", str(tiny_s2_checkpoint), "--out",
               str(tmp_path / "grid.npy"), "--reference-text", "Fine thanks.", "--reference-codes",
               str(tmp_path / "ref.npy")])
    assert rc == 0
    from shoal.text import Reference
    tok = load_tokenizer(tiny_s2_checkpoint)
    want = build_session("s2", tok, "How are you?", [Reference("Fine thanks.", ref)], None).grid()
    assert np.array_equal(np.load(tmp_path / "grid.npy"), want)
    assert "VQ" in capsys.readouterr().out


def test_prompt_multibatch_writes_one_file_per_batch(tiny_s1_checkpoint, tiny_s2_checkpoint, tmp_path):
    rc = main(["prompt", "<|speaker:0|>One two three. <|speaker:1|>Four five six.", "--checkpoint",
               str(tiny_s2_checkpoint), "--out", str(tmp_path / "g.npy"), "--chunk-length", "5",
               "--max-new-tokens", "2"])
    assert rc == 0
    g0, g1 = np.load(tmp_path / "g_b0.npy"), np.load(tmp_path / "g_b1.npy")
    assert g1.shape[1] > g0.shape[1] and np.array_equal(g1[:, :30], g0[:, :30])


def test_codec_encode_decode_cli(tiny_s2_checkpoint, tmp_path):
    clip = _sine(tmp_path / "in.wav", seconds=0.5, sr=48000, channels=2)
    codes, out = tmp_path / "codes.npy", tmp_path / "out.wav"
    assert main(["codec", "encode", str(clip), "--codec", str(tiny_s2_checkpoint / "codec.pth"),
                 "--out", str(codes)]) == 0
    c = np.load(codes)
    assert c.shape == (10, int(np.ceil(0.5 * 44100 / 2048)))
    assert main(["codec", "decode", str(codes), "--codec", str(tiny_s2_checkpoint / "codec.pth"),
                 "-o", str(out)]) == 0
    audio, sr = sf.read(out)
    assert sr == 44100 and len(audio) == 2048 * c.shape[1]
