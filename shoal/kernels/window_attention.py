"""Windowed attention for the codec transformer's streaming calls, over a ring of carried keys.

The codec's ``WindowLimitedTransformer`` (window W = 128 in the real codec) lets query ``i``
see keys ``i - W < j <= i``. A streaming call brings ``t`` new positions ``pos .. pos+t-1`` of
each stream; their queries need the stream's last ``P = W - 1`` keys and the ``t`` new ones.
With ``window_state="ring"`` a stream carries those ``P`` keys and values in ring order: the
key of position ``p`` sits in slot ``p mod P`` (so slot ``s`` holds position
``pos - P + ((s - pos) mod P)``, negative for slots a young stream has not filled: masked).
A call then reads the ring and the new keys where they lie -- no ``[P + t]`` concatenation, no
boolean mask tensor -- and writes only the new keys' slots afterwards (:func:`ring_write`).

:func:`window_attention` is one kernel: each program takes a block of a stream-head's
queries, walks the ring's slots (only when a query of the block is younger than ``P``) and the
new keys inside the block's window, each tile through the paged attention's online-softmax
update (``paged_attention._attend_tile``: fp32 softmax in log2 units, bf16 operands on the
tensor cores, fp32 ones at IEEE precision). The softmax runs over the same keys as
``F.scaled_dot_product_attention`` on the concatenation, in another order: the same function,
not the same bits. :func:`window_attention_ref` is that PyTorch form (the CPU path and the
tests' reference). Launches depend on shapes only (CUDA-graph capture).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .fused import use_triton
from .paged_attention import HAS_TRITON, tl, triton, triton_interpreting

if HAS_TRITON:
    from .paged_attention import _attend_tile  # the online-softmax tile update, called by name

__all__ = ["ring_positions", "ring_slots", "ring_write", "window_attention", "window_attention_ref"]


def ring_positions(pos: Tensor, P: int) -> Tensor:
    """[B, P] int64: the position each ring slot holds before a call at ``pos`` [B]."""
    slot = torch.arange(P, device=pos.device)
    return pos[:, None] - P + torch.remainder(slot[None] - pos[:, None], P)


def window_attention_ref(q: Tensor, k_ring: Tensor, v_ring: Tensor, k_new: Tensor, v_new: Tensor,
                         pos: Tensor, window: int) -> Tensor:
    """PyTorch form: SDPA over ``[ring | new]`` keys with the window mask by position.
    q / k_new / v_new [B, H, t, D], k_ring / v_ring [B, H, P, D], pos [B] int64 -> [B, H, t, D]."""
    P, t = k_ring.shape[2], q.shape[2]
    q_pos = pos[:, None] + torch.arange(t, device=pos.device)
    k_pos = torch.cat([ring_positions(pos, P), q_pos], dim=1)
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    mask = ((kp <= qp) & (kp > qp - window) & (kp >= 0))[:, None]  # [B, 1, t, P + t]
    k = torch.cat([k_ring.to(k_new.dtype), k_new], dim=2)
    v = torch.cat([v_ring.to(v_new.dtype), v_new], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def ring_slots(pos: Tensor, t: int, P: int) -> Tensor:
    """[B, min(t, P)] int64: the ring slots of a call's last ``min(t, P)`` new positions (the
    ones a ring of ``P`` keeps), ``(pos + j) mod P``; distinct within a row."""
    n = min(t, P)
    return torch.remainder(pos[:, None] + torch.arange(t - n, t, device=pos.device)[None], P)


def ring_write(ring: Tensor, new: Tensor, slots: Tensor, rows: Tensor | None = None) -> Tensor:
    """Write the new positions' rows ``new`` [B, H, t, D] into ``ring`` [R, H, P, D] in place:
    the last ``n`` of them at ``slots`` [B, n] (:func:`ring_slots`) of row ``rows[b]`` (None:
    row b); returns ``ring``."""
    B, n = slots.shape
    H, D = ring.shape[1], ring.shape[3]
    src = new[:, :, new.shape[2] - n:].to(ring.dtype)
    if rows is None:
        return ring.scatter_(2, slots[:, None, :, None].expand(B, H, n, D), src)
    # [R, P, H, D] view: (row, slot) pairs index whole [H, D] blocks
    ring.permute(0, 2, 1, 3).index_put_((rows[:, None].expand(B, n), slots), src.permute(0, 2, 1, 3))
    return ring


if HAS_TRITON:

    @triton.jit
    def _window_attn_kernel(q_ptr, kr_ptr, vr_ptr, kn_ptr, vn_ptr, pos_ptr, rows_ptr, o_ptr,
                            sqb, sqh, sqt, skrb, skrh, skrs, svrb, svrh, svrs,
                            sknb, sknh, sknt, svnb, svnh, svnt, sob, soh, sot,
                            H, t, P, W, qk_scale,
                            D: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, UPCAST_DOT: tl.constexpr,
                            DOT_PRECISION: tl.constexpr, ROWS: tl.constexpr):
        pid_bh = tl.program_id(0)
        pid_q = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        pos = tl.load(pos_ptr + b)
        rb = b  # the ring's row: the stream's own, or its slot in a pool
        if ROWS:
            rb = tl.load(rows_ptr + b)
        q0 = pid_q * BQ
        offs_q = q0 + tl.arange(0, BQ)
        offs_d = tl.arange(0, D)
        qmask = offs_q < t
        q = tl.load(q_ptr + b * sqb + h * sqh + offs_q[:, None] * sqt + offs_d[None, :],
                    mask=qmask[:, None], other=0.0)
        q_pos = pos + offs_q
        # a finite start: a tile whose keys are all masked (a young stream's ring, padding
        # rows) leaves m, l and acc as they were instead of making exp2(-inf - -inf)
        m_i = tl.full([BQ], -1.0e30, tl.float32)
        l_i = tl.zeros([BQ], tl.float32)
        acc = tl.zeros([BQ, D], tl.float32)
        # the ring: positions pos - P .. pos - 1, needed only by the block's first P queries
        n_ring = tl.where(q0 < P, P, 0)
        for s0 in range(0, n_ring, BK):
            offs_s = s0 + tl.arange(0, BK)
            smask = offs_s < P
            k = tl.load(kr_ptr + rb * skrb + h * skrh + offs_s[:, None] * skrs + offs_d[None, :],
                        mask=smask[:, None], other=0.0)
            v = tl.load(vr_ptr + rb * svrb + h * svrh + offs_s[:, None] * svrs + offs_d[None, :],
                        mask=smask[:, None], other=0.0)
            k_pos = pos - P + ((offs_s - pos) % P + P) % P
            visible = (smask & (k_pos >= 0))[None, :] & (k_pos[None, :] <= q_pos[:, None]) \
                & (k_pos[None, :] > q_pos[:, None] - W)
            m_i, l_i, acc = _attend_tile(q, k, v, k, v, visible, m_i, l_i, acc, qk_scale,
                                         False, UPCAST_DOT, DOT_PRECISION)
        # the new keys inside the block's window: pos + max(0, q0 - W + 1) .. pos + q0 + BQ - 1
        lo = tl.maximum(q0 - W + 1, 0)
        lo = lo - lo % BK
        hi = tl.minimum(q0 + BQ, t)
        for n0 in range(lo, hi, BK):
            offs_n = n0 + tl.arange(0, BK)
            nmask = offs_n < t
            k = tl.load(kn_ptr + b * sknb + h * sknh + offs_n[:, None] * sknt + offs_d[None, :],
                        mask=nmask[:, None], other=0.0)
            v = tl.load(vn_ptr + b * svnb + h * svnh + offs_n[:, None] * svnt + offs_d[None, :],
                        mask=nmask[:, None], other=0.0)
            k_pos = pos + offs_n
            visible = nmask[None, :] & (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - W)
            m_i, l_i, acc = _attend_tile(q, k, v, k, v, visible, m_i, l_i, acc, qk_scale,
                                         False, UPCAST_DOT, DOT_PRECISION)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + b * sob + h * soh + offs_q[:, None] * sot + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=qmask[:, None])


def window_attention(q: Tensor, k_ring: Tensor, v_ring: Tensor, k_new: Tensor, v_new: Tensor,
                     pos: Tensor, window: int, rows: Tensor | None = None) -> Tensor:
    """Attention of ``t`` new queries over a stream's ring of ``P`` carried keys and the ``t``
    new keys (see the module docstring). q / k_new / v_new [B, H, t, D] (any strides with a
    contiguous last dim), k_ring / v_ring [R, H, P, D] with ``rows`` [B] the ring row of each
    stream (None: R = B, row b), pos [B] int64 (positions before the call) -> [B, H, t, D] in
    q's dtype; the kernel's output lies in [B, t, H, D] memory (a transposed view), so the
    output projection's ``[B, t, H * D]`` input is a view. Runs the kernel on CUDA tensors (or
    under Triton's interpreter), else :func:`window_attention_ref`."""
    B, H, t, D = q.shape
    P = k_ring.shape[2]
    R = B if rows is None else k_ring.shape[0]
    if k_ring.shape != (R, H, P, D) or v_ring.shape != k_ring.shape:
        raise ValueError(f"ring keys / values must be {(R, H, P, D)}, got {tuple(k_ring.shape)} / {tuple(v_ring.shape)}")
    if k_new.shape != q.shape or v_new.shape != q.shape:
        raise ValueError(f"new keys / values must be {tuple(q.shape)}")
    if rows is not None and tuple(rows.shape) != (B,):
        raise ValueError(f"rows must be [{B}], got {tuple(rows.shape)}")
    if (not use_triton(q) or D not in (16, 32, 64, 128) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or k_ring.dtype != q.dtype):
        if rows is not None:
            k_ring, v_ring = k_ring.index_select(0, rows), v_ring.index_select(0, rows)
        return window_attention_ref(q, k_ring, v_ring, k_new, v_new, pos, window)
    q, kr, vr, kn, vn = [x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_ring, v_ring, k_new, v_new)]
    out = torch.empty(B, t, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    if t == 0:
        return out
    BQ = 16 if t <= 16 else 32
    BK = 64
    grid = (B * H, triton.cdiv(t, BQ))
    opts = {} if triton_interpreting() else {"num_warps": 4}
    _window_attn_kernel[grid](
        q, kr, vr, kn, vn, pos.contiguous(), pos if rows is None else rows.contiguous(), out,
        q.stride(0), q.stride(1), q.stride(2), kr.stride(0), kr.stride(1), kr.stride(2),
        vr.stride(0), vr.stride(1), vr.stride(2), kn.stride(0), kn.stride(1), kn.stride(2),
        vn.stride(0), vn.stride(1), vn.stride(2), out.stride(0), out.stride(1), out.stride(2),
        H, t, P, window, math.log2(math.e) / math.sqrt(D),  # the tile update works in log2 units
        D=D, BQ=BQ, BK=BK, UPCAST_DOT=triton_interpreting(),  # see paged_attention._mma_impl
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ROWS=rows is not None, **opts)
    return out
