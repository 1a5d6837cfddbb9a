"""A contiguous KV cache and attention backend: one row of [max_len] slots per sequence.

Used by the reference generation loop and the tests. Every row has its own positions, so a
batch may mix sequences of different lengths; attention is length-aware (keys beyond a
query's position are masked, keys beyond the longest live position are never read).
With ``kv_dtype="fp8"`` it stores e4m3 keys and values with one scale per (token, KV head)
(:mod:`shoal.quant.kv`, the engine's FP8 KV cache) and attends in fp32 over their
dequantized values, so the reference loop decodes with the numerics the engine serves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class StaticKVCache:
    def __init__(self, n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
                 n_heads: int, dtype: torch.dtype, device: torch.device | str,
                 kv_dtype: torch.dtype | str | None = None) -> None:
        from ..quant.kv import FP8_KV_DTYPE, parse_kv_cache_dtype

        kv_dtype = parse_kv_cache_dtype(kv_dtype)
        self.fp8 = kv_dtype == FP8_KV_DTYPE
        shape = (n_layers, batch, max_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=kv_dtype or dtype, device=device)
        self.v = torch.zeros(shape, dtype=kv_dtype or dtype, device=device)
        self.k_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device) if self.fp8 else None
        self.v_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device) if self.fp8 else None
        self.max_len = max_len
        self.group = n_heads // n_kv_heads
        self._rows: Tensor | None = None
        self._positions: Tensor | None = None
        self._mask: Tensor | None = None
        self._kv_len = 0

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def bind(self, positions: Tensor, rows: Tensor | None = None) -> None:
        """Set the positions [B, S] of the next forward; ``rows`` picks cache rows (default 0..B-1)."""
        if positions.dim() != 2:
            raise ValueError("positions must be [batch, seq]")
        if int(positions.max()) >= self.max_len or int(positions.min()) < 0:
            raise ValueError(
                f"position out of range [0, {self.max_len}): the sequence is longer than the cache"
            )
        B = positions.shape[0]
        if rows is None:
            rows = torch.arange(B, device=positions.device)
        self._rows = rows
        self._positions = positions
        self._kv_len = int(positions.max()) + 1
        keys = torch.arange(self._kv_len, device=positions.device)
        self._mask = (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B,1,S,kv]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        assert self._positions is not None and self._rows is not None, "bind() before forward"
        rows = self._rows[:, None].expand_as(self._positions)
        keys = self._write_read(layer, rows, self.k, self.k_scale, k)  # [B, Hkv, kv, D]
        vals = self._write_read(layer, rows, self.v, self.v_scale, v)
        if self.group > 1:
            keys = keys.repeat_interleave(self.group, dim=1)
            vals = vals.repeat_interleave(self.group, dim=1)
        # an FP8 cache is read dequantized in fp32, so the queries go in fp32 too
        qs = q.float() if self.fp8 else q
        y = F.scaled_dot_product_attention(qs.transpose(1, 2), keys, vals, attn_mask=self._mask)
        return y.transpose(1, 2).to(q.dtype)

    def write_kv(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Store this forward's K/V at the bound (rows, positions), reading nothing."""
        assert self._positions is not None and self._rows is not None, "bind() before forward"
        rows = self._rows[:, None].expand_as(self._positions)
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            self._store(layer, rows, cache, scales, x)

    def _store(self, layer: int, rows: Tensor, cache: Tensor, scales: Tensor | None, x: Tensor) -> None:
        if scales is None:
            cache[layer][rows, self._positions] = x
            return
        from ..quant.kv import quantize_kv

        xq, xs = quantize_kv(x)
        cache[layer].view(torch.uint8)[rows, self._positions] = xq.view(torch.uint8)  # no fp8 index_put on CPU
        scales[layer][rows, self._positions] = xs

    def _write_read(self, layer: int, rows: Tensor, cache: Tensor, scales: Tensor | None, x: Tensor) -> Tensor:
        """Store x at (rows, positions) of ``cache[layer]``; return the live context of the
        bound rows as [B, Hkv, kv, D] (dequantized to fp32 for an FP8 cache)."""
        self._store(layer, rows, cache, scales, x)
        if scales is None:
            return cache[layer][self._rows, : self._kv_len].transpose(1, 2)
        from ..quant.kv import dequantize_kv

        return dequantize_kv(cache[layer][self._rows, : self._kv_len],
                             scales[layer][self._rows, : self._kv_len]).transpose(1, 2)
