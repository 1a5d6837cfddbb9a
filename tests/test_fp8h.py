"""FP8-weight / fp16-activation decode GEMM (shoal.kernels.fp8h): the Triton kernel under the
interpreter (child process, see interpreter_worker.py) and on the GPU.

What is checked: the widening is exact for every e4m3 byte (an identity activation reads back
``bf16(fp16(q * h) * 2^E)``), the GEMM matches its reference (``fp16(q * h)`` weights, fp32 sums)
within the final bf16 rounding, split-K reduces in the fused reduce, a per-token scale applies,
the fp16 block multipliers keep the weight scales' ratios, and bad operands raise ValueError.
"""

import os

if __name__ == "__main__":  # interpreter worker: must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import math

import pytest
import torch
from interpreter_worker import assert_case, report_cases, run_worker

from shoal.kernels import fp8, fp8h

CASES = {  # name -> (M, N, K, config, with x_scale)
    "m1_bn64_bk128": (1, 256, 384, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1}, False),
    "m5_bn128_bk64_split3": (5, 192, 384, {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 3}, False),
    "m17_ragged_split2_xscale": (17, 200, 320, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2}, True),
}


def _weight(N, K, g):
    w = torch.randn(N, K, generator=g) * K ** -0.5
    w[0, :16] = 1e-9 * torch.arange(1, 17)  # a block whose small entries land on e4m3 subnormals
    if N > 128:
        w[128:] *= 0.01  # a second row block with scales 100x smaller
    return fp8.quantize_weight_ref(w)


def _case(M, N, K, cfg, with_xs):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).half()
    Wq, Ws = _weight(N, K, g)
    Wh, osc, _ = fp8h.fp16_weight_scales(Ws)
    xs = torch.tensor([2.0 ** (i % 5 - 2) for i in range(M)]) if with_xs else None
    y = fp8h.fp8h_gemm_triton(x, Wq, Wh, osc, x_scale=xs, config=cfg)
    ref = fp8h.fp8h_gemm_ref(x, Wq, Wh, osc, xs).float()
    # per-element: within one bf16 rounding of the output plus fp32 sum-order noise
    err = ((y.float() - ref).abs() / (ref.abs() + 1e-3 * ref.abs().max())).max().item()
    checks = {"rel_elem_vs_ref": (err, 2.0 ** -7)}
    flags = {"shape": tuple(y.shape) == (M, N) and y.dtype == torch.bfloat16}
    counters = fp8._counters.get(("cpu", None))
    flags["counters_reset"] = counters is None or not bool(counters.any())
    return {"checks": checks, "flags": flags}


def _every_byte(device="cpu"):
    """All finite e4m3 bytes as a [256, 128] weight (NaN bytes replaced by 0) with block scales of
    two magnitudes; an identity activation reads the widened weight back exactly."""
    b = torch.arange(256, dtype=torch.int32).repeat(128, 1).t().contiguous().to(torch.uint8)  # [256, 128]
    b[(b == 0x7F) | (b == 0xFF)] = 0
    Wq = b.view(torch.float8_e4m3fn).to(device)
    Ws = torch.tensor([[3.1e-4], [0.7071]], dtype=torch.float32, device=device)
    Wh, osc, _ = fp8h.fp16_weight_scales(Ws)
    x = torch.eye(128, device=device).half()
    y = fp8h.fp8h_gemm_triton(x, Wq, Wh, osc, config={"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128})
    ok = torch.equal(y.t(), fp8h.fp8h_gemm_ref(x, Wq, Wh, osc).t())
    want = ((Wq.float() * Wh.float().repeat_interleave(128, 0)).half().float() * osc).bfloat16()
    return {"checks": {}, "flags": {"every_byte_widens_exactly": ok and torch.equal(y.t(), want)}}


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
def test_fp8h_kernel_interpreter(interp_results, name):
    assert_case(interp_results[name], need_any=True)


def test_weight_scales_keep_ratios():
    Ws = torch.tensor([[1e-3, 2.5e-3], [4e-4, 0.0]])
    Wh, osc, ratio = fp8h.fp16_weight_scales(Ws)
    assert Wh.dtype == torch.float16 and Wh.is_contiguous()
    assert osc == 2.0 ** math.floor(math.log2(2.5e-3))
    assert float(Wh.max()) < 2.0 and float(Wh.max()) >= 1.0
    torch.testing.assert_close(Wh.float() * osc, Ws, rtol=2 ** -11, atol=0)
    assert ratio == pytest.approx(4e-4 / osc, rel=1e-6)
    with pytest.raises(ValueError, match="positive"):
        fp8h.fp16_weight_scales(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="fp32"):
        fp8h.fp16_weight_scales(Ws.half())


def test_reference_is_closer_to_the_dequantized_product_than_w8a8():
    g = torch.Generator().manual_seed(0)
    Wq, Ws = _weight(256, 256, g)
    x = torch.randn(3, 256, generator=g).bfloat16()
    Wh, osc, _ = fp8h.fp16_weight_scales(Ws)
    ref = fp8h.fp8h_gemm_ref(x.half(), Wq, Wh, osc)
    w8a8 = fp8.fp8_gemm_ref(*fp8.quantize_act_ref(x), Wq, Ws)
    exact = x.float() @ fp8.dequant_weight(Wq, Ws).t()
    assert (ref.float() - exact).abs().max() < 0.25 * (w8a8.float() - exact).abs().max()


def test_bad_operands_raise():
    g = torch.Generator().manual_seed(1)
    Wq, Ws = _weight(256, 384, g)
    Wh, osc, _ = fp8h.fp16_weight_scales(Ws)
    x = torch.randn(2, 384, generator=g).half()
    with pytest.raises(ValueError, match="fp16"):
        fp8h.fp8h_gemm_triton(x.bfloat16(), Wq, Wh, osc)
    with pytest.raises(ValueError, match="K="):
        fp8h.fp8h_gemm_triton(x[:, :128], Wq, Wh, osc)
    with pytest.raises(ValueError, match="W_h must be fp16"):
        fp8h.fp8h_gemm_triton(x, Wq, Ws, osc)
    with pytest.raises(ValueError):  # a transposed multiplier grid is refused, never mis-read
        fp8h.fp8h_gemm_triton(x, Wq, Wh.t().contiguous(), osc)
    with pytest.raises(ValueError, match="x_scale"):
        fp8h.fp8h_gemm_triton(x, Wq, Wh, osc, x_scale=torch.ones(3))
    with pytest.raises(ValueError, match="divide 128"):
        fp8h.fp8h_finish_config({"BLOCK_N": 96}, 256)


def test_config_splits_and_defaults():
    c = fp8h.fp8h_finish_config({"SPLIT_K": 7}, 9728)  # 76 K blocks in 7 splits of 11
    assert c["k_per_split"] == 11 * 128 and c["SPLIT_K"] == 7 and c["PACKED_MUL"] and not c["TMA"]
    assert fp8h.fp8h_finish_config({"SPLIT_K": 100}, 256)["SPLIT_K"] == 2  # never an empty split
    d = fp8h.fp8h_config(1, 2560, 9728)
    assert d["BLOCK_N"] == 64 and d["SPLIT_K"] > 1


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available() or not fp8.HAS_TRITON, reason="needs CUDA + triton")


@cuda
@pytest.mark.parametrize("M", [1, 5, 16, 64])
@pytest.mark.parametrize("N,K", [(19456, 2560), (2560, 9728), (200, 384)])
def test_gpu_fp8h_matches_reference(M, N, K):
    """Every launch form (pointer / TMA loads, one or split K, 64 / 128 weight rows, packed or
    scalar fp16 multiply) within the final rounding of the reference; the two multiplies agree
    bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    Wq, Ws = fp8.quantize_weight_ref(w)
    Wh, osc, _ = fp8h.fp16_weight_scales(Ws)
    x = torch.randn(M, K, device="cuda", generator=g).half()
    ref = fp8h.fp8h_gemm_ref(x, Wq, Wh, osc).float()
    bm = max(16, min(64, 1 << (M - 1).bit_length()))
    for cfg in ({"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1},
                {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "TMA": True},
                {"BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 8, "num_stages": 3},
                {"BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 3, "TMA": True, "num_stages": 3}):
        y = fp8h.fp8h_gemm_triton(x, Wq, Wh, osc, config=cfg)
        err = ((y.float() - ref).abs() / (ref.abs() + 1e-3 * ref.abs().max())).max().item()
        assert err <= 2.0 ** -7, (cfg, err)
        assert torch.equal(y, fp8h.fp8h_gemm_triton(x, Wq, Wh, osc, config={**cfg, "PACKED_MUL": False})), cfg
    torch.cuda.synchronize()
    counters = fp8._counters.get(("cuda", x.device.index))
    assert counters is None or not bool(counters.any())


@cuda
def test_gpu_fp8h_every_byte_and_graph_replay():
    assert _every_byte("cuda")["flags"]["every_byte_widens_exactly"]
    M, N, K = 8, 2560, 9728
    Wq, Ws = fp8.quantize_weight_ref((torch.randn(N, K, device="cuda") * 0.01).bfloat16())
    Wh, osc, _ = fp8h.fp16_weight_scales(Ws)
    x = torch.randn(M, K, device="cuda").half()
    cfgs = [{"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8},
            {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "TMA": True}]
    eager = [fp8h.fp8h_gemm_triton(x, Wq, Wh, osc, config=c) for c in cfgs]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fp8h.fp8h_gemm_triton(x, Wq, Wh, osc, config=c) for c in cfgs]
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, outs))


if __name__ == "__main__":
    _worker_main()
