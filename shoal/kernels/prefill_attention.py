"""Paged varlen causal prefill attention (GQA) for the slow transformer.

Several prompt chunks of different sequences are packed into one token axis; every chunk
(a *segment*) attends causally to its sequence's whole context so far, read from the paged
KV cache. The chunk's own K/V are written into the cache before the call (the engine's
prefill backend writes them first), so first chunks and continuation chunks (after a prefix
-cache hit or an earlier chunk) are handled the same way.

Layout
------
* ``q``: ``[N, H, D]`` (RoPE already applied), bf16 / fp16 / fp32, last dim contiguous.
* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, H_kv, D]``, same dtype as ``q``,
  last dim contiguous; or e4m3 caches with ``k_scale`` / ``v_scale`` ``[num_blocks,
  block_size, H_kv]`` fp32 (an FP8 KV cache, :mod:`shoal.quant.kv`; handled as in
  paged_attention.py).
* ``cu_seqlens``: ``[S + 1]`` int (int32 or int64), non-decreasing, ``cu_seqlens[0] == 0``:
  segment ``s`` is query tokens ``[cu_seqlens[s], cu_seqlens[s + 1])``. Segments of length 0
  are allowed (fixed-size metadata with unused entries). Tokens ``>= cu_seqlens[S]`` are
  *padding*: their output is zero.
* ``start_pos``: ``[S]`` int, the sequence position of segment ``s``'s first query token;
  query token ``i`` of the segment (position ``start_pos[s] + i``) attends to positions
  ``[0, start_pos[s] + i]``.
* ``block_tables``: ``[R, max_blocks]`` int; position ``t`` of segment ``s`` lives in page
  ``block_tables[row_s, t // block_size]`` at slot ``t % block_size``, where ``row_s`` is
  ``block_table_rows[s]`` when given (e.g. the engine's per-slot table indexed by slot id),
  else ``s``. Entries past a segment's last position are never read.
* Query head ``h`` attends with KV head ``h // (H // H_kv)``. Softmax in fp32 (fp32
  accumulation); the output has ``q``'s dtype.

Two implementations share this contract:

* :func:`paged_prefill_attention_ref` -- PyTorch (gather pages, pad the queries per segment,
  fp32 SDPA with a causal mask per segment), no host syncs. Shapes follow ``max_context`` / ``max_query`` when
  given (host-side bounds; else the block table's width and ``N``). CPU path and ground truth.
* :func:`paged_prefill_attention_triton` -- a Triton flash-attention kernel. One program per
  (query tile, KV head): a tile is ``BLOCK_M`` consecutive query tokens of one segment
  times the ``H // H_kv`` query heads of the KV head (padded to a power of two), so every
  K/V tile is loaded once for the whole group. Programs find their segment and tile on the
  device (a prefix sum of the segments' tile counts), so the grid --
  ``(cdiv(N, BLOCK_M) + S, H_kv)`` -- depends only on ``N`` and ``S`` and the call never
  syncs with the host: it can be captured in a CUDA graph with fixed ``N`` and ``S`` (unused
  segments have length 0). Programs past the segments' tiles zero the padding tokens'
  output. Keys below a tile's first query position are processed without a causal mask,
  the last key tiles with one. On CPU tensors the dispatcher uses the reference unless
  Triton was imported with ``TRITON_INTERPRET=1`` (see paged_attention.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .paged_attention import HAS_TRITON, _next_pow2, check_kv_scales, gather_kv, triton_interpreting

if HAS_TRITON:
    import triton  # noqa: F401
    import triton.language as tl

    from .paged_attention import _attend_tile  # device helper the kernel calls by name

__all__ = [
    "kernel_supported",
    "max_tiles",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "paged_prefill_attention_triton",
]

_LOG2E = 1.4426950408889634
_HEAD_DIMS = (16, 32, 64, 128, 256)


def _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, block_table_rows,
                  k_scale=None, v_scale=None):
    if q.dim() != 3:
        raise ValueError(f"q must be [N, H, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache/v_cache must both be [num_blocks, block_size, H_kv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    N, H, D = q.shape
    H_kv, Dk = k_cache.shape[2], k_cache.shape[3]
    if Dk != D:
        raise ValueError(f"head_dim mismatch: q has {D}, cache has {Dk}")
    if H_kv < 1 or H % H_kv != 0:
        raise ValueError(f"num query heads {H} is not a multiple of num KV heads {H_kv}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be [S + 1], got {tuple(cu_seqlens.shape)}")
    S = cu_seqlens.shape[0] - 1
    if start_pos.shape != (S,):
        raise ValueError(f"start_pos must be [S={S}], got {tuple(start_pos.shape)}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [rows, max_blocks], got {tuple(block_tables.shape)}")
    if block_table_rows is None:
        if block_tables.shape[0] < S:
            raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {S} segments")
    elif block_table_rows.shape != (S,):
        raise ValueError(f"block_table_rows must be [S={S}], got {tuple(block_table_rows.shape)}")
    check_kv_scales(q, k_cache, v_cache, k_scale, v_scale)
    return N, H, D, H_kv, S


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------


def paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, scale, *,
                                block_table_rows=None, max_context: int | None = None,
                                max_query: int | None = None, k_scale=None, v_scale=None):
    """Reference paged prefill attention (no host syncs).

    ``max_context`` (>= every segment's ``start + length``) and ``max_query`` (>= every
    segment's length) bound the gathered keys and the per-segment query padding; without them
    the block table's width and ``N`` are used.
    """
    N, H, D, H_kv, S = _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos,
                                     block_table_rows, k_scale, v_scale)
    dev = q.device
    out = torch.zeros_like(q)
    if S == 0 or N == 0:
        return out
    num_blocks, bs = k_cache.shape[0], k_cache.shape[1]
    group = H // H_kv
    nb = block_tables.shape[1]
    if max_context is not None:
        nb = min(nb, max(1, -(-int(max_context) // bs)))
    L = nb * bs
    Q = max(1, min(N, int(max_query))) if max_query is not None else N

    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    start = start_pos.to(device=dev, dtype=torch.long)
    rows = (torch.arange(S, device=dev) if block_table_rows is None
            else block_table_rows.to(device=dev, dtype=torch.long))
    bt = block_tables.to(device=dev, dtype=torch.long)[rows, :nb].clamp(0, num_blocks - 1)  # [S, nb]
    k = gather_kv(k_cache, k_scale, bt).reshape(S, L, H_kv, D)
    v = gather_kv(v_cache, v_scale, bt).reshape(S, L, H_kv, D)
    ends = start + (cu[1:] - cu[:-1])  # [S]: keys [0, end) exist for segment s
    keys = torch.arange(L, device=dev)
    kvalid = keys[None, :] < ends[:, None]  # [S, L]
    # never-written slots may hold anything (NaN patterns): zero them so 0 * NaN cannot leak
    k = k.masked_fill(~kvalid[:, :, None, None], 0.0)
    v = v.masked_fill(~kvalid[:, :, None, None], 0.0)

    # token -> (segment, index in segment); padding tokens go to an extra dummy segment S
    tok = torch.arange(N, device=dev)
    seg = torch.searchsorted(cu[1:].contiguous(), tok, right=True)  # in [0, S]
    seg_c = seg.clamp(max=S - 1)
    idx = (tok - cu[seg_c]).clamp(0, Q - 1)
    is_tok = seg < S
    seg_w = torch.where(is_tok, seg, torch.full_like(seg, S))
    qp = torch.zeros(S + 1, Q, H, D, dtype=torch.float32, device=dev)
    qp[seg_w, idx] = q.float()
    qpos = start[:, None] + torch.arange(Q, device=dev)[None, :]  # [S, Q]
    allowed = (keys[None, None, :] <= qpos[:, :, None]) & kvalid[:, None, :]  # [S, Q, L]
    # fp32 SDPA (CPU: the fused flash kernel, no [S, H, Q, L] score tensor); rows with no key
    # (past a segment's end, empty segments) are never read back
    o = F.scaled_dot_product_attention(qp[:S].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=allowed[:, None], scale=float(scale),
                                       enable_gqa=group > 1).transpose(1, 2)  # [S, Q, H, D]
    res = o[seg_c, idx]  # [N, H, D]
    res = torch.where(is_tok[:, None, None], res, torch.zeros_like(res))
    return res.to(q.dtype)


# --------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------

if HAS_TRITON:

    def _v_ptrs_impl(v_head, page, slot, offs_d, stride_vb, stride_vt, stride_vd, PAGE_SIZE: tl.constexpr,
                     TOKEN_MINOR: tl.constexpr):
        """Pointers of a [BLOCK_N, D] value tile. TOKEN_MINOR (an FP8 cache stored token-minor,
        stride_vt == 1): runs of 16 tokens of one page are 16 contiguous, 16-byte aligned bytes
        (callers mask whole pages, so the loads vectorise along the tokens)."""
        ptrs = v_head + page[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :] * stride_vd
        if TOKEN_MINOR and PAGE_SIZE % 16 == 0:
            ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [16, 1]), [16, 1])
        return ptrs

    if triton_interpreting():
        from triton.runtime.interpreter import InterpretedFunction as _Wrap
    else:
        from triton.runtime.jit import JITFunction as _Wrap
    _v_ptrs = _Wrap(_v_ptrs_impl)

    def _prefill_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        o_ptr,
        cu_ptr,
        start_ptr,
        rows_ptr,
        bt_ptr,
        num_segments,
        n_tokens,
        qk_scale,
        stride_qn,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_sb,
        stride_st,
        stride_on,
        stride_oh,
        stride_btr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        SEG_PAD: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        KV_FP8: tl.constexpr,
        stride_vd=1,
        V_TOKEN_MINOR: tl.constexpr = False,
    ):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)

        # ---- which segment and tile: prefix sum of the segments' tile counts
        offs_s = tl.arange(0, SEG_PAD)
        s_mask = offs_s < num_segments
        lo = tl.load(cu_ptr + offs_s, mask=s_mask, other=0).to(tl.int32)
        hi = tl.load(cu_ptr + offs_s + 1, mask=s_mask, other=0).to(tl.int32)
        lens = hi - lo
        tiles = (lens + (BLOCK_M - 1)) // BLOCK_M
        cum = tl.cumsum(tiles, 0)  # inclusive
        total_tiles = tl.sum(tiles, 0)
        seg = tl.sum((cum <= tile).to(tl.int32), 0)  # first segment whose tiles reach past `tile`
        pick = offs_s == seg
        first_tile = tl.sum(tl.where(pick, cum - tiles, 0), 0)
        q_lo = tl.sum(tl.where(pick, lo, 0), 0)
        n_q = tl.sum(tl.where(pick, lens, 0), 0)
        start = tl.sum(tl.where(pick, tl.load(start_ptr + offs_s, mask=s_mask, other=0).to(tl.int32), 0), 0)
        if HAS_ROWS:
            row = tl.sum(tl.where(pick, tl.load(rows_ptr + offs_s, mask=s_mask, other=0).to(tl.int32), 0), 0)
        else:
            row = seg
        q_end = tl.load(cu_ptr + num_segments).to(tl.int32)  # padding tokens start here

        is_seg = tile < total_tiles
        m0 = (tile - first_tile) * BLOCK_M  # first query of this tile, within its segment
        # segment tile: queries [q_lo + m0, q_lo + min(n_q, m0 + BLOCK_M)) attend to keys
        # [0, start + min(n_q, m0 + BLOCK_M)); padding tile: zero rows past q_end, no keys
        tok0 = tl.where(is_seg, q_lo + m0, q_end + (tile - total_tiles) * BLOCK_M)
        tok_end = tl.where(is_seg, q_lo + n_q, n_tokens)
        kv_hi = tl.where(is_seg, start + tl.minimum(n_q, m0 + BLOCK_M), 0)
        full_hi = tl.where(is_seg, start + m0, 0)  # keys below every query of the tile
        n_full = full_hi // BLOCK_N
        n_all = (kv_hi + (BLOCK_N - 1)) // BLOCK_N

        offs_r = tl.arange(0, BLOCK_M * GROUP_PAD)  # row = (query token, head of the group)
        offs_m = offs_r // GROUP_PAD
        offs_g = offs_r % GROUP_PAD
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        tok = tok0 + offs_m
        row_ok = (tok < tok_end) & (offs_g < GROUP)
        heads = kvh * GROUP + offs_g
        qpos = start + m0 + offs_m  # query positions (segment tiles)

        q = tl.load(
            q_ptr + tok.to(tl.int64)[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], dtype=tl.float32)

        bt_row = bt_ptr + row.to(tl.int64) * stride_btr
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_vh
        ks_head = ks_ptr + kvh
        vs_head = vs_ptr + kvh

        # keys every query of the tile sees: no mask
        for kt in range(n_full):
            key = kt * BLOCK_N + offs_n
            page = tl.load(bt_row + key // PAGE_SIZE).to(tl.int64)
            slot = key % PAGE_SIZE
            k = tl.load(k_head + page[:, None] * stride_kb + slot[:, None] * stride_kt + offs_d[None, :])
            v = tl.load(_v_ptrs(v_head, page, slot, offs_d, stride_vb, stride_vt, stride_vd, PAGE_SIZE,
                                V_TOKEN_MINOR))
            if KV_FP8:
                s_off = page * stride_sb + slot * stride_st
                m_i, l_i, acc = _attend_tile(q, k, v, tl.load(ks_head + s_off), tl.load(vs_head + s_off),
                                             key[None, :] >= 0, m_i, l_i, acc, qk_scale,
                                             True, UPCAST_DOT, DOT_PRECISION)
            else:
                m_i, l_i, acc = _attend_tile(q, k, v, k, v, key[None, :] >= 0, m_i, l_i, acc, qk_scale,
                                             False, UPCAST_DOT, DOT_PRECISION)

        # the diagonal: causal mask (every row sees key 0, so no row is ever fully masked)
        for kt in range(n_full, n_all):
            key = kt * BLOCK_N + offs_n
            key_ok = key < kv_hi
            page = tl.load(bt_row + key // PAGE_SIZE, mask=(key // PAGE_SIZE) * PAGE_SIZE < kv_hi,
                           other=0).to(tl.int64)
            slot = key % PAGE_SIZE
            k = tl.load(k_head + page[:, None] * stride_kb + slot[:, None] * stride_kt + offs_d[None, :],
                        mask=key_ok[:, None], other=0.0)
            if V_TOKEN_MINOR:
                # whole pages (a mask constant over each run of 16 tokens): the last page's slots
                # past kv_hi hold finite e4m3 and are not visible to any query
                v = tl.load(_v_ptrs(v_head, page, slot, offs_d, stride_vb, stride_vt, stride_vd, PAGE_SIZE, True),
                            mask=((key // PAGE_SIZE) * PAGE_SIZE < kv_hi)[:, None], other=0.0)
            else:
                v = tl.load(v_head + page[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :],
                            mask=key_ok[:, None], other=0.0)
            visible = (key[None, :] <= qpos[:, None]) & key_ok[None, :]
            if KV_FP8:
                s_off = page * stride_sb + slot * stride_st
                m_i, l_i, acc = _attend_tile(q, k, v, tl.load(ks_head + s_off, mask=key_ok, other=0.0),
                                             tl.load(vs_head + s_off, mask=key_ok, other=0.0), visible,
                                             m_i, l_i, acc, qk_scale, True, UPCAST_DOT, DOT_PRECISION)
            else:
                m_i, l_i, acc = _attend_tile(q, k, v, k, v, visible, m_i, l_i, acc, qk_scale,
                                             False, UPCAST_DOT, DOT_PRECISION)

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows: no keys, acc 0 -> output 0
        out = acc / l_safe[:, None]
        tl.store(
            o_ptr + tok.to(tl.int64)[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )


@functools.cache
def _kernel(interpret: bool):
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_prefill_kernel)
    from triton.runtime.jit import JITFunction

    return JITFunction(_prefill_kernel)


def kernel_supported(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the Triton kernel handles this head size and dtype."""
    return head_dim in _HEAD_DIMS and dtype in (torch.bfloat16, torch.float16, torch.float32)


def default_block_m(group: int, head_dim: int) -> int:
    """Query tokens per tile: about 64 rows (tokens x padded group), at least 16 rows."""
    gp = _next_pow2(group)
    return max(1, 64 // gp) if gp <= 16 else 1


def max_tiles(n_tokens: int, n_segments: int, block_m: int) -> int:
    """Programs per KV head: enough for every segment's tiles plus the padding tiles, for any
    split of ``n_tokens`` into ``n_segments`` segments (sum of ceil(n_s / BLOCK_M) plus
    ceil(padding / BLOCK_M) < N / BLOCK_M + S + 1)."""
    return -(-n_tokens // block_m) + n_segments


def paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, scale, *,
                                   block_table_rows=None, out=None, block_m: int | None = None,
                                   block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                                   k_scale=None, v_scale=None):
    """Run the Triton kernel: compiled (CUDA tensors) or interpreted (``TRITON_INTERPRET=1``).

    ``block_m``: query tokens per tile (rows = ``block_m`` x the padded group, >= 16);
    ``block_n``: keys per tile (power of two >= 16)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    N, H, D, H_kv, S = _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos,
                                     block_table_rows, k_scale, v_scale)
    kv_fp8 = k_scale is not None
    if kv_fp8 and (k_scale.stride(-1) != 1 or v_scale.stride(-1) != 1):
        raise ValueError("k_scale/v_scale must be contiguous in the head dimension")
    if not kernel_supported(D, q.dtype):
        raise ValueError(f"head_dim {D} / dtype {q.dtype} not supported by the Triton kernel")
    from .paged_attention_fp8 import is_token_minor

    v_minor = kv_fp8 and is_token_minor(v_cache)
    if k_cache.stride(-1) != 1 or (v_cache.stride(-1) != 1 and not v_minor):
        raise ValueError("k_cache/v_cache must be contiguous in the last (head_dim) dimension")
    interpret = triton_interpreting()
    if not interpret and not q.is_cuda:
        raise RuntimeError("the compiled Triton kernel needs CUDA tensors; to run it on CPU set "
                           "TRITON_INTERPRET=1 before triton is first imported")
    group = H // H_kv
    group_pad = _next_pow2(group)
    if block_m is None:
        block_m = default_block_m(group, D)
    block_m = _next_pow2(block_m)
    while block_m * group_pad < 16:
        block_m *= 2
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty((N, H, D), dtype=q.dtype, device=q.device)
    elif out.shape != (N, H, D) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must be [N, H, D] with q's dtype and a contiguous last dimension")
    if N == 0:
        return out
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if not cu_seqlens.is_contiguous():
        cu_seqlens = cu_seqlens.contiguous()
    if not start_pos.is_contiguous():
        start_pos = start_pos.contiguous()
    rows = block_table_rows
    if rows is not None and not rows.is_contiguous():
        rows = rows.contiguous()
    grid = (max_tiles(N, S, block_m), H_kv)
    _kernel(bool(interpret))[grid](
        q,
        k_cache,
        v_cache,
        k_scale if kv_fp8 else k_cache,
        v_scale if kv_fp8 else v_cache,
        out,
        cu_seqlens,
        start_pos,
        rows if rows is not None else start_pos,
        block_tables,
        S,
        N,
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
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=D,
        PAGE_SIZE=k_cache.shape[1],
        SEG_PAD=max(2, _next_pow2(S)),
        HAS_ROWS=rows is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=bool(interpret),  # see paged_attention._mma_impl
        KV_FP8=kv_fp8,
        stride_vd=v_cache.stride(3),
        V_TOKEN_MINOR=v_minor,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def use_kernel(q) -> bool:
    """Whether :func:`paged_prefill_attention` runs the Triton kernel for queries like ``q``."""
    return (HAS_TRITON and (q.is_cuda or triton_interpreting())
            and kernel_supported(q.shape[-1], q.dtype))


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, scale, *,
                            block_table_rows=None, out=None, max_context: int | None = None,
                            max_query: int | None = None, k_scale=None, v_scale=None):
    """Paged varlen causal prefill attention: the Triton kernel on CUDA tensors (or on any
    tensors under ``TRITON_INTERPRET=1``) when it supports the head size, else the PyTorch
    reference (``max_context`` / ``max_query``: optional host-side bounds for its shapes).
    ``k_scale`` / ``v_scale``: the scales of an FP8 KV cache."""
    if use_kernel(q):
        return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, scale,
                                              block_table_rows=block_table_rows, out=out,
                                              k_scale=k_scale, v_scale=v_scale)
    res = paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, scale,
                                      block_table_rows=block_table_rows, max_context=max_context,
                                      max_query=max_query, k_scale=k_scale, v_scale=v_scale)
    if out is None:
        return res
    out.copy_(res)
    return out
