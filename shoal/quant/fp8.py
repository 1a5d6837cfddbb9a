"""Block-scaled FP8 (e4m3) math in pure PyTorch: the one definition shoal's checkpoint writer,
loader, CPU model path and (later) the Triton kernels' reference helpers share.

Scheme (docs/quantization.md, /work/shared/reference/fish-scales-ops.md §2.3):

- Weights ``W [N, K]``: one fp32 scale per 128x128 block, ``W_s [ceil(N/128), ceil(K/128)]``
  **row-major** (``W_s[i, j]`` covers rows ``128i..128i+127`` and columns ``128j..128j+127``).
  ``amax`` of the block (floored at 1e-10), ``qs = 448 / amax``, stored scale ``1 / qs``
  (the multiplicative *dequant* scale, ~``amax / 448``), ``W_q = e4m3(sat(W * qs))``.
  Dequantization: ``W ≈ W_q * W_s`` broadcast over each block.
- Activations ``x [..., K]``: the same formula per 1x128 group along K (fake-quant here).
- Partial blocks at the right/bottom edge (N or K not a multiple of 128) use the amax of the
  elements that exist.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

BLOCK = 128
FP8_MAX = 448.0
AMAX_FLOOR = 1e-10
FP8_DTYPE = torch.float8_e4m3fn


def scale_shape(n: int, k: int, block: int = BLOCK) -> tuple[int, int]:
    """Shape of the weight scale grid of an ``[n, k]`` weight: ``[ceil(n/128), ceil(k/128)]``."""
    return (math.ceil(n / block), math.ceil(k / block))


def _pad_blocks(w: Tensor, block: int) -> Tensor:
    n, k = w.shape
    pn, pk = (-n) % block, (-k) % block
    if pn or pk:
        w = nn.functional.pad(w, (0, pk, 0, pn))
    return w


def quantize_weight_block(w: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """``w [N, K]`` (any float dtype) -> ``(W_q float8_e4m3fn [N, K], W_s fp32 [ceil(N/b),
    ceil(K/b)])``, both contiguous, W_s row-major. The single source of the block math."""
    if w.dim() != 2:
        raise ValueError(f"quantize_weight_block expects a 2-D weight, got shape {list(w.shape)}")
    n, k = w.shape
    nb, kb = scale_shape(n, k, block)
    wf = _pad_blocks(w.float(), block).view(nb, block, kb, block)
    amax = wf.abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)  # [nb, kb]
    qs = FP8_MAX / amax
    scale = (1.0 / qs).contiguous()
    q = (wf * qs[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(nb * block, kb * block)[:n, :k].to(FP8_DTYPE).contiguous()
    return q, scale


def expand_scale(scale: Tensor, n: int, k: int, block: int = BLOCK) -> Tensor:
    """``[nb, kb]`` block scales -> ``[n, k]`` per-element scales."""
    return scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


def dequantize_weight_block(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32,
                            block: int = BLOCK) -> Tensor:
    """``(W_q [N, K], W_s [ceil(N/b), ceil(K/b)])`` -> ``W`` in ``dtype`` (computed in fp32)."""
    n, k = q.shape
    if tuple(scale.shape) != scale_shape(n, k, block):
        raise ValueError(f"scale shape {list(scale.shape)} does not match weight {[n, k]} "
                         f"(expected {list(scale_shape(n, k, block))})")
    return (q.float() * expand_scale(scale.float(), n, k, block)).to(dtype)


def fake_quantize_act(x: Tensor, block: int = BLOCK) -> Tensor:
    """Activation quantize-dequantize per 1x``block`` group along the last dim, in fp32:
    ``amax/448`` scales (as ``1/(448/amax)``), e4m3 round-to-nearest with saturation."""
    k = x.shape[-1]
    xf = x.float()
    pk = (-k) % block
    if pk:
        xf = nn.functional.pad(xf, (0, pk))
    g = xf.reshape(*xf.shape[:-1], -1, block)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR)
    qs = FP8_MAX / amax
    scale = 1.0 / qs
    q = (g * qs).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    return (q * scale).reshape(*xf.shape)[..., :k]


# ------------------------------------------------------------------ fingerprint
# Fixed relative positions (row fraction, column fraction) whose dequantized values are recorded.
_FP_POSITIONS = ((0.0, 0.0), (1.0, 1.0), (0.5, 0.3), (1.0, 0.0), (0.0, 1.0), (0.77, 0.61))


def fingerprint(q: Tensor, scale: Tensor, block: int = BLOCK) -> list[float]:
    """A few fp64 checksums of ``dequant(W_q, W_s)`` that depend on which scale multiplies which
    block, so a transposed (even square) or permuted scale grid changes them:

    ``[Σ W, Σ |W|, Σ_ij |W|_block(i,j) * (1 + (7i + 3j) % 11), W at 6 fixed positions...]``.
    Computed from per-block sums, so it is cheap even for large weights.
    """
    n, k = q.shape
    nb, kb = scale_shape(n, k, block)
    if tuple(scale.shape) != (nb, kb):
        raise ValueError(f"scale shape {list(scale.shape)} != {[nb, kb]}")
    qf = _pad_blocks(q.float(), block).view(nb, block, kb, block)
    s = scale.double()
    bsum = qf.sum(dim=(1, 3), dtype=torch.float64)
    babs = qf.abs().sum(dim=(1, 3), dtype=torch.float64)
    i = torch.arange(nb, dtype=torch.float64)[:, None]
    j = torch.arange(kb, dtype=torch.float64)[None, :]
    weight = 1.0 + torch.remainder(7 * i + 3 * j, 11)
    out = [float((bsum * s).sum()), float((babs * s).sum()), float((babs * s * weight).sum())]
    for fr, fc in _FP_POSITIONS:
        r, c = round(fr * (n - 1)), round(fc * (k - 1))
        out.append(float(q[r, c].double() * s[r // block, c // block]))
    return out


def fingerprints_match(a: list[float], b: list[float], rtol: float = 1e-6) -> bool:
    if len(a) != len(b):
        return False
    return all(abs(x - y) <= rtol * max(abs(x), abs(y)) + 1e-30 for x, y in zip(a, b))


# ------------------------------------------------------------------ CPU model path
class FP8Linear(nn.Module):
    """A Linear whose weight is stored as ``(W_q e4m3 [N, K], W_s fp32 [N/128, K/128])``.

    ``forward`` reproduces the block-FP8 GEMM numerics in pure PyTorch: activations are
    quantized per 1x128 group (e4m3, amax/448), products accumulate in fp32 against the
    block-dequantized weight, the result is cast to the input dtype (bf16 when serving) and the
    bias (kept in high precision) is added. On GPU the Triton GEMM replaces this body.
    """

    def __init__(self, weight_q: Tensor, weight_scale: Tensor, bias: Tensor | None = None,
                 quantize_activations: bool = True, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.dtype = dtype  # the dtype of the Linear it replaces (what .weight reports)
        if weight_q.dtype != FP8_DTYPE:
            raise ValueError(f"weight_q must be {FP8_DTYPE}, got {weight_q.dtype}")
        n, k = weight_q.shape
        if tuple(weight_scale.shape) != scale_shape(n, k) or weight_scale.dtype != torch.float32:
            raise ValueError(f"weight_scale must be fp32 {list(scale_shape(n, k))}, got "
                             f"{weight_scale.dtype} {list(weight_scale.shape)}")
        self.in_features, self.out_features = k, n
        self.quantize_activations = quantize_activations
        self.register_buffer("weight_q", weight_q.contiguous())
        self.register_buffer("weight_scale", weight_scale.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._w_cache: Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, quantize_activations: bool = True) -> FP8Linear:
        q, s = quantize_weight_block(linear.weight.detach())
        return cls(q, s, linear.bias, quantize_activations, dtype=linear.weight.dtype)

    def dequantized_weight(self) -> Tensor:
        """fp32 ``[N, K]`` (cached; the buffers are treated as immutable once built)."""
        if self._w_cache is None or self._w_cache.device != self.weight_q.device:
            self._w_cache = dequantize_weight_block(self.weight_q, self.weight_scale)
        return self._w_cache

    @property
    def weight(self) -> Tensor:
        """Dequantized weight in the bias/activation dtype, for code that reads ``.weight``
        directly (e.g. the fast head's ``weight[:n_out]``); weight-only FP8 on that path."""
        return self.dequantized_weight().to(self.dtype)

    def use_kernels(self, x: Tensor) -> bool:
        """Whether ``forward`` runs the Triton kernels (CUDA tensors, activation quantization on)."""
        from ..kernels import fp8 as kfp8

        return self.quantize_activations and x.is_cuda and kfp8.HAS_TRITON

    def forward(self, x: Tensor) -> Tensor:
        if self.use_kernels(x):
            return self.forward_kernels(x)
        xf = fake_quantize_act(x) if self.quantize_activations else x.float()
        y = (xf @ self.dequantized_weight().t()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y

    def forward_kernels(self, x: Tensor, quantized: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """GPU body: block-scaled FP8 GEMM with the 1x128 activation quantize fused in (bf16 out, fp32
        accumulation per 128-wide K block with both scales applied to the partial sums).
        ``quantized``: ``(x_q, x_s)`` already produced by a fused kernel (e.g. SwiGLU + quantize)."""
        from ..kernels import fp8 as kfp8

        if quantized is None:
            lead = x.shape[:-1]
            y = kfp8.fp8_linear(x.reshape(-1, x.shape[-1]), self.weight_q, self.weight_scale)
        else:
            lead = quantized[0].shape[:-1]
            y = kfp8.fp8_gemm(*quantized, self.weight_q, self.weight_scale)
        if y.dtype != self.dtype:
            y = y.to(self.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*lead, self.out_features)

    @classmethod
    def concat(cls, parts: list[FP8Linear]) -> FP8Linear:
        """One FP8Linear computing ``cat([p(x) for p in parts], -1)`` (e.g. ``w1 | w3``): rows of
        ``W_q`` and of the block-scale grid stacked; every part but the last must have a multiple
        of 128 output rows so no 128x128 block straddles two parts."""
        for p in parts[:-1]:
            if p.out_features % BLOCK:
                raise ValueError(f"concat: {p.out_features} output rows is not a multiple of {BLOCK}")
        if len({p.in_features for p in parts}) != 1 or any(p.bias is not None for p in parts):
            raise ValueError("concat: parts must share in_features and have no bias")
        q = torch.cat([p.weight_q for p in parts], 0)
        s = torch.cat([p.weight_scale for p in parts], 0)
        return cls(q, s, None, parts[0].quantize_activations, dtype=parts[0].dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fp8=e4m3 block128")
