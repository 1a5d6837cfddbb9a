"""FP8-weight / bf16-activation decode GEMM (shoal.kernels.fp8w): the Triton kernel under the
interpreter (child process, see interpreter_worker.py) and on the GPU.

What is checked: the widening is exact for every e4m3 byte (an identity activation reads the
bf16 weight back: ``bf16(q * scale)`` exactly), the GEMM equals the bf16 decode GEMM
(shoal.kernels.dense) on the dequantized bf16 weight with the same tiles bit for bit (the same
products in the same order), the bit-move widening equals Triton's conversion, split-K
partials reduce to the fused reduce's bits, and bad operands raise ValueError.
"""

import os

if __name__ == "__main__":  # interpreter worker: must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from interpreter_worker import assert_case, report_cases, run_worker

from shoal.kernels import dense, fp8, fp8w

CASES = {  # name -> (M, N, K, config)
    "m1_bn64_bk128": (1, 256, 384, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1}),
    "m5_bn128_bk64_split3": (5, 192, 384, {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 3}),
    "m17_ragged_n_k_split2": (17, 200, 320, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2}),
    "m3_cvt": (3, 128, 256, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "BITS": False}),
}


def _weight(N, K, g):
    w = torch.randn(N, K, generator=g) * K ** -0.5
    w[0, :16] = 1e-9 * torch.arange(1, 17)  # a block whose small entries land on e4m3 subnormals
    return fp8.quantize_weight_ref(w)


def _case(M, N, K, cfg):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).bfloat16()
    Wq, Ws = _weight(N, K, g)
    y = fp8w.fp8w_gemm_triton(x, Wq, Ws, config=cfg)
    wb = fp8.dequant_weight(Wq, Ws).bfloat16()
    dense_cfg = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")}
    checks = {"rel_vs_ref": (((y.float() - fp8w.fp8w_gemm_ref(x, Wq, Ws).float()).abs().max()
                              / fp8w.fp8w_gemm_ref(x, Wq, Ws).float().abs().max()).item(), 2.0 ** -7)}
    flags = {"equals_dense_on_bf16_weight": torch.equal(y, dense.dense_gemm_triton(x, wb, config=dense_cfg)),
             "shape": tuple(y.shape) == (M, N) and y.dtype == torch.bfloat16,
             "bits_equal_cvt": torch.equal(y, fp8w.fp8w_gemm_triton(x, Wq, Ws, config={**cfg, "BITS": not cfg.get(
                 "BITS", True)}))}
    if cfg["SPLIT_K"] > 1:
        p = fp8w.fp8w_gemm_triton(x, Wq, Ws, config=cfg, partials=True)
        flags["partials_reduce_to_fused_bits"] = isinstance(p, fp8.SplitKPartials) and torch.equal(p.reduce(), y)
    counters = fp8._counters.get(("cpu", None))
    flags["counters_reset"] = counters is None or not bool(counters.any())
    return {"checks": checks, "flags": flags}


def _every_byte(device="cpu"):
    """All 254 finite e4m3 bytes as a [256, 128] weight (NaN bytes replaced by 0), scales of
    several magnitudes; an identity activation reads the widened bf16 weight back exactly."""
    b = torch.arange(256, dtype=torch.int32).repeat(128, 1).t().contiguous().to(torch.uint8)  # [256, 128]
    b[(b == 0x7F) | (b == 0xFF)] = 0
    Wq = b.view(torch.float8_e4m3fn).to(device)
    Ws = torch.tensor([[3.1e-4], [0.7071]], dtype=torch.float32, device=device)
    x = torch.eye(128, device=device).bfloat16()
    ok = True
    for bits in (True, False):
        y = fp8w.fp8w_gemm_triton(x, Wq, Ws, config={"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "BITS": bits})
        ok &= torch.equal(y.t(), fp8.dequant_weight(Wq, Ws).bfloat16())
    return {"checks": {}, "flags": {"every_byte_widens_exactly": ok}}


def _worker_main():
    from shoal.kernels.paged_attention import triton_interpreting

    assert triton_interpreting(), "worker must import triton with TRITON_INTERPRET=1"
    report_cases([*CASES, "every_byte"], lambda name: _every_byte() if name == "every_byte" else _case(*CASES[name]))


@pytest.fixture(scope="module")
def interp_results():
    if not fp8.HAS_TRITON:
        pytest.skip("triton not installed")
    return run_worker(__file__)


@pytest.mark.parametrize("name", [*CASES, "every_byte"])
def test_fp8w_kernel_interpreter(interp_results, name):
    assert_case(interp_results[name], need_any=True)


def test_reference_is_the_bf16_gemm_of_the_dequantized_weight():
    g = torch.Generator().manual_seed(0)
    Wq, Ws = _weight(256, 256, g)
    x = torch.randn(3, 256, generator=g).bfloat16()
    ref = fp8w.fp8w_gemm_ref(x, Wq, Ws)
    assert torch.equal(ref, dense.dense_gemm_ref(x, fp8.dequant_weight(Wq, Ws).bfloat16()))
    # closer to the bf16 weight's product than the W8A8 path (activation kept in bf16)
    w8a8 = fp8.fp8_gemm_ref(*fp8.quantize_act_ref(x), Wq, Ws)
    exact = x.float() @ fp8.dequant_weight(Wq, Ws).t()
    assert (ref.float() - exact).abs().max() < (w8a8.float() - exact).abs().max()


def test_bad_operands_raise():
    g = torch.Generator().manual_seed(1)
    Wq, Ws = _weight(256, 256, g)
    x = torch.randn(2, 256, generator=g).bfloat16()
    with pytest.raises(ValueError, match="bf16"):
        fp8w.fp8w_gemm_triton(x.float(), Wq, Ws)
    with pytest.raises(ValueError, match="K="):
        fp8w.fp8w_gemm_triton(x[:, :128], Wq, Ws)
    with pytest.raises(ValueError):  # a transposed scale grid is refused, never mis-read
        fp8w.fp8w_gemm_triton(x, Wq, Ws.t())
    with pytest.raises(ValueError, match="divide 128"):
        fp8w.finish_config({"BLOCK_N": 96}, 256)
    with pytest.raises(ValueError, match="divide 128"):
        fp8w.finish_config({"BLOCK_K": 256}, 256)


def test_config_splits_and_defaults():
    c = fp8w.finish_config({"SPLIT_K": 7}, 9728)  # 76 K blocks in 7 splits of 11
    assert c["k_per_split"] == 11 * 128 and c["SPLIT_K"] == 7 and c["BITS"] and not c["TMA"]
    c = fp8w.finish_config({"SPLIT_K": 100}, 256)  # never an empty split
    assert c["SPLIT_K"] == 2
    d = fp8w.fp8w_config(1, 2560, 9728)
    assert d["BLOCK_N"] == 64 and d["SPLIT_K"] > 1


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available() or not fp8.HAS_TRITON, reason="needs CUDA + triton")


@cuda
@pytest.mark.parametrize("M", [1, 5, 16, 64, 128])
@pytest.mark.parametrize("N,K", [(19456, 2560), (2560, 9728), (6144, 2560), (200, 384)])
def test_gpu_fp8w_equals_dense_on_the_bf16_weight(M, N, K):
    """Every launch form (pointer / TMA loads, one or split K, 64 / 128 weight rows, the bit
    moves or Triton's conversion) gives the bf16 decode GEMM's bits on the dequantized weight."""
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    Wq, Ws = fp8.quantize_weight_ref(w)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    wb = fp8.dequant_weight(Wq, Ws).bfloat16()
    ref = fp8w.fp8w_gemm_ref(x, Wq, Ws).float()
    bm = max(16, min(128, 1 << (M - 1).bit_length()))
    for cfg in ({"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1},
                {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "TMA": True},
                {"BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 8, "num_stages": 3},
                {"BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 3, "TMA": True, "num_stages": 3},
                {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "BITS": False}):
        y = fp8w.fp8w_gemm_triton(x, Wq, Ws, config=cfg)
        dcfg = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")}
        dcfg["num_warps"], dcfg["num_stages"] = cfg.get("num_warps", 4), cfg.get("num_stages", 4)
        assert torch.equal(y, dense.dense_gemm_triton(x, wb, config=dcfg)), cfg
        assert ((y.float() - ref).abs().max() / ref.abs().max()).item() <= 2.0 ** -7, cfg
    torch.cuda.synchronize()
    counters = fp8._counters.get(("cuda", x.device.index))
    assert counters is None or not bool(counters.any())


@cuda
def test_gpu_fp8w_every_byte_and_graph_replay():
    r = _every_byte("cuda")
    assert r["flags"]["every_byte_widens_exactly"]
    M, N, K = 8, 2560, 9728
    w = (torch.randn(N, K, device="cuda") * 0.01).bfloat16()
    Wq, Ws = fp8.quantize_weight_ref(w)
    x = torch.randn(M, K, device="cuda").bfloat16()
    cfgs = [{"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8},
            {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "TMA": True}]
    eager = [fp8w.fp8w_gemm_triton(x, Wq, Ws, config=c) for c in cfgs]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fp8w.fp8w_gemm_triton(x, Wq, Ws, config=c) for c in cfgs]
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, outs))


if __name__ == "__main__":
    _worker_main()
