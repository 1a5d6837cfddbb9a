"""Block-scaled FP8 (e4m3) GEMM, activation quantize and fused SwiGLU-quantize (Triton).

Scheme ("BSFP8", see /work/shared/reference/fish-scales-ops.md): activations are quantized
in 1x128 groups along K, weights in 128x128 blocks, every group/block with one fp32
*dequant* scale (``value ~= q * scale``), and the GEMM ``y[M, N] = dequant(x) @
dequant(W)^T`` is returned in bf16.

Layouts (validated by every entry point, violations raise ``ValueError``)
-------------------------------------------------------------------------
* weight   ``W_q`` : ``[N, K]``                       float8_e4m3fn, contiguous (row-major)
* weight   ``W_s`` : ``[ceil(N/128), ceil(K/128)]``   float32, contiguous (row-major);
  ``W_s[nb, kb]`` scales the block ``W_q[nb*128:(nb+1)*128, kb*128:(kb+1)*128]``;
  dequant is ``W_q * W_s[n // 128, k // 128]``. This is the DeepSeek/Qwen checkpoint
  ``weight_scale_inv`` tensor (a *multiplicative* dequant scale despite the name).
* activation ``x_q`` : ``[M, K]``                     float8_e4m3fn, unit stride along K
  (row stride may be larger, e.g. a row slice)
* activation ``x_s`` : ``[M, ceil(K/128)]``           float32, contiguous (row-major);
  ``x_s[m, kb]`` scales ``x_q[m, kb*128:(kb+1)*128]``. (Unlike fso this is *not* the
  K-major ``kb*align(M,4)+m`` layout: the metadata describes the bytes exactly.)

Both scale tensors are checked for dtype, exact shape (``(ceil(N/128), ceil(K/128))``,
not its transpose) *and* contiguity, so a transposed view, a ``.t().contiguous()`` copy
of a non-square grid, or a strided slice is rejected, never silently mis-read. A
*square* scale grid (``ceil(N/128) == ceil(K/128)``) that was transposed and made
contiguous cannot be told apart by shape/strides alone: the weight quantizer / loader
layer (implemented by the other helper, not in this file) stores a layout tag with the
checkpoint (``"bsfp8/w128x128/rowmajor-nb-kb"``, :data:`WEIGHT_SCALE_LAYOUT`) and the loader
checks it before handing tensors to these kernels.

Quantization arithmetic (references and kernels agree bit for bit)
-------------------------------------------------------------------
``amax = max(|group|)`` floored at 1e-10; ``qs = 448 / amax`` (fp32 division); stored
scale ``= 1 / qs`` (fso's rule, not ``amax/448``); ``q = e4m3_rn(clamp(v * qs, -448, 448))``
with round-to-nearest-even. Triton's interpreter does not round fp32 -> e4m3 to nearest
even, so the kernels round explicitly (bit arithmetic for normals, ``rint`` on the
subnormal grid) and the final cast only ever sees representable values; the same holds
for fp32 -> bf16 (explicit RNE before the cast).

GEMM kernel
-----------
``fp8_gemm``: programs tile ``(BLOCK_M x BLOCK_N)`` of the output and walk K in 128-wide
blocks: ``acc += dot(x_q_blk, W_q_blk^T) * x_s[m, kb] * W_s[n//128, kb]`` (raw fp8
products accumulated in fp32 per K block, scales applied to the partial sum -- the
DeepGEMM "promotion" structure). For small M the K loop is split over ``SPLIT_K``
programs so that enough CTAs stream the weight; partial fp32 sums go to a workspace
``[SPLIT_K, M, N]`` and a second small kernel adds them in a fixed order (deterministic,
no atomics) and rounds to bf16. Grids depend on shapes only, nothing syncs with the
host: CUDA-graph capturable (compile once outside the capture). With ``partials=True`` the
reduce is skipped and the workspace returned as :class:`SplitKPartials`; the kernels that read
a GEMM output (``silu_mul_quant`` here, add+RMSNorm+quantize and qk-norm+RoPE in
:mod:`shoal.kernels.fused`) then do the same ordered sum + bf16 rounding while loading
(``_load_gemm_out``): one launch fewer, the same bits (:mod:`shoal.kernels.fp8_fused`).

``silu_mul_quant(gate_up)``: ``h = silu(gate) * up`` for ``gate_up = [gate | up]``
(``[M, 2I]``, gate the first I columns -- the stacked layout of the fused ``w1|w3``
GEMM, same as :func:`shoal.kernels.fused.silu_mul`), rounded to bf16 exactly as PyTorch
does (``F.silu(g)`` rounded, then ``* up`` rounded), then 1x128-quantized -- without
writing the bf16 intermediate to memory.

Dispatch (as in :mod:`shoal.kernels.fused`): ``op_ref`` is plain PyTorch, ``op_triton``
the kernel (compiled on CUDA, interpreted on any tensors when Triton was imported with
``TRITON_INTERPRET=1``), ``op`` the kernel when it can run else the reference.

Two kernel variants, chosen per launch config (``KIND``): ``"tile"`` (``_fp8_gemm_kernel``,
tokens on the MMA's M axis; any M) and ``"swap"`` (``_fp8_gemm_swap_kernel``, swap-AB for
decode: ``acc^T = W_tile @ x_tile^T`` with 64-256 weight rows on the MMA's M axis, which lowers
to wgmma on sm_90, and 16/32 tokens on its N axis). Both compute every output element with the
same per-K-block arithmetic, so for the same split they agree up to the tensor core's order of
adding the 128 products of one K block (bit-identical whenever those sums are exact). A split-K
result is reduced either by the reduce kernel (``REDUCE`` "kernel") or inside the GEMM by the
last of a tile's split programs to finish (``REDUCE`` "fused": per-tile arrival counters,
the same ordered sum, one launch fewer; see ``_gemm_epilogue``).

Launch configs: the tuned table ``fp8_tuned.json`` (per (N, K) and M bucket, written by
``python -m shoal.bench.tune_fp8``; another table via :func:`set_tuned_table` or
``$SHOAL_FP8_TUNED``), else :func:`_heuristic_config` (see :func:`_gemm_config`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import fp8_cublas
from .paged_attention import HAS_TRITON, pdl_options, tl, triton, triton_interpreting

__all__ = [
    "ACT_SCALE_LAYOUT",
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "WEIGHT_SCALE_LAYOUT",
    "GemmOut",
    "SplitKPartials",
    "check_act",
    "check_weight",
    "dequant_act",
    "dequant_weight",
    "fp8_gemm",
    "fp8_gemm_ref",
    "fp8_gemm_triton",
    "fp8_linear",
    "fp8_linear_triton",
    "quantize_act",
    "quantize_act_ref",
    "quantize_act_triton",
    "quantize_weight_ref",
    "set_tuned_table",
    "silu_mul_quant",
    "silu_mul_quant_ref",
    "silu_mul_quant_triton",
    "splitk_reduce",
    "splitk_reduce_ref",
    "use_triton",
]

BLOCK = 128  # scale group: 1x128 for activations, 128x128 for weights
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-10
WEIGHT_SCALE_LAYOUT = "bsfp8/w128x128/rowmajor-nb-kb"
ACT_SCALE_LAYOUT = "bsfp8/a1x128/rowmajor-m-kb"


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def use_triton(t: Tensor) -> bool:
    """Whether the dispatchers run the Triton kernel for tensors like ``t``."""
    return HAS_TRITON and (t.is_cuda or triton_interpreting())


@dataclass(frozen=True)
class SplitKPartials:
    """An FP8 GEMM result left as its fp32 split-K partial sums, ``data [split, M, N]``
    (contiguous, ``split >= 2``), instead of being reduced by ``_splitk_reduce_kernel``.

    Its value is the bf16 ``[M, N]`` matrix ``round_bf16(((0 + data[0]) + data[1]) + ...)``
    (the splits added in order, one rounding, round to nearest even): what the reduce kernel
    writes. The kernels that read a GEMM output (:func:`silu_mul_quant`, and
    :func:`shoal.kernels.fused.add_rmsnorm_quant` / ``qk_norm_rope_write``) also take one of
    these and do that sum themselves while loading, so the reduce launch disappears and their
    results are bit-identical. :meth:`reduce` gives the bf16 matrix."""

    data: Tensor

    def __post_init__(self) -> None:
        d = self.data
        if not isinstance(d, Tensor) or d.dtype != torch.float32 or d.dim() != 3 or not d.is_contiguous():
            raise ValueError("SplitKPartials: data must be a contiguous fp32 [split, M, N] tensor, got "
                             f"{getattr(d, 'dtype', type(d))} {tuple(getattr(d, 'shape', ()))}")
        if d.shape[0] < 2:
            raise ValueError(f"SplitKPartials: split must be >= 2, got {d.shape[0]}")

    @property
    def split(self) -> int:
        return int(self.data.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[1]), int(self.data.shape[2]))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the value (the GEMM's bf16 output)."""
        return torch.bfloat16

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def is_cuda(self) -> bool:
        return self.data.is_cuda

    def reduce(self, out: Tensor | None = None) -> Tensor:
        """The bf16 ``[M, N]`` result (the reduce kernel when Triton can run, else PyTorch)."""
        return splitk_reduce(self, out=out)


GemmOut = Tensor | SplitKPartials
"""An FP8 GEMM output as the fused consumers take it: bf16 ``[M, N]`` or :class:`SplitKPartials`."""


def gemm_out_operand(x: GemmOut) -> tuple[Tensor, int, int, int]:
    """``(data, split, row stride, split stride)`` of a GEMM output for the kernels' SPLIT
    loads: a tensor ``[M, N]`` (unit stride along N) is ``SPLIT = 1``; partials read
    ``data[s, m, n]`` at ``s * M * N + m * N + n``."""
    if isinstance(x, SplitKPartials):
        M, N = x.shape
        return x.data, x.split, N, M * N
    if x.dim() != 2:
        raise ValueError(f"GEMM output: expected 2-D [M, N], got {tuple(x.shape)}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    return x, 1, x.stride(0), 0


def splitk_reduce_ref(p: SplitKPartials) -> Tensor:
    """PyTorch version of the reduce kernel: the splits added in order in fp32, rounded to bf16."""
    acc = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    for s in range(p.split):
        acc = acc + p.data[s]
    return acc.to(torch.bfloat16)


# --------------------------------------------------------------------------------------
# Layout validation
# --------------------------------------------------------------------------------------


def _check_scale(name: str, s: Tensor, expect: tuple[int, int], what: str) -> None:
    if not isinstance(s, Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(s).__name__}")  # noqa: TRY004 (layout errors are ValueError)
    if s.dtype != torch.float32:
        raise ValueError(f"{name}: scales must be float32, got {s.dtype}")
    if s.dim() != 2 or tuple(s.shape) != expect:
        hint = ""
        if s.dim() == 2 and tuple(s.shape) == expect[::-1]:
            hint = " (this is the transpose of the expected layout)"
        raise ValueError(f"{name}: expected shape {expect} = {what}, got {tuple(s.shape)}{hint}")
    if not s.is_contiguous():
        raise ValueError(
            f"{name}: scale tensor must be contiguous row-major (strides ({expect[1]}, 1)), got strides "
            f"{tuple(s.stride())}; a transposed or sliced scale view would be mis-read")


def check_weight(W_q: Tensor, W_s: Tensor) -> tuple[int, int]:
    """Validate ``W_q [N, K] e4m3`` contiguous and ``W_s [ceil(N/128), ceil(K/128)] fp32``
    contiguous; returns (N, K)."""
    if not isinstance(W_q, Tensor) or W_q.dtype != FP8_DTYPE:
        raise ValueError(f"W_q: must be {FP8_DTYPE}, got {getattr(W_q, 'dtype', type(W_q))}")
    if W_q.dim() != 2:
        raise ValueError(f"W_q: must be 2-D [N, K], got shape {tuple(W_q.shape)}")
    if not W_q.is_contiguous():
        raise ValueError(f"W_q: must be contiguous row-major [N, K], got strides {tuple(W_q.stride())}")
    N, K = W_q.shape
    _check_scale("W_s", W_s, (_cdiv(N, BLOCK), _cdiv(K, BLOCK)), "(ceil(N/128), ceil(K/128))")
    if W_s.device != W_q.device:
        raise ValueError(f"W_s on {W_s.device}, W_q on {W_q.device}")
    return N, K


def check_act(x_q: Tensor, x_s: Tensor) -> tuple[int, int]:
    """Validate ``x_q [M, K] e4m3`` (unit stride along K) and ``x_s [M, ceil(K/128)] fp32``
    contiguous; returns (M, K)."""
    if not isinstance(x_q, Tensor) or x_q.dtype != FP8_DTYPE:
        raise ValueError(f"x_q: must be {FP8_DTYPE}, got {getattr(x_q, 'dtype', type(x_q))}")
    if x_q.dim() != 2:
        raise ValueError(f"x_q: must be 2-D [M, K], got shape {tuple(x_q.shape)}")
    M, K = x_q.shape
    if K > 1 and x_q.stride(1) != 1:
        raise ValueError(f"x_q: K must have unit stride, got strides {tuple(x_q.stride())}")
    _check_scale("x_s", x_s, (M, _cdiv(K, BLOCK)), "(M, ceil(K/128))")
    if x_s.device != x_q.device:
        raise ValueError(f"x_s on {x_s.device}, x_q on {x_q.device}")
    return M, K


def _check_gemm(x_q, x_s, W_q, W_s) -> tuple[int, int, int]:
    M, K = check_act(x_q, x_s)
    N, K2 = check_weight(W_q, W_s)
    if K != K2:
        raise ValueError(f"K mismatch: x_q has K={K}, W_q has K={K2}")
    if x_q.device != W_q.device:
        raise ValueError(f"x_q on {x_q.device}, W_q on {W_q.device}")
    return M, N, K


# --------------------------------------------------------------------------------------
# References (plain PyTorch)
# --------------------------------------------------------------------------------------


def _quant_from_amax(v: Tensor, amax: Tensor) -> tuple[Tensor, Tensor]:
    """v fp32 [..., G, B], amax fp32 [..., G, 1] -> (q e4m3 like v, scale fp32 [..., G, 1])."""
    amax = amax.clamp_min(AMAX_FLOOR)
    # tensor / tensor: IEEE fp32 division (PyTorch's CPU ``scalar / tensor`` path can be a
    # reciprocal-multiply, 1 ulp off)
    qs = torch.full_like(amax, FP8_MAX) / amax
    scale = torch.ones_like(qs) / qs
    q = (v * qs).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_weight_ref(w: Tensor) -> tuple[Tensor, Tensor]:
    """``w [N, K]`` (any float dtype) -> ``(W_q [N, K] e4m3, W_s [ceil(N/128), ceil(K/128)] fp32)``;
    one scale per 128x128 block (ragged edges are zero-padded for the amax)."""
    if w.dim() != 2:
        raise ValueError(f"w: must be 2-D [N, K], got {tuple(w.shape)}")
    N, K = w.shape
    nb, kb = _cdiv(N, BLOCK), _cdiv(K, BLOCK)
    wp = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    wp[:N, :K] = w.float()
    blk = wp.view(nb, BLOCK, kb, BLOCK).permute(0, 2, 1, 3)  # [nb, kb, 128, 128]
    amax = blk.abs().amax(dim=(-1, -2), keepdim=True)
    q, scale = _quant_from_amax(blk, amax)
    W_q = q.permute(0, 2, 1, 3).reshape(nb * BLOCK, kb * BLOCK)[:N, :K].contiguous()
    return W_q, scale.reshape(nb, kb).contiguous()


def quantize_act_ref(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x [M, K]`` -> ``(x_q [M, K] e4m3, x_s [M, ceil(K/128)] fp32)``; one scale per 1x128 group."""
    if x.dim() != 2:
        raise ValueError(f"x: must be 2-D [M, K], got {tuple(x.shape)}")
    M, K = x.shape
    kb = _cdiv(K, BLOCK)
    xp = torch.zeros(M, kb * BLOCK, dtype=torch.float32, device=x.device)
    xp[:, :K] = x.float()
    g = xp.view(M, kb, BLOCK)
    q, scale = _quant_from_amax(g, g.abs().amax(dim=-1, keepdim=True))
    return q.reshape(M, kb * BLOCK)[:, :K].contiguous(), scale.reshape(M, kb).contiguous()


def dequant_weight(W_q: Tensor, W_s: Tensor) -> Tensor:
    """fp32 ``W_q * W_s[n//128, k//128]``."""
    N, K = check_weight(W_q, W_s)
    s = W_s.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return W_q.float() * s


def dequant_act(x_q: Tensor, x_s: Tensor) -> Tensor:
    """fp32 ``x_q * x_s[m, k//128]``."""
    _, K = check_act(x_q, x_s)
    return x_q.float() * x_s.repeat_interleave(BLOCK, 1)[:, :K]


def fp8_gemm_ref(x_q: Tensor, x_s: Tensor, W_q: Tensor, W_s: Tensor) -> Tensor:
    """``dequant(x) @ dequant(W)^T`` in fp32, rounded to bf16 ``[M, N]``."""
    _check_gemm(x_q, x_s, W_q, W_s)
    return (dequant_act(x_q, x_s) @ dequant_weight(W_q, W_s).t()).to(torch.bfloat16)


def silu_mul_quant_ref(gate_up: GemmOut) -> tuple[Tensor, Tensor]:
    """``quantize_act_ref(F.silu(gate) * up)`` with the bf16 intermediate (as the model computes it)."""
    if isinstance(gate_up, SplitKPartials):
        gate_up = splitk_reduce_ref(gate_up)
    _check_gate_up(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return quantize_act_ref(F.silu(gate) * up)


def _check_gate_up(gu: Tensor) -> int:
    if gu.dim() != 2 or gu.shape[-1] % 2:
        raise ValueError(f"gate_up: must be [M, 2I], got {tuple(gu.shape)}")
    if gu.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"gate_up: unsupported dtype {gu.dtype}")
    return gu.shape[-1] // 2


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------

if HAS_TRITON:
    from triton.language.extra import libdevice

    from .paged_attention import pdl_enter

    @triton.jit
    def _round_bf16(x):
        """fp32 -> fp32 value representable in bf16, round to nearest even (NaN kept)."""
        u = x.to(tl.uint32, bitcast=True)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return tl.where(x != x, x, u.to(tl.float32, bitcast=True))  # noqa: PLR0124

    @triton.jit
    def _round_e4m3(v):
        """fp32 v with |v| <= 448 -> fp32 value on the e4m3 grid, round to nearest even."""
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFFF + ((u >> 20) & 1)) & 0xFFF00000  # keep 3 mantissa bits
        normal = u.to(tl.float32, bitcast=True)
        # subnormal grid 2^-9: |v| + 2^14 rounds (RNE) to a multiple of 2^-9 (fp32 ulp of
        # [2^14, 2^15)); abs() sits between the producer multiply and the add, so no FMA.
        av = tl.abs(v)
        sub = (av + 16384.0) - 16384.0
        sub = tl.where(v < 0, -sub, sub)
        return tl.where(av < 0.015625, sub, normal)

    @triton.jit
    def _quant_tile(v):
        """v fp32 [G, 128] -> (e4m3 [G, 128], fp32 dequant scale [G]) per row. IEEE divisions
        (``div_rn``: a plain ``/`` compiles to the approximate ``div.full.f32`` on the GPU)."""
        amax = tl.max(tl.abs(v), axis=1)
        amax = tl.maximum(amax, 1e-10)
        qs = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
        scale = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), qs)
        y = v * qs[:, None]
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        y = _round_e4m3(y)
        return y.to(tl.float8e4nv), scale

    @triton.jit
    def _quant_rows(v, q_ptrs, s_ptrs, mask, s_mask):
        """v fp32 [G, 128] (masked lanes 0) -> store e4m3 q and one scale per row of v."""
        y, scale = _quant_tile(v)
        tl.store(q_ptrs, y, mask=mask)
        tl.store(s_ptrs, scale, mask=s_mask)

    @triton.jit
    def _quantize_act_kernel(x_ptr, q_ptr, s_ptr, K, KB, stride_xm, stride_qm,
                             GROUPS: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        m = tl.program_id(0)
        g0 = tl.program_id(1) * GROUPS
        offs_g = g0 + tl.arange(0, GROUPS)
        offs_k = offs_g[:, None] * 128 + tl.arange(0, 128)[None, :]
        mask = offs_k < K
        v = tl.load(x_ptr + m * stride_xm + offs_k, mask=mask, other=0.0).to(tl.float32)
        _quant_rows(v, q_ptr + m * stride_qm + offs_k, s_ptr + m * KB + offs_g, mask, offs_g < KB)

    @triton.jit
    def _load_gemm_out(ptrs, mask, stride_s, SPLIT: tl.constexpr):
        """fp32 values of a GEMM output at ``ptrs``: a plain load (any dtype) when SPLIT == 1,
        else the SPLIT fp32 split-K partials (``stride_s`` elements apart) added in split order
        from 0 and rounded to bf16 -- ``_splitk_reduce_kernel``'s arithmetic, so exactly the
        bf16 value the reduced output holds."""
        if SPLIT == 1:
            return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros(ptrs.shape, dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                acc += tl.load(ptrs + s * stride_s, mask=mask, other=0.0)
            return _round_bf16(acc)

    @triton.jit
    def _silu_mul_quant_kernel(gu_ptr, q_ptr, s_ptr, I, KB, stride_gm, stride_qm, stride_gs,
                               GROUPS: tl.constexpr, ROUND_BF16: tl.constexpr, ACCURATE_EXP: tl.constexpr,
                               SPLIT: tl.constexpr, PDL: tl.constexpr = False):
        """SPLIT > 1: ``gu_ptr`` is the fp32 split-K partials of the w1|w3 GEMM (``stride_gs``
        apart), summed and rounded to bf16 on load (see ``_load_gemm_out``)."""
        pdl_enter(PDL)
        m = tl.program_id(0)
        g0 = tl.program_id(1) * GROUPS
        offs_g = g0 + tl.arange(0, GROUPS)
        offs_k = offs_g[:, None] * 128 + tl.arange(0, 128)[None, :]
        mask = offs_k < I
        g = _load_gemm_out(gu_ptr + m * stride_gm + offs_k, mask, stride_gs, SPLIT)
        u = _load_gemm_out(gu_ptr + m * stride_gm + I + offs_k, mask, stride_gs, SPLIT)
        if ACCURATE_EXP:  # libdevice expf (accurate); it has no interpreter implementation
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        s = g / (1.0 + e)
        if ROUND_BF16:
            s = _round_bf16(s)
            h = _round_bf16(s * u)
        else:
            h = s * u
        h = tl.where(mask, h, 0.0)
        _quant_rows(h, q_ptr + m * stride_qm + offs_k, s_ptr + m * KB + offs_g, mask, offs_g < KB)

    @triton.jit
    def _gemm_epilogue(acc, y_ptr, part_ptr, cnt_ptr, y_offs, p_offs, mask, MN, pid_k, tile_id,
                       SPLIT_K: tl.constexpr, FUSED_REDUCE: tl.constexpr):
        """Store one program's fp32 tile ``acc``: SPLIT_K == 1: rounded to bf16 at ``y_ptr +
        y_offs``; else the fp32 partial of split ``pid_k`` at ``part_ptr + pid_k * M * N +
        p_offs`` (``MN = M * N``), and with FUSED_REDUCE the last of the tile's SPLIT_K programs
        to arrive (a per-tile arrival counter, reset to 0 by that program) adds the SPLIT_K
        partials in split order from 0 and writes the bf16 result: ``_splitk_reduce_kernel``'s
        arithmetic without its launch. Deterministic: the same sum whichever program is last."""
        if SPLIT_K == 1:
            tl.store(y_ptr + y_offs, _round_bf16(acc).to(tl.bfloat16), mask=mask)
        else:
            tl.store(part_ptr + pid_k * MN + p_offs, acc, mask=mask)
            if FUSED_REDUCE:
                tl.debug_barrier()  # every thread's partial stored before the (release) arrival
                prev = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
                if prev == SPLIT_K - 1:
                    tot = tl.zeros(acc.shape, dtype=tl.float32)
                    for s in tl.static_range(SPLIT_K):
                        tot += tl.load(part_ptr + s * MN + p_offs, mask=mask, other=0.0, cache_modifier=".cg")
                    tl.store(y_ptr + y_offs, _round_bf16(tot).to(tl.bfloat16), mask=mask)
                    tl.atomic_xchg(cnt_ptr + tile_id, 0)

    @triton.jit
    def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, KB, stride_xm,
                         stride_ym, kb_per_split,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                         QUANT_A: tl.constexpr, FUSED_REDUCE: tl.constexpr, PDL: tl.constexpr = False,
                         KB_STEP: tl.constexpr = 1):
        """KIND "tile": a (BLOCK_M tokens x BLOCK_N weight rows) output tile per program, grid
        (m tiles, n tiles, SPLIT_K); KB_STEP as in ``_fp8_gemm_swap_kernel``. QUANT_A: ``x_ptr``
        is the bf16/fp32 activation, quantized
        per 1x128 group in the prologue of every K block (the same arithmetic as
        ``_quantize_act_kernel``, so the same bytes and scales); ``xs_ptr`` is unused. Output
        (see ``_gemm_epilogue``): bf16 ``y_ptr`` (row stride ``stride_ym``) and/or the fp32
        partials ``part_ptr [SPLIT_K, M, N]``."""
        pdl_enter(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_kk = tl.arange(0, 128)
        m_mask = offs_m < M
        n_mask = offs_n < N
        nb = offs_n // 128
        kb_lo = pid_k * kb_per_split
        kb_hi = tl.minimum(kb_lo + kb_per_split, KB)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb0 in range(kb_lo, kb_hi, KB_STEP):
            for j in tl.static_range(KB_STEP):
                kb = kb0 + j
                offs_k = kb * 128 + offs_kk
                k_mask = offs_k < K
                a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None],
                            mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [128, BLOCK_N]
                if QUANT_A:
                    a, sa = _quant_tile(a.to(tl.float32))
                else:
                    sa = tl.load(xs_ptr + offs_m * KB + kb, mask=m_mask & (kb + 0 * offs_m < KB), other=0.0)
                part = tl.dot(a, b)
                sb = tl.load(ws_ptr + nb * KB + kb, mask=n_mask & (kb + 0 * offs_n < KB), other=0.0)
                acc += part * sa[:, None] * sb[None, :]  # a block past KB adds exact zeros
        _gemm_epilogue(acc, y_ptr, part_ptr, cnt_ptr, offs_m[:, None] * stride_ym + offs_n[None, :],
                       offs_m[:, None] * N + offs_n[None, :], m_mask[:, None] & n_mask[None, :], M * N, pid_k,
                       pid_m * tl.num_programs(1) + pid_n, SPLIT_K, FUSED_REDUCE)

    @triton.jit
    def _fp8_gemm_swap_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, KB, stride_xm,
                              stride_ym, kb_per_split,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                              QUANT_A: tl.constexpr, FUSED_REDUCE: tl.constexpr, PDL: tl.constexpr = False,
                              KB_STEP: tl.constexpr = 1, TMA: tl.constexpr = False, M_FAST: tl.constexpr = False):
        """KIND "swap" (decode, small M): the transposed tile ``acc[BLOCK_N, BLOCK_M] =
        W_tile @ x_tile^T`` so the weight rows (64-256) sit on the MMA's M axis (wgmma on
        sm_90) and the few tokens on its N axis; grid (n tiles, m tiles, SPLIT_K). The same
        arithmetic as ``_fp8_gemm_kernel`` element for element: per 128-wide K block the raw
        fp8 dot in fp32, then ``acc += (dot * sa[m]) * sw[n // 128, kb]``; same epilogue.

        KB_STEP: 128-wide K blocks per loop iteration (unrolled; ``kb_per_split`` is a multiple
        of it, so only the last split runs past KB, whose blocks load as zeros with zero scales
        and add exact zeros, the same expression as every other block): more bytes
        in flight per iteration and fewer loop-carried waits on the MMA, the same sums in the
        same order for the same split boundaries (rounding a split's range up to a multiple of
        KB_STEP can move them, see ``_finish_config``). TMA: ``x_ptr`` / ``w_ptr`` are tensor descriptors with [BLOCK_M, 128] /
        [BLOCK_N, 128] blocks (bulk copies into shared memory, zeros outside the tensor; not with
        QUANT_A). M_FAST: grid (m tiles, n tiles, SPLIT_K), so the programs of one weight tile
        for all token tiles launch together and share its bytes through L2."""
        pdl_enter(PDL)
        if M_FAST:
            pid_m = tl.program_id(0)
            pid_n = tl.program_id(1)
            n_tiles = tl.num_programs(1)
        else:
            pid_n = tl.program_id(0)
            pid_m = tl.program_id(1)
            n_tiles = tl.num_programs(0)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_kk = tl.arange(0, 128)
        m_mask = offs_m < M
        n_mask = offs_n < N
        nb = offs_n // 128
        kb_lo = pid_k * kb_per_split
        kb_hi = tl.minimum(kb_lo + kb_per_split, KB)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb0 in range(kb_lo, kb_hi, KB_STEP):
            for j in tl.static_range(KB_STEP):
                kb = kb0 + j
                if TMA:
                    w = w_ptr.load([pid_n * BLOCK_N, kb * 128])  # [BLOCK_N, 128]
                    a = x_ptr.load([pid_m * BLOCK_M, kb * 128])  # [BLOCK_M, 128]
                else:
                    offs_k = kb * 128 + offs_kk
                    k_mask = offs_k < K
                    w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :],
                                mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_N, 128]
                    a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                                mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, 128]
                if QUANT_A:
                    a, sa = _quant_tile(a.to(tl.float32))
                else:
                    sa = tl.load(xs_ptr + offs_m * KB + kb, mask=m_mask & (kb + 0 * offs_m < KB), other=0.0)
                part = tl.dot(w, tl.trans(a))  # [BLOCK_N, BLOCK_M]
                sw = tl.load(ws_ptr + nb * KB + kb, mask=n_mask & (kb + 0 * offs_n < KB), other=0.0)
                acc += part * sa[None, :] * sw[:, None]  # a block past KB adds exact zeros
        _gemm_epilogue(acc, y_ptr, part_ptr, cnt_ptr, offs_m[None, :] * stride_ym + offs_n[:, None],
                       offs_m[None, :] * N + offs_n[:, None], n_mask[:, None] & m_mask[None, :], M * N, pid_k,
                       pid_m * n_tiles + pid_n, SPLIT_K, FUSED_REDUCE)

    @triton.jit
    def _splitk_reduce_kernel(ws_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                              PDL: tl.constexpr = False):
        pdl_enter(PDL)
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLIT_K):
            acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
        m = offs // N
        n = offs % N
        tl.store(y_ptr + m * stride_ym + n, _round_bf16(acc).to(tl.bfloat16), mask=mask)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(t: Tensor) -> int:
    if t.is_cuda:
        return _num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 132


def _pow2(m: int) -> int:
    return 1 << max(0, int(m) - 1).bit_length()


KINDS = ("tile", "swap")
"""GEMM kernel variants a launch config's ``KIND`` selects: ``"tile"`` = ``_fp8_gemm_kernel``
(tokens on the MMA's M axis; every M), ``"swap"`` = ``_fp8_gemm_swap_kernel`` (swap-AB:
weight rows on the MMA's M axis; decode). Tables without ``KIND`` (and the first tuner's
``"dot"`` / ``"gemv"``) mean ``"tile"``."""


def _finish_config(cfg: dict, M: int, K: int) -> dict:
    """Normalize a config: derive kb_per_split, drop empty splits, fill defaults. ``KIND``:
    ``"tile"`` (default) or ``"swap"``; ``REDUCE``: how a split-K result (``SPLIT_K > 1``, no
    ``partials``) is reduced, ``"kernel"`` (default: ``_splitk_reduce_kernel``) or
    ``"fused"`` (the last split's program of each tile reduces, see ``_gemm_epilogue``; the
    same bits, one launch). ``KB_STEP`` (1, 2 or 4: K blocks per loop iteration, the K range of
    a split rounded up to a multiple of it), ``TMA`` (swap kernel only: operands through
    tensor descriptors; pre-quantized activations only, a prologue-quantized launch uses pointer
    loads) and ``M_FAST`` (swap kernel only: token tiles fastest in the grid) change the
    schedule, not the sums -- except that the rounding of a split's range to KB_STEP blocks can
    move the split boundaries (and the split count), and so the fp32 partials."""
    KB = _cdiv(K, BLOCK)
    cfg = dict(cfg)
    cfg["KIND"] = "swap" if cfg.get("KIND") == "swap" else "tile"
    cfg["REDUCE"] = "fused" if cfg.get("REDUCE") == "fused" else "kernel"
    cfg.setdefault("BLOCK_M", 16)
    cfg.setdefault("BLOCK_N", 64)
    cfg.setdefault("num_warps", 4)
    cfg.setdefault("num_stages", 4)
    step = int(cfg.get("KB_STEP") or 1)
    cfg["KB_STEP"] = step if step in (1, 2, 4) else 1
    # TMA (swap kernel, pre-quantized activations only; see _launch_gemm)
    cfg["TMA"] = bool(cfg.get("TMA")) and cfg["KIND"] == "swap"
    cfg["M_FAST"] = bool(cfg.get("M_FAST")) and cfg["KIND"] == "swap"  # grid order, see the swap kernel
    split = max(1, min(int(cfg.get("SPLIT_K", 1)), KB))
    cfg["kb_per_split"] = _cdiv(_cdiv(KB, split), cfg["KB_STEP"]) * cfg["KB_STEP"]
    cfg["SPLIT_K"] = _cdiv(KB, cfg["kb_per_split"])  # no empty splits
    return cfg


def _heuristic_config(M: int, N: int, K: int, sms: int) -> dict:
    """Fallback when the tuned table has no entry. BLOCK_N divides 128 so a tile never
    straddles two weight scale rows (the kernel handles it anyway: the weight scale is loaded
    per column)."""
    KB = _cdiv(K, BLOCK)
    bm = min(64, max(16, _pow2(M)))
    bn = 64 if M <= 64 else 128
    tiles = _cdiv(M, bm) * _cdiv(N, bn)
    split = 1
    if M <= 128 and tiles < sms:
        # enough programs for ~2 waves of weight streaming, at least 2 K blocks each
        split = max(1, min(KB // 2, _cdiv(2 * sms, tiles), 16))
    return {"BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": split, "num_warps": 4, "num_stages": 3}


TUNED_TABLE_ENV = "SHOAL_FP8_TUNED"
"""Environment variable: path of a tuned table to use instead of ``fp8_tuned.json`` beside this
file (e.g. the fresh output of ``python -m shoal.bench.tune_fp8 --out DIR``)."""

_table_override: list = []  # [path] set by set_tuned_table


def set_tuned_table(path=None) -> None:
    """Use the tuned table at ``path`` (a ``fp8_tuned.json`` as ``shoal.bench.tune_fp8`` writes
    it) from now on; ``None``: back to ``$SHOAL_FP8_TUNED`` or the packaged table. Clears the
    config caches (kernels already captured in CUDA graphs keep their configs)."""
    _table_override[:] = [] if path is None else [str(path)]
    _tuned_table.cache_clear()
    _gemm_config.cache_clear()


@functools.cache
def _tuned_table() -> dict:
    """``fp8_tuned.json`` beside this file (or :func:`set_tuned_table`'s / ``$SHOAL_FP8_TUNED``'s
    path): ``{"N,K": {"M": config}}`` measured on an H200 by ``python -m shoal.bench.tune_fp8``
    (M = the largest M of a bucket; see that module). A config may carry ``KIND``, ``REDUCE``,
    ``KB_STEP``, ``TMA`` and ``M_FAST`` (:func:`_finish_config`)."""
    import json
    import os
    from pathlib import Path

    override = _table_override[0] if _table_override else os.environ.get(TUNED_TABLE_ENV)
    path = Path(override) if override else Path(__file__).with_name("fp8_tuned.json")
    if path.is_dir():
        path = path / "fp8_tuned.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text()).get("configs", {})
    except (OSError, ValueError):
        return {}


def bucket_entry(table: dict | None, M: int) -> dict | None:
    """A tuned table's entry for one (N, K) (``{"M": config}``): the smallest bucket >= M, the
    largest bucket for bigger M; None for an empty or missing table."""
    if not table:
        return None
    buckets = sorted(int(m) for m in table)
    for b in buckets:
        if M <= b:
            return table[str(b)]
    return table[str(buckets[-1])]


def _tuned_config(M: int, N: int, K: int) -> dict | None:
    """The active table's entry for (N, K) and M's bucket (see :func:`bucket_entry`)."""
    return bucket_entry(_tuned_table().get(f"{N},{K}"), M)


@functools.lru_cache(maxsize=4096)  # per-call host overhead in eager prefill; callers copy, never mutate
def _gemm_config(M: int, N: int, K: int, sms: int) -> dict:
    """The launch config: the tuned table's entry for (N, K) and M's bucket if present (tuned on
    132-SM H200s; other GPUs fall back to the heuristic), else :func:`_heuristic_config`."""
    cfg = _tuned_config(M, N, K) if sms == 132 else None
    return _finish_config(cfg or _heuristic_config(M, N, K, sms), M, K)


def _launch_kwargs(cfg: dict, interpret: bool, t: Tensor | None = None) -> dict:
    """num_warps / num_stages (compiled only), plus a PDL launch (``pdl_options``) for ``t``."""
    if interpret:
        return {}
    return {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], **(pdl_options(t) if t is not None else {})}


def _require_triton(t: Tensor) -> bool:
    interpret = triton_interpreting()
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if not t.is_cuda and not interpret:
        raise RuntimeError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 before triton is first imported")
    return interpret


def _out_buffer(out: Tensor | None, M: int, N: int, device) -> Tensor:
    if out is None:
        return torch.empty(M, N, dtype=torch.bfloat16, device=device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (M, N) or (N > 1 and out.stride(1) != 1):
        raise ValueError(f"out: must be bf16 [{M}, {N}] with unit stride along N, got "
                         f"{out.dtype} {tuple(out.shape)} strides {tuple(out.stride())}")
    return out


_COUNTER_SLOTS = 1 << 16
_counters: dict = {}


def _tile_counters(device: torch.device, n_tiles: int) -> Tensor | None:
    """The per-device int32 arrival counters of the fused split-K reduce (all 0 between
    kernels: the last program of a tile resets its counter). Allocated on first use outside a
    CUDA-graph capture and kept for the process (captured graphs hold its address); ``None``
    (use the reduce kernel) when that is not possible or there are more tiles than slots.
    One buffer per device: two such GEMMs must not run concurrently on two streams of one
    device (shoal runs its FP8 GEMMs on one stream)."""
    if n_tiles > _COUNTER_SLOTS:
        return None
    key = (device.type, device.index)
    buf = _counters.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _counters[key] = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


def _launch_gemm(x: Tensor, x_s: Tensor | None, W_q: Tensor, W_s: Tensor, out: Tensor | None, M: int, N: int,
                 K: int, config: dict | None, interpret: bool, partials: bool = False) -> GemmOut:
    """``out=None``: allocated when a bf16 result is written. ``partials``: when the config
    splits K, return the fp32 workspace as :class:`SplitKPartials` instead of reducing it."""
    if M == 0 or N == 0 or K == 0:
        out = _out_buffer(out, M, N, x.device)
        return out.zero_() if K == 0 else out
    if config is None and x_s is not None and not interpret and fp8_cublas.usable(x, x_s, W_q, W_s):
        return fp8_cublas.gemm(x, x_s, W_q, W_s, out)  # prefill sizes: cuBLAS block-scaled
    base = _gemm_config(M, N, K, _device_sms(x))
    if config:  # an explicit config names its kernel: no KIND / REDUCE means "tile" / "kernel"
        base = {k: v for k, v in base.items() if k not in ("KIND", "REDUCE", "KB_STEP", "TMA", "M_FAST")}
    cfg = _finish_config({**base, **config}, M, K) if config else base
    KB = _cdiv(K, BLOCK)
    split = cfg["SPLIT_K"]
    if split == 1 or not partials:
        out = _out_buffer(out, M, N, x.device)
    else:
        out = None  # the partials are the result
    work = None if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    swap = cfg["KIND"] == "swap"
    tiles_m, tiles_n = _cdiv(M, cfg["BLOCK_M"]), _cdiv(N, cfg["BLOCK_N"])
    counters = None
    if split > 1 and not partials and cfg["REDUCE"] == "fused":
        counters = _tile_counters(x.device, tiles_m * tiles_n)
    grid = (tiles_n, tiles_m, split) if swap and not cfg["M_FAST"] else (tiles_m, tiles_n, split)
    kernel = _fp8_gemm_swap_kernel if swap else _fp8_gemm_kernel
    extra = {"KB_STEP": cfg["KB_STEP"]}
    xa, wa = x, W_q
    if swap:
        tma = cfg["TMA"] and x_s is not None and _tma_ok(x, W_q)
        if tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            xa = TensorDescriptor.from_tensor(x, [cfg["BLOCK_M"], BLOCK])
            wa = TensorDescriptor.from_tensor(W_q, [cfg["BLOCK_N"], BLOCK])
        extra.update(TMA=tma, M_FAST=cfg["M_FAST"])
    # unused pointer arguments get stand-ins of the used dtype (one compiled variant fewer)
    kernel[grid](xa, x if x_s is None else x_s, wa, W_s, work.view(torch.bfloat16) if out is None else out,
                 x if work is None else work, W_s if counters is None else counters, M, N, K, KB, x.stride(0),
                 N if out is None else out.stride(0), cfg["kb_per_split"], BLOCK_M=cfg["BLOCK_M"],
                 BLOCK_N=cfg["BLOCK_N"], SPLIT_K=split, QUANT_A=x_s is None, FUSED_REDUCE=counters is not None,
                 **extra, **_launch_kwargs(cfg, interpret, x))
    if split == 1:
        return out
    if partials:
        return SplitKPartials(work)
    if counters is None:
        _launch_reduce(work, out, M, N, split)
    return out


def _tma_ok(*ts: Tensor) -> bool:
    """Tensor descriptors need 16-byte aligned bases and row strides (and unit inner strides)."""
    return all(t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
               and (t.stride(0) * t.element_size()) % 16 == 0 for t in ts)


def _launch_reduce(ws: Tensor, out: Tensor, M: int, N: int, split: int) -> None:
    rb = 1024
    _splitk_reduce_kernel[(_cdiv(M * N, rb),)](ws, out, M, N, out.stride(0), SPLIT_K=split, BLOCK=rb,
                                                **pdl_options(ws))


def splitk_reduce(p: SplitKPartials, *, out: Tensor | None = None) -> Tensor:
    """The bf16 value of split-K partials (the reduce kernel when Triton can run, else
    :func:`splitk_reduce_ref`)."""
    M, N = p.shape
    out = _out_buffer(out, M, N, p.device)
    if use_triton(p.data):
        if M * N:
            _launch_reduce(p.data, out, M, N, p.split)
        return out
    out.copy_(splitk_reduce_ref(p))
    return out


def fp8_gemm_triton(x_q: Tensor, x_s: Tensor, W_q: Tensor, W_s: Tensor, *, out: Tensor | None = None,
                    config: dict | None = None, partials: bool = False) -> GemmOut:
    """Triton block-scaled FP8 GEMM -> bf16 ``[M, N]`` (into ``out`` if given: bf16 [M, N], unit
    stride along N). ``config`` overrides :func:`_gemm_config` (for tuning / tests; its
    missing tile keys come from there, a missing ``KIND`` / ``REDUCE`` means "tile" / "kernel").
    ``partials``: when the launch config splits K (``SPLIT_K > 1``), skip the reduce kernel and
    return the fp32 partials (:class:`SplitKPartials`, ``out`` unused) for a consumer that sums
    them itself; with one split the bf16 result is returned as usual."""
    M, N, K = _check_gemm(x_q, x_s, W_q, W_s)
    interpret = _require_triton(x_q)
    if out is not None:
        out = _out_buffer(out, M, N, x_q.device)
    return _launch_gemm(x_q, x_s, W_q, W_s, out, M, N, K, config, interpret, partials)


def fp8_linear_triton(x: Tensor, W_q: Tensor, W_s: Tensor, *, out: Tensor | None = None,
                      config: dict | None = None, fuse_quant: bool = False, partials: bool = False) -> GemmOut:
    """``x [M, K]`` (bf16/fp16/fp32, unit stride along K) -> bf16 ``[M, N]``, equal to
    ``fp8_gemm(*quantize_act(x), W_q, W_s)``. ``fuse_quant`` quantizes in the GEMM's prologue
    instead of a separate kernel (one launch, the same bytes and scales, so the same result).
    Off by default: measured on the H200 (2026-11-29) the prologue quantize stalls the pipelined
    weight stream (wqkv M=1: 12.4 us fused vs 8.9 us + ~1.5 us for the separate quantize).
    ``partials``: as in :func:`fp8_gemm_triton`."""
    if x.dim() != 2:
        raise ValueError(f"x: must be 2-D [M, K], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x: unsupported dtype {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N, Kw = check_weight(W_q, W_s)
    if Kw != K:
        raise ValueError(f"x has K={K} but the weight has K={Kw}")
    if not fuse_quant:
        return fp8_gemm_triton(*quantize_act_triton(x), W_q, W_s, out=out, config=config, partials=partials)
    interpret = _require_triton(x)
    if out is not None:
        out = _out_buffer(out, M, N, x.device)
    return _launch_gemm(x, None, W_q, W_s, out, M, N, K, config, interpret, partials)


def _groups_per_program(KB: int) -> int:
    return 4 if KB >= 4 else (2 if KB >= 2 else 1)


def quantize_act_triton(x: Tensor) -> tuple[Tensor, Tensor]:
    """One-pass Triton 1x128 quantize of ``x [M, K]`` (bf16/fp16/fp32, unit stride along K)."""
    if x.dim() != 2:
        raise ValueError(f"x: must be 2-D [M, K], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x: unsupported dtype {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    _require_triton(x)
    M, K = x.shape
    KB = _cdiv(K, BLOCK)
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(M, KB, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s
    G = _groups_per_program(KB)
    _quantize_act_kernel[(M, _cdiv(KB, G))](x, q, s, K, KB, x.stride(0), q.stride(0), GROUPS=G, **pdl_options(x))
    return q, s


def silu_mul_quant_triton(gate_up: GemmOut) -> tuple[Tensor, Tensor]:
    """Fused ``silu(gate) * up`` + 1x128 quantize of ``gate_up [M, 2I]`` -> (h_q [M, I], h_s).
    ``gate_up`` may be the w1|w3 GEMM's :class:`SplitKPartials` (summed on load: the same
    bytes and scales as quantizing the reduced bf16 output)."""
    I = _check_gate_up(gate_up.data[0] if isinstance(gate_up, SplitKPartials) else gate_up)
    data, split, stride_m, stride_s = gemm_out_operand(gate_up)
    interpret = _require_triton(data)
    M = gate_up.shape[0]
    KB = _cdiv(I, BLOCK)
    q = torch.empty(M, I, dtype=FP8_DTYPE, device=data.device)
    s = torch.empty(M, KB, dtype=torch.float32, device=data.device)
    if M == 0 or I == 0:
        return q, s
    G = _groups_per_program(KB)
    _silu_mul_quant_kernel[(M, _cdiv(KB, G))](data, q, s, I, KB, stride_m, q.stride(0), stride_s,
                                              GROUPS=G, ROUND_BF16=gate_up.dtype == torch.bfloat16,
                                              ACCURATE_EXP=not interpret, SPLIT=split, **pdl_options(data))
    return q, s


# --------------------------------------------------------------------------------------
# Dispatchers
# --------------------------------------------------------------------------------------


def fp8_gemm(x_q: Tensor, x_s: Tensor, W_q: Tensor, W_s: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Block-scaled FP8 GEMM ``y = dequant(x) @ dequant(W)^T`` (bf16 [M, N])."""
    if use_triton(x_q):
        return fp8_gemm_triton(x_q, x_s, W_q, W_s, out=out)
    y = fp8_gemm_ref(x_q, x_s, W_q, W_s)
    if out is not None:
        out.copy_(y)
        return out
    return y


def fp8_linear(x: Tensor, W_q: Tensor, W_s: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``dequant(quantize_act(x)) @ dequant(W)^T`` in bf16 (fused Triton kernel when it can run)."""
    if use_triton(x):
        return fp8_linear_triton(x, W_q, W_s, out=out)
    return fp8_gemm(*quantize_act_ref(x), W_q, W_s, out=out)


def quantize_act(x: Tensor) -> tuple[Tensor, Tensor]:
    """1x128 activation quantize (Triton when it can run, else the reference)."""
    return quantize_act_triton(x) if use_triton(x) else quantize_act_ref(x)


def silu_mul_quant(gate_up: GemmOut) -> tuple[Tensor, Tensor]:
    """Fused SwiGLU + 1x128 quantize of ``[gate | up]`` (a bf16 tensor or the w1|w3 GEMM's
    :class:`SplitKPartials`; Triton when it can run, else the reference)."""
    data = gate_up.data if isinstance(gate_up, SplitKPartials) else gate_up
    return silu_mul_quant_triton(gate_up) if use_triton(data) else silu_mul_quant_ref(gate_up)
