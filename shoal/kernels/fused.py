"""Fused elementwise kernels for the decode step (Triton, with PyTorch references).

A slow-transformer layer of the decode step runs, besides its GEMMs and the attention
kernel, about forty small elementwise kernels (norms, residual adds, qk-norm, RoPE, K/V
scatter, SiLU). Inside a CUDA graph each still costs a launch, so the step is
launch-bound. The kernels here cut that to four launches per layer:

* :func:`add_rmsnorm` -- ``h = x + residual``; ``normed = RMSNorm(h)`` (one program per row).
  :func:`add_rmsnorm_quant` (the same kernel) also writes the 1x128 FP8 quantization of
  ``normed`` for the next FP8 GEMM, bit-identical to ``quantize_act(normed)``.
* :func:`qk_norm_rope_write` -- from the ``wqkv`` output: per-head qk-norm, RoPE on q and
  k, K/V scatter into the cache through a slot mapping; returns q (one launch).
* :func:`silu_mul` -- ``silu(gate) * up`` from the fused ``w1|w3`` output.
* :func:`fast_decode_attention` -- the fast transformer's attention over its per-row
  10-slot cache (all rows attend to the first ``length`` positions).

Numerics
--------
Every kernel rounds where the model code (``shoal/model/layers.py``) rounds, with the same
operations in the same order, so elementwise results are bit-identical to PyTorch's:

* bf16/fp16 ``a + b`` and ``a * b`` are computed in fp32 and rounded once to the storage
  dtype (round to nearest even), as PyTorch does; fp32 ``a * cos - b * sin`` is two
  rounded products and a rounded difference (the compiled kernels are built with
  ``enable_fp_fusion=False`` so that no FMA contracts them).
* RMSNorm (``RMSNorm`` of layers.py): ``(h * rsqrt(mean(h*h) + eps))`` rounded to h's
  dtype, *then* multiplied by the weight and rounded again (to the promoted dtype).
* qk-norm (``nn.RMSNorm`` = ``F.rms_norm``; PyTorch's fused implementation, checked
  on CPU with torch 2.13 for bf16): ``h * rsqrt(mean(h*h) + eps) * w`` in fp32, rounded
  *once*; RoPE then reads that rounded value.
* SiLU: ``g / (1 + exp(-g))`` in fp32 (IEEE division, accurate ``expf`` -- libdevice on
  GPU, not Triton's approximate ``exp``), rounded, then the multiply by ``up`` rounded.

The only differences left are in reductions: the sum of squares of a norm is added in
another order than PyTorch's (and ``exp`` of SiLU / ``rsqrt`` are 1-2 ulp fp32
library functions that can differ between implementations), which moves the fp32
result by a few ulp and therefore, rarely (~1e-4 of the elements), flips a bf16
rounding: bf16 results of the norms are exact except for <= 1-2 bf16 ulp on those
elements. ``fast_decode_attention`` keeps its probabilities in fp32 (SDPA's kernels
differ among themselves): it matches the reference within attention tolerances.

The mean of a norm is ``sum / n`` on CPU tensors (as PyTorch's CPU ``mean``) and
``sum * (1/n)`` on CUDA tensors (as PyTorch's CUDA ``mean``).

FP8 GEMM outputs: ``add_rmsnorm_quant`` and ``qk_norm_rope_write`` also take an FP8 GEMM's
unreduced split-K partials (:class:`shoal.kernels.fp8.SplitKPartials`) and add them while
loading, in the reduce kernel's order with its rounding, so the values they read are exactly
the reduced bf16 output (see :mod:`shoal.kernels.fp8_fused`).

Triton's interpreter converts fp32 to bf16 by truncation, so every rounding to bf16 is
done explicitly (bit arithmetic, ties to even, NaN kept) before the final cast; the same
code therefore runs compiled and interpreted.

Dispatch
--------
Each ``op`` has ``op_ref`` (plain PyTorch, mirrors the model code, CUDA-graph safe),
``op_triton`` (the kernel: compiled on CUDA tensors, or interpreted on any tensors when
Triton was imported with ``TRITON_INTERPRET=1``) and ``op`` (the kernel when it can run,
else the reference). Launch grids depend on shapes only and nothing syncs with the host,
so all of them can be captured in a CUDA graph (compile them once outside the capture).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .fp8 import BLOCK as QUANT_GROUP
from .fp8 import (
    FP8_DTYPE,
    GemmOut,
    SplitKPartials,
    gemm_out_operand,
    quantize_act_ref,
    quantize_act_triton,
    splitk_reduce,
    splitk_reduce_ref,
)
from .paged_attention import HAS_TRITON, pdl_options, tl, triton, triton_interpreting

__all__ = [
    "NormQuant",
    "add_rmsnorm",
    "add_rmsnorm_quant",
    "add_rmsnorm_quant_ref",
    "add_rmsnorm_quant_triton",
    "add_rmsnorm_ref",
    "add_rmsnorm_triton",
    "fast_decode_attention",
    "fast_rope_attention",
    "fast_rope_attention_ref",
    "fast_rope_attention_triton",
    "fast_decode_attention_ref",
    "fast_decode_attention_triton",
    "qk_norm_rope_write",
    "qk_norm_rope_write_ref",
    "qk_norm_rope_write_triton",
    "silu_mul",
    "silu_mul_ref",
    "silu_mul_triton",
    "use_triton",
    "write_kv",
]

_DT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def use_triton(t: Tensor) -> bool:
    """Whether the dispatchers run the Triton kernel for tensors like ``t``."""
    return HAS_TRITON and (t.is_cuda or triton_interpreting())


def _check_dtype(name: str, t: Tensor) -> None:
    if t.dtype not in _DT_CODE:
        raise ValueError(f"{name}: unsupported dtype {t.dtype} (fp32, bf16 or fp16)")


# --------------------------------------------------------------------------------------
# References (mirror shoal/model/layers.py and shoal/engine/attention.py exactly)
# --------------------------------------------------------------------------------------


def add_rmsnorm_ref(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, *,
                    residual_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``h = x + residual`` (or ``x``); ``normed = RMSNorm(h)`` as in layers.RMSNorm.
    ``residual_scale`` (a LayerScale's gamma, [dim]): ``h = x + residual * gamma``, the product
    rounded first, as the codec transformer's ``x + LayerScale(branch)``."""
    if residual is not None and residual_scale is not None:
        residual = residual * residual_scale
    h = x if residual is None else x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(torch.mean(hf * hf, dim=-1, keepdim=True) + eps)
    return normed.type_as(h) * weight, h


class NormQuant(NamedTuple):
    """What :func:`add_rmsnorm_quant` returns."""

    h: Tensor  # x + residual (x itself when residual is None)
    q: Tensor  # [rows, dim] float8_e4m3fn: quantize_act(normed)
    s: Tensor  # [rows, ceil(dim/128)] fp32 dequant scales
    normed: Tensor | None  # RMSNorm(h) * weight, when asked for


def add_rmsnorm_quant_ref(x: GemmOut, residual: Tensor | None, weight: Tensor, eps: float, *,
                          store_normed: bool = False) -> NormQuant:
    """:func:`add_rmsnorm_ref` then the 1x128 FP8 quantize of ``normed`` (rows = leading dims);
    ``x`` may be an FP8 GEMM's split-K partials (reduced first)."""
    if isinstance(x, SplitKPartials):
        x = splitk_reduce_ref(x)
    normed, h = add_rmsnorm_ref(x, residual, weight, eps)
    q, s = quantize_act_ref(normed.reshape(-1, normed.shape[-1]))
    return NormQuant(h, q, s, normed if store_normed else None)


def _apply_rope_ref(x: Tensor, cs: Tensor) -> Tensor:
    """x: [N, h, D]; cs: [N, D/2, 2] -- layers.apply_rope on a flattened token axis."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    c = cs.unsqueeze(1).float()  # [N, 1, D/2, 2]
    cos, sin = c[..., 0], c[..., 1]
    a, b = xs[..., 0], xs[..., 1]
    out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return out.flatten(2).type_as(x)


def _split_qkv(qkv: Tensor, n_head: int, n_kv_head: int, head_dim: int):
    if qkv.shape[-1] != (n_head + 2 * n_kv_head) * head_dim:
        raise ValueError(
            f"qkv last dim {qkv.shape[-1]} != (n_head + 2 * n_kv_head) * head_dim = "
            f"{(n_head + 2 * n_kv_head) * head_dim}"
        )
    qkv = qkv.reshape(-1, qkv.shape[-1])
    N = qkv.shape[0]
    q, k, v = qkv.split([n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim], dim=-1)
    return (q.reshape(N, n_head, head_dim), k.reshape(N, n_kv_head, head_dim),
            v.reshape(N, n_kv_head, head_dim))


def _flat_cache(cache: Tensor, n_kv_head: int, head_dim: int) -> Tensor:
    if cache.dim() < 3 or tuple(cache.shape[-2:]) != (n_kv_head, head_dim):
        raise ValueError(f"cache must be [..., H_kv={n_kv_head}, D={head_dim}], got {tuple(cache.shape)}")
    return cache.view(-1, n_kv_head, head_dim)  # a view: writes land in the cache


def _paged_minor(cache: Tensor) -> bool:
    """A ``[num_blocks, block_size, H_kv, D]`` cache stored token-minor (no flat slot view)."""
    from .paged_attention_fp8 import is_token_minor

    return cache.dim() == 4 and is_token_minor(cache)


def _scatter_slots(cache: Tensor, slots: Tensor, x: Tensor) -> None:
    """``x [N, H_kv, D]`` into ``cache`` at flat ``slots`` (block * block_size + offset); an
    FP8 cache as bytes (index_copy_ / index_put_ have no float8 kernel on every device)."""
    raw = (lambda t: t.view(torch.uint8)) if cache.dtype == torch.float8_e4m3fn else (lambda t: t)
    if _paged_minor(cache):
        # slots must be >= 0 (not checked: a check would sync with the host inside graphs)
        bs = cache.shape[1]
        raw(cache)[slots // bs, slots % bs] = raw(x.to(cache.dtype))
    else:
        flat = _flat_cache(cache, x.shape[-2], x.shape[-1])
        raw(flat).index_copy_(0, slots, raw(x.to(cache.dtype)))


def write_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor,
             k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    """k / v ``[N, H_kv, D]`` into the caches (``[..., H_kv, D]``, flattened) at flat ``slots``
    ``[N]`` (``index_copy_``); an FP8 cache (``k_scale`` / ``v_scale`` ``[..., H_kv]``) gets
    the e4m3 values and per-head scales of :func:`shoal.quant.kv.quantize_kv`."""
    H_kv, D = k.shape[-2], k.shape[-1]
    for c in (k_cache, v_cache):
        if c.dim() < 3 or tuple(c.shape[-2:]) != (H_kv, D):
            raise ValueError(f"cache must be [..., H_kv={H_kv}, D={D}], got {tuple(c.shape)}")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 != (k_scale is not None and v_scale is not None) or (v_cache.dtype == torch.float8_e4m3fn) != fp8:
        raise ValueError("an FP8 (float8_e4m3fn) KV cache needs k_scale and v_scale, and only it takes them")
    if k_scale is None:
        _scatter_slots(k_cache, slots, k)
        _scatter_slots(v_cache, slots, v)
        return
    from ..quant.kv import quantize_kv

    for cache, sc, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        xq, xs = quantize_kv(x)
        _scatter_slots(cache, slots, xq)
        sc.view(-1, H_kv).index_copy_(0, slots, xs)


def qk_norm_rope_write_ref(qkv, positions, cos_sin, q_norm_w, k_norm_w, eps, k_cache, v_cache, slots,
                           n_head, n_kv_head, head_dim, k_scale=None, v_scale=None):
    """Attention.forward up to ``attend`` plus PagedKVCache.write; returns q [N, H, D].

    qk-norm is ``F.rms_norm`` (what ``nn.RMSNorm`` calls), RoPE is layers.apply_rope with
    ``cos_sin[positions]``, the cache write is ``index_copy_`` into the flattened cache
    (slots must be valid, >= 0). ``k_scale`` / ``v_scale``: an FP8 cache's scales (the cache
    holds e4m3 values, see :func:`write_kv`).
    """
    q, k, v = _split_qkv(qkv, n_head, n_kv_head, head_dim)
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError("give both q_norm_w and k_norm_w, or neither")
    if q_norm_w is not None:
        q = F.rms_norm(q, (head_dim,), q_norm_w, eps)
        k = F.rms_norm(k, (head_dim,), k_norm_w, eps)
    cs = cos_sin[positions.reshape(-1)]
    q = _apply_rope_ref(q, cs)
    k = _apply_rope_ref(k, cs)
    write_kv(k_cache, v_cache, slots.reshape(-1), k, v, k_scale, v_scale)
    return q


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    """``F.silu(gate) * up`` for ``gate_up = cat(w1 x, w3 x)`` (FeedForward)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fast_decode_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, length: int,
                              scale: float | None = None) -> Tensor:
    """FastCacheBackend.attend after its write: q [B, H, D] over positions [0, length) of
    caches [>=B, C, H_kv, D]; returns [B, H, D]."""
    B, H = q.shape[0], q.shape[1]
    kc = k_cache[:B, :length].transpose(1, 2)
    vc = v_cache[:B, :length].transpose(1, 2)
    group = H // kc.shape[1]
    if group > 1:
        kc = kc.repeat_interleave(group, dim=1)
        vc = vc.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q[:, :, None, :], kc, vc, scale=scale)[:, :, 0, :]


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------

if HAS_TRITON:
    from triton.language.extra import libdevice

    if triton_interpreting():
        def _round_impl(x, DT: tl.constexpr):
            """fp32 x -> fp32 value representable in DT (0 fp32, 1 bf16, 2 fp16), RNE.
            The interpreter's fp32 -> bf16 cast does not round to nearest even, so bf16 is
            rounded with integer arithmetic here (the same bits as the hardware cast)."""
            if DT == 1:
                u = x.to(tl.uint32, bitcast=True)
                u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
                return tl.where(x != x, x, u.to(tl.float32, bitcast=True))  # noqa: PLR0124 (NaN)
            elif DT == 2:
                return x.to(tl.float16).to(tl.float32)
            else:
                return x
    else:
        def _round_impl(x, DT: tl.constexpr):
            """fp32 x -> fp32 value representable in DT (0 fp32, 1 bf16, 2 fp16), RNE: one
            hardware ``cvt.rn`` and back (the integer emulation above cost ~7 instructions per
            rounding, the bulk of the Snake kernels' time on an H200)."""
            if DT == 1:
                return x.to(tl.bfloat16).to(tl.float32)
            elif DT == 2:
                return x.to(tl.float16).to(tl.float32)
            else:
                return x

    def _add_rmsnorm_kernel(
        x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, q_ptr, s_ptr, g_ptr,
        stride_x, stride_r, stride_o, stride_h, stride_xs, stride_q, n_groups,
        n_cols, inv_n, eps,
        HAS_RES: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        MEAN_DIV: tl.constexpr,
        BLOCK: tl.constexpr,
        HDT: tl.constexpr,
        ODT: tl.constexpr,
        SPLIT: tl.constexpr,
        STORE_OUT: tl.constexpr,
        QUANT: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_enter(PDL)
        # SPLIT > 1: x is an FP8 GEMM's fp32 split-K partials (stride_xs apart), summed and
        # rounded to bf16 on load (_load_gemm_out). QUANT: also write the 1x128 e4m3
        # quantization of the output row (q, one fp32 scale per group; quantize_act's
        # arithmetic). STORE_OUT: write the normed row itself. HAS_SCALE: the residual is
        # multiplied by g (a LayerScale, rounded to HDT) before the add.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < n_cols
        # every load is issued before the first reduction: a load after it would wait for the
        # reduction's barrier and then pay its own memory round trip (a latency-bound kernel)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        h = _load_gemm_out(x_ptr + row * stride_x + offs, m, stride_xs, SPLIT)
        if HAS_RES:
            r = tl.load(r_ptr + row * stride_r + offs, mask=m, other=0.0).to(tl.float32)
            if HAS_SCALE:
                r = _round(r * tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32), HDT)
            h = _round(h + r, HDT)
            tl.store(h_ptr + row * stride_h + offs, h.to(h_ptr.dtype.element_ty), mask=m)
        ss = tl.sum(h * h, axis=0)
        if MEAN_DIV:
            ms = ss / n_cols
        else:
            ms = ss * inv_n
        rs = tl.math.rsqrt(ms + eps)
        normed = _round(h * rs, HDT)
        o = _round(normed * w, ODT)
        if STORE_OUT:
            tl.store(out_ptr + row * stride_o + offs, o.to(out_ptr.dtype.element_ty), mask=m)
        if QUANT:  # lanes past n_cols hold 0 (masked loads), as quantize_act pads a ragged group
            g = tl.arange(0, BLOCK // 128)
            k2 = g[:, None] * 128 + tl.arange(0, 128)[None, :]
            y, scale = _quant_tile(tl.reshape(o, (BLOCK // 128, 128)))
            tl.store(q_ptr + row * stride_q + k2, y, mask=k2 < n_cols)
            tl.store(s_ptr + row * n_groups + g, scale, mask=g < n_groups)

    @triton.jit
    def _e4m3_scale(amax):
        """Per-vector quantization factor and stored dequant scale of shoal.quant.kv (the
        1x128 activation rule): amax floored at 1e-10, qs = 448 / amax, scale = 1 / qs."""
        amax = tl.maximum(amax, 1e-10)
        qs = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
        return qs, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), qs)

    @triton.jit
    def _e4m3(v, qs):
        return _round_e4m3(tl.minimum(tl.maximum(v * qs, -448.0), 448.0)).to(tl.float8e4nv)

    def _qk_norm_rope_write_kernel(
        qkv_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
        stride_qkv, stride_qkv_s, stride_cs_p, stride_cs_i, stride_cs_c,
        stride_q_t, stride_q_h, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, stride_sc_s,
        inv_d, eps,
        N_HEAD: tl.constexpr,
        N_KV: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,
        QK_NORM: tl.constexpr,
        MEAN_DIV: tl.constexpr,
        DT: tl.constexpr,
        SPLIT: tl.constexpr,
        KV_FP8: tl.constexpr,
        PDL: tl.constexpr = False,
        V_PAGE: tl.constexpr = 0,
        stride_vc_b=0,
        stride_vc_t=0,
        stride_vc_d=0,
    ):
        pdl_enter(PDL)
        # V_PAGE > 0: the value cache is paged [num_blocks, V_PAGE, H_kv, D] with its own
        # strides (a token-minor FP8 cache, shoal.kernels.paged_attention_fp8), not flat slots
        # program (t, j): token t; j < N_HEAD -> query head j, else KV head j - N_HEAD
        # (K normed + roped, V copied). KV_FP8: K and V are stored as e4m3 with one fp32
        # scale per (token, KV head) at ks_ptr / vs_ptr (shoal.quant.kv). Head j's columns in qkv start at j * HEAD_DIM for
        # both q and k heads. SPLIT > 1: qkv is the wqkv FP8 GEMM's fp32 split-K partials
        # (stride_qkv_s apart), summed and rounded to bf16 on load (_load_gemm_out).
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        i = tl.arange(0, HALF)
        jv = i * 0 + j  # j as a vector: masks are built from vector comparisons only
        is_q = jv < N_HEAD
        is_k = jv >= N_HEAD

        pos = tl.load(pos_ptr + t).to(tl.int64)
        # the slot and the V row are loaded up front, so their round trips overlap the q/k ones
        # (loads after the norm's reduction would each wait for it); the V load ignores the
        # slot (a padding row's V is read and never stored)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        d = tl.arange(0, HEAD_DIM)
        vsrc = qkv_ptr + t * stride_qkv + (j + N_KV) * HEAD_DIM + d
        vload = (d * 0 + j) >= N_HEAD
        if KV_FP8 or SPLIT > 1:
            vf = _load_gemm_out(vsrc, vload, stride_qkv_s, SPLIT)  # fp32 (the model-dtype value)
        else:
            vraw = tl.load(vsrc, mask=vload, other=0.0)
        cs = cs_ptr + pos * stride_cs_p + i * stride_cs_i
        cos = tl.load(cs).to(tl.float32)
        sin = tl.load(cs + stride_cs_c).to(tl.float32)

        src = qkv_ptr + t * stride_qkv + j * HEAD_DIM + 2 * i
        if SPLIT == 1:
            a = tl.load(src).to(tl.float32)
            b = tl.load(src + 1).to(tl.float32)
        else:
            a = _load_gemm_out(src, i < HALF, stride_qkv_s, SPLIT)
            b = _load_gemm_out(src + 1, i < HALF, stride_qkv_s, SPLIT)
        if QK_NORM:
            wa = tl.where(is_q, tl.load(qw_ptr + 2 * i, mask=is_q, other=0.0).to(tl.float32),
                          tl.load(kw_ptr + 2 * i, mask=is_k, other=0.0).to(tl.float32))
            wb = tl.where(is_q, tl.load(qw_ptr + 2 * i + 1, mask=is_q, other=0.0).to(tl.float32),
                          tl.load(kw_ptr + 2 * i + 1, mask=is_k, other=0.0).to(tl.float32))
            ss = tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)
            if MEAN_DIV:
                ms = ss / HEAD_DIM
            else:
                ms = ss * inv_d
            rs = tl.math.rsqrt(ms + eps)
            a = _round(a * rs * wa, DT)
            b = _round(b * rs * wb, DT)
        oa = _round(a * cos - b * sin, DT)
        ob = _round(b * cos + a * sin, DT)

        qdst = q_ptr + t * stride_q_t + j * stride_q_h + 2 * i
        tl.store(qdst, oa.to(q_ptr.dtype.element_ty), mask=is_q)
        tl.store(qdst + 1, ob.to(q_ptr.dtype.element_ty), mask=is_q)

        kvh = j - N_HEAD
        wmask = is_k & ((i * 0 + slot) >= 0)  # negative slot: padding row, nothing written
        kdst = kc_ptr + slot * stride_kc_s + kvh * stride_kc_h + 2 * i
        if KV_FP8:
            kqs, ksc = _e4m3_scale(tl.zeros([HALF], tl.float32)
                                   + tl.maximum(tl.max(tl.abs(oa), 0), tl.max(tl.abs(ob), 0)))
            tl.store(kdst, _e4m3(oa, kqs), mask=wmask)
            tl.store(kdst + 1, _e4m3(ob, kqs), mask=wmask)
            tl.store(ks_ptr + slot * stride_sc_s + kvh + i * 0, ksc, mask=wmask & (i == 0))
        else:
            tl.store(kdst, oa.to(kc_ptr.dtype.element_ty), mask=wmask)
            tl.store(kdst + 1, ob.to(kc_ptr.dtype.element_ty), mask=wmask)
        dmask = vload & ((d * 0 + slot) >= 0)
        if V_PAGE > 0:
            vdst = (vc_ptr + (slot // V_PAGE) * stride_vc_b + (slot % V_PAGE) * stride_vc_t + kvh * stride_vc_h
                    + d * stride_vc_d)
        else:
            vdst = vc_ptr + slot * stride_vc_s + kvh * stride_vc_h + d
        if KV_FP8:
            vqs, vsc = _e4m3_scale(tl.zeros([HEAD_DIM], tl.float32) + tl.max(tl.abs(vf), 0))
            tl.store(vdst, _e4m3(vf, vqs), mask=dmask)
            tl.store(vs_ptr + slot * stride_sc_s + kvh + d * 0, vsc, mask=dmask & (d == 0))
        else:
            if SPLIT == 1:
                v = vraw
            else:
                v = vf.to(vc_ptr.dtype.element_ty)
            tl.store(vdst, v, mask=dmask)

    def _qk_norm_rope_write_rows_kernel(
        qkv_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
        n_tokens, stride_qkv, stride_cs_p, stride_cs_i, stride_cs_c,
        stride_q_t, stride_q_h, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, stride_sc_s,
        inv_d, eps,
        N_HEAD: tl.constexpr,
        N_KV: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,
        QK_NORM: tl.constexpr,
        MEAN_DIV: tl.constexpr,
        DT: tl.constexpr,
        KV_FP8: tl.constexpr,
        BLOCK_T: tl.constexpr,
        V_PAGE: tl.constexpr = 0,
        stride_vc_b=0,
        stride_vc_t=0,
        stride_vc_d=0,
        PDL: tl.constexpr = False,
    ):
        pdl_enter(PDL)
        # _qk_norm_rope_write_kernel for BLOCK_T tokens x one head per program, one warp (prefill rows;
        # bf16 / fp16 / fp32 qkv, no split-K partials): every row's arithmetic is the per-token
        # kernel's, on [BLOCK_T, HALF] / [BLOCK_T, HEAD_DIM] tiles, so one program has BLOCK_T
        # rows' loads in flight instead of one
        j = tl.program_id(1)
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < n_tokens
        tc = tl.where(t_ok, t, 0)
        i = tl.arange(0, HALF)
        d = tl.arange(0, HEAD_DIM)
        is_q = j < N_HEAD
        pos = tl.load(pos_ptr + tc, mask=t_ok, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + tc, mask=t_ok, other=-1).to(tl.int64)
        row = qkv_ptr + tc[:, None] * stride_qkv
        # the V row up front (KV-head programs), so its round trip overlaps the q / k ones
        vraw = tl.load(row + (j + N_KV) * HEAD_DIM + d[None, :], mask=t_ok[:, None] & (j >= N_HEAD), other=0.0)
        cs = cs_ptr + pos[:, None] * stride_cs_p + i[None, :] * stride_cs_i
        cos = tl.load(cs, mask=t_ok[:, None], other=0.0).to(tl.float32)
        sin = tl.load(cs + stride_cs_c, mask=t_ok[:, None], other=0.0).to(tl.float32)
        src = row + j * HEAD_DIM + 2 * i[None, :]
        a = tl.load(src, mask=t_ok[:, None], other=0.0).to(tl.float32)
        b = tl.load(src + 1, mask=t_ok[:, None], other=0.0).to(tl.float32)
        if QK_NORM:
            if is_q:
                wa = tl.load(qw_ptr + 2 * i).to(tl.float32)
                wb = tl.load(qw_ptr + 2 * i + 1).to(tl.float32)
            else:
                wa = tl.load(kw_ptr + 2 * i).to(tl.float32)
                wb = tl.load(kw_ptr + 2 * i + 1).to(tl.float32)
            ss = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)
            if MEAN_DIV:
                ms = ss / HEAD_DIM
            else:
                ms = ss * inv_d
            rs = tl.math.rsqrt(ms + eps)[:, None]
            a = _round(a * rs * wa[None, :], DT)
            b = _round(b * rs * wb[None, :], DT)
        oa = _round(a * cos - b * sin, DT)
        ob = _round(b * cos + a * sin, DT)
        if is_q:
            qdst = q_ptr + tc[:, None] * stride_q_t + j * stride_q_h + 2 * i[None, :]
            tl.store(qdst, oa.to(q_ptr.dtype.element_ty), mask=t_ok[:, None])
            tl.store(qdst + 1, ob.to(q_ptr.dtype.element_ty), mask=t_ok[:, None])
        else:
            kvh = j - N_HEAD
            live = t_ok & (slot >= 0)  # negative slot: padding row, nothing written
            sl = tl.where(live, slot, 0)
            kdst = kc_ptr + sl[:, None] * stride_kc_s + kvh * stride_kc_h + 2 * i[None, :]
            if KV_FP8:
                kqs, ksc = _e4m3_scale(tl.maximum(tl.max(tl.abs(oa), 1), tl.max(tl.abs(ob), 1)))
                tl.store(kdst, _e4m3(oa, kqs[:, None]), mask=live[:, None])
                tl.store(kdst + 1, _e4m3(ob, kqs[:, None]), mask=live[:, None])
                tl.store(ks_ptr + sl * stride_sc_s + kvh, ksc, mask=live)
            else:
                tl.store(kdst, oa.to(kc_ptr.dtype.element_ty), mask=live[:, None])
                tl.store(kdst + 1, ob.to(kc_ptr.dtype.element_ty), mask=live[:, None])
            if V_PAGE > 0:
                vdst = (vc_ptr + ((sl // V_PAGE) * stride_vc_b + (sl % V_PAGE) * stride_vc_t)[:, None]
                        + kvh * stride_vc_h + d[None, :] * stride_vc_d)
            else:
                vdst = vc_ptr + sl[:, None] * stride_vc_s + kvh * stride_vc_h + d[None, :]
            if KV_FP8:
                vf = vraw.to(tl.float32)
                vqs, vsc = _e4m3_scale(tl.max(tl.abs(vf), 1))
                tl.store(vdst, _e4m3(vf, vqs[:, None]), mask=live[:, None])
                tl.store(vs_ptr + sl * stride_sc_s + kvh, vsc, mask=live)
            else:
                tl.store(vdst, vraw, mask=live[:, None])

    def _silu_mul_kernel(
        gu_ptr, out_ptr, stride_gu, stride_o, n_inter,
        BLOCK: tl.constexpr,
        DT: tl.constexpr,
        ACCURATE_EXP: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n_inter
        g = tl.load(gu_ptr + row * stride_gu + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + n_inter + offs, mask=m, other=0.0).to(tl.float32)
        if ACCURATE_EXP:
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        s = _round(tl.math.div_rn(g, 1.0 + e), DT)
        o = _round(s * u, DT)
        tl.store(out_ptr + row * stride_o + offs, o.to(out_ptr.dtype.element_ty), mask=m)

    def _fast_program_impl(GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                           LENGTH: tl.constexpr, LEN_PAD: tl.constexpr):
        """A fast attention program's (row b, KV head) and lanes: positions n, dims d, the
        valid-head and valid-position masks and the group's query heads."""
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        g = tl.arange(0, GROUP_PAD)
        n = tl.arange(0, LEN_PAD)
        d = tl.arange(0, HEAD_DIM)
        return b, kvh, n, d, g < GROUP, n < LENGTH, kvh * GROUP + g

    def _fast_attend_impl(q, k, v, nm, scale, DT: tl.constexpr):
        """Attention of the fast kernels: q [GROUP_PAD, D] over k / v [LEN_PAD, D] (fp32 values
        of the stored dtype), positions where ``nm``; the output rounded to DT."""
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, LEN_PAD]
        s = tl.where(nm[None, :], s, float("-inf"))
        mx = tl.max(s, axis=1)
        p = tl.exp(s - mx[:, None])
        p = tl.where(nm[None, :], p, 0.0)
        den = tl.sum(p, axis=1)
        o = tl.sum(p[:, :, None] * v[None, :, :], axis=1) / den[:, None]
        return _round(o, DT)

    def _fast_attn_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, scale,
        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh, stride_ob, stride_oh,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        LENGTH: tl.constexpr,
        LEN_PAD: tl.constexpr,
        DT: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_enter(PDL)
        b, kvh, n, d, gm, nm, heads = _fast_program(GROUP, GROUP_PAD, HEAD_DIM, LENGTH, LEN_PAD)
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gm[:, None], other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * stride_kb + n[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                    mask=nm[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + b * stride_vb + n[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                    mask=nm[:, None], other=0.0).to(tl.float32)  # before the reductions: one round trip
        o = _fast_attend(q, k, v, nm, scale, DT)
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=gm[:, None])

    def _fast_rope_attn_kernel(
        qkv_ptr, cs_ptr, k_ptr, v_ptr, o_ptr, q8_ptr, s8_ptr, scale,
        stride_qkv, stride_cs_p, stride_cs_i, stride_cs_c,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ob, stride_oh,
        stride_q8,
        N_HEAD: tl.constexpr, N_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, LENGTH: tl.constexpr, LEN_PAD: tl.constexpr, DT: tl.constexpr,
        PDL: tl.constexpr = False,
        QUANT: tl.constexpr = False,
    ):
        """One fast-transformer position in one launch: RoPE of q and k at position
        LENGTH - 1 from the wqkv row, K and V stored into the row's cache there, then
        _fast_attn_kernel's attention over positions [0, LENGTH) with the new K/V taken from
        registers. Each value is computed by the same operations in the same order as
        _qk_norm_rope_write_kernel (no qk-norm) followed by _fast_attn_kernel."""
        pdl_enter(PDL)
        b, kvh, n, d, gm, nm, heads = _fast_program(GROUP, GROUP_PAD, HEAD_DIM, LENGTH, LEN_PAD)
        old = n < LENGTH - 1  # positions already in the cache
        row = qkv_ptr + b * stride_qkv
        # every load before any arithmetic: q and k with their RoPE partners (lane d ^ 1),
        # the new V, this position's cos / sin per lane, the cached K / V
        qx = tl.load(row + heads[:, None] * HEAD_DIM + d[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
        qp = tl.load(row + heads[:, None] * HEAD_DIM + (d ^ 1)[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
        kx = tl.load(row + (N_HEAD + kvh) * HEAD_DIM + d).to(tl.float32)
        kp = tl.load(row + (N_HEAD + kvh) * HEAD_DIM + (d ^ 1)).to(tl.float32)
        vraw = tl.load(row + (N_HEAD + N_KV + kvh) * HEAD_DIM + d)
        cs = cs_ptr + (LENGTH - 1) * stride_cs_p + (d // 2) * stride_cs_i
        cos = tl.load(cs).to(tl.float32)
        sin = tl.load(cs + stride_cs_c).to(tl.float32)
        kbase = k_ptr + b * stride_kb + kvh * stride_kh
        vbase = v_ptr + b * stride_vb + kvh * stride_vh
        kc = tl.load(kbase + n[:, None] * stride_kt + d[None, :], mask=old[:, None], other=0.0).to(tl.float32)
        vc = tl.load(vbase + n[:, None] * stride_vt + d[None, :], mask=old[:, None], other=0.0).to(tl.float32)
        # interleaved RoPE: even lane a*cos - b*sin, odd lane b*cos + a*sin, (a, b) a pair
        even = (d % 2) == 0
        q = _round(tl.where(even[None, :], qx * cos[None, :] - qp * sin[None, :],
                            qx * cos[None, :] + qp * sin[None, :]), DT)
        k_new = _round(tl.where(even, kx * cos - kp * sin, kx * cos + kp * sin), DT)
        tl.store(kbase + (LENGTH - 1) * stride_kt + d, k_new.to(k_ptr.dtype.element_ty))
        tl.store(vbase + (LENGTH - 1) * stride_vt + d, vraw)
        last = (n == LENGTH - 1)[:, None]
        k = tl.where(last, k_new[None, :], kc)
        v = tl.where(last, vraw.to(tl.float32)[None, :], vc)
        o = _fast_attend(q, k, v, nm, scale, DT)
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=gm[:, None])
        if QUANT:  # HEAD_DIM == 128: each head's output row is one 1x128 group of wo's input;
            # quantized from the value just stored (rounded to DT), as quantize_act would read it
            oq, osc = _quant_tile(_round(o, DT))
            tl.store(q8_ptr + b * stride_q8 + heads[:, None] * HEAD_DIM + d[None, :], oq, mask=gm[:, None])
            tl.store(s8_ptr + b * N_HEAD + heads, osc, mask=gm)

    # Triton fixes interpreted vs compiled mode when triton.language is imported; wrap
    # the kernels (and the device helper they call by its global name) to match.
    from .paged_attention import pdl_enter  # noqa: F401 - a device helper the kernels call by name
    from .fp8 import (  # device helpers the kernels call by name
        _load_gemm_out,
        _quant_tile,
        _round_e4m3,
    )

    if triton_interpreting():
        from triton.runtime.interpreter import InterpretedFunction as _Wrap
    else:
        from triton.runtime.jit import JITFunction as _Wrap
    _round = _Wrap(_round_impl)
    _fast_attend = _Wrap(_fast_attend_impl)
    _fast_program = _Wrap(_fast_program_impl)

    @functools.cache
    def _kernel(name: str):
        return _Wrap(globals()[name])


def _rows(t: Tensor, dim: int) -> Tensor:
    """``t`` as [rows, dim] with unit stride along dim (a view when possible)."""
    t2 = t.reshape(-1, dim)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch_opts(num_warps: int, t: Tensor | None = None) -> dict:
    # fp fusion off: torch computes a * c - b * s with rounded products (no FMA).
    # ``t``: a tensor of the launch, for programmatic dependent launch (pdl_options)
    return {"num_warps": num_warps, "enable_fp_fusion": False, **(pdl_options(t) if t is not None else {})}


def _require_kernel(t: Tensor) -> bool:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    interpret = triton_interpreting()
    if not interpret and not t.is_cuda:
        raise RuntimeError(
            "the compiled Triton kernels need CUDA tensors; to run them on CPU set "
            "TRITON_INTERPRET=1 before triton is first imported"
        )
    return interpret


# --------------------------------------------------------------------------------------
# add_rmsnorm
# --------------------------------------------------------------------------------------


def _rmsnorm_launch(dim: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the add+RMSNorm kernel for rows of ``dim``: shared by every variant,
    so that the sum of squares is reduced in the same order (same layout) in all of them."""
    block = _next_pow2(dim)
    return block, 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1


def add_rmsnorm_triton(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, *,
                       out: Tensor | None = None, h_out: Tensor | None = None,
                       residual_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Kernel version of :func:`add_rmsnorm_ref`. ``out`` / ``h_out`` (optional) receive
    ``normed`` / ``h``; ``h_out`` may be ``residual`` or ``x`` itself (in place).
    ``residual_scale``: [dim] in x's dtype (needs a residual)."""
    _require_kernel(x)
    _check_dtype("x", x)
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must have x's shape and dtype")
    g = None
    if residual_scale is not None:
        if residual is None:
            raise ValueError("residual_scale needs a residual")
        if residual_scale.numel() != dim or residual_scale.dtype != x.dtype:
            raise ValueError(f"residual_scale must be [{dim}] {x.dtype}, got {tuple(residual_scale.shape)} "
                             f"{residual_scale.dtype}")
        g = residual_scale.reshape(dim)
        g = g if g.stride(0) == 1 else g.contiguous()
    if dim > 8192:
        raise ValueError(f"dim {dim} > 8192 is not supported (one program per row)")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out_dtype not in _DT_CODE:
        raise ValueError(f"unsupported output dtype {out_dtype}")
    x2 = _rows(x, dim)
    rows = x2.shape[0]
    r2 = None if residual is None else _rows(residual, dim)
    w = weight if weight.stride(0) == 1 else weight.contiguous()

    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != out_dtype:
        raise ValueError(f"out must be {tuple(x.shape)} {out_dtype}")
    o2 = out.view(-1, dim)
    if residual is None:
        h = x
        h2 = x2
    else:
        h = torch.empty_like(x) if h_out is None else h_out
        if h.shape != x.shape or h.dtype != x.dtype:
            raise ValueError("h_out must have x's shape and dtype")
        h2 = h.view(-1, dim)
    if o2.stride(-1) != 1 or h2.stride(-1) != 1:
        raise ValueError("out / h_out must be contiguous in the last dimension")
    if rows == 0:
        return out, h

    block, nw = _rmsnorm_launch(dim)
    _kernel("_add_rmsnorm_kernel")[(rows,)](
        x2, r2 if r2 is not None else x2, w, o2, h2, x2, x2, g if g is not None else w,
        x2.stride(0), r2.stride(0) if r2 is not None else 0, o2.stride(0), h2.stride(0), 0, 0, 0,
        dim, 1.0 / dim, float(eps),
        HAS_RES=residual is not None,
        HAS_SCALE=g is not None,
        MEAN_DIV=not x.is_cuda,
        BLOCK=block,
        HDT=_DT_CODE[x.dtype],
        ODT=_DT_CODE[out_dtype],
        SPLIT=1,
        STORE_OUT=True,
        QUANT=False,
        **_launch_opts(nw, x2),
    )
    return out, h


def add_rmsnorm_quant_triton(x: GemmOut, residual: Tensor | None, weight: Tensor, eps: float, *,
                             store_normed: bool = False, h_out: Tensor | None = None) -> NormQuant:
    """:func:`add_rmsnorm_triton` and :func:`shoal.kernels.fp8.quantize_act` of its ``normed``
    in one launch: ``q`` / ``s`` are bit-identical to ``quantize_act(add_rmsnorm(x, ...)[0])``
    (and ``h`` / ``normed`` to add_rmsnorm's), the same arithmetic in the same order.
    ``store_normed``: also write ``normed`` (the FP8 path does not need it).

    ``x`` may be an FP8 GEMM's :class:`~shoal.kernels.fp8.SplitKPartials` (then ``residual``
    is required): the partials are summed on load as the reduce kernel would, so the reduce
    launch is saved and nothing changes. Rows are all leading dims; dim <= 8192."""
    partial = isinstance(x, SplitKPartials)
    data = x.data if partial else x
    _require_kernel(data)
    dim = x.shape[-1]
    if partial:
        if residual is None:
            raise ValueError("add_rmsnorm_quant: split-K partials need a residual")
        if residual.dim() != 2:
            residual = residual.reshape(-1, dim)
    else:
        _check_dtype("x", x)
    xdt = x.dtype
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}], got {tuple(weight.shape)}")
    if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.dtype != xdt):
        raise ValueError("residual must have x's shape and dtype")
    if dim > 8192:
        raise ValueError(f"dim {dim} > 8192 is not supported (one program per row)")
    out_dtype = torch.promote_types(xdt, weight.dtype)
    if out_dtype not in _DT_CODE:
        raise ValueError(f"unsupported output dtype {out_dtype}")
    block, nw = _rmsnorm_launch(dim)
    if block < QUANT_GROUP:  # a row shorter than one group: the two kernels (same numerics)
        xt = splitk_reduce(x) if partial else x
        normed, h = add_rmsnorm_triton(xt, residual, weight, eps, h_out=h_out)
        q, s = quantize_act_triton(normed.reshape(-1, dim))
        return NormQuant(h, q, s, normed if store_normed else None)
    if partial:
        x2, split, stride_x, stride_xs = gemm_out_operand(x)
        shape = x.shape
    else:
        x2 = _rows(x, dim)
        split, stride_x, stride_xs, shape = 1, x2.stride(0), 0, tuple(x.shape)
    rows = int(x2.shape[-2])
    device = data.device
    r2 = None if residual is None else _rows(residual, dim)
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    if residual is None:
        h = x
        h2 = x2
    else:
        h = torch.empty(shape, dtype=xdt, device=device) if h_out is None else h_out
        if tuple(h.shape) != tuple(shape) or h.dtype != xdt:
            raise ValueError("h_out must have x's shape and dtype")
        h2 = h.view(-1, dim)
        if h2.stride(-1) != 1:
            raise ValueError("h_out must be contiguous in the last dimension")
    normed = torch.empty(shape, dtype=out_dtype, device=device) if store_normed else None
    o2 = normed.view(-1, dim) if normed is not None else h2
    kb = -(-dim // QUANT_GROUP)
    q = torch.empty(rows, dim, dtype=FP8_DTYPE, device=device)
    s = torch.empty(rows, kb, dtype=torch.float32, device=device)
    if rows == 0:
        return NormQuant(h, q, s, normed)
    _kernel("_add_rmsnorm_kernel")[(rows,)](
        x2, r2 if r2 is not None else x2, w, o2, h2, q, s, w,
        stride_x, r2.stride(0) if r2 is not None else 0, o2.stride(0), h2.stride(0), stride_xs, q.stride(0), kb,
        dim, 1.0 / dim, float(eps),
        HAS_RES=residual is not None,
        HAS_SCALE=False,
        MEAN_DIV=not data.is_cuda,
        BLOCK=block,
        HDT=_DT_CODE[xdt],
        ODT=_DT_CODE[out_dtype],
        SPLIT=split,
        STORE_OUT=store_normed,
        QUANT=True,
        **_launch_opts(nw, x2),
    )
    return NormQuant(h, q, s, normed)


def add_rmsnorm_quant(x: GemmOut, residual: Tensor | None, weight: Tensor, eps: float, *,
                      store_normed: bool = False, h_out: Tensor | None = None) -> NormQuant:
    """``h = x + residual``; ``normed = RMSNorm(h)``; ``(q, s) = quantize_act(normed)`` (1x128
    e4m3 groups), in one kernel when Triton can run (:func:`add_rmsnorm_quant_triton`), else
    :func:`add_rmsnorm_quant_ref`."""
    data = x.data if isinstance(x, SplitKPartials) else x
    if use_triton(data):
        return add_rmsnorm_quant_triton(x, residual, weight, eps, store_normed=store_normed, h_out=h_out)
    res = add_rmsnorm_quant_ref(x, residual, weight, eps, store_normed=store_normed)
    if h_out is not None and residual is not None:
        h_out.copy_(res.h)
        res = res._replace(h=h_out)
    return res


def add_rmsnorm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, *,
                out: Tensor | None = None, h_out: Tensor | None = None,
                residual_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(normed, h)`` with ``h = x + residual`` (``x`` itself when ``residual`` is None,
    not re-written) and ``normed = RMSNorm(h)`` (layers.RMSNorm numerics). Rows are all
    leading dims; dim <= 8192. ``residual_scale``: see :func:`add_rmsnorm_ref`."""
    if use_triton(x):
        return add_rmsnorm_triton(x, residual, weight, eps, out=out, h_out=h_out, residual_scale=residual_scale)
    normed, h = add_rmsnorm_ref(x, residual, weight, eps, residual_scale=residual_scale)
    if out is not None:
        out.copy_(normed)
        normed = out
    if h_out is not None and residual is not None:
        h_out.copy_(h)
        h = h_out
    return normed, h


# --------------------------------------------------------------------------------------
# qk_norm_rope_write
# --------------------------------------------------------------------------------------


QK_NORM_ROWS_ENV = "SHOAL_QKNORM_ROWS"
"""Environment variable: tokens per program of the qk-norm + RoPE + KV-write kernel on calls of
at least :data:`QK_NORM_ROWS_MIN` rows (prefill chunks), e.g. 8; 0 (the default) keeps one
token per program. Opt-in until timed on a GPU: same bits (interpreter tests; one warp a
program, so a row's norm sums in the per-token kernel's order), compiled for sm_90a with
Triton 3.6 (8 rows: 167 registers at bf16, 154 with an FP8 cache, no spills; 16 rows spill),
speed not yet measured."""
QK_NORM_ROWS_MIN = 256  # above any decode batch (max_running_requests <= 128 by default): prefill only
QK_NORM_ROWS_DEFAULT = 0


@functools.cache
def qk_norm_rows_block() -> int:
    """Tokens per program of the rows form of the qk-norm + RoPE + KV-write kernel (a power of
    two; ``SHOAL_QKNORM_ROWS``; 0, the default, turns the rows form off)."""
    from ..envutil import env_int

    n = env_int(QK_NORM_ROWS_ENV, QK_NORM_ROWS_DEFAULT)
    if n < 0 or n & (n - 1):
        raise ValueError(f"{QK_NORM_ROWS_ENV} must be 0 or a power of two, got {n}")
    return n


def qk_norm_rope_write_triton(qkv, positions, cos_sin, q_norm_w, k_norm_w, eps, k_cache, v_cache, slots,
                              n_head, n_kv_head, head_dim, *, q_out=None, k_scale=None, v_scale=None):
    """Kernel version of :func:`qk_norm_rope_write_ref` (one launch). Negative slots are
    skipped (nothing written for that token). ``q_out``: optional [N, H, D] output.
    ``qkv`` may be the wqkv FP8 GEMM's :class:`~shoal.kernels.fp8.SplitKPartials` (summed on
    load as the reduce kernel would: the same q and cache writes, one launch fewer)."""
    partial = isinstance(qkv, SplitKPartials)
    _require_kernel(qkv.data if partial else qkv)
    if not partial:
        _check_dtype("qkv", qkv)
    D = head_dim
    if D < 2 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two, got {D}")
    if qkv.shape[-1] != (n_head + 2 * n_kv_head) * D:
        raise ValueError(f"qkv last dim {qkv.shape[-1]} != (n_head + 2 * n_kv_head) * head_dim")
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError("give both q_norm_w and k_norm_w, or neither")
    if partial:
        qkv2, split, stride_row, stride_split = gemm_out_operand(qkv)
    else:
        qkv2 = qkv.reshape(-1, qkv.shape[-1])
        if qkv2.stride(-1) != 1:
            qkv2 = qkv2.contiguous()
        split, stride_row, stride_split = 1, qkv2.stride(0), 0
    dtype, device = qkv.dtype, qkv2.device
    N = qkv.shape[0] if partial else qkv2.shape[0]
    pos = positions.reshape(-1)
    sl = slots.reshape(-1)
    if pos.shape[0] != N or sl.shape[0] != N:
        raise ValueError(f"positions and slots must have {N} entries")
    if cos_sin.dim() != 3 or cos_sin.shape[1:] != (D // 2, 2):
        raise ValueError(f"cos_sin must be [L, {D // 2}, 2], got {tuple(cos_sin.shape)}")
    kc = _flat_cache(k_cache, n_kv_head, D)
    v_minor = _paged_minor(v_cache)
    if v_minor and tuple(v_cache.shape[-2:]) != (n_kv_head, D):
        raise ValueError(f"cache must be [..., H_kv={n_kv_head}, D={D}], got {tuple(v_cache.shape)}")
    vc = v_cache if v_minor else _flat_cache(v_cache, n_kv_head, D)
    kv_fp8 = k_scale is not None or v_scale is not None
    if kv_fp8:
        if kc.dtype != torch.float8_e4m3fn or vc.dtype != torch.float8_e4m3fn or k_scale is None or v_scale is None:
            raise ValueError("an FP8 KV write needs float8_e4m3fn caches and both k_scale and v_scale")
        ks, vs = k_scale.reshape(-1, n_kv_head), v_scale.reshape(-1, n_kv_head)
        if (ks.shape[0] != kc.shape[0] or vs.shape != ks.shape or (v_minor and vc.dtype != torch.float8_e4m3fn) or ks.dtype != torch.float32
                or vs.dtype != torch.float32 or ks.stride() != (n_kv_head, 1) or vs.stride() != ks.stride()):
            raise ValueError(f"k_scale / v_scale must be contiguous float32 [slots={kc.shape[0]}, {n_kv_head}]")
    elif kc.dtype != dtype or vc.dtype != dtype:
        raise ValueError(f"cache dtype {kc.dtype} / {vc.dtype} != qkv dtype {dtype}")
    if kc.stride(-1) != 1 or (vc.stride(-1) != 1 and not v_minor):
        raise ValueError("caches must be contiguous in head_dim")
    if q_out is None:
        q_out = torch.empty((N, n_head, D), dtype=dtype, device=device)
    elif q_out.shape != (N, n_head, D) or q_out.dtype != dtype or q_out.stride(-1) != 1:
        raise ValueError(f"q_out must be [{N}, {n_head}, {D}] {dtype}, contiguous in D")
    if N == 0:
        return q_out
    if q_norm_w is not None:
        for name, w in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)):
            if w.shape != (D,):
                raise ValueError(f"{name} must be [{D}], got {tuple(w.shape)}")
        qw = q_norm_w.contiguous()
        kw = k_norm_w.contiguous()
    else:
        qw = kw = qkv2
    rows = qk_norm_rows_block()
    if rows and not partial and N >= QK_NORM_ROWS_MIN:
        _kernel("_qk_norm_rope_write_rows_kernel")[(triton.cdiv(N, rows), n_head + n_kv_head)](
            qkv2, pos, cos_sin, qw, kw, sl, q_out, kc, vc, ks if kv_fp8 else kc, vs if kv_fp8 else vc,
            N, stride_row, cos_sin.stride(0), cos_sin.stride(1), cos_sin.stride(2),
            q_out.stride(0), q_out.stride(1), kc.stride(0), kc.stride(1), 0 if v_minor else vc.stride(0),
            vc.stride(2) if v_minor else vc.stride(1),
            n_kv_head if kv_fp8 else 0,
            1.0 / D, float(eps),
            N_HEAD=n_head, N_KV=n_kv_head, HEAD_DIM=D, HALF=D // 2, QK_NORM=q_norm_w is not None,
            MEAN_DIV=not qkv2.is_cuda, DT=_DT_CODE[dtype], KV_FP8=kv_fp8, BLOCK_T=rows,
            V_PAGE=v_cache.shape[1] if v_minor else 0,
            stride_vc_b=vc.stride(0) if v_minor else 0,
            stride_vc_t=vc.stride(1) if v_minor else 0,
            stride_vc_d=vc.stride(3) if v_minor else 0,
            # one warp: each row's 64 pairs then sit on the 32 lanes as in the per-token kernel
            # (lane k holds k and k + 32), so the norm's fp32 sum runs in the same order; with
            # more warps a row splits across two of them and the sum's last bit can differ
            **_launch_opts(1, qkv2),
        )
        return q_out
    _kernel("_qk_norm_rope_write_kernel")[(N, n_head + n_kv_head)](
        qkv2, pos, cos_sin, qw, kw, sl, q_out, kc, vc, ks if kv_fp8 else kc, vs if kv_fp8 else vc,
        stride_row, stride_split, cos_sin.stride(0), cos_sin.stride(1), cos_sin.stride(2),
        q_out.stride(0), q_out.stride(1), kc.stride(0), kc.stride(1), 0 if v_minor else vc.stride(0),
        vc.stride(2) if v_minor else vc.stride(1),
        n_kv_head if kv_fp8 else 0,
        1.0 / D, float(eps),
        N_HEAD=n_head,
        N_KV=n_kv_head,
        HEAD_DIM=D,
        HALF=D // 2,
        QK_NORM=q_norm_w is not None,
        MEAN_DIV=not qkv2.is_cuda,
        DT=_DT_CODE[dtype],
        SPLIT=split,
        KV_FP8=kv_fp8,
        V_PAGE=v_cache.shape[1] if v_minor else 0,
        stride_vc_b=vc.stride(0) if v_minor else 0,
        stride_vc_t=vc.stride(1) if v_minor else 0,
        stride_vc_d=vc.stride(3) if v_minor else 0,
        **_launch_opts(1 if D <= 128 else 2, qkv2),
    )
    return q_out


def qk_norm_rope_write(qkv, positions, cos_sin, q_norm_w, k_norm_w, eps, k_cache, v_cache, slots,
                       n_head, n_kv_head, head_dim, *, q_out=None, k_scale=None, v_scale=None):
    """qk-norm (optional) + RoPE of q and k from the ``wqkv`` output, K/V written to
    ``k_cache`` / ``v_cache`` (``[..., H_kv, D]``, flattened to slots) at ``slots``;
    returns q ``[N, H, D]``.

    ``qkv``: ``[N, (H + 2 H_kv) D]`` (leading dims flattened), or the wqkv FP8 GEMM's
    :class:`~shoal.kernels.fp8.SplitKPartials`; ``positions`` / ``slots``: ``[N]`` int;
    ``cos_sin``: ``[L, D/2, 2]`` (layers.rope_table). Works for the paged cache
    (``PagedKVCache.k(layer)``, slot = block * block_size + offset) and for the fast cache
    (``FastCacheBackend.k[layer]``, slot = row * C + position). An FP8 paged cache passes its
    ``k_scale`` / ``v_scale`` (``PagedKVCache.k_scale(layer)``): K and V are stored as e4m3
    with one scale per (token, KV head), byte-identical to :func:`shoal.quant.kv.quantize_kv`.
    """
    if use_triton(qkv.data if isinstance(qkv, SplitKPartials) else qkv):
        return qk_norm_rope_write_triton(qkv, positions, cos_sin, q_norm_w, k_norm_w, eps, k_cache, v_cache,
                                         slots, n_head, n_kv_head, head_dim, q_out=q_out,
                                         k_scale=k_scale, v_scale=v_scale)
    if isinstance(qkv, SplitKPartials):
        qkv = splitk_reduce_ref(qkv)
    q = qk_norm_rope_write_ref(qkv, positions, cos_sin, q_norm_w, k_norm_w, eps, k_cache, v_cache, slots,
                               n_head, n_kv_head, head_dim, k_scale, v_scale)
    if q_out is not None:
        q_out.copy_(q)
        return q_out
    return q


# --------------------------------------------------------------------------------------
# silu_mul
# --------------------------------------------------------------------------------------


def silu_mul_triton(gate_up: Tensor, *, out: Tensor | None = None, block: int = 1024) -> Tensor:
    """Kernel version of :func:`silu_mul_ref`."""
    interpret = _require_kernel(gate_up)
    _check_dtype("gate_up", gate_up)
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"gate_up last dim must be even, got {two_i}")
    inter = two_i // 2
    gu = gate_up.reshape(-1, two_i)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    rows = gu.shape[0]
    shape = (*gate_up.shape[:-1], inter)
    if out is None:
        out = torch.empty(shape, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != shape or out.dtype != gate_up.dtype:
        raise ValueError(f"out must be {shape} {gate_up.dtype}")
    o2 = out.view(-1, inter)
    if o2.stride(-1) != 1:
        raise ValueError("out must be contiguous in the last dimension")
    if rows == 0 or inter == 0:
        return out
    block = min(block, _next_pow2(inter))
    _kernel("_silu_mul_kernel")[(rows, triton.cdiv(inter, block))](
        gu, o2, gu.stride(0), o2.stride(0), inter,
        BLOCK=block,
        DT=_DT_CODE[gate_up.dtype],
        # libdevice has no interpreter implementation; the interpreter's exp is numpy's.
        ACCURATE_EXP=not interpret,
        **_launch_opts(4 if block >= 512 else 1, gu),
    )
    return out


def silu_mul(gate_up: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``silu(gate) * up`` for ``gate_up = cat(gate, up)`` along the last dim."""
    if use_triton(gate_up):
        return silu_mul_triton(gate_up, out=out)
    res = silu_mul_ref(gate_up)
    if out is not None:
        out.copy_(res)
        return out
    return res


# --------------------------------------------------------------------------------------
# fast_decode_attention
# --------------------------------------------------------------------------------------


def fast_decode_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, length: int,
                                 scale: float | None = None, *, out: Tensor | None = None) -> Tensor:
    """Kernel version of :func:`fast_decode_attention_ref`; ``length`` is a compile-time
    constant (one specialisation per position of the fast loop)."""
    _require_kernel(q)
    _check_dtype("q", q)
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("q must be [B, H, D], k_cache / v_cache [rows, C, H_kv, D]")
    B, H, D = q.shape
    rows, C, H_kv, Dk = k_cache.shape
    length = int(length)
    if Dk != D or H % H_kv or rows < B or not 1 <= length <= C:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, length {length}")
    if D & (D - 1):
        raise ValueError(f"head_dim must be a power of two, got {D}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError("q and caches must share a dtype")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches must be contiguous in head_dim")
    out = _fast_out(out, B, H, D, q)
    if B == 0:
        return out
    _kernel("_fast_attn_kernel")[(B, H_kv)](
        q, k_cache, v_cache, out, float(D ** -0.5 if scale is None else scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        **_fast_meta(H, H_kv, D, length, q.dtype), **_launch_opts(4, q),
    )
    return out


def _fast_out(out: Tensor | None, B: int, H: int, D: int, like: Tensor) -> Tensor:
    """The fast attention's output [B, H, D] in ``like``'s dtype: ``out`` checked, or a new one."""
    if out is None:
        return torch.empty((B, H, D), dtype=like.dtype, device=like.device)
    if out.shape != (B, H, D) or out.dtype != like.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{B}, {H}, {D}] {like.dtype}, contiguous in D")
    return out


def _fast_meta(H: int, H_kv: int, D: int, length: int, dtype: torch.dtype) -> dict:
    """The compile-time constants the fast attention kernels share."""
    group = H // H_kv
    return {"GROUP": group, "GROUP_PAD": _next_pow2(group), "HEAD_DIM": D, "LENGTH": length,
            "LEN_PAD": max(2, _next_pow2(length)), "DT": _DT_CODE[dtype]}


@functools.cache
def fast_rope_attention_enabled() -> bool:
    """``SHOAL_FAST_ROPE_ATTN`` (default on; ``0`` turns it off): each fast-transformer position's
    RoPE, K/V write and attention run as one kernel (:func:`fast_rope_attention_triton`) instead
    of two; the same bits. Measured on an H200 (2026-12-06, third session): the bf16 engine at
    c=64 7,863 -> 7,943-7,949 frames/s, c=1 187 -> 187-188."""
    return os.environ.get("SHOAL_FAST_ROPE_ATTN", "1").strip().lower() not in ("0", "false", "no", "off")


def fast_rope_attention_ref(qkv: Tensor, cos_sin: Tensor, k_cache: Tensor, v_cache: Tensor, length: int,
                            n_head: int, n_kv_head: int, head_dim: int, scale: float | None = None) -> Tensor:
    """RoPE of q and k at position ``length - 1`` (interleaved pairs, no qk-norm), K/V written to
    the per-row caches ``[rows >= B, C, H_kv, D]`` there, then :func:`fast_decode_attention_ref`
    over ``[0, length)``; ``qkv`` [B, (H + 2 H_kv) D]. Returns [B, H, D]."""
    B = qkv.shape[0]
    pos = torch.full((B,), length - 1, dtype=torch.long, device=qkv.device)
    q, k, v = _split_qkv(qkv, n_head, n_kv_head, head_dim)
    cs = cos_sin[pos]
    q = _apply_rope_ref(q, cs)
    k = _apply_rope_ref(k, cs)
    k_cache[:B, length - 1] = k
    v_cache[:B, length - 1] = v
    return fast_decode_attention_ref(q, k_cache, v_cache, length, scale)


def _check_quant_out(quant_out, B: int, H: int, D: int) -> tuple[Tensor, Tensor]:
    if D != 128:
        raise ValueError(f"quant_out needs head_dim 128 (one 1x128 group per head), got {D}")
    q8, s8 = quant_out
    if (q8.shape != (B, H * D) or q8.dtype != torch.float8_e4m3fn or q8.stride(-1) != 1
            or s8.shape != (B, H) or s8.dtype != torch.float32 or not s8.is_contiguous()):
        raise ValueError(f"quant_out must be (float8_e4m3fn [{B}, {H * D}], contiguous float32 [{B}, {H}])")
    return q8, s8


def fast_rope_attention_triton(qkv: Tensor, cos_sin: Tensor, k_cache: Tensor, v_cache: Tensor, length: int,
                               n_head: int, n_kv_head: int, head_dim: int, scale: float | None = None, *,
                               out: Tensor | None = None,
                               quant_out: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Kernel version of :func:`fast_rope_attention_ref`: one launch where
    :func:`qk_norm_rope_write` then :func:`fast_decode_attention` take two, with the same
    bits (the K/V written and the output). ``quant_out`` (head_dim 128): ``(q [B, H*D] e4m3,
    s [B, H] fp32)`` also receive the 1x128 quantization of the output rows, byte-equal to
    ``quantize_act`` of the returned output (the input of an FP8 ``wo``) without its launch."""
    _require_kernel(qkv)
    _check_dtype("qkv", qkv)
    D, H, H_kv = head_dim, n_head, n_kv_head
    if D < 2 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two, got {D}")
    if qkv.dim() != 2 or qkv.shape[1] != (H + 2 * H_kv) * D or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be [B, {(H + 2 * H_kv) * D}] contiguous in its last dim, got {tuple(qkv.shape)}")
    B = qkv.shape[0]
    rows, C, hk, Dk = k_cache.shape
    length = int(length)
    if v_cache.shape != k_cache.shape or hk != H_kv or Dk != D or H % H_kv or rows < B or not 1 <= length <= C:
        raise ValueError(f"bad shapes: qkv {tuple(qkv.shape)}, cache {tuple(k_cache.shape)}, length {length}")
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise ValueError("qkv and caches must share a dtype")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches must be contiguous in head_dim")
    if cos_sin.dim() != 3 or cos_sin.shape[1:] != (D // 2, 2) or cos_sin.shape[0] < length:
        raise ValueError(f"cos_sin must be [>= {length}, {D // 2}, 2], got {tuple(cos_sin.shape)}")
    out = _fast_out(out, B, H, D, qkv)
    q8, s8 = _check_quant_out(quant_out, B, H, D) if quant_out is not None else (out, out)
    if B == 0:
        return out
    _kernel("_fast_rope_attn_kernel")[(B, H_kv)](
        qkv, cos_sin, k_cache, v_cache, out, q8, s8, float(D ** -0.5 if scale is None else scale),
        qkv.stride(0), cos_sin.stride(0), cos_sin.stride(1), cos_sin.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        q8.stride(0) if quant_out is not None else 0,
        N_HEAD=H, N_KV=H_kv, **_fast_meta(H, H_kv, D, length, qkv.dtype), **_launch_opts(4, qkv),
        QUANT=quant_out is not None,
    )
    return out


def fast_rope_attention(qkv: Tensor, cos_sin: Tensor, k_cache: Tensor, v_cache: Tensor, length: int,
                        n_head: int, n_kv_head: int, head_dim: int, scale: float | None = None, *,
                        quant_out: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """RoPE + K/V write + attention of one fast position (see :func:`fast_rope_attention_ref`):
    the kernel where Triton runs, else the reference. ``quant_out``: as in
    :func:`fast_rope_attention_triton` (the reference path quantizes with ``quantize_act_ref``)."""
    if use_triton(qkv):
        return fast_rope_attention_triton(qkv, cos_sin, k_cache, v_cache, length, n_head, n_kv_head, head_dim,
                                          scale, quant_out=quant_out)
    out = fast_rope_attention_ref(qkv, cos_sin, k_cache, v_cache, length, n_head, n_kv_head, head_dim, scale)
    if quant_out is not None:
        from .fp8 import quantize_act_ref

        q8, s8 = _check_quant_out(quant_out, out.shape[0], n_head, head_dim)
        rq, rs = quantize_act_ref(out.reshape(out.shape[0], -1))
        q8.copy_(rq)
        s8.copy_(rs)
    return out


def fast_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, length: int,
                          scale: float | None = None, *, out: Tensor | None = None) -> Tensor:
    """Attention of q ``[B, H, D]`` over positions ``[0, length)`` of the per-row caches
    ``[rows >= B, C, H_kv, D]`` (row b for query b; GQA); returns ``[B, H, D]``."""
    if use_triton(q):
        return fast_decode_attention_triton(q, k_cache, v_cache, length, scale, out=out)
    res = fast_decode_attention_ref(q, k_cache, v_cache, length, scale)
    if out is not None:
        out.copy_(res)
        return out
    return res
