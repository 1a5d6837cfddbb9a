"""Transformer building blocks with the reference numerics (fish-speech spec §2.3-2.4).

- RMSNorm is computed in fp32 and cast back *before* the weight multiply.
- qk-norm is the stock ``rms_norm`` over each head, applied before RoPE.
- RoPE uses the interleaved-pair (GPT-J) layout with a cos/sin table rounded to **bf16**,
  applied in fp32. A fp32 table or the NeoX half-split layout changes logits by ~1e-3.

Attention itself is delegated to an :class:`AttentionBackend` so the same layer code runs
over a contiguous cache (reference loop, tests) or a paged one (the engine).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import TransformerShape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_table(length: int, head_dim: int, base: float) -> Tensor:
    """[length, head_dim/2, 2] (cos, sin) table, computed in fp32 and rounded to bf16."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    t = torch.arange(length, device=freqs.device)
    angles = torch.outer(t, freqs)
    cis = torch.polar(torch.ones_like(angles), angles)
    return torch.stack([cis.real, cis.imag], dim=-1).to(torch.bfloat16)


def apply_rope(x: Tensor, cos_sin: Tensor) -> Tensor:
    """x: [B, S, H, D]; cos_sin: [B, S, D/2, 2] (bf16). Adjacent pairs rotate, math in fp32."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    cs = cos_sin.unsqueeze(2).float()  # [B, S, 1, D/2, 2]
    cos, sin = cs[..., 0], cs[..., 1]
    a, b = xs[..., 0], xs[..., 1]
    out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return out.flatten(3).type_as(x)


class AttentionBackend(Protocol):
    """Writes this step's K/V into a cache and attends over it.

    q: [B, S, H, D], k/v: [B, S, H_kv, D] (RoPE already applied); returns [B, S, H, D].
    """

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class Attention(nn.Module):
    def __init__(self, shape: TransformerShape, eps: float) -> None:
        super().__init__()
        self.shape = shape
        self.wqkv = nn.Linear(shape.dim, shape.q_size + 2 * shape.kv_size, bias=shape.qkv_bias)
        self.wo = nn.Linear(shape.q_size, shape.dim, bias=shape.o_bias)
        if shape.qk_norm:
            self.q_norm = nn.RMSNorm(shape.head_dim, eps=eps)
            self.k_norm = nn.RMSNorm(shape.head_dim, eps=eps)

    def _qkv(self, x: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k (qk-normed where the shape says, RoPE applied) and v of ``x`` [B, S, dim]."""
        B, S, _ = x.shape
        sh = self.shape
        q, k, v = self.wqkv(x).split([sh.q_size, sh.kv_size, sh.kv_size], dim=-1)
        q = q.view(B, S, sh.n_head, sh.head_dim)
        k = k.view(B, S, sh.n_local_heads, sh.head_dim)
        v = v.view(B, S, sh.n_local_heads, sh.head_dim)
        if sh.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return apply_rope(q, cos_sin), apply_rope(k, cos_sin), v

    def forward(self, x: Tensor, cos_sin: Tensor, backend: AttentionBackend, layer: int) -> Tensor:
        B, S, _ = x.shape
        q, k, v = self._qkv(x, cos_sin)
        y = backend.attend(layer, q, k, v)
        return self.wo(y.reshape(B, S, self.shape.q_size))

    def write_kv(self, x: Tensor, cos_sin: Tensor, backend, layer: int) -> None:
        """Only this layer's K/V writes for ``x`` (what a later position reads of it), for a
        position whose output nothing reads; ``backend`` has ``write_kv(layer, k, v)``."""
        _, k, v = self._qkv(x, cos_sin)
        backend.write_kv(layer, k, v)


class FeedForward(nn.Module):
    def __init__(self, shape: TransformerShape) -> None:
        super().__init__()
        self.w1 = nn.Linear(shape.dim, shape.intermediate_size, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.intermediate_size, bias=False)
        self.w2 = nn.Linear(shape.intermediate_size, shape.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, shape: TransformerShape, eps: float) -> None:
        super().__init__()
        self.attention = Attention(shape, eps)
        self.feed_forward = FeedForward(shape)
        self.attention_norm = RMSNorm(shape.dim, eps)
        self.ffn_norm = RMSNorm(shape.dim, eps)

    def forward(self, x: Tensor, cos_sin: Tensor, backend: AttentionBackend, layer: int) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos_sin, backend, layer)
        return h + self.feed_forward(self.ffn_norm(h))

    def write_kv(self, x: Tensor, cos_sin: Tensor, backend: AttentionBackend, layer: int) -> None:
        """The K/V writes of :meth:`forward` alone (its output is not computed)."""
        self.attention.write_kv(self.attention_norm(x), cos_sin, backend, layer)
