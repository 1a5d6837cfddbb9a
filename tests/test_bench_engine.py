"""``shoal bench engine`` on CPU with the tiny shapes: the shared-voice workload (``--voices``)
and its prefix-cache accounting; the SM-partition option is a no-op off CUDA."""

from __future__ import annotations

import json

import numpy as np

from shoal.bench import engine as bench
from shoal.bench.random_model import tiny_config

TINY = ["--device", "cpu", "--shape", "tiny", "--dtype", "fp32", "--concurrency", "2", "--frames", "8",
        "--prompt-tokens", "96", "--ref-frames", "48", "--requests-per-client", "2"]


def test_voice_prompts_share_the_reference_part_only():
    cfg = tiny_config()
    voices = bench.voice_prompts(cfg, 96, 48, 3)
    rng = np.random.default_rng(0)
    ref_end = (96 - 48) // 2 + 48
    grids = [bench.prompt_for(cfg, 96, 48, rng, voices) for _ in range(12)]
    for g in grids:
        assert g.shape == voices[0].shape
        assert any(np.array_equal(g[:, :ref_end], v[:, :ref_end]) for v in voices)
    tails = {g[0, ref_end:].tobytes() for g in grids}
    assert len(tails) == len(grids)  # every request has its own target text
    fresh = [bench.prompt_for(cfg, 96, 48, rng, None) for _ in range(4)]
    assert len({g[:, :ref_end].tobytes() for g in fresh}) == 4


def _run(tmp_path, *extra) -> dict:
    out = tmp_path / "out"
    assert bench.main([*TINY, "--out", str(out), *extra]) == 0
    return json.loads((out / "engine.json").read_text())


def test_shared_voices_hit_the_prefix_cache(tmp_path):
    data = _run(tmp_path, "--voices", "1", "--audio-sms", "16")
    (lv,) = data["results"]
    assert lv["voices"] == 1
    # four 96-token requests of one voice whose shared 72 leading tokens fill 4 whole 16-token
    # blocks: the first wave of two misses, the second wave's two reuse 64 tokens each at least
    assert lv["prefix_hit_rate"] >= 2 * 64 / (4 * 96) - 1e-9, lv
    assert data["meta"]["audio_sms"] is None  # no codec (and no CUDA): nothing confined


def test_own_voices_miss_the_prefix_cache(tmp_path):
    (lv,) = _run(tmp_path)["results"]
    assert lv["voices"] == 0 and lv["prefix_hit_rate"] == 0.0
