"""Paged decode attention on an FP8 KV cache, tokens on the MMA's M axis (swap-AB).

The kernel of :mod:`shoal.kernels.paged_attention` puts the query group (padded to 16 rows)
on the MMA's M axis; this one puts the *tokens* there, so a 64-128-token tile is one MMA
operand read straight from the cache:

* scores ``S^T [BLOCK_N, N] = K_tile [BLOCK_N, D] @ Q^T [D, N]``;
* output ``O^T [D, N] += V_tile^T [D, BLOCK_N] @ P [BLOCK_N, N]``,

with N the GQA group's query heads padded to ``SLOTS`` (8 for S2-Pro's group of 4; see
:func:`mma8_slots`).

Operands (``F16_OPS``, the default through ``FP8_KV_CONFIG["f16ops"]``): the e4m3 K / V tiles
are widened to fp16 (exact), the query is rounded once to fp16 after a per-head scale of
``448 / amax``, the probabilities once after the value-scale normalisation below (they lie in
[0, 256]): 11 significant bits each, fp32 accumulation. What the MMAs run on depends on N:
Triton 3.6 lowers N = 8 to ``mma.sync`` m16n8k16 in fp16 (the e4m3 tiles widened in
registers; read off an sm_90a compile, 2026-12-07) and N >= 16 to Hopper's wgmma. Without
``F16_OPS`` the kernel keeps e4m3 operands for wgmma (N >= 16): the query and the
probabilities are each split into two e4m3 terms, ``x * s = hi + lo / 16`` with
``hi = e4m3(x * s)`` and ``lo = e4m3((x * s - hi) * 16)`` (about 8 significant bits, bf16's
precision), two MMAs per product summed in fp32 -- at N = 8 that path is still widened to fp16
by the compiler, so its second MMA buys nothing, which is why fp16 operands are the default
(H100, 2026-12-07: 1.02-1.25x faster and a 17% smaller error against the exact attention of the
stored e4m3 K / V, docs/benchmarks.md). ``JOINT_MAX`` takes the tile's score and value-scale
maxima in one cross-warp reduction; ``LAZY_L`` keeps the softmax denominators per token row
(rescaled like the accumulator) and sums them over the rows once after the loop.

Scales: the key scales multiply the score rows, the value scales the probability rows
(normalised by the tile's largest value scale, which multiplies the tile's product), as in
:func:`shoal.kernels.paged_attention._attend_tile_impl`.

V layout: wgmma reads an 8-bit operand only K-major, and V's K axis here is the token. The
kernel accepts V in the cache's standard layout (``[num_blocks, block_size, H_kv, D]``, head
dim contiguous: the tile goes through registers and is transposed on its way to shared memory,
1.5-1.9x slower) or *token-minor* (the same logical shape with ``stride(1) == 1``, stored
``[num_blocks, H_kv, D, block_size]``: both tiles are asynchronous copies; see
:func:`token_minor_like`; the engine's FP8 cache uses it when this kernel serves it,
:func:`wants_token_minor`). Everything else -- splits, the partial outputs and the reduce
kernel, PDL, CUDA-graph capture -- is the standard kernel's. Measured on the H200 (2026-12-02):
60.5 us at 64 sequences x 1k tokens against 70.0 for the bf16 cache and 74.2 for the widening
kernel.
"""

from __future__ import annotations

import functools

import torch

from .paged_attention import HAS_TRITON, tl, triton, triton_interpreting

__all__ = ["MMA8_GROUP_MAX", "TMA_PAGE_SIZES", "mma8_slots", "tma_descriptors", "token_minor_like", "is_token_minor", "wants_token_minor"]

MMA8_GROUP_MAX = 16  # query heads per KV head (the MMAs' N axis); larger groups use the widening kernel
SLOTS_ENV = "SHOAL_ATTN_MMA8_SLOTS"  # the smallest N of the kernel's MMAs (8, or 16)


def mma8_slots(group: int) -> int:
    """The MMAs' N: the group's query heads padded to a power of two >= 8 (env
    ``SHOAL_ATTN_MMA8_SLOTS`` raises the floor, e.g. 16)."""
    import os

    raw = os.environ.get(SLOTS_ENV, "8")
    try:
        floor = int(raw)
    except ValueError:
        floor = 0
    if floor not in (8, 16):
        raise ValueError(f"{SLOTS_ENV} must be 8 or 16, got {raw!r}")
    return max(floor, 1 << max(0, (int(group) - 1).bit_length()))


def wants_token_minor(dtype: torch.dtype, group: int) -> bool:
    """Whether an FP8 KV cache for a model of ``dtype`` with ``group`` query heads per KV head
    should store its values token-minor: when its decode attention runs this kernel (the
    FP8-cache launch config's ``cvt`` is "mma8", and the model is not fp32 and the group fits)."""
    from .paged_attention import fp8_kv_config

    return fp8_kv_config()["cvt"] == "mma8" and dtype != torch.float32 and group <= MMA8_GROUP_MAX


def token_minor_like(shape, device, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """A zeroed cache tensor of logical shape ``[num_blocks, block_size, H_kv, D]`` stored
    ``[num_blocks, H_kv, D, block_size]`` (each page's tokens contiguous per head dimension)."""
    nb, bs, hkv, d = shape
    return torch.zeros((nb, hkv, d, bs), dtype=dtype, device=device).permute(0, 3, 1, 2)


def is_token_minor(cache: torch.Tensor) -> bool:
    """True for a ``[num_blocks, block_size, H_kv, D]`` cache stored token-minor."""
    nb, bs, hkv, d = cache.shape
    return cache.stride() == (hkv * d * bs, 1, d * bs, bs)


TMA_PAGE_SIZES = (32, 64, 128)  # pages whose tiles the kernel reads as tensor-descriptor boxes
_DESCRIPTORS: dict = {}


def tma_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """``(k_desc, v_desc)``: tensor descriptors of one layer's FP8 cache for the kernel's TMA
    path (a page per tile), or None where it does not apply: values not token-minor, a page size
    outside :data:`TMA_PAGE_SIZES`, keys not in the standard contiguous layout, or a base not
    16-byte aligned. Cached per (address, shape): a descriptor holds only those."""
    nb, bs, hkv, d = k_cache.shape
    if (bs not in TMA_PAGE_SIZES or not is_token_minor(v_cache) or k_cache.stride() != (bs * hkv * d, hkv * d, d, 1)
            or k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16):
        return None
    key = (k_cache.data_ptr(), v_cache.data_ptr(), tuple(k_cache.shape), str(k_cache.device))
    hit = _DESCRIPTORS.get(key)
    if hit is None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if len(_DESCRIPTORS) > 4096:
            _DESCRIPTORS.clear()
        v_raw = v_cache.permute(0, 2, 3, 1)  # the storage order [num_blocks, H_kv, D, block_size]
        hit = _DESCRIPTORS[key] = (TensorDescriptor.from_tensor(k_cache.view(nb * bs, hkv * d), [bs, d]),
                                   TensorDescriptor.from_tensor(v_raw.reshape(nb * hkv * d, bs), [d, bs]))
    return hit


if HAS_TRITON:
    from .fp8 import _round_e4m3
    from .paged_attention import pdl_enter

    def _split8_impl(y, EXACT_CAST: tl.constexpr):
        """``y`` (fp32, within e4m3's range) -> (hi, lo) e4m3 with ``y ~ hi + lo / 16``, both
        rounded to nearest even. EXACT_CAST (the interpreter, whose fp32 -> e4m3 cast does not
        round to nearest): round on the fp32 grid first, so the cast only sees e4m3 values."""
        if EXACT_CAST:
            hi = _round_e4m3(y)
            lo = _round_e4m3((y - hi) * 16.0).to(tl.float8e4nv)
            hi = hi.to(tl.float8e4nv)
        else:
            hi = y.to(tl.float8e4nv)
            lo = ((y - hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
        return hi, lo

    def _mma8_impl(a, b, UPCAST_DOT: tl.constexpr):
        """``a @ b`` of e4m3 or fp16 operands, fp32 accumulation; interpreted runs widen to fp32 (exact)."""
        if UPCAST_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    def _max_pair_impl(a0, b0, a1, b1):
        """Combine of a two-tensor max reduction (``tl.reduce`` over a tuple)."""
        return tl.maximum(a0, a1), tl.maximum(b0, b1)

    if triton_interpreting():
        from triton.runtime.interpreter import InterpretedFunction as _Wrap
    else:
        from triton.runtime.jit import JITFunction as _Wrap

    _split8 = _Wrap(_split8_impl)
    _mma8 = _Wrap(_mma8_impl)
    _max_pair = _Wrap(_max_pair_impl)

    def _split_kernel_mma8(
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
        stride_vd,
        stride_sb,
        stride_st,
        stride_sh,
        stride_btb,
        stride_ob,
        stride_oh,
        stride_pb,
        stride_ph,
        stride_ps,
        stride_lb,
        stride_lh,
        GROUP: tl.constexpr,
        SLOTS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        V_TOKEN_MINOR: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        PDL: tl.constexpr = False,
        TMA: tl.constexpr = False,
        H_KV: tl.constexpr = 1,
        F16_OPS: tl.constexpr = False,
        LAZY_L: tl.constexpr = False,
        JOINT_MAX: tl.constexpr = False,
    ):
        # TMA (``BLOCK_N == PAGE_SIZE``, token-minor V): ``k_ptr`` / ``v_ptr`` are tensor
        # descriptors of the layer's cache viewed 2-D -- keys ``[pages * PAGE_SIZE, H_kv * D]``
        # in ``[PAGE_SIZE, D]`` boxes, values ``[pages * H_kv * D, PAGE_SIZE]`` in ``[D,
        # PAGE_SIZE]`` boxes -- so a tile is two bulk copies instead of a pointer gather
        pdl_enter(PDL)
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        split = tl.program_id(2)

        ctx = tl.load(lens_ptr + b)
        n_tiles = tl.cdiv(ctx, BLOCK_N)
        tiles_per_split = tl.cdiv(n_tiles, NUM_SPLITS)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, n_tiles)

        # the MMAs' N axis: the group's query heads, padded to SLOTS columns
        offs_h = tl.arange(0, SLOTS)
        h_valid = offs_h < GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + offs_h

        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=h_valid[:, None], other=0.0).to(tl.float32)
        q_amax = tl.maximum(tl.max(tl.abs(q), 1), 1e-30)
        if F16_OPS:
            # one fp16 operand (11 significant bits) instead of the two e4m3 terms
            q16_t = tl.trans((q * (448.0 / q_amax)[:, None]).to(tl.float16))  # [D, SLOTS]
        else:
            q_hi, q_lo = _split8(q * (448.0 / q_amax)[:, None], UPCAST_DOT)
            q_hi_t = tl.trans(q_hi)  # [D, SLOTS]
            q_lo_t = tl.trans(q_lo)
        # per head: the query's dequant scale times the softmax scale (log2 units)
        q_scale = q_amax * (qk_scale / 448.0)

        m_i = tl.full([SLOTS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([SLOTS], dtype=tl.float32)
        if LAZY_L:  # the softmax denominators kept per token row, summed over the rows once at the end
            l_rows = tl.zeros([BLOCK_N, SLOTS], dtype=tl.float32)
        acc = tl.zeros([HEAD_DIM, SLOTS], dtype=tl.float32)  # O^T

        bt_row = bt_ptr + b * stride_btb
        if not TMA:
            k_head = k_ptr + kvh * stride_kh
            v_head = v_ptr + kvh * stride_vh
        ks_head = ks_ptr + kvh * stride_sh
        vs_head = vs_ptr + kvh * stride_sh
        for tile in range(tile_lo, tile_hi):
            tok = tile * BLOCK_N + offs_n
            tok_mask = tok < ctx
            if TMA:
                # one page per tile, whole boxes: the slots past the context hold finite e4m3
                # (zeros or an earlier token's values) and are masked below
                tpage = tl.load(bt_row + tile)
                k8 = k_ptr.load([tpage * PAGE_SIZE, kvh * HEAD_DIM])  # [BLOCK_N, D]
                v8t = v_ptr.load([(tpage * H_KV + kvh) * HEAD_DIM, 0])  # [D, BLOCK_N]
                s_off = tpage.to(tl.int64) * stride_sb + offs_n * stride_st
            else:
                page_mask = (tok // PAGE_SIZE) * PAGE_SIZE < ctx  # the token's page is the sequence's
                page = tl.load(bt_row + tok // PAGE_SIZE, mask=page_mask, other=0).to(tl.int64)
                pslot = tok % PAGE_SIZE
                k8 = tl.load(k_head + page[:, None] * stride_kb + pslot[:, None] * stride_kt + offs_d[None, :],
                             mask=tok_mask[:, None], other=0.0)
                if V_TOKEN_MINOR:
                    v_ptrs = v_head + page[None, :] * stride_vb + pslot[None, :] + offs_d[:, None] * stride_vd
                    if PAGE_SIZE % 16 == 0:
                        # runs of 16 tokens share a page: 16 contiguous, 16-byte aligned bytes
                        v_ptrs = tl.max_contiguous(tl.multiple_of(v_ptrs, [1, 16]), [1, 16])
                    # masked by whole pages, so the mask is constant over each 16-byte run: the slots
                    # of the last page past the context hold finite e4m3 (zeros or an earlier token's
                    # values) and meet probabilities of 0
                    v8t = tl.load(v_ptrs, mask=page_mask[None, :], other=0.0)  # [D, BLOCK_N]
                else:
                    v8t = tl.trans(tl.load(v_head + page[:, None] * stride_vb + pslot[:, None] * stride_vt
                                           + offs_d[None, :], mask=tok_mask[:, None], other=0.0))
                s_off = page * stride_sb + pslot * stride_st
            ksc = tl.load(ks_head + s_off, mask=tok_mask, other=0.0)
            vsc = tl.load(vs_head + s_off, mask=tok_mask, other=0.0)

            if F16_OPS:
                s = _mma8(k8.to(tl.float16), q16_t, UPCAST_DOT)  # [BLOCK_N, SLOTS]
            else:
                # the hi and lo products are independent MMAs, combined once both are in registers
                s = _mma8(k8, q_hi_t, UPCAST_DOT) + _mma8(k8, q_lo_t, UPCAST_DOT) * 0.0625  # [BLOCK_N, SLOTS]
            s = s * ksc[:, None] * q_scale[None, :]
            s = tl.where(tok_mask[:, None], s, float("-inf"))
            if JOINT_MAX:
                # the scores' and the value scales' maxima over the tile in one reduction
                t_max, vs_cols = tl.reduce((s, tl.broadcast_to(vsc[:, None], [BLOCK_N, SLOTS])), 0, _max_pair)
                vs_max = tl.maximum(vs_cols, 1e-30)  # [SLOTS], every entry the tile's largest
            else:
                t_max = tl.max(s, 0)
                vs_max = tl.maximum(tl.max(vsc, 0), 1e-30)
            m_new = tl.maximum(m_i, t_max)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])  # [BLOCK_N, SLOTS], in [0, 1]
            if LAZY_L:
                l_rows = l_rows * alpha[None, :] + p
            else:
                l_i = l_i * alpha + tl.sum(p, 0)
            if JOINT_MAX:
                pw = p * vsc[:, None] * (256.0 / vs_max)[None, :]
            else:
                pw = p * (vsc * (256.0 / vs_max))[:, None]
            if F16_OPS:
                pv = _mma8(v8t.to(tl.float16), pw.to(tl.float16), UPCAST_DOT)  # [D, SLOTS]
            else:
                p_hi, p_lo = _split8(pw, UPCAST_DOT)
                pv = _mma8(v8t, p_hi, UPCAST_DOT) + _mma8(v8t, p_lo, UPCAST_DOT) * 0.0625  # [D, SLOTS]
            acc = acc * alpha[None, :] + pv * (vs_max / 256.0)
            m_i = m_new

        if LAZY_L:
            l_i = tl.sum(l_rows, 0)

        has = l_i > 0.0
        l_safe = tl.where(has, l_i, 1.0)
        out = acc / l_safe[None, :]  # [D, SLOTS]
        if NUM_SPLITS == 1:
            tl.store(o_ptr + b * stride_ob + heads[None, :] * stride_oh + offs_d[:, None],
                     out.to(o_ptr.dtype.element_ty), mask=h_valid[None, :])
        else:
            lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
            p_off = b * stride_pb + heads * stride_ph + split * stride_ps
            tl.store(po_ptr + p_off[None, :] + offs_d[:, None], out, mask=h_valid[None, :])
            tl.store(plse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_valid)


@functools.lru_cache(maxsize=None)
def mma8_kernel(interpret: bool):
    """The split kernel, wrapped for the interpreter or for compilation."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_split_kernel_mma8)
    from triton.runtime.jit import JITFunction

    return JITFunction(_split_kernel_mma8)
