"""Paged decode attention on an FP8 KV cache with e4m3 tensor-core operands (sm_90 wgmma).

The kernel of :mod:`shoal.kernels.paged_attention` widens the e4m3 K / V tiles to fp16 for
``mma.sync`` products with the query group padded to 16 rows; this one keeps every operand in
e4m3 and puts the *tokens* on the MMA's M axis (swap-AB), so a 64-128-token tile feeds Hopper's
asynchronous wgmma directly:

* scores ``S^T [BLOCK_N, 16] = K_tile [BLOCK_N, D] @ Qx^T [D, 16]``;
* output ``O^T [D, 16] += V_tile^T [D, BLOCK_N] @ Px [BLOCK_N, 16]``.

Precision: the query and the probabilities are not rounded to e4m3 (3 mantissa bits). Each is
split into two e4m3 terms, ``x * s = hi + lo / 16`` with ``hi = e4m3(x * s)`` and
``lo = e4m3((x * s - hi) * 16)``: about 8 significant bits, bf16's precision. The 16 MMA columns
hold the ``hi`` terms of 8 head slots and then their ``lo`` terms (a GQA group of up to 8 query
heads), so the split costs no MMA instructions at S2-Pro's group of 4 (N = 16 is the
instruction's smallest efficient width anyway). The query's scale is ``448 / amax`` per head
(its largest element maps to e4m3's largest normal), the probabilities' ``256`` (they lie in
[0, 1] after the online-softmax shift and the value-scale normalisation below). Measured in fp32
emulation (docs/benchmarks.md): the attention output's error against exact attention is the
same as the widening kernel's (both are set by the e4m3 K / V).

Scales: the key scales multiply the score rows, the value scales the probability rows
(normalised by the tile's largest value scale, which multiplies the tile's product), as in
:func:`shoal.kernels.paged_attention._attend_tile_impl`.

V layout: wgmma reads an 8-bit operand only K-major, and V's K axis here is the token. The
kernel accepts V in the cache's standard layout (``[num_blocks, block_size, H_kv, D]``, head
dim contiguous: the tile is transposed on its way to shared memory) or *token-minor*
(the same logical shape with ``stride(1) == 1``, stored ``[num_blocks, H_kv, D, block_size]``:
the tile is copied as it lies; see :func:`token_minor_like`). Everything else -- splits, the
partial outputs and the reduce kernel, PDL, CUDA-graph capture -- is the standard kernel's.
"""

from __future__ import annotations

import functools

import torch

from .paged_attention import HAS_TRITON, tl, triton, triton_interpreting

__all__ = ["MMA8_GROUP_MAX", "token_minor_like", "is_token_minor"]

MMA8_GROUP_MAX = 8  # query heads per KV head that the 16 MMA columns hold (hi + lo terms)


def token_minor_like(shape, device, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """A zeroed cache tensor of logical shape ``[num_blocks, block_size, H_kv, D]`` stored
    ``[num_blocks, H_kv, D, block_size]`` (each page's tokens contiguous per head dimension)."""
    nb, bs, hkv, d = shape
    return torch.zeros((nb, hkv, d, bs), dtype=dtype, device=device).permute(0, 3, 1, 2)


def is_token_minor(cache: torch.Tensor) -> bool:
    """True for a ``[num_blocks, block_size, H_kv, D]`` cache stored token-minor."""
    nb, bs, hkv, d = cache.shape
    return cache.stride() == (hkv * d * bs, 1, d * bs, bs)


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
        """``a @ b`` of e4m3 operands, fp32 accumulation; interpreted runs widen to fp32 (exact)."""
        if UPCAST_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    def _pair_sum_impl(x, ROWS: tl.constexpr):
        """``x [ROWS, 16]`` (columns: 8 hi slots, then their 8 lo slots) -> ``hi + lo / 16``
        as ``[ROWS, 8]``."""
        x3 = tl.reshape(x, (ROWS, 2, 8))
        w = tl.where(tl.arange(0, 2) == 0, 1.0, 0.0625)
        return tl.sum(x3 * w[None, :, None], axis=1)

    if triton_interpreting():
        from triton.runtime.interpreter import InterpretedFunction as _Wrap
    else:
        from triton.runtime.jit import JITFunction as _Wrap
    _split8 = _Wrap(_split8_impl)
    _mma8 = _Wrap(_mma8_impl)
    _pair_sum = _Wrap(_pair_sum_impl)

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
        stride_btb,
        stride_ob,
        stride_oh,
        stride_pb,
        stride_ph,
        stride_ps,
        stride_lb,
        stride_lh,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        V_TOKEN_MINOR: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_enter(PDL)
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        split = tl.program_id(2)

        ctx = tl.load(lens_ptr + b)
        n_tiles = tl.cdiv(ctx, BLOCK_N)
        tiles_per_split = tl.cdiv(n_tiles, NUM_SPLITS)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, n_tiles)

        # the 16 MMA columns: slot c < 8 holds head c's hi term, slot 8 + c its lo term
        offs_c = tl.arange(0, 16)
        slot = offs_c % 8
        c_valid = slot < GROUP
        offs_h = tl.arange(0, 8)
        h_valid = offs_h < GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)

        q = tl.load(q_ptr + b * stride_qb + (kvh * GROUP + slot)[:, None] * stride_qh + offs_d[None, :],
                    mask=c_valid[:, None], other=0.0).to(tl.float32)
        q_amax = tl.maximum(tl.max(tl.abs(q), 1), 1e-30)
        q_hi, q_lo = _split8(q * (448.0 / q_amax)[:, None], UPCAST_DOT)
        qx = tl.where((offs_c < 8)[:, None], q_hi, q_lo)  # [16, D] e4m3
        qx_t = tl.trans(qx)  # [D, 16]
        # per head slot: the query's dequant scale times the softmax scale (log2 units)
        q_scale = tl.max(tl.where(offs_h[:, None] == slot[None, :], q_amax[None, :], 0.0), 1) * (qk_scale / 448.0)

        m_i = tl.full([8], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([8], dtype=tl.float32)
        acc = tl.zeros([HEAD_DIM, 8], dtype=tl.float32)  # O^T

        bt_row = bt_ptr + b * stride_btb
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_vh
        ks_head = ks_ptr + kvh
        vs_head = vs_ptr + kvh
        for tile in range(tile_lo, tile_hi):
            tok = tile * BLOCK_N + offs_n
            tok_mask = tok < ctx
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

            s = _pair_sum(_mma8(k8, qx_t, UPCAST_DOT), BLOCK_N)  # [BLOCK_N, 8]
            s = s * ksc[:, None] * q_scale[None, :]
            s = tl.where(tok_mask[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])  # [BLOCK_N, 8], in [0, 1]
            l_i = l_i * alpha + tl.sum(p, 0)
            vs_max = tl.maximum(tl.max(vsc, 0), 1e-30)
            p_hi, p_lo = _split8(p * (vsc * (256.0 / vs_max))[:, None], UPCAST_DOT)
            px = tl.reshape(tl.permute(tl.join(p_hi, p_lo), (0, 2, 1)), (BLOCK_N, 16))  # [hi slots | lo slots]
            pv = _pair_sum(_mma8(v8t, px, UPCAST_DOT), HEAD_DIM)  # [D, 8]
            acc = acc * alpha[None, :] + pv * (vs_max / 256.0)
            m_i = m_new

        has = l_i > 0.0
        l_safe = tl.where(has, l_i, 1.0)
        out = acc / l_safe[None, :]  # [D, 8]
        heads = kvh * GROUP + offs_h
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
