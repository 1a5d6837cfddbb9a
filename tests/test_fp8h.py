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


def _norm_silu_case():
    """The producers of fp16 activations: add+RMSNorm and SiLU*mul write ``fp16(bf16 value *
    2^-S)``, the bf16 kernels' values scaled, exactly; the wo conversion likewise."""
    from shoal.kernels import fused

    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 640, generator=g).bfloat16()
    res = (torch.randn(3, 640, generator=g) * 2).bfloat16()
    w = (1 + 0.3 * torch.randn(640, generator=g)).bfloat16()
    normed, h = fused.add_rmsnorm_triton(x, res, w, 1e-6)
    flags = {}
    for S in (0, 3):
        x16, h16 = fused.add_rmsnorm_triton(x, res, w, 1e-6, f16_shift=S)
        flags[f"norm_f16_S{S}"] = x16.dtype == torch.float16 and torch.equal(x16, fp8h.to_f16_act_ref(normed, S))
        flags[f"norm_h_S{S}"] = torch.equal(h16, h)
        gu = (torch.randn(3, 2 * 384, generator=g) * 3).bfloat16()
        flags[f"silu_f16_S{S}"] = torch.equal(fused.silu_mul_triton(gu, f16_shift=S),
                                              fp8h.to_f16_act_ref(fused.silu_mul_triton(gu), S))
        flags[f"to_f16_S{S}"] = torch.equal(fp8h.to_f16_act(normed, S), fp8h.to_f16_act_ref(normed, S))
    return {"checks": {}, "flags": flags}


def _model_case():
    """A tiny FP8 model's fused layer stacks on fp16 activations: closer to the dequantized
    weights' exact product than W8A8, no e4m3 quantize launch, one wo conversion per layer."""
    import contextlib

    from test_fp8_fusion import _patched, run_layer_stack, tiny_fp8_model

    from shoal.kernels import fp8_fused
    from shoal.quant.fp8 import FP8Linear

    model = tiny_fp8_model()
    counts = {}

    def counting(name, fn):
        def wrapped(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)
        return wrapped

    flags, checks = {}, {}
    with contextlib.ExitStack() as st:
        st.enter_context(_patched(FP8Linear, use_kernels=lambda self, x: self.quantize_activations
                                  and fp8.use_triton(x)))
        st.enter_context(_patched(fp8, quantize_act_triton=counting("quantize", fp8.quantize_act_triton)))
        st.enter_context(_patched(fp8h, to_f16_act=counting("to_f16", fp8h.to_f16_act),
                                  fp8h_gemm_triton=counting("fp8h", fp8h.fp8h_gemm_triton)))
        lins = [m for m in model.modules() if isinstance(m, FP8Linear)]
        for stack, rows, pos in (("slow", 3, 4), ("fast", 2, 0)):
            n = len(model.layers if stack == "slow" else model.fast_layers)
            for lin in lins:  # the reference: dequantized weights, activations unquantized, fp32 sums
                lin.quantize_activations = False
            ref = run_layer_stack(model, stack, rows, pos)
            for lin in lins:
                lin.quantize_activations = True
            for layers in (model.layers, model.fast_layers):  # stack_supported's cache saw the reference
                layers.__dict__.pop("_fp8_fused_ok", None)
            counts.clear()
            w8a8 = run_layer_stack(model, stack, rows, pos)
            flags[f"{stack}_enabled"] = fp8_fused.enable_f16(model)
            counts.clear()
            f16 = run_layer_stack(model, stack, rows, pos)
            c16 = dict(counts)
            fp8_fused.disable_f16(model)
            # RMS errors (the max error is a bf16 ulp or two of the output either way)
            e8 = (w8a8[0].float() - ref[0].float()).square().mean().sqrt().item()
            e16 = (f16[0].float() - ref[0].float()).square().mean().sqrt().item()
            scale = ref[0].float().square().mean().sqrt().item()
            checks[f"{stack}_f16_rms_err_vs_w8a8"] = (e16 / max(e8, 1e-30), 0.5)
            checks[f"{stack}_f16_rms_err_rel"] = (e16 / scale, 2.0 ** -7)
            flags[f"{stack}_f16_ran"] = not torch.equal(f16[0], w8a8[0])
            flags[f"{stack}_launches"] = (c16.get("quantize", 0) == 0 and c16.get("to_f16", 0) == n
                                          and c16.get("fp8h", 0) == 4 * n)
            flags[f"{stack}_k_cache_close"] = bool(((f16[1].float() - ref[1].float()).abs().max()
                                                    <= (w8a8[1].float() - ref[1].float()).abs().max() + 1e-6))
    return {"checks": checks, "flags": flags}


def _worker_main():
    from shoal.kernels.paged_attention import triton_interpreting

    assert triton_interpreting(), "worker must import triton with TRITON_INTERPRET=1"
    extra = {"every_byte": _every_byte, "producers": _norm_silu_case, "model": _model_case}
    report_cases([*CASES, *extra], lambda name: extra[name]() if name in extra else _case(*CASES[name]))


@pytest.fixture(scope="module")
def interp_results():
    if not fp8.HAS_TRITON:
        pytest.skip("triton not installed")
    return run_worker(__file__)


@pytest.mark.parametrize("name", [*CASES, "every_byte", "producers", "model"])
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


def test_activation_bounds_hold_and_shifts():
    """The bounds enable_f16 derives from the weights hold for the inputs every FP8 GEMM of the
    layer stacks actually sees (large and spiky hidden states included), and the shifts follow."""
    from test_fp8_fusion import run_layer_stack, tiny_fp8_model

    from shoal.kernels import fp8_fused
    from shoal.quant.fp8 import FP8Linear

    model = tiny_fp8_model()
    with torch.no_grad():  # a norm weight with a large entry: bounds far above fp16's range
        model.layers[1].ffn_norm.weight[3] = 3000.0
    assert fp8_fused.enable_f16(model)
    seen = {}
    hooks = []
    for stack in (model.layers, model.fast_layers):
        for layer in stack:
            for lin in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13_fp8, layer.feed_forward.w2):
                hooks.append(lin.register_forward_pre_hook(
                    lambda m, a: seen.__setitem__(id(m), max(seen.get(id(m), 0.0), float(a[0].float().abs().max())))))
    lins = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for lin in lins:  # the PyTorch path (every FP8Linear called as a module)
        lin.quantize_activations = False
    for seed in range(3):
        run_layer_stack(model, "slow", 3, 4, seed=seed)
        run_layer_stack(model, "fast", 2, 0, seed=seed)
    for h in hooks:
        h.remove()
    checked = 0
    for stack in (model.layers, model.fast_layers):
        for layer in stack:
            for lin in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13_fp8, layer.feed_forward.w2):
                assert lin.f16 is not None and seen[id(lin)] <= lin.f16.bound, (seen[id(lin)], lin.f16)
                assert lin.f16.bound * 2 <= 65504 * 2.0 ** lin.f16.shift
                checked += 1
    assert checked == 4 * (len(model.layers) + len(model.fast_layers))
    assert model.layers[1].feed_forward.w2.f16.shift > 0  # the 3000x norm weight needed a shift
    fp8_fused.disable_f16(model)
    assert all(getattr(lin, "f16", None) is None for lin in lins)


def test_enable_f16_refuses_scales_beyond_fp16(monkeypatch, caplog):
    from test_fp8_fusion import tiny_fp8_model

    from shoal.kernels import fp8_fused

    model = tiny_fp8_model()
    with torch.no_grad():
        model.layers[0].attention.wo.weight_scale[0, 0] *= 1e-6  # one block 2^-20 below the rest
    assert not fp8_fused.enable_f16(model)
    assert "refused" in caplog.text
    assert all(getattr(m, "f16", None) is None for m in model.modules())
    monkeypatch.setenv("SHOAL_FP8_ACT", "fp16")
    assert fp8_fused.f16_requested()
    monkeypatch.setenv("SHOAL_FP8_ACT", "int4")
    with pytest.raises(ValueError, match="SHOAL_FP8_ACT"):
        fp8_fused.f16_requested()


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


@cuda
def test_gpu_layer_stacks_on_fp16_activations():
    """The fused FP8 layer stacks on fp16 activations at a GPU size: closer to the dequantized
    weights' exact product than W8A8, and a CUDA-graph replay gives the eager bits."""
    from test_fp8_fusion import run_layer_stack, tiny_fp8_model

    from shoal.kernels import fp8_fused
    from shoal.quant.fp8 import FP8Linear

    model = tiny_fp8_model("cuda", dim=1024, heads=(8, 2, 128), inter=2048)
    lins = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for lin in lins:
        lin.quantize_activations = False
    ref = run_layer_stack(model, "slow", 8, 4)[0].float()
    for lin in lins:
        lin.quantize_activations = True
    for layers in (model.layers, model.fast_layers):
        layers.__dict__.pop("_fp8_fused_ok", None)
    w8a8 = run_layer_stack(model, "slow", 8, 4)[0].float()
    assert fp8_fused.enable_f16(model)
    f16 = run_layer_stack(model, "slow", 8, 4)[0]
    rms = lambda a: a.square().mean().sqrt().item()  # noqa: E731
    assert rms(f16.float() - ref) < 0.5 * rms(w8a8 - ref)
    # graph replay of the same pass equals eager
    from shoal.engine.attention import FastCacheBackend

    sh = model.layers[0].attention.shape
    be = FastCacheBackend(len(model.layers), 8, 10, sh.n_head, sh.n_local_heads, sh.head_dim, torch.bfloat16, "cuda")
    be.position, be._rows = 0, 8
    x = torch.randn(8, 1, sh.dim, device="cuda").bfloat16()
    pos = torch.full((8, 1), 3, device="cuda")
    eager = model._layers_fused(x, model.layers, pos, model.slow_rope, be).clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = model._layers_fused(x, model.layers, pos, model.slow_rope, be)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


if __name__ == "__main__":
    _worker_main()
