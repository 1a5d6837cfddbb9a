"""bf16 decode GEMM (shoal.kernels.dense): the Triton kernel vs the fp32 reference under the
interpreter (child process, see interpreter_worker.py) and on the GPU, the table dispatch, and
the model's fused path using it.

Numerics: the kernel sums fp32 products in another order than the reference (per BLOCK_K
chunk, then split by split) and rounds once to bf16, so an output may differ by one bf16 ulp:
``max|y - y_ref| <= 2^-7 * max|y_ref|``. With exactly representable operands (small integers,
every partial sum exact) it equals the reference bit for bit, and the in-kernel split-K reduce
equals the separate reduce kernel bit for bit.
"""

import os

if __name__ == "__main__":  # interpreter worker: must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import json

import pytest
import torch
from interpreter_worker import assert_case, report_cases, run_worker

from shoal.kernels import dense

CASES = {  # name -> (M, N, K, config)
    "m1_nosplit": (1, 96, 256, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1}),
    "m3_split3_fused": (3, 64, 384, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 3}),
    "m17_ragged_n_k": (17, 70, 200, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2}),
    "m33_bm64_bk128": (33, 64, 512, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2}),
    # the CUDA-core GEMV (one token per program row): one split, split K with the fused
    # reduce, ragged N and K, and a few tokens (the weight read once per token)
    "gemv_m1_nosplit": (1, 96, 256, {"KIND": "gemv", "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 1}),
    "gemv_m1_split3_fused": (1, 64, 384, {"KIND": "gemv", "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 3}),
    "gemv_m3_ragged_split2": (3, 70, 200, {"KIND": "gemv", "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2}),
    "tma_m3_split3": (3, 64, 384, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 3, "TMA": True}),
    "tma_m17_ragged_n_k": (17, 70, 200, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "TMA": True}),
    "tma_tile_m40_ragged": (40, 70, 200, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2, "TMA": True,
                                          "KIND": "tile"}),
    # stream-K: 7 programs over 2 x 6 = 12 (tile, K block) iterations (each tile shared by 3-4
    # programs); 5 programs over 12 (3 x 4, ragged N and K), pointer and TMA loads; 2 programs
    # with one whole tile each
    "streamk_m3_p7": (3, 64, 384, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "KIND": "streamk", "PROGRAMS": 7}),
    "streamk_m17_ragged": (17, 70, 200, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "KIND": "streamk",
                                         "PROGRAMS": 5}),
    "streamk_tma_m40_p5": (40, 70, 200, {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "KIND": "streamk",
                                         "PROGRAMS": 5, "TMA": True}),
    "streamk_one_per_tile": (5, 64, 256, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "KIND": "streamk",
                                          "PROGRAMS": 2}),
}
# gate_up GEMM + SwiGLU in one kernel: (M, I, K, config); w13 is [2I, K]
SWIGLU_CASES = {
    "swiglu_m1_nosplit": (1, 64, 256, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1}),
    "swiglu_m3_split3": (3, 64, 384, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 3}),
    "swiglu_m17_ragged": (17, 70, 200, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2}),
    "swiglu_tma_m5_ragged": (5, 70, 200, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "TMA": True}),
}


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def _case(M, N, K, cfg):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16()
    y = dense.dense_gemm_triton(x, w, config=cfg)
    checks = {"rel_vs_ref": (_rel(y, dense.dense_gemm_ref(x, w)), 2.0 ** -7)}
    # exactly representable operands: every order of fp32 additions gives the same sum
    xi = torch.randint(-4, 5, (M, K), generator=g).bfloat16()
    wi = torch.randint(-4, 5, (N, K), generator=g).bfloat16()
    flags = {"exact_ints": torch.equal(dense.dense_gemm_triton(xi, wi, config=cfg), dense.dense_gemm_ref(xi, wi)),
             "shape": tuple(y.shape) == (M, N) and y.dtype == torch.bfloat16}
    # a strided row view of x (rows of a wider buffer) reads the same values
    wide = torch.zeros(M, K + 64).bfloat16()
    wide[:, :K] = x
    flags["strided_rows"] = torch.equal(dense.dense_gemm_triton(wide[:, :K], w, config=cfg), y)
    if cfg.get("KIND") == "streamk":
        # whole tiles: the plain kernel's bits; shared tiles: the exact integer case above;
        # every arrival counter back to 0 (the interpreter runs programs one at a time in
        # order, so the arrival race itself is exercised on the GPU only)
        from shoal.kernels import fp8

        counters = fp8._counters.get(("cpu", None))
        flags["counters_reset"] = counters is None or not bool(counters.any())
        plan = dense.streamk_plan(M, N, K, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["PROGRAMS"])
        if plan[4] == 1:
            plain = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
            flags["whole_tiles_equal_plain"] = torch.equal(dense.dense_gemm_triton(x, w, config=plain), y)
    return {"checks": checks, "flags": flags}


def _swiglu_case(M, inter, K, cfg):
    from shoal.kernels import fp8
    from shoal.kernels.fused import silu_mul, silu_mul_ref

    g = torch.Generator().manual_seed(M * 1000 + inter + K)
    x = torch.randn(M, K, generator=g).bfloat16()
    w13 = (torch.randn(2 * inter, K, generator=g) * K ** -0.5).bfloat16()
    y = dense.dense_swiglu_triton(x, w13, config=cfg)
    ref = silu_mul_ref(dense.dense_gemm_ref(x, w13))
    checks = {"rel_vs_ref": (_rel(y, ref), 2.0 ** -6)}
    # the unfused composition with the same tiles: the same sums and roundings, so the same bits
    flags = {"equals_gemm_then_silu_mul": torch.equal(silu_mul(dense.dense_gemm_triton(x, w13, config=cfg)), y),
             "shape": tuple(y.shape) == (M, inter) and y.dtype == torch.bfloat16}
    xi = torch.randint(-3, 4, (M, K), generator=g).bfloat16()
    wi = torch.randint(-3, 4, (2 * inter, K), generator=g).bfloat16()
    flags["exact_ints_vs_ref"] = torch.equal(dense.dense_swiglu_triton(xi, wi, config=cfg),
                                             silu_mul_ref(dense.dense_gemm_ref(xi, wi)))
    counters = fp8._counters.get(("cpu", None))
    flags["counters_reset"] = counters is None or not bool(counters.any())
    return {"checks": checks, "flags": flags}


def _worker_main():
    from shoal.kernels.paged_attention import triton_interpreting

    assert triton_interpreting(), "worker must import triton with TRITON_INTERPRET=1"
    report_cases({**CASES, **SWIGLU_CASES},
                 lambda name: _case(*CASES[name]) if name in CASES else _swiglu_case(*SWIGLU_CASES[name]))


@pytest.fixture(scope="module")
def interp_results():
    if not dense.HAS_TRITON:
        pytest.skip("triton not installed")
    return run_worker(__file__)


@pytest.mark.parametrize("name", list(CASES) + list(SWIGLU_CASES))
def test_kernel_matches_reference_interpreter(interp_results, name):
    assert_case(interp_results[name], need_any=True)


def test_swiglu_config_uses_the_gate_up_tiles(tmp_path, monkeypatch):
    table = {"configs": {"128,256": {"1": {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 2, "TMA": True},
                                     "64": {"BLOCK_M": 64, "BLOCK_N": 128, "KIND": "tile", "TMA": True},
                                     "128": None}}}
    (tmp_path / "dense_tuned.json").write_text(json.dumps(table))
    try:
        dense.set_dense_table(tmp_path)
        c = dense.swiglu_config(1, 128, 256)  # the gate_up tiles themselves: the unfused path's bits
        assert c["BLOCK_N"] == 64 and c["SPLIT_K"] == 2 and c["TMA"] and c["KIND"] == "swap"
        assert dense.swiglu_config(64, 128, 256) is None  # tokens-on-M tiles: not fused
        assert dense.swiglu_config(128, 128, 256) is None  # cuBLAS bucket
        # a tuned entry of its own wins over the halved gate_up tile; a null bucket: unfused
        table["configs"]["swiglu:128,256"] = {"4": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 4},
                                              "64": None}
        (tmp_path / "dense_tuned.json").write_text(json.dumps(table))
        dense.set_dense_table(tmp_path)
        c = dense.swiglu_config(1, 128, 256)
        assert c["BLOCK_N"] == 16 and c["SPLIT_K"] == 4 and not c.get("TMA")
        assert dense.swiglu_config(64, 128, 256) is None and dense.swiglu_config(1, 128, 512) is None
    finally:
        dense.set_dense_table(None)


def test_dense_swiglu_off_the_kernel_path_is_silu_mul_of_linear(monkeypatch):
    from shoal.kernels.fused import silu_mul_ref

    monkeypatch.setenv(dense.SWIGLU_ENV, "1")
    dense._swiglu_enabled.cache_clear()
    try:
        x = torch.randn(2, 3, 64).bfloat16()
        w13 = torch.randn(96, 64).bfloat16()
        y = dense.dense_swiglu(x, w13)  # CPU tensors: F.linear, then the reference SwiGLU
        assert y.shape == (2, 3, 48) and torch.equal(y, silu_mul_ref(torch.nn.functional.linear(x, w13)))
    finally:
        dense._swiglu_enabled.cache_clear()
    with pytest.raises(ValueError, match="2I"):
        dense.dense_swiglu_triton(torch.randn(2, 64).bfloat16(), torch.randn(95, 64).bfloat16())


# --------------------------------------------------------------------------------------
# Configs and dispatch (no kernels run)
# --------------------------------------------------------------------------------------


def test_finish_config_splits_in_whole_blocks():
    c = dense.finish_config({"BLOCK_K": 128, "SPLIT_K": 8}, 9728)  # 76 K blocks
    assert c["k_per_split"] % 128 == 0 and c["SPLIT_K"] * c["k_per_split"] >= 9728
    assert (c["SPLIT_K"] - 1) * c["k_per_split"] < 9728  # no empty split
    assert dense.finish_config({"BLOCK_K": 64, "SPLIT_K": 99}, 256)["SPLIT_K"] == 4


def test_streamk_plan_matches_a_direct_count():
    # the contributors of every tile, counted by walking each program's range
    for M, N, K, bm, bn, bk, p in ((1, 2560, 9728, 16, 64, 128, 132), (64, 6144, 2560, 64, 64, 128, 132),
                                   (3, 64, 384, 16, 32, 64, 7), (1, 96, 256, 16, 32, 64, 1000)):
        tiles_n, kbt, iters, progs, maxc = dense.streamk_plan(M, N, K, bm, bn, bk, p)
        assert progs == min(p, iters) and iters == kbt * tiles_n * -(-M // bm)
        owners: dict[int, set] = {}
        for q in range(progs):
            for i in range(q * iters // progs, (q + 1) * iters // progs):
                owners.setdefault(i // kbt, set()).add(q)
        assert maxc == max(len(v) for v in owners.values())
        assert all(sorted(v) == list(range(min(v), max(v) + 1)) for v in owners.values())
    c = dense.finish_config({"KIND": "streamk", "BLOCK_K": 128, "SPLIT_K": 4, "PREFETCH": 512}, 9728)
    assert c["KIND"] == "streamk" and c["SPLIT_K"] == 1 and c["PROGRAMS"] == dense.TUNED_SMS and c["PREFETCH"] == 0
    assert "PROGRAMS" not in dense.finish_config({"PROGRAMS": 7}, 256)


def test_gemv_config_is_normalized():
    c = dense.finish_config({"KIND": "gemv", "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 3, "TMA": True,
                             "PREFETCH": 512}, 9728)
    assert c["KIND"] == "gemv" and not c["TMA"] and c["PREFETCH"] == 0 and c["BLOCK_M"] == 1
    assert c["SPLIT_K"] == 3 and c["k_per_split"] % 256 == 0 and c["k_per_split"] * 3 >= 9728


def test_prefetch_option_is_normalized():
    c = dense.finish_config({"BLOCK_K": 128, "SPLIT_K": 8, "PREFETCH": 1024}, 2560)
    assert c["PREFETCH"] == 256 and c["PREFETCH"] <= c["k_per_split"]  # a power of two within the split
    assert dense.finish_config({"BLOCK_K": 128, "PREFETCH": 1024, "TMA": True}, 2560)["PREFETCH"] == 0
    assert dense.finish_config({"BLOCK_K": 128, "PREFETCH": 32}, 2560)["PREFETCH"] == 0


def test_table_buckets_and_override(tmp_path):
    table = {"configs": {"64,256": {"4": {"BLOCK_M": 16, "SPLIT_K": 2}, "32": {"BLOCK_M": 32}, "128": None}}}
    (tmp_path / "dense_tuned.json").write_text(json.dumps(table))
    try:
        dense.set_dense_table(tmp_path)
        assert dense.dense_config(1, 64, 256)["SPLIT_K"] == 2
        assert dense.dense_config(4, 64, 256)["BLOCK_M"] == 16
        assert dense.dense_config(5, 64, 256)["BLOCK_M"] == 32
        assert dense.dense_config(64, 64, 256) is None  # bucket 128 says cuBLAS
        assert dense.dense_config(300, 64, 256) is None  # prefill: cuBLAS
        assert dense.dense_config(1, 65, 256) is None  # no entry for this shape
    finally:
        dense.set_dense_table(None)


def test_packaged_table_is_well_formed():
    for key, entry in dense._table().items():
        n, k = (int(v) for v in key.removeprefix("swiglu:").split(","))
        for m, cfg in entry.items():
            assert 1 <= int(m) <= dense.MAX_M
            if cfg is not None:
                c = dense.finish_config(cfg, k)
                assert c["BLOCK_M"] >= min(16, int(m)) and c["BLOCK_N"] in (32, 64, 128, 256), (key, m, c)
                assert c["BLOCK_K"] in (32, 64, 128, 256) and c["SPLIT_K"] >= 1


def test_tuner_search_space(monkeypatch):
    from shoal.bench import tune_dense

    monkeypatch.setattr(tune_dense, "pdl_enabled", lambda: True)  # as on an H200 (PREFETCH needs PDL)

    for M in (1, 4, 16, 32, 64, 128):
        for N, K in ((19456, 2560), (2560, 9728), (4097, 2560), (1024, 2560)):
            cands = tune_dense.candidates(M, N, K)
            assert cands and any(c.get("TMA") for c in cands) and any(not c.get("TMA") for c in cands)
            for c in cands:
                assert c["BLOCK_M"] >= min(M, 128) and c["BLOCK_M"] >= 16
                assert c["num_stages"] * (c["BLOCK_N"] + c["BLOCK_M"]) * c["BLOCK_K"] * 2 <= tune_dense.SMEM
            keys = [json.dumps(dense.finish_config(c, K), sort_keys=True) for c in cands]
            assert len(keys) == len(set(keys))  # no launch timed twice
            assert not any(c.get("PREFETCH") or c.get("KIND") in ("tile", "streamk") for c in cands)  # opt-in
            wide = tune_dense.candidates(M, N, K, prefetch=True, tile=True, streamk=True)
            assert any(c.get("KIND") == "tile" for c in wide) if M >= 64 else any(c.get("PREFETCH") for c in wide)
            assert any(c.get("KIND") == "streamk" for c in wide)
            for c in wide:
                assert c["num_stages"] * (c["BLOCK_N"] + c["BLOCK_M"]) * c["BLOCK_K"] * 2 <= tune_dense.SMEM
            assert len(wide) > len(cands)


def test_mma_v2_tuner_search_space():
    """--mma-v2: only 16/32-weight-row swap-AB launches (what Triton lowers to mma.sync), each
    fitting shared memory, with pointer and TMA loads, no launch twice."""
    from shoal.bench import tune_dense

    for M in (1, 16, 64):
        for N, K in ((2560, 4096), (2560, 9728), (6144, 2560)):
            cands = tune_dense.mma_v2_candidates(M, N, K)
            assert cands and any(c.get("TMA") for c in cands) and any(not c.get("TMA") for c in cands)
            for c in cands:
                assert c["BLOCK_N"] in (16, 32) and c["BLOCK_M"] >= min(M, 128)
                assert c["num_stages"] * (c["BLOCK_N"] + c["BLOCK_M"]) * c["BLOCK_K"] * 2 <= tune_dense.SMEM
                assert dense.finish_config(c, K)["KIND"] == "swap"
            keys = [json.dumps(dense.finish_config(c, K), sort_keys=True) for c in cands]
            assert len(keys) == len(set(keys))


def test_swiglu_tuner_search_space():
    from shoal.bench import tune_dense

    for M in (1, 4, 16, 32, 64, 128):
        cands = tune_dense.swiglu_candidates(M, 19456, 2560)
        assert cands and any(c.get("TMA") for c in cands) and any(not c.get("TMA") for c in cands)
        for c in cands:
            assert c["BLOCK_M"] >= min(M, 128) and c["BLOCK_N"] in (16, 32, 64, 128)
            assert c["num_stages"] * (2 * c["BLOCK_N"] + c["BLOCK_M"]) * c["BLOCK_K"] * 2 <= tune_dense.SMEM
            assert dense.finish_config(c, 2560)["KIND"] == "swap"
        keys = [json.dumps(dense.finish_config(c, 2560), sort_keys=True) for c in cands]
        assert len(keys) == len(set(keys))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_bench_dense_step_smoke_on_cpu(tmp_path):
    """``shoal bench dense-step`` end to end on CPU (tiny shapes, eager steps): every candidate
    of the asked projection is timed in the engine's decode step, the report and a table are
    written, nothing is taken into it (no dense kernel on CPU), and the table in force is the
    one from before."""
    import json

    from shoal.cli import main

    before = dense._table_doc()
    assert main(["bench", "dense-step", "--device", "cpu", "--shape", "tiny", "--limit", "1", "--replays", "1",
                 "--shapes", "wo", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "tune_step.json").read_text())
    wo = rep["projections"]["wo"]
    assert [c["config"].get("KIND", "swap") for c in wo["candidates"]] == ["swap", "gemv"]
    assert all(c["step_ms"] > 0 for c in wo["candidates"]) and len(rep["baseline_ms"]) == 2
    assert not wo["taken"] and rep["tuned_ms"] > 0
    assert json.loads((tmp_path / "dense_tuned.json").read_text())["configs"] == before.get("configs", {})
    assert dense._table_override == [] and dense._table_doc() == before


def test_bench_dense_step_projections_are_the_steps_gemms():
    """The tuner's (N, K) per projection are the weights the decode step multiplies by: the
    fast head on its residual-code rows, the slow head on the allowed tokens."""
    import torch as _t

    from shoal.bench.random_model import random_dualar, tiny_config
    from shoal.bench.tune_step import projections

    model = random_dualar(tiny_config(256), "cpu", _t.float32)
    model.set_allowed_tokens([1, 2])
    shapes = projections(model)
    d = model.config.slow.dim
    assert shapes["fast_head"] == (model.config.residual_codebook_size, model.config.fast.dim)
    assert shapes["semantic_head"] == tuple(model.allowed_head.shape) and shapes["wo"][0] == d
    assert shapes["gate_up"] == (2 * model.config.slow.intermediate_size, d)


def test_bench_dense_without_cuda_says_so(capsys):
    from shoal.cli import main

    assert main(["bench", "dense", "--ms", "1"]) == 0
    assert "CUDA not available" in capsys.readouterr().out


def test_cpu_tensors_use_cublas_path():
    x = torch.randn(2, 3, 64).bfloat16()
    w = torch.randn(32, 64).bfloat16()
    b = torch.randn(32).bfloat16()
    assert not dense.use_dense_kernel(x.reshape(-1, 64), w)
    assert torch.equal(dense.dense_linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(dense.dense_linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_rejects_bad_operands():
    with pytest.raises(ValueError, match="bf16"):
        dense.dense_gemm_triton(torch.randn(2, 64), torch.randn(8, 64))
    with pytest.raises(ValueError, match="expected"):
        dense.dense_gemm_triton(torch.randn(2, 64).bfloat16(), torch.randn(8, 32).bfloat16())


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available() or not dense.HAS_TRITON, reason="needs CUDA + triton")


@cuda
@pytest.mark.parametrize("M", [1, 5, 16, 48, 128])
@pytest.mark.parametrize("N,K", [(19456, 2560), (2560, 9728), (4097, 2560), (200, 384)])
def test_gpu_kernel_matches_reference(M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    ref = dense.dense_gemm_ref(x, w)
    bm = max(16, min(128, 1 << (M - 1).bit_length()))
    for cfg in ({"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1},
                {"BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 4, "num_warps": 8, "num_stages": 5},
                {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "TMA": True},
                {"BLOCK_M": bm, "BLOCK_N": 256, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 8, "TMA": True},
                {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "PREFETCH": 1024},
                {"KIND": "gemv", "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 3, "num_stages": 3},
                {"KIND": "gemv", "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "num_stages": 1},
                {"BLOCK_M": max(bm, 64), "BLOCK_N": 256, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 8, "TMA": True,
                 "KIND": "tile"},
                {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "KIND": "streamk", "PROGRAMS": 132, "TMA": True},
                {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "KIND": "streamk", "PROGRAMS": 264},
                {"BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 64, "KIND": "streamk", "PROGRAMS": 132, "num_stages": 5,
                 "TMA": True}):
        y = dense.dense_gemm_triton(x, w, config=cfg)
        assert _rel(y, ref) <= 2.0 ** -7, cfg
    assert _rel(dense.dense_linear(x, w), ref) <= 2.0 ** -7  # the table's choice (or cuBLAS)
    torch.cuda.synchronize()
    from shoal.kernels import fp8

    counters = fp8._counters.get(("cuda", x.device.index))
    assert counters is None or not bool(counters.any())  # every arrival counter back to 0


@cuda
@pytest.mark.parametrize("M", [1, 7, 64])
def test_gpu_swiglu_equals_gemm_then_silu_mul(M):
    """S2-Pro's gate_up (w13 [19456, 2560]): the fused kernel gives the bits of the GEMM with
    the same tiles followed by silu_mul, for pointer / TMA loads, one split and split K (fused
    reduce), and through the dispatcher with the packaged table when enabled."""
    from shoal.kernels.fused import silu_mul, silu_mul_ref

    K, inter = 2560, 9728
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(2 * inter, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    bm = max(16, min(128, 1 << (M - 1).bit_length()))
    ref = silu_mul_ref(dense.dense_gemm_ref(x, w13))
    for cfg in ({"BLOCK_M": bm, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "num_stages": 3},
                {"BLOCK_M": bm, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "TMA": True},
                {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 3, "TMA": True},
                {"BLOCK_M": bm, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4}):
        y = dense.dense_swiglu_triton(x, w13, config=cfg)
        assert torch.equal(y, silu_mul(dense.dense_gemm_triton(x, w13, config=cfg))), cfg
        assert _rel(y, ref) <= 2.0 ** -6, cfg
    cfg = dense.swiglu_config(M, 2 * inter, K)
    if cfg is not None:
        fused = dense.dense_swiglu_triton(x, w13)
        assert torch.equal(fused, silu_mul(dense.dense_gemm_triton(x, w13, config=cfg)))
        if f"swiglu:{2 * inter},{K}" not in dense._table():  # the gate_up tiles: the model's unfused bits
            assert torch.equal(fused, silu_mul(dense.dense_linear(x, w13)))
    torch.cuda.synchronize()
    from shoal.kernels import fp8

    counters = fp8._counters.get(("cuda", x.device.index))
    assert counters is None or not bool(counters.any())


@cuda
def test_gpu_cuda_graph_replay_bit_exact():
    M, N, K = 8, 2560, 9728
    x = torch.randn(M, K, device="cuda").bfloat16()
    w = (torch.randn(N, K, device="cuda") * 0.01).bfloat16()
    cfgs = [{"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8},
            {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 256, "SPLIT_K": 2, "num_stages": 3},
            {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "TMA": True},
            {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "PREFETCH": 512},
            {"KIND": "gemv", "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 3, "num_stages": 3},
            {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "KIND": "streamk", "PROGRAMS": 132, "TMA": True}]

    def step():
        return [dense.dense_gemm_triton(x, w, config=c) for c in cfgs]

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        for s in static:
            s.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        again = step()
        for a, b in zip(static, again):
            assert torch.equal(a, b)
        assert _rel(static[0], dense.dense_gemm_ref(x, w)) <= 2.0 ** -7


def test_tuner_odd_splits_search_space():
    """--odd-splits (M <= 32): split counts that are not powers of two join the space (e.g. wo
    at 3: 40 weight tiles x 3 = 120 programs), every launch once; M >= 64 keeps its space."""
    from shoal.bench import tune_dense

    for M in (1, 16, 64):
        for N, K in ((2560, 4096), (2560, 9728), (19456, 2560)):
            plain = tune_dense.candidates(M, N, K)
            odd = tune_dense.candidates(M, N, K, odd_splits=True)
            keys = [tune_dense.launch_key(c, K) for c in odd]
            assert len(keys) == len(set(keys))
            splits = {dense.finish_config(c, K)["SPLIT_K"] for c in odd}
            if M <= 32:
                assert len(odd) > len(plain) and splits - {1, 2, 4, 8, 16}
            else:
                assert odd == plain
    wo = tune_dense.candidates(1, 2560, 4096, odd_splits=True)
    assert any(c["BLOCK_N"] == 64 and dense.finish_config(c, 4096)["SPLIT_K"] == 3 for c in wo)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_bench_dense_step_odd_splits_on_cpu(tmp_path):
    """``shoal bench dense-step --odd-splits``: the swap candidates are only the launches the odd
    split counts add (at S2-Pro's wo: 3, 5, 6 or 12 splits; none at the tiny shapes' K), and the
    command runs end to end with them."""
    import json

    from shoal.bench import tune_dense
    from shoal.bench.tune_step import odd_split_launches
    from shoal.cli import main

    new = odd_split_launches(1, 2560, 4096)
    plain = {tune_dense.launch_key(c, 4096) for c in tune_dense.candidates(1, 2560, 4096)}
    assert new and all(tune_dense.launch_key(c, 4096) not in plain for c in new)
    assert {dense.finish_config(c, 4096)["SPLIT_K"] for c in new} <= {3, 5, 6, 11, 12}
    assert main(["bench", "dense-step", "--device", "cpu", "--shape", "tiny", "--limit", "2", "--replays", "1",
                 "--shapes", "wqkv", "--kinds", "swap", "--odd-splits", "--out", str(tmp_path)]) == 0
    wqkv = json.loads((tmp_path / "tune_step.json").read_text())["projections"]["wqkv"]
    from shoal.bench.random_model import random_dualar, tiny_config
    from shoal.bench.tune_step import projections

    N, K = projections(random_dualar(tiny_config(), "cpu", torch.float32))["wqkv"]
    assert len(wqkv["candidates"]) == min(2, len(odd_split_launches(1, N, K)))


if __name__ == "__main__":
    _worker_main()
