"""The FP8 decoder layer with fewer launches (the FP8 branch of ``DualAR._layers_fused``).

At decode batch sizes a step is launch/latency bound, so the FP8 layer keeps every
intermediate that only the next kernel reads out of separate kernels:

* the add+RMSNorm kernel also writes the 1x128 e4m3 quantization of its output
  (:func:`shoal.kernels.fused.add_rmsnorm_quant`) instead of a separate ``quantize_act``;
* an FP8 GEMM whose launch config splits K (``SPLIT_K > 1``, the small-M configs) leaves its
  fp32 partials (:class:`~shoal.kernels.fp8.SplitKPartials`) to the kernel that reads its
  output -- qk-norm+RoPE+KV write, add+RMSNorm+quantize, SiLU*mul+quantize -- which adds
  them in the reduce kernel's order and rounds to bf16 on load: no reduce launch.

Launches per layer when every GEMM splits K (the M = 1 case at S2-Pro shapes)::

    unfused (16)                                     fused (9)
    add_rmsnorm, quantize_act                        add_rmsnorm_quant   (previous layer's)
    wqkv GEMM, reduce, qk_norm_rope_write            wqkv GEMM, qk_norm_rope_write
    attention                                        attention
    quantize_act, wo GEMM, reduce                    quantize_act, wo GEMM
    add_rmsnorm, quantize_act                        add_rmsnorm_quant
    w13 GEMM, reduce, silu_mul_quant                 w13 GEMM, silu_mul_quant
    w2 GEMM, reduce                                  w2 GEMM

**fp16 activations** (opt-in, ``SHOAL_FP8_ACT=fp16``, :func:`enable_f16`): the same layer with
the FP8-weight / fp16-activation GEMM of :mod:`shoal.kernels.fp8h` instead of W8A8. The norms and
SiLU*mul write ``fp16(x * 2^-S)`` instead of e4m3 groups (the bf16-rounded value, exact in fp16's
range), ``wo``'s input is converted by one small kernel (W8A8 quantizes it the same way), and the
GEMMs reduce their split-K partials themselves. ``S`` is fixed per linear at enable time from a
bound on its input that holds for every input (the RMSNorm output is at most ``sqrt(dim) *
max|w_norm|``; V rows, the attention output and SwiGLU follow from the weights' row norms), so no
activation can overflow fp16. Numerics differ from W8A8: the activation keeps its bf16 value
instead of a 1x128 e4m3 rounding.

Every kernel does the unfused path's arithmetic in the same order (same launch configs, the
same reduction layouts), so hidden states, KV-cache writes and logits are bit-identical to
the unfused FP8 path (tests/test_fp8_fusion.py). The last layer's w2 output is reduced as
before (it feeds the plain residual add after the loop). Nothing syncs with the host and
the partial workspaces are allocated per call like the reduce's: CUDA-graph capturable.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .fp8 import BLOCK, GemmOut, fp8_gemm_triton, fp8_linear_triton, silu_mul_quant, splitk_reduce
from .fused import add_rmsnorm_quant

__all__ = ["Act", "F16Operands", "active", "enable_f16", "f16_requested", "mlp", "norm_quant", "project",
           "stack_supported"]

log = logging.getLogger(__name__)
F16_ENV = "SHOAL_FP8_ACT"
MAX_F16_SHIFT = 24  # beyond this the bound is not a real model's (an fp16 activation would lose its small values)


def f16_requested() -> bool:
    """``SHOAL_FP8_ACT=fp16``: the fused FP8 layer runs on fp16 activations (shoal.kernels.fp8h)."""
    v = os.environ.get(F16_ENV, "e4m3").strip().lower()
    if v not in ("e4m3", "fp16", ""):
        raise ValueError(f"{F16_ENV} must be e4m3 or fp16, got {v!r}")
    return v == "fp16"


@dataclass(frozen=True)
class F16Operands:
    """What the fp16-activation GEMM of one FP8Linear needs: the fp16 block multipliers, the
    output scale ``2^E * 2^S`` and the activation shift ``S`` (its input is ``fp16(x * 2^-S)``)."""

    weight_h: Tensor
    out_scale: float
    shift: int
    bound: float  # the bound on |x| that S was chosen for

Act = tuple[Tensor, Tensor]
"""A 1x128-quantized activation: ``(q [M, K] float8_e4m3fn, s [M, ceil(K/128)] fp32)``."""


def _fp8_linear_ok(lin) -> bool:
    """An FP8Linear (shoal.quant) whose kernel body is exactly the FP8 GEMM: activations
    quantized, no bias, bf16 output."""
    return (lin is not None and hasattr(lin, "weight_q") and hasattr(lin, "use_kernels")
            and getattr(lin, "bias", None) is None and getattr(lin, "quantize_activations", False)
            and getattr(lin, "dtype", None) == torch.bfloat16)


def stack_supported(layers: nn.ModuleList) -> bool:
    """Whether every layer's wqkv, wo, stacked w1|w3 (``feed_forward.w13_fp8``, made by
    ``DualAR.enable_fused_kernels``) and w2 is a plain FP8Linear. Cached on ``layers`` (the
    modules are fixed once fused kernels are enabled)."""
    cached = layers.__dict__.get("_fp8_fused_ok")
    if cached is not None:
        return cached
    ok = len(layers) > 0 and all(
        _fp8_linear_ok(layer.attention.wqkv) and _fp8_linear_ok(layer.attention.wo)
        and _fp8_linear_ok(getattr(layer.feed_forward, "w13_fp8", None)) and _fp8_linear_ok(layer.feed_forward.w2)
        for layer in layers)
    layers.__dict__["_fp8_fused_ok"] = ok
    return ok


def active(layers: nn.ModuleList, x: Tensor) -> bool:
    """Whether the fused FP8 path runs for ``layers`` on activations like ``x`` (bf16, and the
    FP8Linears run their Triton kernels for it)."""
    return (x.dtype == torch.bfloat16 and stack_supported(layers)
            and layers[0].attention.wqkv.use_kernels(x))


def norm_quant(x: GemmOut, residual: Tensor | None, weight: Tensor, eps: float,
               consumer=None) -> tuple[Tensor, Act | Tensor]:
    """``h = x + residual`` and the FP8 quantization of ``RMSNorm(h) * weight``, one launch;
    ``x`` may be split-K partials. Returns ``(h, (q, s))``; when the ``consumer`` FP8Linear runs
    on fp16 activations (:func:`enable_f16`), ``(h, fp16(normed * 2^-S))`` instead."""
    f16 = getattr(consumer, "f16", None)
    if f16 is not None:
        from .fused import add_rmsnorm_triton

        if not isinstance(x, Tensor):
            x = splitk_reduce(x)
        dim = x.shape[-1]
        x16, h = add_rmsnorm_triton(x.reshape(-1, dim), None if residual is None else residual.reshape(-1, dim),
                                    weight, eps, f16_shift=f16.shift)
        return h, x16
    r = add_rmsnorm_quant(x, residual, weight, eps)
    return r.h, (r.q, r.s)


def project(linear, x: Act | Tensor, *, partials: bool = True) -> GemmOut:
    """``linear`` (FP8Linear) of a quantized activation ``(q, s)`` (the GEMM alone) or of a
    bf16 ``[M, K]`` tensor (quantize + GEMM, as ``FP8Linear.forward_kernels``). ``partials``:
    leave split-K partials unreduced for the consuming kernel. With fp16 activations
    (``linear.f16``): an fp16 ``x`` goes straight to the fp8h GEMM, a bf16 one is converted
    first; the result is always reduced bf16."""
    f16 = getattr(linear, "f16", None)
    if f16 is not None and not isinstance(x, tuple):
        from .fp8h import fp8h_gemm_triton, to_f16_act

        if x.dtype != torch.float16:
            x = to_f16_act(x, f16.shift)
        return fp8h_gemm_triton(x, linear.weight_q, f16.weight_h, f16.out_scale)
    if isinstance(x, tuple):
        return fp8_gemm_triton(*x, linear.weight_q, linear.weight_scale, partials=partials)
    return fp8_linear_triton(x, linear.weight_q, linear.weight_scale, partials=partials)


def mlp(ff, act: Act | Tensor, *, partials: bool = True) -> GemmOut:
    """The FP8 SwiGLU MLP of a quantized activation: stacked w1|w3 GEMM -> SiLU*mul+quantize
    (reading the GEMM's partials) -> w2 GEMM (partials left unreduced unless ``partials`` is
    False, e.g. for the last layer, whose output feeds a plain residual add). With fp16
    activations: SiLU*mul writes w2's fp16 input."""
    gu = project(ff.w13_fp8, act)
    f16 = getattr(ff.w2, "f16", None)
    if f16 is not None:
        from .fused import silu_mul_triton

        if not isinstance(gu, Tensor):
            gu = splitk_reduce(gu)
        return project(ff.w2, silu_mul_triton(gu, f16_shift=f16.shift), partials=partials)
    return project(ff.w2, silu_mul_quant(gu), partials=partials)


# --------------------------------------------------------------------------------------
# fp16 activations: operands and shifts
# --------------------------------------------------------------------------------------

def row_norms(linear, rows: slice | None = None) -> Tensor:
    """The L2 norm of every dequantized weight row of an FP8Linear (fp32 ``[N]``, or the rows of
    ``rows``), computed block by block (no dequantized copy of the whole weight)."""
    q, s = linear.weight_q, linear.weight_scale
    N, K = q.shape
    lo, hi = (0, N) if rows is None else (rows.start, rows.stop)
    KB = -(-K // BLOCK)
    out = torch.empty(hi - lo, dtype=torch.float32, device=q.device)
    step = 2048
    for r0 in range(lo, hi, step):
        r1 = min(hi, r0 + step)
        qq = q[r0:r1].float().square()
        if K % BLOCK:
            qq = torch.nn.functional.pad(qq, (0, KB * BLOCK - K))
        blk = qq.view(r1 - r0, KB, BLOCK).sum(-1)  # [rows, KB]
        sc = s[torch.arange(r0, r1, device=q.device) // BLOCK]  # [rows, KB]
        out[r0 - lo:r1 - lo] = (blk * sc.square()).sum(-1).sqrt()
    return out


def _operands(linear, bound: float) -> F16Operands:
    from .fp8h import FP16_MIN_NORMAL, f16_shift_for, fp16_weight_scales

    W_h, e_scale, ratio = fp16_weight_scales(linear.weight_scale)
    if ratio < FP16_MIN_NORMAL:
        raise ValueError(f"block scales span more than fp16's normal range (smallest / largest {ratio:.3g})")
    S = f16_shift_for(bound)
    if S > MAX_F16_SHIFT:
        raise ValueError(f"activation bound {bound:.3g} needs a shift of {S} > {MAX_F16_SHIFT}")
    return F16Operands(W_h, e_scale * 2.0 ** S, S, bound)


def _layer_bounds(layer) -> dict[str, float]:
    """Bounds on the inputs of one layer's four FP8 GEMMs that hold for every input (a few
    percent added for the bf16 roundings on the way):

    * RMSNorm output: ``|h_i * rs| <= sqrt(dim)``, so ``|normed_i| <= sqrt(dim) * max|w|`` and
      ``||normed||_2 <= sqrt(dim) * max|w|``;
    * wo's input (the attention output) is a convex combination of V rows, and ``|V_j| <=
      ||normed||_2 * ||Wv_j||_2``;
    * w2's input ``silu(g) * u`` with ``|g_i|``, ``|u_i|`` bounded the same way and ``|silu(g)| <=
      max(|g|, 0.2785)``."""
    att, ff = layer.attention, layer.feed_forward
    dim = att.wqkv.in_features
    slack = 1.05
    na = math.sqrt(dim) * float(layer.attention_norm.weight.detach().abs().max()) * slack
    nf = math.sqrt(dim) * float(layer.ffn_norm.weight.detach().abs().max()) * slack
    sh = att.shape
    v0 = (sh.n_head + sh.n_local_heads) * sh.head_dim
    v_bound = na * float(row_norms(att.wqkv, slice(v0, v0 + sh.n_local_heads * sh.head_dim)).max()) * slack
    inter = ff.w2.in_features
    r13 = row_norms(ff.w13_fp8)
    g = (nf * r13[:inter]).clamp_min(0.2785)
    u = nf * r13[inter:]
    return {"wqkv": na, "wo": v_bound, "w13": nf, "w2": float((g * u).max()) * slack}


def enable_f16(model) -> bool:
    """Give every FP8Linear of the fused FP8 layers (slow and fast) its fp16-activation operands
    (``linear.f16``), so the fused layer runs the fp8h GEMMs. Returns False, changing nothing,
    when a stack is not the fused FP8 layer or a weight's scales or activation bound do not fit
    fp16 (logged). Call after the model is on its device and ``enable_fused_kernels``."""
    plan = []
    try:
        for stack in (model.layers, model.fast_layers):
            if not stack_supported(stack):
                log.warning("%s=fp16: a layer stack is not the fused FP8 layer; keeping e4m3 activations", F16_ENV)
                return False
            for layer in stack:
                b = _layer_bounds(layer)
                att, ff = layer.attention, layer.feed_forward
                plan += [(att.wqkv, _operands(att.wqkv, b["wqkv"])), (att.wo, _operands(att.wo, b["wo"])),
                         (ff.w13_fp8, _operands(ff.w13_fp8, b["w13"])), (ff.w2, _operands(ff.w2, b["w2"]))]
    except ValueError as e:
        log.warning("%s=fp16 refused (%s); keeping e4m3 activations", F16_ENV, e)
        return False
    for lin, ops in plan:
        lin.f16 = ops
    shifts = sorted({ops.shift for _, ops in plan})
    log.info("FP8 layers on fp16 activations (shoal.kernels.fp8h): %d GEMMs, activation shifts %s", len(plan), shifts)
    return True


def disable_f16(model) -> None:
    """Back to e4m3 activations (W8A8)."""
    for stack in (model.layers, model.fast_layers):
        for layer in stack:
            for lin in (layer.attention.wqkv, layer.attention.wo, getattr(layer.feed_forward, "w13_fp8", None),
                        layer.feed_forward.w2):
                if lin is not None and hasattr(lin, "f16"):
                    lin.f16 = None
