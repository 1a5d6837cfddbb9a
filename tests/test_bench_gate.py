"""``shoal bench gate`` on CPU with the tiny shapes: writing a baseline, passing, failing on a
slower engine (simulated by inflating the baseline), refusing another device or workload.

CPU timings of a shared machine are noisy, so the rerun-passes check uses a wide tolerance; the
comparison itself is tested exactly on fixed numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.bench import gate

TINY = ["--device", "cpu", "--shape", "tiny", "--dtype", "fp32", "--concurrency", "1,2", "--frames", "24",
        "--prompt-tokens", "64", "--ref-frames", "32", "--requests-per-client", "1", "--repeats", "2"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gate") / "baselines" / "cpu.json"
    assert gate.main(["--baseline", str(path), "--update", *TINY]) == 0
    return path


def _edit(src: Path, dst: Path, **changes) -> Path:
    data = json.loads(src.read_text())
    for k, fn in changes.items():
        data[k] = fn(data[k])
    dst.write_text(json.dumps(data))
    return dst


def test_update_writes_a_complete_baseline(baseline):
    data = json.loads(baseline.read_text())
    assert data["format"] == gate.FORMAT and data["metric"] == "per_stream_fps_mean"
    for key in ("date", "gpu", "torch", "commit", "command", "python"):
        assert data[key], key
    assert data["gpu"] == gate.device_name("cpu")
    assert data["command"].startswith("shoal bench gate --baseline") and "--update" in data["command"]
    assert data["workload"] == {"shape": "tiny", "dtype": "fp32", "frames": 24, "prompt_tokens": 64, "ref_frames": 32,
                                "requests_per_client": 1.0, "max_running": 128, "cuda_graphs": True, "repeats": 2}
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    for lv in data["levels"]:
        assert lv["per_stream_fps"] > 0 and len(lv["per_stream_fps_runs"]) == 2
        assert lv["per_stream_fps"] == max(lv["per_stream_fps_runs"])
        assert lv["aggregate_fps"] > 0 and lv["ttff_p50_ms"] > 0


def test_unchanged_rerun_passes(baseline, tmp_path, capsys):
    # the workload comes from the baseline file: no workload options needed
    rc = gate.main(["--baseline", str(baseline), "--device", "cpu", "--tolerance", "0.95",
                    "--json", str(tmp_path / "run.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "gate passed" in out and "baseline" in out
    run = json.loads((tmp_path / "run.json").read_text())
    assert [r["concurrency"] for r in run["comparison"]] == [1, 2]
    assert all(r["status"] != "REGRESSION" for r in run["comparison"])


def test_inflated_baseline_fails_and_names_the_level(baseline, tmp_path, capsys):
    def inflate(levels):
        for lv in levels:
            if lv["concurrency"] == 2:
                lv["per_stream_fps"] *= 1000
        return levels

    fast = _edit(baseline, tmp_path / "fast.json", levels=inflate)
    rc = gate.main(["--baseline", str(fast), "--device", "cpu", "--tolerance", "0.95"])  # c=1 passes despite noise
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "gate FAILED" in out and "c=2" in out and "c=1 " not in out.split("gate FAILED")[1]
    assert "REGRESSION" in out


def test_gpu_name_mismatch_is_refused(baseline, tmp_path, capsys):
    other = _edit(baseline, tmp_path / "h200.json", gpu=lambda _: "NVIDIA H200")
    assert gate.main(["--baseline", str(other), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "NVIDIA H200" in err and gate.device_name("cpu") in err and "--allow-device-mismatch" in err


def test_workload_mismatch_and_missing_baseline_are_refused(baseline, tmp_path, capsys):
    assert gate.main(["--baseline", str(baseline), "--device", "cpu", "--frames", "99"]) == 2
    assert "frames: baseline 24, command line 99" in capsys.readouterr().err
    assert gate.main(["--baseline", str(baseline), "--device", "cpu", "--concurrency", "1,64"]) == 2
    assert "no level c=64" in capsys.readouterr().err
    assert gate.main(["--baseline", str(tmp_path / "none.json"), "--device", "cpu", "--shape", "tiny"]) == 2
    assert "--update" in capsys.readouterr().err
    assert gate.main(["--baseline", str(tmp_path / "x.json"), "--update", "--device", "cpu"]) == 2  # S2-Pro on CPU
    assert "--shape tiny" in capsys.readouterr().err


def test_compare_table_and_tolerance():
    base = {"levels": [{"concurrency": 1, "per_stream_fps": 100.0, "aggregate_fps": 100.0},
                       {"concurrency": 16, "per_stream_fps": 80.0, "aggregate_fps": 1280.0},
                       {"concurrency": 64, "per_stream_fps": 50.0, "aggregate_fps": 3200.0}]}
    now = [{"concurrency": 1, "per_stream_fps": 96.0, "aggregate_fps": 96.0},  # -4 %: within 5 %
           {"concurrency": 16, "per_stream_fps": 75.0, "aggregate_fps": 1200.0},  # -6.25 %
           {"concurrency": 64, "per_stream_fps": 60.0, "aggregate_fps": 3840.0}]  # +20 %
    rows, table = gate.compare(base, now, 0.05)
    assert [r["status"] for r in rows] == ["ok", "REGRESSION", "faster"]
    assert rows[1]["delta"] == pytest.approx(-0.0625)
    assert "-6.2%" in table and "+20.0%" in table and "baseline" in table
