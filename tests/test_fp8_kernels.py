"""Block-scaled FP8 kernels (shoal.kernels.fp8): references vs plain fp32 math, Triton
kernels vs the references (interpreter, in a subprocess as in test_fused_kernels.py),
layout validation, and GPU-only checks (skipped without CUDA).

Numerics checked:
* quantizers (act 1x128, fused SwiGLU-quant): kernel == reference bit for bit (q bytes and
  fp32 scales).
* GEMM kernel vs reference: ``max|y - y_ref| <= 2^-7 * max|y_ref|`` (the fp32 sums are
  added in another order -- per K block with the scales applied per block -- so a bf16
  rounding may flip; in practice <= 1 bf16 ulp). The same bound between the swap-AB decode
  kernel (KIND "swap") and the tile kernel for the same split; both equal the reference bit for
  bit on exactly representable operands (every summation order exact). The in-kernel split-K
  reduce (REDUCE "fused") equals the reduce kernel bit for bit, and the swap kernel's
  SplitKPartials give the fused consumers (SwiGLU+quantize, add+RMSNorm+quantize) the same
  bytes as their reduced bf16 input.
* reference vs the unquantized product: relative Frobenius error < 6e-2 (~3.7e-2 observed).
* exactness: with exactly representable inputs (small-integer e4m3 values, power-of-two
  scales) the reference GEMM equals the exact product rounded to bf16, and quantize ->
  dequantize is the identity.
"""

import os

if __name__ == "__main__":  # interpreter worker: must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"


import pytest
import torch
from interpreter_worker import assert_case, report_cases, run_worker

from shoal.kernels import fp8

E4M3 = torch.float8_e4m3fn


def _bytes(q):
    return q.view(torch.uint8)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------------------
# Interpreter cases (run in the worker subprocess)
# --------------------------------------------------------------------------------------

# name -> (M, K, N)
INTERP_CASES = {
    f"m{M}_k{K}_n{N}": (M, K, N)
    for M, K, N in [
        (1, 128, 128), (1, 256, 200), (1, 384, 256),
        (3, 128, 256), (3, 384, 200),
        (16, 256, 128), (16, 384, 256),
        (33, 128, 200), (33, 256, 256),
        (5, 200, 136),  # ragged K and N
    ]
}


def _interp_case(M, K, N):
    g = torch.Generator().manual_seed(M * 1000 + K * 7 + N)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    checks, flags = {}, {}
    # activation quantize
    xq, xs = fp8.quantize_act_triton(x)
    xq_r, xs_r = fp8.quantize_act_ref(x)
    flags["quant_q_exact"] = torch.equal(_bytes(xq), _bytes(xq_r))
    flags["quant_s_exact"] = torch.equal(xs, xs_r)
    # GEMM: default config, forced split-K, forced no split, out=, row-sliced x_q
    Wq, Ws = fp8.quantize_weight_ref(w)
    y_r = fp8.fp8_gemm_ref(xq_r, xs_r, Wq, Ws)
    KB = -(-K // 128)
    configs = [("default", None), ("split1", {"SPLIT_K": 1}), ("splitmax", {"SPLIT_K": KB}),
               ("bm32_bn128", {"BLOCK_M": 32, "BLOCK_N": 128, "SPLIT_K": 2}),
               ("bm16_bn64", {"BLOCK_M": 16, "BLOCK_N": 64})]
    for label, cfg in configs:
        y = fp8.fp8_gemm_triton(xq_r, xs_r, Wq, Ws, config=cfg)
        checks[f"gemm_{label}"] = (_rel(y, y_r), 2.0 ** -7)
    # quantize fused into the GEMM: the same bytes, so the same result as quantize + GEMM
    for label, cfg in (("default", None), ("split2", {"SPLIT_K": 2})):
        y_lin = fp8.fp8_linear_triton(x, Wq, Ws, config=cfg, fuse_quant=True)
        flags[f"linear_{label}_equals_gemm"] = torch.equal(y_lin, fp8.fp8_gemm_triton(xq_r, xs_r, Wq, Ws, config=cfg))
    out = torch.full((M, N + 8), float("nan"), dtype=torch.bfloat16)[:, :N]
    fp8.fp8_gemm_triton(xq_r, xs_r, Wq, Ws, out=out)
    checks["gemm_out"] = (_rel(out, y_r), 2.0 ** -7)
    big = torch.zeros(M, K + 64, dtype=E4M3)
    big[:, :K] = xq_r
    checks["gemm_strided_x"] = (_rel(fp8.fp8_gemm_triton(big[:, :K], xs_r, Wq, Ws), y_r), 2.0 ** -7)
    # fused SwiGLU + quantize (I = K)
    gu = (torch.randn(M, 2 * K, generator=g) * 3).bfloat16()
    hq, hs = fp8.silu_mul_quant_triton(gu)
    hq_r, hs_r = fp8.silu_mul_quant_ref(gu)
    flags["smq_q_exact"] = torch.equal(_bytes(hq), _bytes(hq_r))
    checks["smq_s_rel"] = (((hs - hs_r).abs() / hs_r).max().item(), 1e-6)
    # dispatchers pick the kernel under the interpreter
    flags["dispatch_uses_triton"] = fp8.use_triton(x)
    return {"checks": checks, "flags": flags}


# swap-AB decode kernel (KIND "swap") and the in-kernel split-K reduce (REDUCE "fused"):
# name -> (M, K, N); odd M, ragged N and K, M above one token tile (17 > 16, 33 > 32)
SWAP_CASES = {
    f"swap_m{M}_k{K}_n{N}": (M, K, N)
    for M, K, N in [(1, 256, 200), (3, 640, 256), (17, 200, 136), (33, 384, 130)]
}


def _swap_case(M, K, N):
    from shoal.kernels import fused

    g = torch.Generator().manual_seed(M * 1000 + K * 7 + N + 1)
    x = torch.randn(M, K, generator=g).bfloat16()
    Wq, Ws = fp8.quantize_weight_ref((torch.randn(N, K, generator=g) * 0.05).bfloat16())
    xq, xs = fp8.quantize_act_ref(x)
    y_r = fp8.fp8_gemm_ref(xq, xs, Wq, Ws)
    KB = -(-K // 128)
    checks, flags = {}, {}
    bm = 16 if M <= 16 else 32
    for label, cfg in [("bn64", {"BLOCK_M": bm, "BLOCK_N": 64}),
                       ("bn128_split2", {"BLOCK_M": 16, "BLOCK_N": 128, "SPLIT_K": 2}),
                       ("bn64_splitmax", {"BLOCK_M": bm, "BLOCK_N": 64, "SPLIT_K": KB})]:
        swap = {**cfg, "KIND": "swap"}
        y_swap = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=swap)
        checks[f"swap_{label}"] = (_rel(y_swap, y_r), 2.0 ** -7)
        # the tile kernel with the same split: the same per-element arithmetic
        y_tile = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config={"SPLIT_K": cfg.get("SPLIT_K", 1)})
        checks[f"swap_vs_tile_{label}"] = (_rel(y_swap, y_tile), 2.0 ** -7)
        split = fp8._finish_config(swap, M, K)["SPLIT_K"]
        if split > 1:
            # fused reduce == reduce kernel == partials reduced, bit for bit (either kernel)
            for kind in ("swap", "tile"):
                c = {**cfg, "KIND": kind}
                y_k = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=c)
                y_f = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config={**c, "REDUCE": "fused"})
                part = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config={**c, "REDUCE": "fused"}, partials=True)
                flags[f"{kind}_{label}_fused_reduce_exact"] = torch.equal(y_f, y_k)
                flags[f"{kind}_{label}_partials"] = isinstance(part, fp8.SplitKPartials) and part.split == split
                flags[f"{kind}_{label}_partials_exact"] = torch.equal(part.reduce(), y_k)
            flags[f"{label}_counters_reset"] = not bool(fp8._counters[("cpu", None)].any())
            # the swap kernel's partials feed the fused consumers: the same bytes as their bf16 input
            part = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=swap, partials=True)
            ys = part.reduce()
            flags[f"{label}_swap_partials_reduce_ref"] = torch.equal(fp8.splitk_reduce_ref(part), ys)
            if N % 2 == 0:
                hq, hs = fp8.silu_mul_quant_triton(part)
                rq, rs = fp8.silu_mul_quant_triton(ys)
                flags[f"{label}_smq_exact"] = torch.equal(_bytes(hq), _bytes(rq)) and torch.equal(hs, rs)
            res = torch.randn(M, N, generator=g).bfloat16()
            w = (1 + 0.3 * torch.randn(N, generator=g)).bfloat16()
            a = fused.add_rmsnorm_quant_triton(part, res, w, 1e-6, store_normed=True)
            b = fused.add_rmsnorm_quant_triton(ys, res, w, 1e-6, store_normed=True)
            flags[f"{label}_norm_exact"] = (torch.equal(a.h, b.h) and torch.equal(_bytes(a.q), _bytes(b.q))
                                            and torch.equal(a.s, b.s) and torch.equal(a.normed, b.normed))
    # KB_STEP (K blocks unrolled per iteration) and TMA operands change the schedule, not the
    # sums: bit-equal to the plain kernel with the same K range per program (one split, pinned:
    # an explicit config without SPLIT_K inherits the table's or the heuristic's, and KB_STEP
    # rounds a split's range up, which moves the split boundaries); K = 200 has a row stride
    # TMA cannot take (the pointer loads are used instead)
    one = {"KIND": "swap", "BLOCK_M": bm, "BLOCK_N": 64, "SPLIT_K": 1}
    y_one = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=one)
    for step in (1, 2, 4):
        for tma in (False, True):
            if step == 1 and not tma:
                continue
            y_st = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config={**one, "KB_STEP": step, "TMA": tma})
            flags[f"swap_step{step}_tma{int(tma)}_exact"] = torch.equal(y_st, y_one)
    flags["tile_step2_exact"] = torch.equal(
        fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config={"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 1, "KB_STEP": 2}),
        fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config={"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 1}))
    # split K with the range rounded up to the step (the last split runs past KB)
    stepped = {**one, "SPLIT_K": 2, "KB_STEP": 2, "TMA": True, "REDUCE": "fused"}
    checks["swap_step2_split2_tma"] = (_rel(fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=stepped), y_r), 2.0 ** -7)
    # token tiles fastest in the grid (several token tiles at M = 17, 33): bit-equal
    for c in (one, stepped):
        flags[f"m_fast_exact_split{c.get('SPLIT_K', 1)}"] = torch.equal(
            fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config={**c, "BLOCK_M": 16, "M_FAST": True}),
            fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config={**c, "BLOCK_M": 16}))
    fin = fp8._finish_config(stepped, M, K)  # K blocks 2, 3, 5 with 2 splits asked, 2 blocks a step
    flags["step_rounds_split_range"] = (fin["kb_per_split"], fin["SPLIT_K"]) == {2: (2, 1), 3: (2, 2), 5: (4, 2)}[KB]
    # quantize fused into the swap kernel's prologue: the same bytes, so the same result
    swap = {"KIND": "swap", "BLOCK_M": bm, "BLOCK_N": 64, "SPLIT_K": 2, "REDUCE": "fused"}
    flags["swap_linear_fuse_quant"] = torch.equal(fp8.fp8_linear_triton(x, Wq, Ws, config=swap, fuse_quant=True),
                                                  fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=swap))
    out = torch.full((M, N + 8), float("nan"), dtype=torch.bfloat16)[:, :N]
    fp8.fp8_gemm_triton(xq, xs, Wq, Ws, out=out, config=swap)
    checks["swap_out_strided"] = (_rel(out, y_r), 2.0 ** -7)
    # exactly representable operands (small-integer e4m3, power-of-two scales): every order of
    # summation is exact, so both kernels equal the reference bit for bit
    iq = torch.randint(-4, 5, (M, K), generator=g).float().to(E4M3)
    iw = torch.randint(-4, 5, (N, K), generator=g).float().to(E4M3)
    isx = 2.0 ** torch.randint(-3, 3, (M, KB), generator=g).float()
    isw = 2.0 ** torch.randint(-6, 0, (-(-N // 128), KB), generator=g).float()
    ye = fp8.fp8_gemm_ref(iq, isx, iw, isw)
    for label, cfg in [("swap", {"KIND": "swap", "BLOCK_M": bm, "BLOCK_N": 128}),
                       ("swap_split_fused", {"KIND": "swap", "BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 2,
                                             "REDUCE": "fused"}),
                       ("swap_step2_tma_split", {**stepped, "BLOCK_N": 128}),
                       ("swap_step4_split", {**one, "SPLIT_K": 2, "KB_STEP": 4}),
                       ("tile_step2_split", {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 2, "KB_STEP": 2}),
                       ("tile", {"BLOCK_M": 16, "BLOCK_N": 64})]:
        flags[f"exact_{label}"] = torch.equal(fp8.fp8_gemm_triton(iq, isx, iw, isw, config=cfg), ye)
    return {"checks": checks, "flags": flags}


def _tuner_flow_case():
    """``shoal.bench.tune_fp8.main`` end to end on CPU tensors (interpreter; the CUDA-graph timer
    replaced by a fake): candidates run and verified, the table written and loadable."""
    import json
    import random
    import tempfile

    from shoal.bench import kernels_fp8, tune_fp8

    saved = (tune_fp8.DEV, tune_fp8.time_graph, torch.cuda.is_available, torch.cuda.get_device_name)
    kernels_fp8.SHAPES["tiny"] = (256, 384)
    rng = random.Random(0)

    def fake_time(fns, iters):
        fns[-1]()
        return rng.uniform(1.0, 10.0)

    try:
        tune_fp8.DEV, tune_fp8.time_graph, torch.cuda.is_available = "cpu", fake_time, lambda: True
        torch.cuda.get_device_name = lambda *a: "cpu"
        flags = {"precompile_worker": tune_fp8._compile_jobs(
            [(256, 384, 1, {"KIND": "swap", "BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 2, "REDUCE": "fused"})]) == 0}
        with tempfile.TemporaryDirectory() as d:
            rc = tune_fp8.main(["--shapes", "tiny", "--ms", "1,8", "--jobs", "0", "--max-candidates", "3",
                                "--out", d])
            table = json.load(open(f"{d}/fp8_tuned.json"))["configs"]
            cells = json.load(open(f"{d}/tune_fp8_cells.json"))
            flags["rc0"] = rc == 0
            flags["tuned_both_buckets"] = set(table.get("256,384", {})) == {"1", "8"}
            flags["swap_at_m1"] = table["256,384"]["1"]["KIND"] == "swap"
            flags["packaged_entries_kept"] = "2560,9728" in table
            flags["cells_verified"] = all(c["n_failed"] == 0 and c["best"] for c in cells)
            fp8.set_tuned_table(d)
            flags["table_loads"] = fp8._gemm_config(1, 256, 384, 132)["KIND"] == "swap"
        fp8.set_tuned_table(None)
        # --mma-v2: only launches with fewer than 64 rows on the MMA's M axis (mma.sync)
        flags["mma_v2_family"] = all((c["KIND"] == "tile" and c["BLOCK_M"] < 64)
                                     or (c["KIND"] == "swap" and c["BLOCK_N"] < 64)
                                     for M in (1, 16, 64, 128) for c in tune_fp8.mma_v2_candidates(M, 2560, 9728))
        with tempfile.TemporaryDirectory() as d:
            rc = tune_fp8.main(["--shapes", "tiny", "--ms", "64", "--mma-v2", "--jobs", "0", "--max-candidates", "2",
                                "--out", d])
            cell = json.load(open(f"{d}/tune_fp8_cells.json"))[0]
            flags["mma_v2_rc0_verified"] = rc == 0 and cell["n_failed"] == 0 and cell["best"] is not None
    finally:
        tune_fp8.DEV, tune_fp8.time_graph, torch.cuda.is_available, torch.cuda.get_device_name = saved
        kernels_fp8.SHAPES.pop("tiny", None)
        fp8.set_tuned_table(None)
    return {"checks": {}, "flags": flags}


def _worker_main():
    assert fp8.triton_interpreting(), "worker must import triton with TRITON_INTERPRET=1"
    cases = {**INTERP_CASES, **SWAP_CASES, "tuner_flow": None}

    def run(name):
        if name == "tuner_flow":
            return _tuner_flow_case()
        return _swap_case(*SWAP_CASES[name]) if name in SWAP_CASES else _interp_case(*INTERP_CASES[name])

    report_cases(cases, run)


@pytest.fixture(scope="module")
def interp_results():
    if not fp8.HAS_TRITON:
        pytest.skip("triton not installed")
    return run_worker(__file__)


@pytest.mark.parametrize("name", list(INTERP_CASES))
def test_kernels_match_reference_interpreter(interp_results, name):
    assert_case(interp_results[name])


@pytest.mark.parametrize("name", list(SWAP_CASES))
def test_swap_kernel_and_fused_reduce_interpreter(interp_results, name):
    assert_case(interp_results[name], need_any=True)


def test_tuner_flow_interpreter(interp_results):
    assert_case(interp_results["tuner_flow"], need_any=True)


# --------------------------------------------------------------------------------------
# Launch configs: KIND / REDUCE, tuned tables (no kernels run)
# --------------------------------------------------------------------------------------


def test_finish_config_keeps_kind_and_reduce():
    c = fp8._finish_config({"KIND": "swap", "BLOCK_M": 16, "BLOCK_N": 128, "SPLIT_K": 16, "REDUCE": "fused"},
                           1, 9728)
    assert c["KIND"] == "swap" and c["REDUCE"] == "fused"
    assert c["kb_per_split"] == 5 and c["SPLIT_K"] == 16  # 76 K blocks: 15 splits of 5 + 1 of 1
    # tables without the keys, and the first tuner's "dot" / "gemv", mean the tile kernel
    for old in ({}, {"KIND": "dot"}, {"KIND": "gemv", "BLOCK_N": 32}):
        c = fp8._finish_config({**old, "SPLIT_K": 4}, 1, 2560)
        assert c["KIND"] == "tile" and c["REDUCE"] == "kernel" and c["SPLIT_K"] == 4


def test_tuned_table_override_selects_the_variant(tmp_path, monkeypatch):
    import json

    packaged = fp8._gemm_config(1, 2560, 9728, 132)
    assert packaged["KIND"] in ("tile", "swap")  # the shipped entry, whichever kernel won on the H200
    doc = {"configs": {"2560,9728": {
        "1": {"KIND": "swap", "BLOCK_M": 16, "BLOCK_N": 128, "SPLIT_K": 8, "REDUCE": "fused",
              "num_warps": 4, "num_stages": 6},
        "16": {"KIND": "dot", "BLOCK_M": 16, "BLOCK_N": 32, "SPLIT_K": 4}}}}
    (tmp_path / "fp8_tuned.json").write_text(json.dumps(doc))
    try:
        fp8.set_tuned_table(tmp_path)  # a directory means DIR/fp8_tuned.json
        c1 = fp8._gemm_config(1, 2560, 9728, 132)
        assert (c1["KIND"], c1["BLOCK_N"], c1["SPLIT_K"], c1["REDUCE"], c1["num_stages"]) == ("swap", 128, 8, "fused", 6)
        c8 = fp8._gemm_config(8, 2560, 9728, 132)  # bucket 16
        assert c8["KIND"] == "tile" and c8["BLOCK_N"] == 32
        assert fp8._gemm_config(1, 2560, 9728, 108)["KIND"] == "tile"  # other GPUs: heuristic
        fp8.set_tuned_table(None)
        monkeypatch.setenv(fp8.TUNED_TABLE_ENV, str(tmp_path / "fp8_tuned.json"))
        fp8.set_tuned_table(None)
        assert fp8._gemm_config(1, 2560, 9728, 132)["KIND"] == "swap"
    finally:
        monkeypatch.delenv(fp8.TUNED_TABLE_ENV, raising=False)
        fp8.set_tuned_table(None)
    assert fp8._gemm_config(1, 2560, 9728, 132) == packaged


def test_tuner_search_space():
    from shoal.bench import tune_fp8
    from shoal.bench.kernels_fp8 import SHAPES

    for name in tune_fp8.TUNE_SHAPES:
        N, K = SHAPES[name]
        KB = -(-K // 128)
        for M in tune_fp8.MS:
            cands = tune_fp8.candidates(M, N, K)
            keys = [tune_fp8._key(c, M, K) for c in cands]
            assert len(keys) == len(set(keys)), (name, M)  # no launch timed twice
            assert all(c.get("KIND", "tile") == "tile" for c in cands if M > 128)  # prefill: tile kernel
            if M == 1:
                assert any(c.get("KIND") == "swap" for c in cands)
                # K blocks per iteration and TMA loads are tuner dimensions
                assert {int(c.get("KB_STEP") or 1) for c in cands} >= {1, 2, 4}
                assert {bool(c.get("TMA")) for c in cands} == {False, True}
            if M in (64, 128):  # the swap kernel (whole or small token tiles) competes with the tile kernel
                assert {c.get("KIND", "tile") for c in cands} == {"tile", "swap"}
                assert any(c.get("M_FAST") for c in cands)
            assert sum(1 for c in cands if c.get("_old")) == 1  # the packaged entry is always timed
            for c in cands:
                f = fp8._finish_config(tune_fp8._public(c), M, K)
                assert f["SPLIT_K"] == 1 or f["kb_per_split"] >= 2 or f["KIND"] == "tile"
                assert f["SPLIT_K"] <= 16 and f["SPLIT_K"] <= KB
                if f["SPLIT_K"] > 1 and not c.get("_old"):
                    assert c.get("REDUCE") in ("fused", None)
            assert len(cands) <= 128
        seeds = tune_fp8.candidates(1, N, K)[:3]
        for M in (8, 32):
            seeded = tune_fp8.candidates(M, N, K, seeds)
            assert len(seeded) <= len(seeds) + 2
            assert all(c["BLOCK_M"] == (16 if M <= 16 else 32) for c in seeded[:len(seeds)] if c["KIND"] == "swap")
    # down at M = 1: wide weight tiles with deep split-K are in the space
    down = [fp8._finish_config(tune_fp8._public(c), 1, 9728) for c in tune_fp8.candidates(1, 2560, 9728)]
    assert any(c["KIND"] == "swap" and c["BLOCK_N"] == 128 and c["SPLIT_K"] == 16 for c in down)
    assert tune_fp8.short({"KIND": "swap", "BLOCK_M": 16, "BLOCK_N": 128, "SPLIT_K": 8, "REDUCE": "fused",
                           "num_warps": 4, "num_stages": 6}) == "swap 16x128 sk8f w4s6"


# --------------------------------------------------------------------------------------
# References (CPU)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("M,K,N", [(1, 256, 128), (7, 384, 256), (33, 512, 384), (4, 200, 136)])
def test_reference_gemm_error_vs_unquantized(M, K, N):
    g = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16()
    xq, xs = fp8.quantize_act_ref(x)
    Wq, Ws = fp8.quantize_weight_ref(w)
    assert xq.dtype == E4M3 and xs.shape == (M, -(-K // 128)) and xs.dtype == torch.float32
    assert Wq.shape == (N, K) and Ws.shape == (-(-N // 128), -(-K // 128))
    y = fp8.fp8_gemm_ref(xq, xs, Wq, Ws)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    exact = x.float() @ w.float().t()
    rel = ((y.float() - exact).norm() / exact.norm()).item()
    assert rel < 6e-2, rel
    # each quantizer alone: per-element error within half an e4m3 ulp (2^-4 relative) of the group amax
    dx = fp8.dequant_act(xq, xs) - x.float()
    assert (dx.abs() <= x.float().abs() * 2 ** -4 + xs.repeat_interleave(128, 1)[:, :K] * 2 ** -9 + 1e-12).all()


def test_reference_gemm_exact_with_representable_inputs():
    g = torch.Generator().manual_seed(1)
    M, K, N = 5, 384, 256
    xq = torch.randint(-8, 9, (M, K), generator=g).float().to(E4M3)
    Wq = torch.randint(-8, 9, (N, K), generator=g).float().to(E4M3)
    xs = 2.0 ** torch.randint(-6, 4, (M, K // 128), generator=g).float()
    Ws = 2.0 ** torch.randint(-10, 0, (N // 128, K // 128), generator=g).float()
    y = fp8.fp8_gemm_ref(xq, xs, Wq, Ws)
    exact = torch.zeros(M, N, dtype=torch.float64)
    for kb in range(K // 128):
        sl = slice(kb * 128, (kb + 1) * 128)
        part = xq[:, sl].double() @ Wq[:, sl].double().t()
        exact += part * xs[:, kb, None].double() * Ws[:, kb].double().repeat_interleave(128)[None, :]
    assert torch.equal(y, exact.to(torch.bfloat16))  # fp64 exact -> one rounding to bf16


def test_quantize_roundtrip_exact_for_representable_inputs():
    g = torch.Generator().manual_seed(2)
    M, K = 4, 256
    q = torch.randint(-448, 449, (M, K), generator=g).float().to(E4M3).float()
    q[:, 0], q[:, 128] = 448.0, -448.0  # every group's amax = 448 * its power-of-two scale
    sc = 2.0 ** torch.randint(-12, 2, (M, K // 128), generator=g).float()
    x = q * sc.repeat_interleave(128, 1)
    xq, xs = fp8.quantize_act_ref(x)
    assert torch.equal(xs, sc)
    assert torch.equal(fp8.dequant_act(xq, xs), x)
    w = torch.ones(256, 256)
    w[3, 5] = 16.0
    w[130, 200] = -16.0
    Wq, Ws = fp8.quantize_weight_ref(w)
    assert Ws[0, 0].item() == (torch.tensor(1.0) / torch.tensor(448.0 / 16.0)).item()  # scale = 1 / (448 / amax)
    assert abs(Ws[0, 0].item() - 16.0 / 448.0) <= 2 ** -24 * 16.0 / 448.0 * 2
    assert Ws[0, 1].item() == (1 / torch.tensor(448.0)).item()  # amax 1
    dq = fp8.dequant_weight(Wq, Ws)
    assert dq[3, 5].item() == 16.0 and dq[130, 200].item() == -16.0


def test_weight_quantizer_reads_every_row_of_a_block():
    w = torch.zeros(256, 128)
    w[127, 0] = 3.0  # last row of block 0
    w[255, 127] = 5.0  # last row/col of block 1
    _, Ws = fp8.quantize_weight_ref(w)
    assert torch.allclose(Ws.flatten(), torch.tensor([3.0, 5.0]) / 448.0, rtol=1e-6)


def test_ragged_reference_pads_with_zeros():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 200, generator=g)
    w = torch.randn(136, 200, generator=g)
    _, xs = fp8.quantize_act_ref(x)
    _, Ws = fp8.quantize_weight_ref(w)
    assert xs.shape == (3, 2) and Ws.shape == (2, 2)
    assert torch.allclose(xs[:, 1], x[:, 128:].abs().amax(1) / 448.0, rtol=1e-6)
    assert torch.allclose(Ws[1, 1], w[128:, 128:].abs().amax() / 448.0, rtol=1e-6)


def test_silu_mul_quant_ref_matches_unfused():
    from shoal.kernels.fused import silu_mul_ref

    gu = torch.randn(6, 512).bfloat16()
    hq, hs = fp8.silu_mul_quant_ref(gu)
    rq, rs = fp8.quantize_act_ref(silu_mul_ref(gu))
    assert torch.equal(_bytes(hq), _bytes(rq)) and torch.equal(hs, rs)


def test_cpu_dispatch_without_interpreter_uses_reference():
    if fp8.triton_interpreting():
        pytest.skip("triton imported in interpreter mode in this process")
    x = torch.randn(3, 256).bfloat16()
    xq, xs = fp8.quantize_act(x)
    rq, rs = fp8.quantize_act_ref(x)
    assert torch.equal(_bytes(xq), _bytes(rq)) and torch.equal(xs, rs)
    Wq, Ws = fp8.quantize_weight_ref(torch.randn(128, 256))
    out = torch.empty(3, 128, dtype=torch.bfloat16)
    assert fp8.fp8_gemm(xq, xs, Wq, Ws, out=out) is out
    assert torch.equal(out, fp8.fp8_gemm_ref(xq, xs, Wq, Ws))


# --------------------------------------------------------------------------------------
# Layout validation
# --------------------------------------------------------------------------------------


def _operands(M=2, K=384, N=256):
    xq, xs = fp8.quantize_act_ref(torch.randn(M, K))
    Wq, Ws = fp8.quantize_weight_ref(torch.randn(N, K))
    return xq, xs, Wq, Ws


def test_rejects_transposed_weight_scale():
    xq, xs, Wq, Ws = _operands()  # Ws [2, 3]
    with pytest.raises(ValueError, match="transpose"):
        fp8.fp8_gemm(xq, xs, Wq, Ws.t().contiguous())
    with pytest.raises(ValueError):
        fp8.fp8_gemm(xq, xs, Wq, Ws.t())


def test_rejects_non_contiguous_scales():
    xq, xs, Wq, Ws = _operands()
    wide = torch.zeros(Ws.shape[0], Ws.shape[1] * 2)
    wide[:, ::2] = Ws
    with pytest.raises(ValueError, match="contiguous"):
        fp8.fp8_gemm(xq, xs, Wq, wide[:, ::2])
    xwide = torch.zeros(xs.shape[0], xs.shape[1] * 2)
    with pytest.raises(ValueError, match="contiguous"):
        fp8.fp8_gemm(xq, xwide[:, ::2], Wq, Ws)
    # a square activation-scale grid given as a transposed view: same shape, wrong strides
    xq3, xs3 = fp8.quantize_act_ref(torch.randn(3, 384))
    with pytest.raises(ValueError, match="contiguous"):
        fp8.check_act(xq3, xs3.t().contiguous().t())


def test_rejects_bad_dtypes_and_shapes():
    xq, xs, Wq, Ws = _operands()
    with pytest.raises(ValueError, match="float32"):
        fp8.fp8_gemm(xq, xs.half(), Wq, Ws)
    with pytest.raises(ValueError, match="float8"):
        fp8.fp8_gemm(xq.float(), xs, Wq, Ws)
    with pytest.raises(ValueError, match="contiguous"):
        fp8.check_weight(Wq.t().contiguous().t(), Ws)
    with pytest.raises(ValueError, match="transpose"):
        fp8.fp8_gemm(xq, xs.t().contiguous(), Wq, Ws)
    xq2, xs2 = fp8.quantize_act_ref(torch.randn(2, 256))
    with pytest.raises(ValueError):
        fp8.fp8_gemm(xq2, xs2, Wq, Ws)  # K mismatch


# --------------------------------------------------------------------------------------
# GPU (compiled kernels)
# --------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available() or not fp8.HAS_TRITON, reason="needs CUDA + triton")


@cuda
@pytest.mark.parametrize("M", [1, 3, 16, 33, 128, 300])
@pytest.mark.parametrize("N,K", [(6144, 2560), (2560, 9728), (4097, 2560), (200, 384)])
def test_gpu_kernels_match_reference(M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    xq, xs = fp8.quantize_act(x)
    rq, rs = fp8.quantize_act_ref(x)
    # Values must be equal; the only byte difference allowed is the sign of a zero: PyTorch's
    # CUDA float -> e4m3 conversion returns +0 where a tiny negative input (|x| < 2^-10 of its
    # group's scale) rounds to zero, the kernel -0 (as PyTorch on CPU). Both dequantize to 0.
    n_bad = int((xq.float() != rq.float()).sum())
    n_bad_s = int((xs != rs).sum())
    diff = _bytes(xq) != _bytes(rq)
    assert n_bad == 0 and n_bad_s == 0, (f"{n_bad} of {xq.numel()} values, {n_bad_s} of {xs.numel()} scales differ",
                                         xq.float()[diff][:4].tolist(), rq.float()[diff][:4].tolist())
    assert bool((xq.float()[diff] == 0).all() and (x.float()[diff] < 0).all())
    Wq, Ws = fp8.quantize_weight_ref(w)
    y = fp8.fp8_gemm(xq, xs, Wq, Ws)
    y_r = fp8.fp8_gemm_ref(rq, rs, Wq, Ws)
    assert _rel(y, y_r) <= 2.0 ** -7
    assert torch.equal(fp8.fp8_linear(x, Wq, Ws), y)  # quantize fused in the prologue
    exact = x.float() @ w.float().t()
    assert ((y.float() - exact).norm() / exact.norm()).item() < 6e-2
    gu = (torch.randn(M, 2 * K, device="cuda", generator=g) * 3).bfloat16()
    hq, hs = fp8.silu_mul_quant(gu)
    hq_r, hs_r = fp8.silu_mul_quant_ref(gu)
    # libdevice expf vs torch's expf may differ by an ulp and flip a bf16 rounding
    assert (_bytes(hq) != _bytes(hq_r)).float().mean().item() < 1e-3
    assert ((hs - hs_r).abs() / hs_r).max().item() < 1e-2


@cuda
def test_gpu_cuda_graph_replay_bit_exact():
    M, N, K = 4, 2560, 9728
    x = torch.randn(M, K, device="cuda").bfloat16()
    Wq, Ws = fp8.quantize_weight_ref(torch.randn(N, K, device="cuda") * 0.01)
    gu = torch.randn(M, 2 * K, device="cuda").bfloat16()

    def step():
        xq, xs = fp8.quantize_act(x)
        hq, hs = fp8.silu_mul_quant(gu)
        return fp8.fp8_gemm(xq, xs, Wq, Ws), fp8.fp8_gemm(hq, hs, Wq, Ws)

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    again = step()
    for a, b in zip(static, again):
        assert torch.equal(a, b)
    assert not torch.equal(static[0], eager[0])


@cuda
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("N,K", [(19456, 2560), (2560, 9728), (200, 384)])
def test_gpu_swap_kernel_matches_reference(M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    Wq, Ws = fp8.quantize_weight_ref((torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16())
    xq, xs = fp8.quantize_act(x)
    y_r = fp8.fp8_gemm_ref(xq, xs, Wq, Ws)
    bm = 16 if M <= 16 else 32
    # (every distinct config and integer specialization is one compile: the full set at M = 1)
    shapes = ((64, 1, 4, 4), (128, 8, 4, 6), (256, 4, 8, 3)) if M == 1 else ((128, 8, 4, 6),)
    for bn, sk, nw, ns in shapes:
        cfg = {"KIND": "swap", "BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": sk, "num_warps": nw, "num_stages": ns}
        y_k = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=cfg)
        assert _rel(y_k, y_r) <= 2.0 ** -7, cfg
        y_f = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config={**cfg, "REDUCE": "fused"})
        assert torch.equal(y_f, y_k), cfg  # in-kernel reduce == reduce kernel, bit for bit
        part = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=cfg, partials=True)
        if isinstance(part, fp8.SplitKPartials):
            assert torch.equal(part.reduce(), y_k)
        if bn == 128:
            assert torch.equal(fp8.fp8_linear_triton(x, Wq, Ws, config=cfg, fuse_quant=True), y_k)
    torch.cuda.synchronize()
    assert not bool(fp8._counters[("cuda", x.device.index)].any())  # every counter back to 0


@cuda
@pytest.mark.parametrize("M", [1, 64])
@pytest.mark.parametrize("N,K", [(19456, 2560), (2560, 9728)])
def test_gpu_swap_kb_step_and_tma(M, N, K):
    """KB_STEP and TMA change the schedule only: bit-equal to the plain swap kernel at one split
    (same K range per program), within the reference bound with split K (ragged last split),
    and a TMA config with the fused reduce replays in a CUDA graph."""
    g = torch.Generator(device="cuda").manual_seed(M + N + K + 5)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    Wq, Ws = fp8.quantize_weight_ref((torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16())
    xq, xs = fp8.quantize_act(x)
    y_r = fp8.fp8_gemm_ref(xq, xs, Wq, Ws)
    bm = 16 if M == 1 else 64
    # one split pinned (see the interpreter case): the same K range per program at every KB_STEP
    one = {"KIND": "swap", "BLOCK_M": bm, "BLOCK_N": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
    y_one = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=one)
    for step, tma in ((2, False), (1, True), (2, True), (4, True)):
        y = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config={**one, "KB_STEP": step, "TMA": tma})
        assert torch.equal(y, y_one), (step, tma)
    # token tiles fastest in the grid: the same programs in another launch order, bit-equal
    if M > 16:
        small = {**one, "BLOCK_M": 16, "SPLIT_K": 2, "KB_STEP": 2, "TMA": True, "REDUCE": "fused"}
        assert torch.equal(fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config={**small, "M_FAST": True}),
                           fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=small))
    split = {**one, "SPLIT_K": 3, "KB_STEP": 2, "TMA": True, "REDUCE": "fused"}
    y_s = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=split)
    assert _rel(y_s, y_r) <= 2.0 ** -7
    out = torch.empty_like(y_s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8.fp8_gemm_triton(xq, xs, Wq, Ws, out=out, config=split)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y_s)
    assert not bool(fp8._counters[("cuda", x.device.index)].any())


@cuda
def test_gpu_fused_reduce_cuda_graph_replay_bit_exact():
    M, N, K = 1, 2560, 9728
    x = torch.randn(M, K, device="cuda").bfloat16()
    Wq, Ws = fp8.quantize_weight_ref(torch.randn(N, K, device="cuda") * 0.01)
    cfgs = [{"KIND": "swap", "BLOCK_M": 16, "BLOCK_N": 128, "SPLIT_K": 16, "REDUCE": "fused"},
            {"KIND": "tile", "BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 8, "REDUCE": "fused"}]

    def step():
        xq, xs = fp8.quantize_act(x)
        return [fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=c) for c in cfgs]

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
        xq, xs = fp8.quantize_act(x)
        assert _rel(static[0], fp8.fp8_gemm_ref(xq, xs, Wq, Ws)) <= 2.0 ** -7


if __name__ == "__main__":
    _worker_main()


def test_tuner_odd_splits_search_space():
    """--odd-splits (swap kernel, M <= 32): split counts that are not powers of two join the
    space, every launch once, the packaged entry still timed."""
    from shoal.bench import tune_fp8
    from shoal.bench.kernels_fp8 import SHAPES

    for name in ("wo", "down"):
        N, K = SHAPES[name]
        plain = tune_fp8.candidates(1, N, K)
        odd = tune_fp8.candidates(1, N, K, odd_splits=True)
        keys = [tune_fp8._key(c, 1, K) for c in odd]
        assert len(keys) == len(set(keys)) and len(odd) > len(plain)
        splits = {fp8._finish_config(tune_fp8._public(c), 1, K)["SPLIT_K"] for c in odd}
        assert splits - {1, 2, 4, 8, 16}, name
        assert sum(1 for c in odd if c.get("_old")) == 1
