"""Paged decode attention (one query token per sequence, GQA) for the slow transformer.

Layout
------
* ``q``: ``[B, H, D]`` (RoPE already applied), bf16 / fp16 / fp32.
* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, H_kv, D]``, same dtype as ``q``;
  the last dimension must be contiguous. Or an FP8 KV cache (:mod:`shoal.quant.kv`): e4m3
  caches with ``k_scale`` / ``v_scale`` ``[num_blocks, block_size, H_kv]`` fp32 (one dequant
  scale per token and KV head); the kernel widens the e4m3 tiles exactly to ``q``'s dtype,
  scales the scores by the key scales and the probabilities by the value scales (the default
  for FP8 caches is the e4m3-operand kernel of :mod:`shoal.kernels.paged_attention_fp8`).
* ``block_tables``: ``[B, max_blocks]`` int32; token ``t`` of sequence ``b`` lives in
  page ``block_tables[b, t // block_size]`` at slot ``t % block_size``. Entries past a
  sequence's last page are never read (they may hold 0, -1 or garbage).
* ``context_lens``: ``[B]`` int32, number of valid keys per sequence (>= 1); the current
  token's K/V is already in the cache.
* Query head ``h`` attends with KV head ``h // (H // H_kv)``. Softmax is computed in fp32;
  the output has ``q``'s dtype.

Two implementations share this contract:

* :func:`paged_decode_attention_ref` -- plain PyTorch (gather + masked fp32 softmax). It
  runs on any device, does no host syncs (so it is CUDA-graph capturable too) and is the
  ground truth for tests.
* :func:`paged_decode_attention` -- a Triton "flash-decoding" kernel. One program per
  (KV head, sequence, split) loads each K/V tile once for all ``H // H_kv`` query heads of
  its group (the group is padded to 16 rows so the two products run on tensor cores),
  runs an online softmax over a contiguous range of ``BLOCK_N``-token tiles and, when the
  context is split over several programs, writes a partial (normalised output,
  log-sum-exp) that a second small kernel merges. The grid depends only on shapes and the
  per-sequence loop bounds are read from ``context_lens`` on the device, so the call is
  CUDA-graph capturable. On CPU tensors it falls back to the reference unless Triton
  was imported with ``TRITON_INTERPRET=1`` (Triton fixes its interpreter mode at import),
  in which case the kernel runs in Triton's interpreter.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Optional

import torch

from ..envutil import env_int

try:  # Triton is optional: CPU-only installs use the reference path.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

try:  # programmatic dependent launch intrinsics (griddepcontrol, sm_90+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except Exception:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None
    HAS_PDL = False

__all__ = [
    "HAS_TRITON",
    "FP8_KV_CONFIG",
    "attention_tma",
    "kv_tma_descriptors",
    "check_kv_scales",
    "fp8_kv_config",
    "choose_num_splits",
    "gather_kv",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_attention_triton",
    "triton_interpreting",
]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
MAX_SPLITS_ENV = "SHOAL_ATTN_MAX_SPLITS"  # caps choose_num_splits (a tuning override; default 64)
_PROGRAMS_PER_SM = 3


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------


def check_kv_scales(q, k_cache, v_cache, k_scale, v_scale) -> bool:
    """Validate the cache dtypes (and an FP8 cache's scales); True for an FP8 cache."""
    if k_cache.dtype == torch.float8_e4m3fn and v_cache.dtype == torch.float8_e4m3fn:
        want = tuple(k_cache.shape[:3])
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None:
                raise ValueError(f"an FP8 KV cache needs {name} [num_blocks, block_size, H_kv]")
            if tuple(sc.shape) != want or sc.dtype != torch.float32:
                raise ValueError(f"{name} must be {list(want)} float32, got {tuple(sc.shape)} {sc.dtype}")
            if sc.stride() != k_scale.stride():
                raise ValueError("k_scale and v_scale must have the same strides")
        return True
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if k_scale is not None or v_scale is not None:
        raise ValueError("k_scale / v_scale are for an FP8 (float8_e4m3fn) KV cache")
    return False


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scale=None, v_scale=None):
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache/v_cache must both be [num_blocks, block_size, H_kv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    B, H, D = q.shape
    _, _, H_kv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"head_dim mismatch: q has {D}, cache has {Dk}")
    if H_kv < 1 or H % H_kv != 0:
        raise ValueError(f"num query heads {H} is not a multiple of num KV heads {H_kv}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be [B={B}, max_blocks], got {tuple(block_tables.shape)}")
    if context_lens.shape != (B,):
        raise ValueError(f"context_lens must be [B={B}], got {tuple(context_lens.shape)}")
    check_kv_scales(q, k_cache, v_cache, k_scale, v_scale)
    return B, H, D, H_kv


def gather_kv(cache, scale, pages):
    """fp32 K or V of the given pages (``cache[pages]``), dequantized for an FP8 cache."""
    if scale is None:
        return cache[pages].float()
    from ..quant.kv import dequantize_kv

    return dequantize_kv(cache[pages], scale[pages])


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, *,
                               k_scale=None, v_scale=None):
    """Reference paged decode attention: gather pages, masked fp32 softmax.

    Gathers every page listed in ``block_tables`` (out-of-range entries are clamped, then
    masked), so memory is ``O(B * max_blocks * block_size * H_kv * D)``. No host syncs.
    """
    B, H, D, H_kv = _check_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    group = H // H_kv
    max_blocks = block_tables.shape[1]
    L = max_blocks * block_size

    bt = block_tables.to(device=q.device, dtype=torch.long).clamp(0, num_blocks - 1)
    # [B, max_blocks, block_size, H_kv, D] -> [B, L, H_kv, D]
    k = gather_kv(k_cache, k_scale, bt).reshape(B, L, H_kv, D)
    v = gather_kv(v_cache, v_scale, bt).reshape(B, L, H_kv, D)
    qf = q.float().reshape(B, H_kv, group, D)

    scores = torch.einsum("bkgd,blkd->bkgl", qf, k) * float(scale)  # [B, H_kv, G, L]
    pos = torch.arange(L, device=q.device)
    valid = pos[None, :] < context_lens.to(device=q.device, dtype=torch.long)[:, None]  # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # context_len == 0 (outside the contract) -> 0
    # Slots past the context may hold anything (torch.empty caches: NaN/inf bit patterns);
    # zero them so 0 * NaN cannot leak into the output.
    v = v.masked_fill(~valid[:, :, None, None], 0.0)
    out = torch.einsum("bkgl,blkd->bkgd", probs, v)
    return out.reshape(B, H, D).to(q.dtype)


# --------------------------------------------------------------------------------------
# Triton kernels (plain functions; wrapped lazily as compiled or interpreted kernels)
# --------------------------------------------------------------------------------------

if HAS_TRITON:

    def _split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        bt_ptr,
        lens_ptr,
        o_ptr,
        po_ptr,
        plse_ptr,
        qk_scale,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_sb,
        stride_st,
        stride_btb,
        stride_ob,
        stride_oh,
        stride_pb,
        stride_ph,
        stride_ps,
        stride_lb,
        stride_lh,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        KV_FP8: tl.constexpr,
        CVT_F16: tl.constexpr,
        PDL: tl.constexpr = False,
        cnt_ptr=None,
        SPLITS_PAD: tl.constexpr = 2,
        FUSED_REDUCE: tl.constexpr = False,
        TMA: tl.constexpr = False,
    ):
        # TMA (bf16 / fp16 / fp32 cache, ``BLOCK_N == PAGE_SIZE``): ``k_ptr`` / ``v_ptr`` are
        # tensor descriptors of the layer's cache viewed 2-D, ``[pages * PAGE_SIZE, H_kv * D]``
        # in ``[PAGE_SIZE, D]`` boxes (:func:`kv_tma_descriptors`): a tile is one page, two bulk
        # copies instead of a pointer gather. The slots of the last page past the context may
        # hold anything (a NaN would survive a zero probability), so the value rows there are
        # zeroed as the gather's masked load zeroes them: the same operands, the same bits.
        pdl_enter(PDL)
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        split = tl.program_id(2)

        ctx = tl.load(lens_ptr + b)
        n_tiles = tl.cdiv(ctx, BLOCK_N)
        tiles_per_split = tl.cdiv(n_tiles, NUM_SPLITS)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, n_tiles)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        heads = kvh * GROUP + offs_g

        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None],
            other=0.0,
        )

        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)

        bt_row = bt_ptr + b * stride_btb
        if not TMA:
            k_head = k_ptr + kvh * stride_kh
            v_head = v_ptr + kvh * stride_vh
        ks_head = ks_ptr + kvh
        vs_head = vs_ptr + kvh
        if KV_FP8:
            # FP8 cache: e4m3 tiles widened to the dot dtype (exact), key scales on the scores,
            # value scales on the probabilities (normalised by the tile's largest value scale,
            # applied to the product: p * scale stays in fp16 range). The widening between load
            # and dot keeps Triton from pipelining these loads (~2 TB/s on an H200; register
            # double-buffering of the next tile measured slower, docs/benchmarks.md).
            if CVT_F16:
                qd = q.to(tl.float16)  # exact for bf16 values in fp16's range (qk-normed)
            else:
                qd = q
            for tile in range(tile_lo, tile_hi):
                tok = tile * BLOCK_N + offs_n
                tok_mask = tok < ctx
                page = tl.load(bt_row + tok // PAGE_SIZE, mask=tok_mask, other=0).to(tl.int64)
                slot = tok % PAGE_SIZE
                s_off = page * stride_sb + slot * stride_st
                k8 = tl.load(k_head + page[:, None] * stride_kb + slot[:, None] * stride_kt + offs_d[None, :],
                             mask=tok_mask[:, None], other=0.0)
                v8 = tl.load(v_head + page[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :],
                             mask=tok_mask[:, None], other=0.0)
                ksc = tl.load(ks_head + s_off, mask=tok_mask, other=0.0)
                vsc = tl.load(vs_head + s_off, mask=tok_mask, other=0.0)
                m_i, l_i, acc = _attend_tile(qd, k8, v8, ksc, vsc, tok_mask[None, :], m_i, l_i, acc, qk_scale,
                                             True, UPCAST_DOT, DOT_PRECISION)
        else:
            for tile in range(tile_lo, tile_hi):
                tok = tile * BLOCK_N + offs_n
                tok_mask = tok < ctx
                if TMA:
                    row = tl.load(bt_row + tile) * PAGE_SIZE
                    k = k_ptr.load([row, kvh * HEAD_DIM])  # [BLOCK_N, D]
                    v = tl.where(tok_mask[:, None], v_ptr.load([row, kvh * HEAD_DIM]), 0.0)
                else:
                    page = tl.load(bt_row + tok // PAGE_SIZE, mask=tok_mask, other=0).to(tl.int64)
                    slot = tok % PAGE_SIZE
                    k = tl.load(k_head + page[:, None] * stride_kb + slot[:, None] * stride_kt + offs_d[None, :],
                                mask=tok_mask[:, None], other=0.0)
                    v = tl.load(v_head + page[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :],
                                mask=tok_mask[:, None], other=0.0)
                m_i, l_i, acc = _attend_tile(q, k, v, k, v, tok_mask[None, :], m_i, l_i, acc, qk_scale,
                                             False, UPCAST_DOT, DOT_PRECISION)

        has = l_i > 0.0
        l_safe = tl.where(has, l_i, 1.0)
        out = acc / l_safe[:, None]
        if NUM_SPLITS == 1:
            tl.store(
                o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                out.to(o_ptr.dtype.element_ty),
                mask=g_mask[:, None],
            )
        else:
            # log2-sum-exp2 of this split's scores (scores are already in log2 units).
            lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
            p_off = b * stride_pb + heads * stride_ph + split * stride_ps
            tl.store(po_ptr + p_off[:, None] + offs_d[None, :], out, mask=g_mask[:, None])
            tl.store(plse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)
            if FUSED_REDUCE:
                # the last split of this (sequence, KV head) to arrive merges the splits of its
                # query heads: the reduce kernel's arithmetic without its launch
                tl.debug_barrier()  # every thread's partials stored before the (release) arrival
                cnt = cnt_ptr + b * tl.num_programs(0) + kvh
                prev = tl.atomic_add(cnt, 1, sem="acq_rel")
                if prev == NUM_SPLITS - 1:
                    for gi in tl.static_range(GROUP):
                        _merge_splits(po_ptr, plse_ptr, o_ptr, kvh * GROUP + gi, b, stride_pb, stride_ph, stride_ps,
                                      stride_lb, stride_lh, stride_ob, stride_oh, NUM_SPLITS, SPLITS_PAD, HEAD_DIM,
                                      True)
                    tl.atomic_xchg(cnt, 0)

    def _reduce_kernel(
        po_ptr,
        plse_ptr,
        o_ptr,
        stride_pb,
        stride_ph,
        stride_ps,
        stride_lb,
        stride_lh,
        stride_ob,
        stride_oh,
        NUM_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_enter(PDL)
        _merge_splits(po_ptr, plse_ptr, o_ptr, tl.program_id(0), tl.program_id(1), stride_pb, stride_ph, stride_ps,
                      stride_lb, stride_lh, stride_ob, stride_oh, NUM_SPLITS, SPLITS_PAD, HEAD_DIM, False)


FUSED_REDUCE_ENV = "SHOAL_ATTN_FUSED_REDUCE"


@functools.cache
def attention_fused_reduce() -> bool:
    """``SHOAL_ATTN_FUSED_REDUCE=1``: the decode attention's splits merged by their last
    program instead of the reduce kernel (see :func:`paged_decode_attention_triton`)."""
    return os.environ.get(FUSED_REDUCE_ENV, "0") in ("1", "true", "yes", "on")


PDL_ENV = "SHOAL_PDL"
"""Environment variable: ``0`` launches the decode step's Triton kernels normally instead of with
programmatic dependent launch (the default where supported, see :func:`pdl_enabled`)."""


@functools.cache
def pdl_enabled() -> bool:
    """Programmatic dependent launch (PDL) for the decode step's Triton kernels: each is
    launched with ``launch_pdl`` and starts with ``griddepcontrol.wait`` (it reads nothing and
    writes nothing before the previous kernel in the stream has completed and its writes are
    visible) followed by ``griddepcontrol.launch_dependents`` (the next kernel may be scheduled
    onto SMs as this one's programs start). So a kernel's launch, scheduling and prologue overlap
    its predecessor's tail instead of following it; the order of memory effects is unchanged.
    CUDA graphs keep the programmatic edges. Needs compiled Triton with the intrinsics and a
    CUDA device of compute capability >= 9.0; ``SHOAL_PDL=0`` turns it off. Measured on the H200
    (2026-12-02): the bf16 engine at one stream 163 -> 177 frames/s, FP8 208 -> 230, the codes
    unchanged (tests/test_pdl_gpu.py)."""
    if not (HAS_TRITON and HAS_PDL) or triton_interpreting():
        return False
    if os.environ.get(PDL_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return (torch.version.hip is None and torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= (9, 0))


PDL_AFTER_FOREIGN_ENV = "SHOAL_PDL_AFTER_CUBLAS"
"""Environment variable: ``0`` launches the first of our kernels after a cuBLAS GEMM (see
:func:`note_foreign_kernel`) normally instead of with PDL."""

PDL_PREFILL_ENV = "SHOAL_PDL_PREFILL"
"""Environment variable: ``1`` launches the prefill forward's kernels with PDL too (off by
default, see :func:`pdl_in_prefill`)."""

_pdl_local = threading.local()


@functools.cache
def pdl_after_foreign() -> bool:
    """Whether a kernel that follows a kernel of another library (cuBLAS: it takes part in no
    programmatic dependency of ours) is still launched with PDL, ``SHOAL_PDL_AFTER_CUBLAS``
    (default on)."""
    return os.environ.get(PDL_AFTER_FOREIGN_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def pdl_in_prefill() -> bool:
    """Whether the prefill forward's kernels are launched with PDL, ``SHOAL_PDL_PREFILL``
    (default off). The prefill's kernels run over many rows in several waves, between cuBLAS
    GEMMs; measured on an H100 (2026-12-06), a graph-replayed 1,024-token prefill step took
    15.69 ms with PDL and 15.17 ms without."""
    return os.environ.get(PDL_PREFILL_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def note_foreign_kernel(t: "torch.Tensor") -> None:
    """Record that a kernel without PDL (a cuBLAS GEMM) was just enqueued for ``t``: with
    ``SHOAL_PDL_AFTER_CUBLAS=0`` the next :func:`pdl_options` of this thread is a normal
    launch (the kernel's own ``griddepcontrol`` instructions are then no-ops)."""
    if not pdl_after_foreign() and t.is_cuda:
        _pdl_local.after_foreign = True


class pdl_suppressed:
    """Context manager: kernels launched inside it on this thread are launched normally (the
    same compiled kernels; their ``griddepcontrol`` instructions are then no-ops). ``active``
    False makes it a no-op."""

    def __init__(self, active: bool = True) -> None:
        self.active = active

    def __enter__(self):
        self._prev = getattr(_pdl_local, "suppressed", False)
        if self.active:
            _pdl_local.suppressed = True
        return self

    def __exit__(self, *exc) -> None:
        _pdl_local.suppressed = self._prev


def pdl_options(t: "torch.Tensor") -> dict:
    """Launch keywords of a PDL launch of a kernel with a ``PDL`` constexpr, for tensors on
    ``t``'s device: ``{"PDL": True, "launch_pdl": True}`` when :func:`pdl_enabled`, else {}.
    Inside :class:`pdl_suppressed`, or once after :func:`note_foreign_kernel`, the launch is a
    normal one (``{"PDL": True}``: the same compiled kernel)."""
    if not (t.is_cuda and pdl_enabled()):
        return {}
    if getattr(_pdl_local, "after_foreign", False):
        _pdl_local.after_foreign = False
        return {"PDL": True}
    if getattr(_pdl_local, "suppressed", False):
        return {"PDL": True}
    return {"PDL": True, "launch_pdl": True}


def triton_interpreting() -> bool:
    """True when Triton was imported in interpreter mode (``TRITON_INTERPRET=1``).

    Triton fixes the mode of its own ``@jit`` library functions (``tl.sum``, ``tl.max``,
    ...) when ``triton.language`` is first imported, so that moment -- not the current
    value of the variable -- decides whether kernels can run in the interpreter.
    """
    return HAS_TRITON and type(tl.sum).__name__ == "InterpretedFunction"


if HAS_TRITON:

    def _mma_impl(a, b, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """a @ b with fp32 accumulation. Triton's interpreter multiplies bf16 dot operands as
        raw uint16 bit patterns (seen with triton 3.9), so interpreted runs (UPCAST_DOT) do the
        products in fp32 on the operands as stored, like the compiled kernel."""
        if UPCAST_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b, input_precision=DOT_PRECISION)

    def _attend_tile_impl(q, k, v, k_scale, v_scale, visible, m_i, l_i, acc, qk_scale,
                          KV_FP8: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One key tile of flash attention (online softmax in log2 units); returns (m, l, acc).

        ``q`` [R, D] (the dot dtype), ``k`` / ``v`` [N, D] tiles as loaded, ``visible`` [R, N]
        (or broadcastable). KV_FP8: ``k`` / ``v`` are e4m3, widened exactly to q's dtype; the
        key scales ``k_scale`` [N] multiply the scores, the value scales ``v_scale`` [N] the
        probabilities, normalised by the tile's largest value scale (applied to the product) so
        that ``p * scale`` stays in fp16's range."""
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = _mma(q, tl.trans(k), UPCAST_DOT, DOT_PRECISION)
        if KV_FP8:
            s = s * k_scale[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:
            vs_max = tl.maximum(tl.max(v_scale, 0), 1e-30)
            pv = _mma((p * (v_scale / vs_max)[None, :]).to(v.dtype), v, UPCAST_DOT, DOT_PRECISION) * vs_max
        else:
            pv = _mma(p.to(v.dtype), v, UPCAST_DOT, DOT_PRECISION)
        return m_new, l_i, acc * alpha[:, None] + pv

    # device helpers the kernels call by name, wrapped in Triton's mode (fixed at its import)
    if triton_interpreting():
        from triton.runtime.interpreter import InterpretedFunction as _Wrap
    else:
        from triton.runtime.jit import JITFunction as _Wrap
    _mma = _Wrap(_mma_impl)
    _attend_tile = _Wrap(_attend_tile_impl)

    def _merge_splits_impl(po_ptr, plse_ptr, o_ptr, h, b, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                           stride_ob, stride_oh, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                           HEAD_DIM: tl.constexpr, CG: tl.constexpr):
        """Query head ``h`` of sequence ``b``: the splits' outputs weighted by their
        log2-sum-exp2 -> ``o``. CG: read the partials at L2 (written by other programs of the
        same kernel)."""
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        s_mask = offs_s < NUM_SPLITS
        lse_ptrs = plse_ptr + b * stride_lb + h * stride_lh + offs_s
        po_ptrs = po_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
        if CG:
            lse = tl.load(lse_ptrs, mask=s_mask, other=float("-inf"), cache_modifier=".cg")
            po = tl.load(po_ptrs, mask=s_mask[:, None], other=0.0, cache_modifier=".cg")
        else:
            lse = tl.load(lse_ptrs, mask=s_mask, other=float("-inf"))
            po = tl.load(po_ptrs, mask=s_mask[:, None], other=0.0)
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)  # empty splits: exp2(-inf) = 0
        num = tl.sum(w[:, None] * po, 0)
        den = tl.sum(w, 0)
        den = tl.where(den > 0.0, den, 1.0)
        tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, (num / den).to(o_ptr.dtype.element_ty))

    _merge_splits = _Wrap(_merge_splits_impl)

    def _pdl_enter_impl(PDL: tl.constexpr):
        """First statement of a PDL-capable kernel (see :func:`pdl_enabled`)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    pdl_enter = _Wrap(_pdl_enter_impl)


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """(split_kernel, reduce_kernel), wrapped for the interpreter or for compilation."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_split_kernel), InterpretedFunction(_reduce_kernel)
    from triton.runtime.jit import JITFunction

    return JITFunction(_split_kernel), JITFunction(_reduce_kernel)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _default_block_n(block_size: int, head_dim: int) -> int:
    return 64


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int, num_sms: int = 132) -> int:
    """Number of context splits per (sequence, KV head); a function of shapes only.

    With at least ``3 * num_sms`` (sequence, KV head) programs the GPU is full and the
    context is not split. Otherwise split it so that there are about three programs per
    SM, keeping at least two ``block_n``-token tiles per split of the *maximum* context
    (``max_blocks * block_size``: the actual lengths are only known on the device; splits
    past a short sequence's end exit at once). Measured on an H200 (132 SMs, S2-Pro
    shapes): B=32 x 8 KV heads runs ~10% faster with 2 splits than 1, B=64 ~7% slower.
    ``SHOAL_ATTN_MAX_SPLITS`` (a tuning override; 0 or unset: 64) caps the count; on an H100
    (2026-12-06) caps of 2-16 at one sequence were no faster than the heuristic's 50.
    """
    progs = max(1, batch * num_kv_heads)
    target = _PROGRAMS_PER_SM * max(1, num_sms)
    if progs >= target:
        return 1
    max_tiles = max(1, -(-max_context // block_n))
    want = -(-target // progs)
    return max(1, min(want, max_tiles // 2, env_int(MAX_SPLITS_ENV, _MAX_SPLITS) or _MAX_SPLITS))


# Launch options of the kernel on an FP8 cache (keys of paged_decode_attention_triton plus
# ``cvt``: "mma8" runs the e4m3-operand kernel of shoal.kernels.paged_attention_fp8 (the engine
# then stores the cache's values token-minor), "f16" widens e4m3 to fp16 for the products (q is
# widened from bf16 exactly), "q" to the query's dtype; ``split_mult`` multiplies the heuristic
# split count). The best of ``shoal.bench.kernels_attention --fp8-sweep`` on an H200
# (2026-12-02, B 1-128 x 512-4k: "mma8" 1.1-1.3x faster than the widening kernel's best in
# every cell); SHOAL_ATTN_FP8_CONFIG="key=value,..." overrides them ("cvt=f16,block_n=128":
# the widening kernel's own best, and the standard value layout). ``tma``: with "mma8" on pages of
# 32-128 tokens, one page per tile read as two tensor-descriptor boxes (``block_n`` becomes the
# page size; H200, 64-token pages: 0.72-0.87x the pointer gather's time, docs/benchmarks.md).
# ``f16ops``: the "mma8" kernel's products take fp16 operands (the e4m3 tiles widened, the query
# and the weighted probabilities rounded once to fp16) instead of two e4m3 terms each;
# ``joint_max``: the tile's score and value-scale maxima in one reduction; ``lazy_l``: the softmax
# denominators kept per token row and summed once after the loop (each 0 off, 1 on, 2 on where
# the context is split). Measured on an H100 (2026-12-07, fourteenth session, docs/benchmarks.md):
# fp16 operands 1.02x at 64-128 x 700 tokens, 1.21x at 16 x 700, 1.06-1.10x at one sequence;
# with the other two as well 1.12-1.25x at one sequence and 16 x 700, but 0.99x at 64 x 700 and
# 1,024, where the context is not split; smaller error than the e4m3 terms.
FP8_KV_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2, "cvt": "mma8", "split_mult": 1, "tma": 1,
                 "f16ops": 1, "lazy_l": 2, "joint_max": 2}


def _auto(value: int, num_splits: int) -> bool:
    """An FP8-cache option of 0 (off), 1 (on) or 2 (on where the context is split, i.e. the
    (sequence, KV head) programs alone would not fill the GPU)."""
    return bool(value == 1 or (value == 2 and num_splits > 1))


def fp8_kv_config() -> dict:
    """``FP8_KV_CONFIG`` with the ``SHOAL_ATTN_FP8_CONFIG`` overrides (parsed once per value)."""
    import os

    return dict(_fp8_kv_config(os.environ.get("SHOAL_ATTN_FP8_CONFIG", "")))


@functools.lru_cache(maxsize=8)
def _fp8_kv_config(env: str) -> tuple:
    cfg = dict(FP8_KV_CONFIG)
    for item in filter(None, env.split(",")):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in cfg:
            raise ValueError(f"SHOAL_ATTN_FP8_CONFIG: unknown key {key!r} (keys: {', '.join(cfg)})")
        cfg[key] = value.strip() if key == "cvt" else int(value)
        if cfg[key] not in _FP8_CHOICES.get(key, (cfg[key],)):
            raise ValueError(f"SHOAL_ATTN_FP8_CONFIG: {key} must be one of {_FP8_CHOICES[key]}, got {value!r}")
    return tuple(cfg.items())


_FP8_CHOICES = {"f16ops": (0, 1), "joint_max": (0, 1, 2), "lazy_l": (0, 1, 2)}  # 2: where split


TMA_ENV = "SHOAL_ATTN_TMA"
"""Environment variable: ``1`` reads a bf16 / fp16 / fp32 KV cache's tiles as tensor-descriptor
boxes instead of by pointer gather (see :func:`attention_tma`)."""

KV_TMA_PAGE_SIZES = (32, 64, 128)  # pages a tile of the standard kernel may read as one box
_KV_DESCRIPTORS: dict = {}


@functools.cache
def attention_tma() -> bool:
    """Whether the decode attention on a bf16 / fp16 / fp32 cache reads a page per tile through
    tensor descriptors where it can (:func:`kv_tma_descriptors`; ``SHOAL_ATTN_TMA=1``, default
    off). Same operands as the pointer gather with ``block_n`` equal to the page size, so the
    same bits. Measured on an H200 (2026-12-06, third session, 64-token pages): level at 1-16
    sequences, 1.06-1.28x *slower* at 64-128 (64 x 700 tokens: 60.8 against 49.1 us): the
    gather already streams at 3.7-4.4 TB/s there, docs/benchmarks.md."""
    return os.environ.get(TMA_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def kv_tma_descriptors(k_cache, v_cache):
    """``(k_desc, v_desc)``: tensor descriptors of one layer's standard-layout cache (``[num_blocks,
    block_size, H_kv, D]``, contiguous) viewed ``[num_blocks * block_size, H_kv * D]`` in ``[block_size,
    D]`` boxes, or None where they do not apply: a page size outside :data:`KV_TMA_PAGE_SIZES`,
    another layout, a base not 16-byte aligned, or a compiled launch on a GPU without TMA
    (compute capability < 9.0). Cached per (addresses, shape, dtype): a descriptor holds only
    those."""
    nb, bs, hkv, d = k_cache.shape
    std = (bs * hkv * d, hkv * d, d, 1)
    if (bs not in KV_TMA_PAGE_SIZES or k_cache.stride() != std or v_cache.stride() != std
            or k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16 or (hkv * d * k_cache.element_size()) % 16):
        return None
    if k_cache.is_cuda and not triton_interpreting() and torch.cuda.get_device_capability(k_cache.device) < (9, 0):
        return None
    key = (k_cache.data_ptr(), v_cache.data_ptr(), tuple(k_cache.shape), k_cache.dtype, str(k_cache.device))
    hit = _KV_DESCRIPTORS.get(key)
    if hit is None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if len(_KV_DESCRIPTORS) > 4096:
            _KV_DESCRIPTORS.clear()
        hit = _KV_DESCRIPTORS[key] = tuple(TensorDescriptor.from_tensor(c.view(nb * bs, hkv * d), [bs, d])
                                           for c in (k_cache, v_cache))
    return hit


def paged_decode_attention_triton(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale,
    *,
    out=None,
    k_scale=None,
    v_scale=None,
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    cvt: Optional[str] = None,
    fused_reduce: Optional[bool] = None,
    tma: Optional[bool] = None,
):
    """Run the Triton kernels: compiled (CUDA tensors), or interpreted (any device) when
    Triton was imported with ``TRITON_INTERPRET=1``.

    ``fused_reduce`` (default: on with ``SHOAL_ATTN_FUSED_REDUCE=1``, else off, as it is slower on an H200, docs/benchmarks.md): with
    several splits, the last split of each (sequence, KV head) merges them (per-pair arrival
    counters) instead of a second kernel -- the same arithmetic, so the same bits when the split
    kernel runs the reduce kernel's 4 warps (the default; other warp counts may sum the splits
    in another order). The e4m3-operand kernel (FP8 cache, ``cvt`` "mma8") always uses the
    reduce kernel: ``fused_reduce`` does not apply to it. ``tma`` (default: the FP8 config's
    ``tma``): that kernel reads a token-minor cache with pages of 32-128 tokens a page per tile
    through tensor descriptors (when ``block_n`` is unset or the page size). On a bf16 / fp16 /
    fp32 cache, ``tma`` (default :func:`attention_tma`) reads a page per tile the same way where
    :func:`kv_tma_descriptors` applies (pages of 32-128 tokens, the standard layout, sm_90+): the
    same operands as the gather with ``block_n`` set to the page size, so the same bits.

    ``num_splits`` / ``block_n`` (power of two >= 16) override the heuristics;
    ``num_warps`` / ``num_stages`` are passed to the split kernel (default 4 / 2). ``k_scale`` /
    ``v_scale``: the scales of an FP8 cache (see the module docstring); its launch options
    default to :func:`fp8_kv_config` (``cvt``: see ``FP8_KV_CONFIG``; "mma8", the default, runs
    the e4m3-operand kernel of :mod:`shoal.kernels.paged_attention_fp8`, which also reads a
    token-minor ``v_cache``; groups past 16 query heads per KV head and fp32 queries fall back
    to the widening kernel).
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    B, H, D, H_kv = _check_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    kv_fp8 = k_scale is not None
    if D not in (32, 64, 128):
        raise ValueError(f"head_dim {D} not supported by the Triton kernel (32, 64 or 128)")
    mma8 = kv_fp8 and (cvt if cvt is not None else fp8_kv_config()["cvt"]) == "mma8"
    if mma8:
        from .paged_attention_fp8 import MMA8_GROUP_MAX, is_token_minor

        if H // H_kv > MMA8_GROUP_MAX or q.dtype == torch.float32:
            # the e4m3-operand kernel holds up to 16 query heads per KV head, and its split query
            # keeps bf16's precision, not fp32's: the widening kernel serves those calls
            mma8, cvt = False, ("q" if q.dtype == torch.float32 else "f16")
    if kv_fp8 and not mma8 and (k_scale.stride(-1) != 1 or v_scale.stride(-1) != 1):
        # the widening kernel reads the scales with unit stride (decided after the fallback, so
        # a call meant for the e4m3-operand kernel that falls back is checked too)
        raise ValueError("k_scale/v_scale must be contiguous in the head dimension")
    v_minor = mma8 and is_token_minor(v_cache)
    if k_cache.stride(-1) != 1 or (v_cache.stride(-1) != 1 and not v_minor):
        raise ValueError("k_cache/v_cache must be contiguous in the last (head_dim) dimension"
                         + (" (or v_cache token-minor)" if mma8 else ""))
    interpret = triton_interpreting()
    if not interpret and not q.is_cuda:
        raise RuntimeError(
            "the compiled Triton kernel needs CUDA tensors; to run it on CPU set "
            "TRITON_INTERPRET=1 before triton is first imported"
        )

    block_size = k_cache.shape[1]
    group = H // H_kv
    group_pad = max(16, _next_pow2(group))
    split_mult = 1
    block_n_arg = block_n
    if kv_fp8:
        fc = fp8_kv_config()
        block_n = fc["block_n"] if block_n is None else block_n
        num_warps = fc["num_warps"] if num_warps is None else num_warps
        num_stages = fc["num_stages"] if num_stages is None else num_stages
        cvt = fc["cvt"] if cvt is None else cvt
        split_mult = fc["split_mult"]
        if cvt not in ("f16", "q", "mma8"):
            raise ValueError(f"cvt must be 'f16', 'q' or 'mma8', got {cvt!r}")
    descs = None
    if mma8 and (fc["tma"] if tma is None else tma) and (block_n_arg is None or block_n_arg == block_size):
        from .paged_attention_fp8 import tma_descriptors

        descs = tma_descriptors(k_cache, v_cache)  # pages of 32-128 tokens: one page per tile
        if descs is not None:
            block_n = block_size
    elif (not kv_fp8 and (attention_tma() if tma is None else tma)
          and (block_n_arg is None or block_n_arg == block_size)):
        descs = kv_tma_descriptors(k_cache, v_cache)  # pages of 32-128 tokens: one page per tile
        if descs is not None:
            block_n = block_size
    num_warps = 4 if num_warps is None else num_warps
    num_stages = 2 if num_stages is None else num_stages
    if block_n is None:
        block_n = _default_block_n(block_size, D)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if mma8 and block_n < 32:  # an 8-bit MMA's K (here the tile's tokens) is at least 32
        raise ValueError(f"block_n must be >= 32 for the e4m3-operand kernel, got {block_n}")
    if num_splits is None:
        sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device()) if q.is_cuda else 132
        num_splits = choose_num_splits(B, H_kv, block_tables.shape[1] * block_size, block_n, sms)
        max_tiles = max(1, -(-block_tables.shape[1] * block_size // block_n))
        num_splits = min(num_splits * split_mult, max_tiles, _MAX_SPLITS)
    num_splits = int(max(1, num_splits))

    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    if context_lens.dtype != torch.int32 or not context_lens.is_contiguous():
        context_lens = context_lens.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    else:
        if out.shape != (B, H, D) or out.dtype != q.dtype or out.stride(-1) != 1:
            raise ValueError("out must be [B, H, D] with q's dtype and a contiguous last dimension")

    if num_splits > 1:
        partial_o = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q.device)
        partial_lse = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
        p_strides = (H * num_splits * D, num_splits * D, D, H * num_splits, num_splits)
    else:
        partial_o = out  # unused by the kernel when NUM_SPLITS == 1
        partial_lse = out
        p_strides = (0, 0, 0, 0, 0)

    split_kernel, reduce_kernel = _kernels(bool(interpret))
    pdl = pdl_options(q)
    counters = None
    if mma8:
        from .paged_attention_fp8 import mma8_kernel, mma8_slots

        mma8_kernel(bool(interpret))[(H_kv, B, num_splits)](
            q, *(descs if descs is not None else (k_cache, v_cache)), k_scale, v_scale, block_tables, context_lens, out, partial_o, partial_lse,
            float(scale) * _LOG2E, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
            k_scale.stride(0), k_scale.stride(1), k_scale.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
            *p_strides, GROUP=group, SLOTS=mma8_slots(group), HEAD_DIM=D, PAGE_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
            V_TOKEN_MINOR=v_minor, UPCAST_DOT=bool(interpret), TMA=descs is not None, H_KV=H_kv,
            F16_OPS=bool(fc["f16ops"]), LAZY_L=_auto(fc["lazy_l"], num_splits),
            JOINT_MAX=_auto(fc["joint_max"], num_splits),
            num_warps=num_warps, num_stages=num_stages, **pdl)
    elif num_splits > 1 and (fused_reduce if fused_reduce is not None else attention_fused_reduce()):
        from .fp8 import _tile_counters  # the per-device arrival counters (reset by their last user)

        counters = _tile_counters(q.device, B * H_kv)
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if not mma8:
        split_kernel[(H_kv, B, num_splits)](
            q,
            *(descs if descs is not None else (k_cache, v_cache)),
            k_scale if kv_fp8 else k_cache,
            v_scale if kv_fp8 else v_cache,
            block_tables,
            context_lens,
            out,
            partial_o,
            partial_lse,
            float(scale) * _LOG2E,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            k_scale.stride(0) if kv_fp8 else 0,
            k_scale.stride(1) if kv_fp8 else 0,
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            *p_strides,
            GROUP=group,
            GROUP_PAD=group_pad,
            HEAD_DIM=D,
            PAGE_SIZE=block_size,
            BLOCK_N=block_n,
            NUM_SPLITS=num_splits,
            DOT_PRECISION=dot_precision,
            UPCAST_DOT=bool(interpret),  # see _mma_impl
            KV_FP8=kv_fp8,
            CVT_F16=kv_fp8 and cvt == "f16" and q.dtype != torch.float32,
            cnt_ptr=counters if counters is not None else context_lens,
            SPLITS_PAD=max(2, _next_pow2(num_splits)),
            FUSED_REDUCE=counters is not None,
            TMA=descs is not None,
            num_warps=num_warps,
            num_stages=num_stages,
            **pdl,
        )
    if num_splits > 1 and counters is None:
        reduce_kernel[(H, B)](
            partial_o,
            partial_lse,
            out,
            *p_strides,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=max(2, _next_pow2(num_splits)),
            HEAD_DIM=D,
            num_warps=4,
            **pdl,
        )
    return out


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *, out=None,
                           k_scale=None, v_scale=None, cvt=None):
    """Paged decode attention: the Triton kernel on CUDA tensors (or on any tensors when
    Triton runs in its interpreter, ``TRITON_INTERPRET=1``), else the PyTorch reference.
    ``k_scale`` / ``v_scale``: the scales of an FP8 KV cache; ``cvt``: its widening dtype
    (``FP8_KV_CONFIG``; "q" for queries that may leave fp16's range)."""
    if HAS_TRITON and (q.is_cuda or triton_interpreting()):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, out=out,
                                             k_scale=k_scale, v_scale=v_scale, cvt=cvt)
    res = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                                     k_scale=k_scale, v_scale=v_scale)
    if out is None:
        return res
    out.copy_(res)
    return out
