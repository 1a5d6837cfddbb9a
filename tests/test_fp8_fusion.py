"""The fused FP8 decoder layer (shoal.kernels.fp8_fused) is bit-identical to the unfused FP8 path.

* kernels (Triton interpreter, in a subprocess as in test_fp8_kernels.py): an FP8 GEMM's
  split-K partials (``partials=True``) read by add+RMSNorm+quantize, SiLU*mul+quantize and
  qk-norm+RoPE+KV write give exactly the bytes of the reduce kernel followed by the unfused
  kernels (fp8 bytes, scales, bf16 outputs, KV-cache writes), for M in {1, 3, 33} and 1, 2, 5
  splits; add_rmsnorm_quant == quantize_act(add_rmsnorm(...)) also for a plain bf16 input;
* a tiny FP8 model (interpreter): ``DualAR._layers_fused`` with ``fp8_fusion`` on == off
  (hidden states and KV caches), with and without split-K GEMMs, and the reduce / quantize
  launches it saves;
* GPU (skipped without CUDA): the same layer-stack equality at S2-Pro shapes, M = 1 and 64,
  eager and CUDA-graph replay.
"""

import contextlib
import functools
import os

if __name__ == "__main__":  # interpreter worker: must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from interpreter_worker import report_cases, run_worker

from shoal.kernels import fp8, fp8_fused, fused

E4M3 = torch.float8_e4m3fn


def _same(a, b) -> bool:
    """Bit equality (fp8 through its bytes; NaN-safe for floats)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == E4M3:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if a.dtype in (torch.bfloat16, torch.float16):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


# --------------------------------------------------------------------------------------
# Interpreter cases (run in the worker subprocess)
# --------------------------------------------------------------------------------------

# name -> (M, N, split, heads (H, H_kv, D) whose qkv width is N)
K_IN = 640  # 5 K blocks: 1, 2 and 5 splits are all exact
KERNEL_CASES = {f"m{M}_n{N}_split{sp}": (M, N, sp, heads)
                for M in (1, 3, 33) for sp in (1, 2, 5)
                for N, heads in ((256, (2, 1, 64)),) + (((320, (6, 2, 32)),) if (M, sp) == (3, 5) else ())}
EXTRA_CASES = ["norm_plain_inputs", "model_split1", "model_split2", "model_reduced_split2", "model_attn_quant"]


def _gemm_case(M, N, split, heads):
    g = torch.Generator().manual_seed(M * 100 + N + split)
    x = torch.randn(M, K_IN, generator=g).bfloat16()
    Wq, Ws = fp8.quantize_weight_ref((torch.randn(N, K_IN, generator=g) * K_IN ** -0.5).bfloat16())
    xq, xs = fp8.quantize_act_triton(x)
    cfg = {"SPLIT_K": split, "BLOCK_M": 16, "BLOCK_N": 64}
    flags = {}
    thorough = M <= 3  # (the interpreter is slow: the variants run at the small sizes only)
    part = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=cfg, partials=True)
    y = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=cfg)  # reduce kernel (split > 1)
    flags["partials_iff_split"] = isinstance(part, fp8.SplitKPartials) == (split > 1)
    if split > 1:
        flags["partials_shape"] = part.split == split and part.shape == (M, N)
        flags["partials_reduce_exact"] = _same(part.reduce(), y)
        flags["partials_reduce_ref_exact"] = _same(fp8.splitk_reduce_ref(part), y)
    else:
        flags["split1_is_bf16"] = _same(part, y)
    if thorough:
        lin = fp8.fp8_linear_triton(x, Wq, Ws, config=cfg, partials=True)
        flags["linear_partials_exact"] = _same(lin.reduce() if isinstance(lin, fp8.SplitKPartials) else lin, y)

    # (a) add + RMSNorm + quantize reading the GEMM output as x
    res = (torch.randn(M, N, generator=g) * 2).bfloat16()
    w = (1 + 0.3 * torch.randn(N, generator=g)).bfloat16()
    normed, h = fused.add_rmsnorm_triton(y, res, w, 1e-6)
    q_r, s_r = fp8.quantize_act_triton(normed)
    for store in (False, True) if thorough else (True,):
        out = fused.add_rmsnorm_quant_triton(part, res, w, 1e-6, store_normed=store)
        flags[f"norm_h_exact_{store}"] = _same(out.h, h)
        flags[f"norm_q_exact_{store}"] = _same(out.q, q_r)
        flags[f"norm_s_exact_{store}"] = _same(out.s, s_r)
        flags[f"norm_normed_{store}"] = _same(out.normed, normed) if store else out.normed is None
    if thorough:
        hh, act = fp8_fused.norm_quant(part, res, w, 1e-6)
        flags["norm_quant_helper"] = _same(hh, h) and _same(act[0], q_r) and _same(act[1], s_r)

    # (b) SiLU * mul + quantize reading the w1|w3 output
    hq_r, hs_r = fp8.silu_mul_quant_triton(y)
    hq, hs = fp8.silu_mul_quant_triton(part)
    flags["smq_q_exact"] = _same(hq, hq_r)
    flags["smq_s_exact"] = _same(hs, hs_r)
    if thorough:
        flags["smq_dispatch"] = _same(fp8.silu_mul_quant(part)[0], hq_r)

    # (c) qk-norm + RoPE + KV write reading the wqkv output (one slot negative: padding row)
    H, H_kv, D = heads
    pos = torch.randint(0, 64, (M,), generator=g)
    cs = torch.randn(64, D // 2, 2, generator=g).bfloat16()
    qw = (1 + 0.2 * torch.randn(D, generator=g)).bfloat16()
    kw = (1 + 0.2 * torch.randn(D, generator=g)).bfloat16()
    slots = torch.randperm(4 * M + 4, generator=g)[:M]
    if M > 1:
        slots[1] = -1
    outs = []
    for qkv in (y, part) if split > 1 else (y,):  # (split 1: part is y)
        kc = torch.full((4 * M + 4, H_kv, D), float("nan"), dtype=torch.bfloat16)
        vc = kc.clone()
        q = fused.qk_norm_rope_write_triton(qkv, pos, cs, qw, kw, 1e-6, kc, vc, slots, H, H_kv, D)
        outs.append((q, kc, vc))
    flags["qk_q_exact"] = _same(outs[0][0], outs[-1][0])
    flags["qk_k_cache_exact"] = _same(outs[0][1], outs[-1][1])
    flags["qk_v_cache_exact"] = _same(outs[0][2], outs[-1][2])
    flags["qk_wrote_something"] = not torch.isnan(outs[-1][1].float()).all().item()
    return {"checks": {}, "flags": flags}


def _norm_plain_case():
    """add_rmsnorm_quant on plain inputs: no residual, fp32 weight (fp32 normed), ragged
    dim, dim < 128 (the two-kernel fallback), leading dims."""
    g = torch.Generator().manual_seed(5)
    flags = {}
    for rows, dim, wdt, has_res in ((3, 256, torch.bfloat16, False), (5, 200, torch.bfloat16, True),
                                   (2, 384, torch.float32, True), (4, 64, torch.bfloat16, True),
                                   (1, 1024, torch.bfloat16, True)):
        x = torch.randn(rows, dim, generator=g).bfloat16()
        r = torch.randn(rows, dim, generator=g).bfloat16() if has_res else None
        w = (1 + 0.3 * torch.randn(dim, generator=g)).to(wdt)
        normed, h = fused.add_rmsnorm_triton(x, r, w, 1e-5)
        q_r, s_r = fp8.quantize_act_triton(normed)
        out = fused.add_rmsnorm_quant(x, r, w, 1e-5, store_normed=True)
        tag = f"{rows}x{dim}_{str(wdt)[6:]}_{has_res}"
        flags[f"{tag}_q"] = _same(out.q, q_r)
        flags[f"{tag}_s"] = _same(out.s, s_r)
        flags[f"{tag}_h"] = _same(out.h, h)
        flags[f"{tag}_normed"] = _same(out.normed, normed)
    x3 = torch.randn(2, 3, 256, generator=g).bfloat16()
    r3 = torch.randn(2, 3, 256, generator=g).bfloat16()
    w3 = torch.ones(256, dtype=torch.bfloat16)
    out = fused.add_rmsnorm_quant(x3, r3, w3, 1e-6)
    q_r, s_r = fp8.quantize_act_triton(fused.add_rmsnorm_triton(x3, r3, w3, 1e-6)[0].reshape(6, 256))
    flags["leading_dims"] = out.h.shape == (2, 3, 256) and _same(out.q, q_r) and _same(out.s, s_r)
    return {"checks": {}, "flags": flags}


def tiny_fp8_model(device="cpu", dim=256, n_layer=2, heads=(4, 2, 64), inter=384, seed=0):
    """A small DualAR with FP8 weights and fused kernels enabled (qk-norm in the slow stack)."""
    from shoal.bench.random_model import random_dualar
    from shoal.model.config import ModelConfig, TransformerShape

    H, H_kv, D = heads
    slow = TransformerShape(dim=dim, n_layer=n_layer, n_head=H, n_local_heads=H_kv, head_dim=D,
                            intermediate_size=inter, qk_norm=True)
    fast = TransformerShape(dim=dim, n_layer=n_layer, n_head=H, n_local_heads=H_kv, head_dim=D,
                            intermediate_size=inter)
    cfg = ModelConfig(family="s2", vocab_size=600, slow=slow, fast=fast, codebook_size=256, max_seq_len=256,
                      semantic_begin_id=300, semantic_end_id=555, eos_token_id=299)
    model = random_dualar(cfg, device, torch.bfloat16, seed=seed, quantization="fp8")
    model.enable_fused_kernels()
    return model


def run_layer_stack(model, stack: str, rows: int, position: int, seed: int = 0, final_norm=None):
    """One ``_layers_fused`` pass over ``model.layers`` ("slow") or ``fast_layers`` at
    ``position`` of a FastCacheBackend whose earlier positions hold random K/V. Returns
    (hidden, k cache, v cache), and with ``final_norm`` (a norm weight, fused with the last
    residual add) (normed, hidden, k cache, v cache)."""
    from shoal.engine.attention import FastCacheBackend

    layers = model.layers if stack == "slow" else model.fast_layers
    sh = layers[0].attention.shape
    dev = model.device
    g = torch.Generator(device=dev).manual_seed(seed)
    be = FastCacheBackend(len(layers), rows, 10, sh.n_head, sh.n_local_heads, sh.head_dim, torch.bfloat16, dev)
    be.k.normal_(generator=g)
    be.v.normal_(generator=g)
    be.position, be._rows = position, rows
    x = torch.randn(rows, 1, sh.dim, generator=g, device=dev).bfloat16()
    pos = torch.randint(0, 100, (rows, 1), generator=g, device=dev)
    rope = model.slow_rope if stack == "slow" else model.fast_rope
    if stack == "fast":
        pos = torch.full((rows, 1), position, device=dev)
    if final_norm is not None:
        normed, h = model._layers_fused(x, layers, pos, rope, be, final_norm=final_norm)
        return normed, h, be.k, be.v
    h = model._layers_fused(x, layers, pos, rope, be)
    return h, be.k, be.v


@functools.cache
def _worker_model():
    return tiny_fp8_model()


@contextlib.contextmanager
def _patched(obj, **attrs):
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


def _model_case(split: int, reduced: bool = False):
    """``reduced``: SHOAL_FP8_PARTIALS=0 with the GEMMs' in-kernel reduce (REDUCE "fused"): the
    fused layer's GEMMs reduce their own partials and the consumers read bf16."""
    from shoal.quant.fp8 import FP8Linear

    counts = {}

    def counting(name, fn):
        def wrapped(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)
        return wrapped

    base = fp8._gemm_config
    with contextlib.ExitStack() as stack:
        # FP8Linear runs its Triton body only on CUDA tensors; under the interpreter the same
        # kernels run on CPU tensors
        stack.enter_context(_patched(FP8Linear, use_kernels=lambda self, x: self.quantize_activations
                                     and fp8.use_triton(x)))
        stack.enter_context(_patched(fp8, _launch_reduce=counting("reduce", fp8._launch_reduce),
                                     quantize_act_triton=counting("quantize", fp8.quantize_act_triton)))
        extra = {"REDUCE": "fused"} if reduced else {}
        if split > 1:  # every GEMM splits K (the tiny shapes' heuristic configs do not)
            stack.enter_context(_patched(fp8, _gemm_config=lambda M, N, K, sms: fp8._finish_config(
                {**base(M, N, K, sms), "SPLIT_K": split, **extra}, M, K)))
        if reduced:
            stack.enter_context(_patched(fp8_fused, consumer_partials=lambda: False))

        def noting_partials(fn):
            def wrapped(*a, **k):
                out = fn(*a, **k)
                if isinstance(out, fp8.SplitKPartials):
                    counts["partials"] = counts.get("partials", 0) + 1
                return out
            return wrapped

        stack.enter_context(_patched(fp8_fused, fp8_gemm_triton=noting_partials(fp8_fused.fp8_gemm_triton),
                                     fp8_linear_triton=noting_partials(fp8_fused.fp8_linear_triton)))
        return _model_passes(_worker_model(), split, counts, reduced)


def _model_passes(model, split, counts, reduced=False):
    flags = {}
    passes = (("slow", 3, 4), ("fast", 1, 0)) if split > 1 else (("slow", 2, 4),)
    for stack, rows, position in passes:
        results = []
        for fusion in (False, True):
            counts.clear()
            model.fp8_fusion = fusion
            results.append((run_layer_stack(model, stack, rows, position), dict(counts)))
        (ref, c_ref), (out, c_out) = results
        tag = f"{stack}_r{rows}_p{position}"
        flags[f"{tag}_active"] = fp8_fused.active(model.layers, torch.zeros(1, dtype=torch.bfloat16))
        flags[f"{tag}_hidden_exact"] = _same(out[0], ref[0])
        flags[f"{tag}_k_cache_exact"] = _same(out[1], ref[1])
        flags[f"{tag}_v_cache_exact"] = _same(out[2], ref[2])
        n = len(model.layers)
        # unfused: 3 activation quantizes per layer (wqkv, wo, w13 inputs; w2's comes from the
        # SwiGLU kernel), fused: 1 (wo's) ...
        flags[f"{tag}_quantize_launches"] = c_ref.get("quantize", 0) == 3 * n and c_out.get("quantize", 0) == n
        # ... and with split K one reduce per GEMM, fused: only the last layer's w2
        # the fused path hands split-K partials on to their consumers, unless reduced
        flags[f"{tag}_partials_handed_on"] = (c_out.get("partials", 0) > 0) == (split > 1 and not reduced)
        # (reduced: every GEMM sums its own partials, in-kernel: no reduce launch on either path)
        flags[f"{tag}_reduce_launches"] = (c_ref.get("reduce", 0) == (4 * n if split > 1 and not reduced else 0)
                                           and c_out.get("reduce", 0) == (1 if split > 1 and not reduced else 0))
    model.fp8_fusion = True
    return {"checks": {}, "flags": flags}


@functools.cache
def _worker_model_d128():
    return tiny_fp8_model(heads=(4, 2, 128))


def _attn_quant_flags(model, rows_list=(1, 3)):
    """The fast stack with SHOAL_FP8_ATTN_QUANT off and on (the attention kernel quantizes wo's
    input): the same hidden state and caches, and no activation quantize launch left."""
    from shoal.kernels import fused

    flags = {}
    for rows in rows_list:
        outs, quant_calls = [], []
        for on in (False, True):
            calls = [0]
            real = fp8.quantize_act_triton

            def counting(*a, **k):
                calls[0] += 1
                return real(*a, **k)

            with _patched(fp8_fused, attn_quant=lambda on=on: on), _patched(fp8, quantize_act_triton=counting):
                outs.append(tuple(t.clone() for t in run_layer_stack(model, "fast", rows, 3)))
            quant_calls.append(calls[0])
        for name, a, b in zip(("hidden", "k", "v"), *outs):
            flags[f"r{rows}_{name}_exact"] = _same(a, b)
        # off: wo's input quantized by its own launch in every layer; on: by the attention kernel
        flags[f"r{rows}_quantize_launches"] = quant_calls == [len(model.fast_layers), 0]
    flags["fast_rope_attention_on"] = fused.fast_rope_attention_enabled()
    return flags


def _interp_case(name):
    if name in KERNEL_CASES:
        return _gemm_case(*KERNEL_CASES[name])
    if name == "norm_plain_inputs":
        return _norm_plain_case()
    if name == "model_attn_quant":
        from shoal.quant.fp8 import FP8Linear

        with _patched(FP8Linear, use_kernels=lambda self, x: self.quantize_activations and fp8.use_triton(x)):
            return {"checks": {}, "flags": _attn_quant_flags(_worker_model_d128())}
    return _model_case(int(name[-1]), reduced="reduced" in name)


def _worker_main():
    assert fp8.triton_interpreting(), "worker must import triton with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    report_cases(list(KERNEL_CASES) + EXTRA_CASES, _interp_case)


@pytest.fixture(scope="module")
def interp_results():
    if not fp8.HAS_TRITON:
        pytest.skip("triton not installed")
    return run_worker(__file__)


@pytest.mark.parametrize("name", list(KERNEL_CASES) + EXTRA_CASES)
def test_fused_equals_unfused_interpreter(interp_results, name):
    res = interp_results[name]
    assert "error" not in res, res.get("error")
    assert res["flags"]
    bad = [k for k, ok in res["flags"].items() if not ok]
    assert not bad, (bad, res)


# --------------------------------------------------------------------------------------
# CPU (no kernels): references, validation, dispatch
# --------------------------------------------------------------------------------------


def test_split_k_partials_validation_and_reference_reduce():
    with pytest.raises(ValueError, match="split"):
        fp8.SplitKPartials(torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="fp32"):
        fp8.SplitKPartials(torch.zeros(2, 2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        fp8.SplitKPartials(torch.zeros(2, 3, 2).transpose(1, 2))
    g = torch.Generator().manual_seed(0)
    d = torch.randn(3, 4, 5, generator=g) * 10
    p = fp8.SplitKPartials(d)
    assert p.split == 3 and p.shape == (4, 5) and p.dtype == torch.bfloat16
    assert _same(fp8.splitk_reduce_ref(p), ((d[0] + d[1]) + d[2]).to(torch.bfloat16))
    data, split, stride_row, stride_split = fp8.gemm_out_operand(p)
    assert data is d and split == 3 and stride_row == 5 and stride_split == 20
    y = torch.randn(4, 10).bfloat16()[:, :5]
    assert fp8.gemm_out_operand(y)[1:] == (1, 10, 0)


def test_cpu_references_reduce_partials_first():
    if fp8.triton_interpreting():
        pytest.skip("triton imported in interpreter mode in this process")
    g = torch.Generator().manual_seed(1)
    p = fp8.SplitKPartials(torch.randn(2, 3, 256, generator=g))
    y = fp8.splitk_reduce_ref(p)
    assert _same(p.reduce(), y)
    r = torch.randn(3, 256, generator=g).bfloat16()
    w = torch.rand(256, generator=g).bfloat16()
    out = fused.add_rmsnorm_quant(p, r, w, 1e-6, store_normed=True)
    normed, h = fused.add_rmsnorm_ref(y, r, w, 1e-6)
    q, s = fp8.quantize_act_ref(normed)
    assert _same(out.h, h) and _same(out.normed, normed) and _same(out.q, q) and _same(out.s, s)
    assert _same(fp8.silu_mul_quant(p)[0], fp8.silu_mul_quant_ref(y)[0])


def test_fp8_fusion_inactive_without_fp8_kernels():
    from shoal.bench.random_model import random_dualar, tiny_config

    model = random_dualar(tiny_config(), "cpu", torch.bfloat16)
    model.enable_fused_kernels()
    assert not fp8_fused.stack_supported(model.layers)  # bf16 weights
    if not fp8.triton_interpreting():  # FP8 weights, CPU tensors: FP8Linear's PyTorch body
        fp8_model = tiny_fp8_model()
        assert fp8_fused.stack_supported(fp8_model.layers)
        assert not fp8_fused.active(fp8_model.layers, torch.zeros(1, 256, dtype=torch.bfloat16))


# --------------------------------------------------------------------------------------
# GPU (compiled kernels)
# --------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available() or not fp8.HAS_TRITON, reason="needs CUDA + triton")


@pytest.fixture(scope="module")
def s2_pro_fp8():
    """2 slow + 2 fast layers at S2-Pro shapes (dim 2560, heads 32/8, head_dim 128, 9728)."""
    return tiny_fp8_model("cuda", dim=2560, n_layer=2, heads=(32, 8, 128), inter=9728)


@cuda
@pytest.mark.parametrize("M", [1, 64])
@pytest.mark.parametrize("stack", ["slow", "fast"])
@pytest.mark.parametrize("partials", ["1", "0"])
def test_gpu_fused_fp8_layers_equal_unfused(s2_pro_fp8, M, stack, partials, monkeypatch):
    """Also with SHOAL_FP8_PARTIALS=0 (the GEMMs reduce their own split-K partials)."""
    monkeypatch.setenv(fp8_fused.PARTIALS_ENV, partials)
    fp8_fused.consumer_partials.cache_clear()
    try:
        _check_fused_equals_unfused(s2_pro_fp8, M, stack)
    finally:
        monkeypatch.delenv(fp8_fused.PARTIALS_ENV)
        fp8_fused.consumer_partials.cache_clear()


def _check_fused_equals_unfused(model, M, stack):
    assert fp8_fused.active(model.layers, torch.zeros(1, device="cuda", dtype=torch.bfloat16))
    outs = []
    for fusion in (False, True):
        model.fp8_fusion = fusion
        outs.append(run_layer_stack(model, stack, M, 3))
    model.fp8_fusion = True
    for name, a, b in zip(("hidden", "k cache", "v cache"), outs[0], outs[1]):
        n_bad = int((a.view(torch.int16) != b.view(torch.int16)).sum())
        assert n_bad == 0, f"{name}: {n_bad} of {a.numel()} elements differ (M={M}, {stack})"


@cuda
def test_gpu_fp8_attention_quantizes_wo_input(s2_pro_fp8):
    """SHOAL_FP8_ATTN_QUANT at S2-Pro shapes: the fast stack's bits unchanged at M = 1 and 64,
    and wo's activation quantize launch gone."""
    flags = _attn_quant_flags(s2_pro_fp8, rows_list=(1, 64))
    assert all(flags.values()), {k: v for k, v in flags.items() if not v}


@cuda
@pytest.mark.parametrize("M", [1, 64])
@pytest.mark.parametrize("stack", ["slow", "fast"])
def test_gpu_fp8_last_add_fused_with_the_final_norm(s2_pro_fp8, M, stack):
    """The FP8 stack's last residual add run fused with the final RMSNorm (the decode path)
    leaves the hidden state and caches as the plain add, and its normed output equals
    add_rmsnorm of that hidden state."""
    model = s2_pro_fp8
    w = (model.norm if stack == "slow" else model.fast_norm).weight
    h, k, v = (t.clone() for t in run_layer_stack(model, stack, M, 3))
    normed, h2, k2, v2 = run_layer_stack(model, stack, M, 3, final_norm=w)
    assert torch.equal(h2.view(torch.int16), h.view(torch.int16))
    assert torch.equal(k2.view(torch.int16), k.view(torch.int16)) and torch.equal(v2.view(torch.int16), v.view(torch.int16))
    want = fused.add_rmsnorm(h[:, 0], None, w, model.config.norm_eps)[0]
    assert torch.equal(normed.view(torch.int16), want.view(torch.int16))


@cuda
def test_gpu_fused_fp8_layers_cuda_graph(s2_pro_fp8):
    from shoal.engine.attention import FastCacheBackend

    model = s2_pro_fp8
    layers = model.fast_layers
    M, D = 4, 2560
    be = FastCacheBackend(len(layers), M, 10, 32, 8, 128, torch.bfloat16, "cuda")
    be.position, be._rows = 2, M
    x = torch.randn(M, 1, D, device="cuda").bfloat16()
    pos = torch.full((M, 1), 2, device="cuda")

    def step():
        return model._layers_fused(x, layers, pos, model.fast_rope, be)

    model.fp8_fusion = False
    ref = step().clone()
    model.fp8_fusion = True
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static.view(torch.int16), ref.view(torch.int16))


if __name__ == "__main__":
    _worker_main()
