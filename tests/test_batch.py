"""``shoal batch``: JSONL jobs through the engine, outputs equal to the batch-1 loop, resume,
validation, --no-audio, Ctrl-C (CPU, tiny checkpoints)."""

import json
import signal

import numpy as np
import pytest
import soundfile as sf

from shoal.batch import derive_seed, main_for_tests
from shoal.engine.engine import Engine
from shoal.engine.generate import generate
from shoal.engine.request import FinishEvent
from shoal.text import Reference, build_session
from shoal.tts import TTS

MAX_NEW = 8


def _sine(path, seconds=0.6, sr=22050):
    t = np.arange(int(seconds * sr)) / sr
    sf.write(path, 0.3 * np.sin(2 * np.pi * 220 * t), sr)
    return path


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch_assets")
    _sine(d / "ref.wav")
    (d / "voices").mkdir()
    np.save(d / "voices" / "voice.npy", np.random.default_rng(3).integers(0, 1024, size=(10, 30)))
    return d


S2_ROWS = [
    {"id": "a", "text": "Hello world, this is a test.", "greedy": True},
    {"text": "How are you doing today my friend?", "seed": 7,  # id defaults to "000002"
     "references": [{"audio": "ref.wav", "text": "A tone."}]},
    {"id": "c", "text": "Speech synthesis is fun.", "greedy": True, "priority": "realtime",
     "references": [{"codes": "voices/voice.npy", "text": "A voice."}]},
    {"id": "d", "text": "The quick brown fox.", "temperature": 0.7, "top_p": 0.9, "top_k": 20,
     "max_new_tokens": 5,  # no seed: derived from the id
     "references": [{"audio": "ref.wav", "text": "A tone."},
                    {"codes": "voices/voice.npy", "text": "A voice."}]},
    {"id": "e", "text": "<|speaker:0|>Hi there friend. <|speaker:1|>Hello to you as well!",
     "chunk_length": 10, "seed": 3},  # two text batches
]
S2_IDS = ["a", "000002", "c", "d", "e"]


def _expected(tts, assets, row, rid):
    """What the batch-1 reference loop gives for one line alone (same seed / greedy)."""
    from shoal.engine.sampling import SamplingParams

    refs = []
    for r in row.get("references", []):
        codes = tts.encode_reference(assets / r["audio"]) if "audio" in r else np.load(assets / r["codes"])
        refs.append(Reference(r["text"], codes))
    session = build_session(tts.family, tts.tokenizer, row["text"], refs, row.get("chunk_length"))
    kw = {k: row[k] for k in ("temperature", "top_p", "top_k") if k in row}
    params = SamplingParams(greedy=row.get("greedy", False),
                            repetition_penalty=1.1 if tts.family == "s1" else 1.0, **kw)
    seed = row.get("seed", derive_seed(rid))
    n = row.get("max_new_tokens", MAX_NEW)
    out, frames = [], 0
    while not session.done():
        res = generate(tts.model, session.grid(), params, tts.tokenizer.im_end_id, n, seed=seed,
                       frame_offset=frames)
        session.commit(res.codes)
        out.append(res.codes)
        frames += res.columns.shape[1]
    return np.concatenate(out, axis=1), seed


def _run(jsonl, out, ckpt, *extra):
    return main_for_tests([str(jsonl), "--out", str(out), "--checkpoint", str(ckpt), "--device", "cpu",
                           "--dtype", "fp32", "--max-new-tokens", str(MAX_NEW), *extra])


def _manifest(out):
    return [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def s2_job(tiny_s2_checkpoint, assets, tmp_path_factory):
    jsonl = _write_jsonl(assets / "s2.jsonl", S2_ROWS)
    out = tmp_path_factory.mktemp("s2_out")
    assert _run(jsonl, out, tiny_s2_checkpoint, "--max-running", "3") == 0
    return jsonl, out


def test_s2_job_equals_the_reference_loop_per_line(s2_job, tiny_s2_checkpoint, assets):
    _, out = s2_job
    tts = TTS.load(tiny_s2_checkpoint, device="cpu", dtype="fp32")
    manifest = {e["id"]: e for e in _manifest(out)}
    assert set(manifest) == set(S2_IDS)
    for row, rid in zip(S2_ROWS, S2_IDS):
        codes = np.load(out / f"{rid}.npy")
        want, seed = _expected(tts, assets, row, rid)
        assert codes.dtype == np.int64 and codes.shape[0] == 10
        assert np.array_equal(codes, want), rid
        audio, sr = sf.read(out / f"{rid}.wav", dtype="float32")
        assert sr == 44100 and len(audio) == 2048 * codes.shape[1]
        assert np.abs(audio - tts.decode(codes)).max() < 2e-4  # int16 PCM of the one-shot decode
        e = manifest[rid]
        assert (e["frames"], e["seed"]) == (codes.shape[1], seed)
        assert e["stop"] in ("eos", "length") and e["seconds"] == pytest.approx(len(audio) / 44100, abs=1e-3)
    assert np.load(out / "d.npy").shape[1] <= 5  # the line's own max_new_tokens
    assert np.load(out / "e.npy").shape[1] > MAX_NEW  # two text batches
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_kv_block_size_changes_nothing_but_the_pages(s2_job, tiny_s2_checkpoint, tmp_path, capsys):
    """``--kv-block-size 64``: the same codes as the job on 16-token pages; 0 is a clean error."""
    jsonl, out = s2_job
    assert _run(jsonl, tmp_path / "bs64", tiny_s2_checkpoint, "--max-running", "3", "--kv-block-size", "64") == 0
    for rid in S2_IDS:
        assert np.array_equal(np.load(tmp_path / "bs64" / f"{rid}.npy"), np.load(out / f"{rid}.npy")), rid
    capsys.readouterr()
    assert _run(jsonl, tmp_path / "bs0", tiny_s2_checkpoint, "--kv-block-size", "0") == 2
    assert "--kv-block-size must be >= 1" in capsys.readouterr().err


def test_resume_regenerates_only_missing_outputs(s2_job, tiny_s2_checkpoint, capsys):
    jsonl, out = s2_job
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("*.[nw][pa][yv]")}
    (out / "c.npy").unlink()
    (out / "000002.wav").unlink()
    capsys.readouterr()
    assert _run(jsonl, out, tiny_s2_checkpoint) == 0
    err = capsys.readouterr().err
    assert "skipped 3 of 5" in err and "2 done" in err
    for name, (mtime, data) in before.items():
        p = out / name
        if name.split(".")[0] in ("c", "000002"):
            assert p.read_bytes() == data, name  # regenerated, identically
        else:
            assert p.stat().st_mtime_ns == mtime, name  # untouched
    ids = [e["id"] for e in _manifest(out)]
    assert sorted(ids) == sorted(S2_IDS)  # one entry per line, none duplicated
    assert _run(jsonl, out, tiny_s2_checkpoint) == 0
    assert "nothing to generate" in capsys.readouterr().err


def test_s1_job(tiny_s1_checkpoint, assets, tmp_path):
    rows = [{"id": "g", "text": "Hello there, this is a test.", "greedy": True},
            {"id": "s", "text": "How are you?", "seed": 5,
             "references": [{"codes": "voices/voice.npy", "text": "A voice."}]}]
    jsonl = _write_jsonl(assets / "s1.jsonl", rows)
    assert _run(jsonl, tmp_path, tiny_s1_checkpoint, "--no-audio") == 0
    tts = TTS.load(tiny_s1_checkpoint, device="cpu", dtype="fp32")
    for row in rows:
        want, _ = _expected(tts, assets, row, row["id"])
        assert np.array_equal(np.load(tmp_path / f"{row['id']}.npy"), want), row["id"]


def test_no_audio_writes_codes_only_and_audio_run_completes_it(tiny_s2_checkpoint, assets, tmp_path, capsys):
    jsonl = _write_jsonl(tmp_path / "r.jsonl", [{"id": "x", "text": "One.", "seed": 1},
                                                 {"id": "y", "text": "Two.", "greedy": True}])
    out = tmp_path / "out"
    assert _run(jsonl, out, tiny_s2_checkpoint, "--no-audio") == 0
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert names == ["manifest.jsonl", "x.npy", "y.npy"]
    assert all(e["seconds"] == pytest.approx(e["frames"] * 2048 / 44100, abs=1e-3) for e in _manifest(out))
    codes = np.load(out / "x.npy")
    assert _run(jsonl, out, tiny_s2_checkpoint, "--no-audio") == 0
    assert "nothing to generate" in capsys.readouterr().err
    assert _run(jsonl, out, tiny_s2_checkpoint) == 0  # without --no-audio the .wav files are missing
    assert (out / "x.wav").is_file() and (out / "y.wav").is_file()
    assert np.array_equal(np.load(out / "x.npy"), codes)


def test_validation_reports_every_bad_line_and_generates_nothing(tmp_path, assets, capsys):
    rows = [
        {"id": "ok", "text": "Fine."},
        '{"text": "broken json",',
        {"id": "nt"},
        {"id": "uk", "text": "x", "tempurature": 0.5},
        {"id": "ok", "text": "again"},
        {"id": "../x", "text": "escape"},
        {"text": "bad ref", "references": [{"audio": "missing.wav", "text": "t"}]},
        {"text": "bad values", "top_p": 2, "priority": "urgent", "seed": -1},
        {"text": "ref without transcript", "references": [{"codes": str(assets / "voices" / "voice.npy")}]},
    ]
    jsonl = _write_jsonl(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "out"
    assert main_for_tests([str(jsonl), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shoal: error:") and "8 bad lines" in err
    for n, words in [(2, "invalid JSON"), (3, "missing required key 'text'"), (4, "'tempurature'"),
                     (5, "duplicate id 'ok'"), (6, "'../x'"), (7, "missing.wav"), (8, "top_p"),
                     (8, "priority"), (8, "seed"), (9, "transcript")]:
        hits = [line for line in err.splitlines() if line.startswith(f"  line {n}: ") and words in line]
        assert hits, (n, words)
    assert "line 1:" not in err
    assert not out.exists()  # nothing loaded, nothing written


def test_clean_errors(tiny_s2_checkpoint, tmp_path, capsys):
    assert main_for_tests([str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "requests file not found" in capsys.readouterr().err
    (tmp_path / "garbage.wav").write_bytes(b"not audio at all" * 10)
    jsonl = _write_jsonl(tmp_path / "r.jsonl",
                         [{"text": "x", "references": [{"audio": "garbage.wav", "text": "t"}]}])
    assert _run(jsonl, tmp_path / "o", tiny_s2_checkpoint) == 2
    err = capsys.readouterr().err
    assert "line 1:" in err and "cannot read audio" in err
    # found only once the model is loaded: a prompt longer than the context
    jsonl = _write_jsonl(tmp_path / "long.jsonl", [{"text": "fine"}, {"text": "word " * 5000}])
    assert _run(jsonl, tmp_path / "o2", tiny_s2_checkpoint) == 2
    err = capsys.readouterr().err
    assert "line 2:" in err and "context" in err and "line 1:" not in err
    assert not list((tmp_path / "o2").glob("*.npy"))


def test_ctrl_c_keeps_finished_outputs_and_resumes(tiny_s2_checkpoint, tmp_path, monkeypatch, capsys):
    rows = [{"id": f"r{i}", "text": f"Sentence number {i} is here.", "seed": i, "max_new_tokens": 3 + 4 * i}
            for i in range(4)]
    jsonl = _write_jsonl(tmp_path / "r.jsonl", rows)
    out = tmp_path / "out"
    step = Engine.step

    def step_then_ctrl_c(self):
        events = step(self)
        if any(isinstance(e, FinishEvent) for e in events):
            signal.raise_signal(signal.SIGINT)  # as if Ctrl-C was pressed during this step
        return events

    monkeypatch.setattr(Engine, "step", step_then_ctrl_c)
    assert _run(jsonl, out, tiny_s2_checkpoint, "--no-audio") == 130
    assert "interrupted" in capsys.readouterr().err
    done = sorted(p.stem for p in out.glob("*.npy"))
    assert "r0" in done and len(done) < 4  # the shortest finished first; unfinished ones not written
    assert sorted(e["id"] for e in _manifest(out)) == done
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.setattr(Engine, "step", step)
    first = np.load(out / "r0.npy")
    assert _run(jsonl, out, tiny_s2_checkpoint, "--no-audio") == 0
    assert f"skipped {len(done)} of 4" in capsys.readouterr().err
    assert sorted(p.stem for p in out.glob("*.npy")) == ["r0", "r1", "r2", "r3"]
    assert np.array_equal(np.load(out / "r0.npy"), first)
