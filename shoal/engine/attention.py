"""Attention backends over the engine's caches (see ``AttentionBackend`` in model/layers.py).

- :class:`PagedDecodeBackend`: one query per sequence over the paged KV cache; writes the new
  K/V through a slot mapping and attends with the paged decode kernel (Triton on GPU, PyTorch
  reference on CPU). Shapes are fixed per batch bucket and nothing syncs with the host, so the
  whole decode step can be captured in a CUDA graph.
- :class:`PagedPrefillBackend`: prompt chunks of several sequences packed into one token
  axis, each attending causally over its cached prefix plus itself: one paged varlen
  attention call per layer (graph-capturable). :class:`SegmentedPrefillBackend` is the
  previous per-segment SDPA version, kept for comparisons.
- :class:`FastCacheBackend`: the fast transformer's 10-slot cache, one row per batch row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.fused import write_kv
from ..kernels.paged_attention import paged_decode_attention
from ..kernels.prefill_attention import paged_prefill_attention
from ..quant.kv import FP8_KV_DTYPE, parse_kv_cache_dtype


class PagedKVCache:
    """K/V storage for every slow layer: [layers, 2, num_blocks, block_size, H_kv, D].

    ``kv_dtype=torch.float8_e4m3fn`` (or ``"fp8"``): an FP8 KV cache (:mod:`shoal.quant.kv`),
    e4m3 values plus ``scales`` [layers, 2, num_blocks, block_size, H_kv] fp32, one per
    (token, KV head); about half the bytes per token, which the decode attention reads.

    ``v_token_minor`` (FP8 caches; default: when the FP8 decode attention runs its e4m3-operand
    kernel, :func:`shoal.kernels.paged_attention_fp8.wants_token_minor`): the values
    are stored ``[layers, num_blocks, H_kv, D, block_size]`` (each page's tokens contiguous, the
    K-major operand that kernel reads without a transpose) and :meth:`v` returns the same logical
    ``[num_blocks, block_size, H_kv, D]`` view; keys keep the standard layout. Every reader and
    writer takes the cache through its strides."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 kv_dtype: torch.dtype | str | None = None, v_token_minor: bool | None = None,
                 group: int | None = None) -> None:
        kv_dtype = parse_kv_cache_dtype(kv_dtype)
        self.fp8 = kv_dtype == FP8_KV_DTYPE
        if v_token_minor is None:  # ``group``: query heads per KV head
            from ..kernels.paged_attention_fp8 import wants_token_minor

            if self.fp8 and group is None:
                # the value layout depends on which kernel reads the cache, and that on the group
                raise ValueError("an FP8 KV cache needs group (query heads per KV head) or an explicit v_token_minor")

            v_token_minor = self.fp8 and wants_token_minor(dtype, group or 1)
        if v_token_minor and not self.fp8:
            raise ValueError("a token-minor value layout is for an FP8 KV cache")
        self.v_token_minor = bool(v_token_minor)
        self.head_dim = head_dim
        if self.v_token_minor:
            self.data = None
            self.k_data = torch.zeros(n_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype=kv_dtype,
                                      device=device)
            self.v_data = torch.zeros(n_layers, num_blocks, n_kv_heads, head_dim, block_size, dtype=kv_dtype,
                                      device=device).permute(0, 1, 4, 2, 3)
        else:
            self.data = torch.zeros(n_layers, 2, num_blocks, block_size, n_kv_heads, head_dim,
                                    dtype=kv_dtype or dtype, device=device)
        self.scales = (torch.zeros(n_layers, 2, num_blocks, block_size, n_kv_heads,
                                   dtype=torch.float32, device=device) if self.fp8 else None)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @staticmethod
    def bytes_per_block(n_layers: int, block_size: int, n_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, kv_dtype: torch.dtype | str | None = None) -> int:
        """Device bytes of one block over all layers (K and V, plus an FP8 cache's scales)."""
        kv_dtype = parse_kv_cache_dtype(kv_dtype)
        per_token = n_kv_heads * head_dim * (kv_dtype or dtype).itemsize
        if kv_dtype == FP8_KV_DTYPE:
            per_token += n_kv_heads * 4
        return 2 * n_layers * block_size * per_token

    def k(self, layer: int) -> Tensor:
        return self.k_data[layer] if self.data is None else self.data[layer, 0]

    def v(self, layer: int) -> Tensor:
        return self.v_data[layer] if self.data is None else self.data[layer, 1]

    def k_scale(self, layer: int) -> Tensor | None:
        return None if self.scales is None else self.scales[layer, 0]

    def v_scale(self, layer: int) -> Tensor | None:
        return None if self.scales is None else self.scales[layer, 1]

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """k/v [N, H_kv, D] into flat slots [N] (block * block_size + offset)."""
        write_kv(self.k(layer), self.v(layer), slots, k, v, self.k_scale(layer), self.v_scale(layer))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` (every layer: K, V and an FP8 cache's scales) with the
        semantics of doing the pairs in order. One gather + scatter per tensor when no
        destination is also a source (the pool's case: a destination is a fresh block), else
        pair by pair."""
        copies = [(src, dst) for src, dst in copies if src != dst]  # a block onto itself: nothing to do
        if not copies:
            return
        last: dict[int, int] = {}
        for src, dst in copies:
            last.pop(dst, None)
            last[dst] = src
        if set(last) & set(last.values()):  # a destination read by another pair: keep the order
            for src, dst in copies:
                self.copy_blocks([(src, dst)])
            return
        dev = self.k(0).device  # index uploads without a host sync, as the block tables'
        src = torch.tensor(list(last.values()), dtype=torch.long).to(dev, non_blocking=True)
        dst = torch.tensor(list(last.keys()), dtype=torch.long).to(dev, non_blocking=True)
        def raw(t: Tensor) -> Tensor:  # e4m3 has no index kernels on every backend: copy bytes
            return t.view(torch.uint8) if t.element_size() == 1 else t

        if self.data is not None:
            raw(self.data).index_copy_(2, dst, raw(self.data).index_select(2, src))
        else:
            raw(self.k_data).index_copy_(1, dst, raw(self.k_data).index_select(1, src))
            raw(self.v_data).index_copy_(1, dst, raw(self.v_data).index_select(1, src))
        if self.scales is not None:
            self.scales.index_copy_(2, dst, self.scales.index_select(2, src))

    @property
    def nbytes(self) -> int:
        if self.data is None:
            n = (self.k_data.numel() + self.v_data.numel()) * self.k_data.element_size()
        else:
            n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * 4)


class _PagedCacheTarget:
    """What the fused qk-norm/RoPE/cache-write kernel needs from a paged backend."""

    cache: PagedKVCache
    slots: Tensor | None

    def fused_target(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.cache.k(layer), self.cache.v(layer), self.slots

    def kv_scales(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        """An FP8 cache's (k_scale, v_scale) of ``layer``; (None, None) for a model-dtype cache."""
        return self.cache.k_scale(layer), self.cache.v_scale(layer)


class PagedDecodeBackend(_PagedCacheTarget):
    def __init__(self, cache: PagedKVCache, n_heads: int, head_dim: int, qk_norm: bool = True) -> None:
        self.cache = cache
        self.scale = head_dim ** -0.5
        # an FP8 cache's kernel may widen to fp16 only for qk-normed queries (bounded, far inside
        # fp16's range); otherwise it widens to the query's dtype
        self.fp8_cvt = None if qk_norm or cache.v_token_minor else "q"  # mma8 scales q per head: any range
        self.slots: Tensor | None = None
        self.block_tables: Tensor | None = None
        self.context_lens: Tensor | None = None

    def set(self, slots: Tensor, block_tables: Tensor, context_lens: Tensor) -> None:
        self.slots, self.block_tables, self.context_lens = slots, block_tables, context_lens

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.cache.write(layer, self.slots, k[:, 0], v[:, 0])
        return self.attend_only(layer, q)

    def attend_only(self, layer: int, q: Tensor) -> Tensor:
        out = paged_decode_attention(q[:, 0], self.cache.k(layer), self.cache.v(layer),
                                     self.block_tables, self.context_lens, self.scale,
                                     k_scale=self.cache.k_scale(layer), v_scale=self.cache.v_scale(layer),
                                     cvt=self.fp8_cvt)
        return out[:, None]


class PagedPrefillBackend(_PagedCacheTarget):
    """Prompt chunks of several sequences packed into one token axis (B = 1, N tokens).

    The projections and MLPs run once over all N tokens; the chunks' K/V are written into the
    paged cache first, then ONE paged varlen causal attention call per layer
    (:func:`~shoal.kernels.prefill_attention.paged_prefill_attention`: Triton on GPU, its
    PyTorch reference on CPU) reads every segment's context from the cache -- first chunks and
    continuation chunks alike. No per-segment work, no masks, no host syncs: with fixed-size
    metadata (unused segments of length 0, padding tokens past the last segment writing to a
    scratch slot) the whole prefill forward can be captured in a CUDA graph."""

    def __init__(self, cache: PagedKVCache, n_heads: int, n_kv_heads: int, head_dim: int | None = None) -> None:
        self.cache = cache
        self.scale = (head_dim or cache.head_dim) ** -0.5
        self.slots: Tensor | None = None
        self.cu_seqlens: Tensor | None = None
        self.start_pos: Tensor | None = None
        self.block_tables: Tensor | None = None
        self.block_table_rows: Tensor | None = None
        self.max_context: int | None = None
        self.max_query: int | None = None

    def set(self, slots: Tensor, cu_seqlens: Tensor, start_pos: Tensor, block_tables: Tensor,
            block_table_rows: Tensor | None = None, max_context: int | None = None,
            max_query: int | None = None) -> None:
        """``slots`` [N]: flat cache slot of every token (padding tokens: a scratch slot);
        ``cu_seqlens`` [S+1], ``start_pos`` [S], ``block_tables`` [R, max_blocks] with
        ``block_table_rows`` [S] (row of each segment; default row s): see
        :mod:`shoal.kernels.prefill_attention`. ``max_context`` / ``max_query``: host-side
        bounds that size the PyTorch reference's work (CPU); the Triton kernel ignores them."""
        self.slots, self.cu_seqlens, self.start_pos = slots, cu_seqlens, start_pos
        self.block_tables, self.block_table_rows = block_tables, block_table_rows
        self.max_context, self.max_query = max_context, max_query

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.write_kv(layer, k, v)
        return self.attend_only(layer, q)

    def write_kv(self, layer: int, k: Tensor, v: Tensor) -> None:
        """The chunk's K/V into the cache, nothing read (a layer whose output is not used)."""
        self.cache.write(layer, self.slots, k[0], v[0])

    def attend_only(self, layer: int, q: Tensor) -> Tensor:
        out = paged_prefill_attention(q[0], self.cache.k(layer), self.cache.v(layer), self.block_tables,
                                      self.cu_seqlens, self.start_pos, self.scale,
                                      block_table_rows=self.block_table_rows, max_context=self.max_context,
                                      max_query=self.max_query, k_scale=self.cache.k_scale(layer),
                                      v_scale=self.cache.v_scale(layer))
        return out[None]


class SegmentedPrefillBackend(PagedPrefillBackend):
    """The previous prefill backend, kept for comparisons (``shoal.bench.kernels_prefill``,
    tests): attention runs per segment in Python -- a chunk that starts a sequence attends to
    itself (causal SDPA on its own K/V), a later chunk to its prefix gathered from its blocks
    plus itself (SDPA with a mask) -- so a step launches several kernels per segment and layer."""

    def __init__(self, cache: PagedKVCache, n_heads: int, n_kv_heads: int) -> None:
        self.cache = cache  # comparisons only: reads the cache as stored (no FP8 KV dequant)
        self.gqa = n_heads != n_kv_heads
        self.slots: Tensor | None = None
        self.segments: list[tuple[int, int, Tensor, int, Tensor | None]] = []

    def set(self, slots: Tensor, segments: list[tuple[int, int, Tensor, int, int]]) -> None:
        """``segments``: (offset in N, length, block ids, start position, end position)."""
        if self.cache.fp8:
            raise ValueError("the segmented prefill backend does not read an FP8 KV cache")
        self.slots = slots
        self.segments = []
        for off, n, blocks, start, end in segments:
            mask = None
            if start > 0:
                keys = torch.arange(end, device=slots.device)
                queries = torch.arange(start, end, device=slots.device)
                mask = (keys[None, :] <= queries[:, None])[None, None]
            self.segments.append((off, n, blocks, end, mask))

    def attend_only(self, layer: int, q: Tensor) -> Tensor:
        out = torch.empty_like(q)
        kl, vl = self.cache.k(layer), self.cache.v(layer)
        kflat = kl.view(-1, *kl.shape[2:])
        vflat = vl.view(-1, *vl.shape[2:])
        for off, n, blocks, end, mask in self.segments:
            qs = q[:, off: off + n].transpose(1, 2)
            if mask is None:  # the chunk is the whole context so far: read back its own K/V
                sl = self.slots[off: off + n]
                kc = kflat[sl].transpose(0, 1)[None]
                vc = vflat[sl].transpose(0, 1)[None]
                y = F.scaled_dot_product_attention(qs, kc, vc, is_causal=True, enable_gqa=self.gqa)
            else:
                kc = kl[blocks].flatten(0, 1)[:end].transpose(0, 1)[None]  # [1, H_kv, ctx, D]
                vc = vl[blocks].flatten(0, 1)[:end].transpose(0, 1)[None]
                y = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=mask, enable_gqa=self.gqa)
            out[:, off: off + n] = y.transpose(1, 2)
        return out


class FastCacheBackend:
    """Per-row K/V for codebook positions 0..C-1; position set per call (a Python int)."""

    def __init__(self, n_layers: int, rows: int, length: int, n_heads: int, n_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k = torch.zeros(n_layers, rows, length, n_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.group = n_heads // n_kv_heads
        self.position = 0
        self._rows = 0  # batch rows of the current step (fused path)
        self._slot_table: Tensor | None = None  # [length, rows]: row * length + position
        self._pos_table: Tensor | None = None  # [length, rows]: position

    def fused_target(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """(K cache, V cache, flat slots of this position for rows 0..B-1): the slots are a
        view into a table built once, so a captured step launches no index kernels for them."""
        if self._slot_table is None:
            rows, length = self.k.shape[1], self.k.shape[2]
            self._slot_table = (torch.arange(rows, device=self.k.device)[None, :] * length
                                + torch.arange(length, device=self.k.device)[:, None]).contiguous()
        return self.k[layer], self.v[layer], self._slot_table[self.position, : self._rows]

    def fused_positions(self) -> Tensor:
        """[rows, 1] int64 filled with this call's position: a view into a [length, rows]
        table owned by this backend and built once at full size, so captured decode graphs
        keep valid pointers and launch no fill kernel per fast position."""
        if self._pos_table is None:
            rows, length = self.k.shape[1], self.k.shape[2]
            self._pos_table = torch.arange(length, device=self.k.device)[:, None].repeat(1, rows).contiguous()
        return self._pos_table[self.position, : self._rows, None]

    def attend_only(self, layer: int, q: Tensor) -> Tensor:
        from ..kernels.fused import fast_decode_attention

        B = q.shape[0]
        out = fast_decode_attention(q[:, 0], self.k[layer, :B], self.v[layer, :B], self.position + 1)
        return out[:, None]

    def rope_attend(self, layer: int, qkv: Tensor, rope: Tensor, n_head: int, n_kv_head: int,
                    head_dim: int, *, quant: bool = False) -> Tensor | tuple[Tensor, tuple[Tensor, Tensor]]:
        """RoPE of this position's q and k (no qk-norm), its K/V written, and the attention, as one
        kernel (``SHOAL_FAST_ROPE_ATTN``; the bits of ``fused_target`` + ``qk_norm_rope_write`` +
        :meth:`attend_only`). ``qkv`` [B, (H + 2 H_kv) D]; returns [B, 1, H, D]. ``quant``
        (head_dim 128): also returns the output's 1x128 FP8 quantization ``(q [B, H*D], s [B, H])``,
        the input of an FP8 ``wo``."""
        from ..kernels.fused import fast_rope_attention

        B = qkv.shape[0]
        q8 = s8 = None
        if quant:
            q8 = torch.empty(B, n_head * head_dim, dtype=torch.float8_e4m3fn, device=qkv.device)
            s8 = torch.empty(B, n_head, dtype=torch.float32, device=qkv.device)
        out = fast_rope_attention(qkv, rope, self.k[layer], self.v[layer], self.position + 1,
                                  n_head, n_kv_head, head_dim, quant_out=(q8, s8) if quant else None)
        return (out[:, None], (q8, s8)) if quant else out[:, None]

    def write_kv(self, layer: int, k: Tensor, v: Tensor) -> None:
        B, p = k.shape[0], self.position
        self.k[layer, :B, p] = k[:, 0]
        self.v[layer, :B, p] = v[:, 0]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        B, p = q.shape[0], self.position
        self.write_kv(layer, k, v)
        kc = self.k[layer, :B, : p + 1].transpose(1, 2)
        vc = self.v[layer, :B, : p + 1].transpose(1, 2)
        return F.scaled_dot_product_attention(q.transpose(1, 2), kc, vc,
                                              enable_gqa=self.group > 1).transpose(1, 2)
