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

``SHOAL_FP8_PARTIALS=0`` (an experiment's switch, :func:`consumer_partials`) has the GEMMs reduce
their own partials instead (the launch config's in-kernel reduce by each tile's last program,
else the reduce kernel), so the consumers read bf16: the same bits, the summing spread over the
GEMM's tiles rather than done by the consumer's one program per row.

Every kernel does the unfused path's arithmetic in the same order (same launch configs, the
same reduction layouts), so hidden states, KV-cache writes and logits are bit-identical to
the unfused FP8 path (tests/test_fp8_fusion.py). The last layer's w2 output is reduced as
before (it feeds the plain residual add after the loop). Nothing syncs with the host and
the partial workspaces are allocated per call like the reduce's: CUDA-graph capturable.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from ..envutil import env_flag
from .fp8 import GemmOut, fp8_gemm_triton, fp8_linear_triton, silu_mul_quant
from .fused import add_rmsnorm_quant

__all__ = ["ATTN_QUANT_ENV", "Act", "PARTIALS_ENV", "active", "attn_quant", "consumer_partials", "mlp", "norm_quant", "project", "stack_supported"]

PARTIALS_ENV = "SHOAL_FP8_PARTIALS"
ATTN_QUANT_ENV = "SHOAL_FP8_ATTN_QUANT"


@functools.cache
def consumer_partials() -> bool:
    """Whether a split-K GEMM of the fused FP8 layer leaves its fp32 partials to the kernel that
    reads its output (``SHOAL_FP8_PARTIALS``, default on; ``0``: the GEMM reduces them, see
    the module docstring)."""
    return env_flag(PARTIALS_ENV) is not False

@functools.cache
def attn_quant() -> bool:
    """Whether the fast positions' RoPE + attention kernel also writes the FP8 quantization of
    its output for ``wo`` (``SHOAL_FP8_ATTN_QUANT=1``; opt-in until measured on a GPU): the bytes
    ``quantize_act`` would write, without its launch (head_dim 128: one 1x128 group per head)."""
    return env_flag(ATTN_QUANT_ENV) is True


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


def norm_quant(x: GemmOut, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Act]:
    """``h = x + residual`` and the FP8 quantization of ``RMSNorm(h) * weight``, one launch;
    ``x`` may be split-K partials. Returns ``(h, (q, s))``."""
    r = add_rmsnorm_quant(x, residual, weight, eps)
    return r.h, (r.q, r.s)


def project(linear, x: Act | Tensor, *, partials: bool = True) -> GemmOut:
    """``linear`` (FP8Linear) of a quantized activation ``(q, s)`` (the GEMM alone) or of a
    bf16 ``[M, K]`` tensor (quantize + GEMM, as ``FP8Linear.forward_kernels``). ``partials``:
    leave split-K partials unreduced for the consuming kernel (unless :func:`consumer_partials`
    is off)."""
    partials = partials and consumer_partials()
    if isinstance(x, tuple):
        return fp8_gemm_triton(*x, linear.weight_q, linear.weight_scale, partials=partials)
    return fp8_linear_triton(x, linear.weight_q, linear.weight_scale, partials=partials)


def mlp(ff, act: Act, *, partials: bool = True) -> GemmOut:
    """The FP8 SwiGLU MLP of a quantized activation: stacked w1|w3 GEMM -> SiLU*mul+quantize
    (reading the GEMM's partials) -> w2 GEMM (partials left unreduced unless ``partials`` is
    False, e.g. for the last layer, whose output feeds a plain residual add)."""
    gu = project(ff.w13_fp8, act)
    return project(ff.w2, silu_mul_quant(gu), partials=partials)
