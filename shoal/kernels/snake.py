"""Fused Snake activation for the codec decoder (Triton, with a PyTorch reference).

The codec's Snake (``dac.nn.layers.snake``) is ``x + (α + 1e-9)⁻¹ · sin(αx)²`` with a
per-channel α. In PyTorch eager it is five elementwise kernels (mul, sin, pow, reciprocal,
mul, add: ~10 passes over the activation); the decoder applies it 26 times per call at up to
2048 samples per frame, so it is a large share of the codec's memory traffic.
:func:`snake` does it in one pass, optionally fused with what precedes it in the decoder:

* ``h = x (+ y) (+ bias[c])`` -- the residual add of the previous residual unit (``y`` is
  the unit's branch output) or the bias of a bias-free transposed conv;
* ``s = h + (α + 1e-9)⁻¹ · sin(αh)²`` -- written to ``out`` (any strides, e.g. a view
  inside a conv input buffer after its carried left context);
* ``h`` written to ``h_out`` when requested (the residual stream continues from it).

Tensors are 3-D ``[B, C, L]`` with arbitrary strides (channels-first or channels-last
memory); ``alpha`` and ``bias`` are ``[C]`` (or Snake's ``[1, C, 1]`` parameter).

Numerics mirror PyTorch eager on the same dtype: every operation is rounded to the storage
dtype where PyTorch rounds (``α·h``, ``sin``, the square, the reciprocal, the product, the
sum; ``x + y`` then ``+ bias``), fp32 sine is libdevice's accurate ``sinf`` (PyTorch's CUDA
``sin``), the reciprocal an IEEE division, and FMA contraction is off. fp32 results agree
with the reference to ~1 ulp of the sine; bf16 results are bit-equal except for rare 1-ulp
differences where the fp32 sine differs in its last bit across a rounding boundary.

Dispatch as in :mod:`shoal.kernels.fused`: :func:`snake` runs the kernel on CUDA tensors (or
anywhere when Triton was imported with ``TRITON_INTERPRET=1``), else :func:`snake_ref`.
Launches depend on shapes only, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from .fused import _DT_CODE, _check_dtype, _launch_opts, _require_kernel, use_triton
from .paged_attention import HAS_TRITON, tl, triton, triton_interpreting

__all__ = ["snake", "snake_ref", "snake_triton", "SNAKE_EPS"]

SNAKE_EPS = 1e-9


def _per_channel(t: Tensor | None, C: int, name: str) -> Tensor | None:
    if t is None:
        return None
    if t.numel() != C:
        raise ValueError(f"{name} must have {C} elements (one per channel), got shape {tuple(t.shape)}")
    return t.reshape(C)


def snake_ref(x: Tensor, alpha: Tensor, y: Tensor | None = None, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(s, h)``: ``h = x (+ y) (+ bias)``, ``s = h + (α + 1e-9)⁻¹ · sin(αh)²`` (layers.Snake)."""
    C = x.shape[1]
    h = x if y is None else x + y
    if bias is not None:
        h = h + _per_channel(bias, C, "bias")[:, None]
    a = _per_channel(alpha, C, "alpha")[:, None]
    return h + (a + SNAKE_EPS).reciprocal() * torch.sin(a * h).pow(2), h


if HAS_TRITON:
    from triton.language.extra import libdevice

    from .fused import _round  # noqa: F401 - called by name from the kernel

    def _fast_sin_impl(x):
        """sin(x) for fp32 x on the GPU: x reduced to [-pi, pi] (Cody-Waite, two FMAs with
        2*pi split in fp32 head and tail), then the SFU's ``sin.approx.f32`` (absolute error
        below 2^-20.9 there). Used only where the result is rounded to bf16, whose ulp is far
        above that error (tests check <= 1 ulp against PyTorch's accurate sine)."""
        k = libdevice.rint(x * 0.15915494309189535)
        r = tl.fma(-k, 6.2831854820251465, x)
        r = tl.fma(-k, -1.7484556000744883e-07, r)
        return tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [r], dtype=tl.float32,
                                         is_pure=True, pack=1)

    def _snake_math_impl(h, a, DT: tl.constexpr, ACCURATE_SIN: tl.constexpr):
        """Snake of fp32 ``h`` (values of storage dtype DT) with per-channel ``a`` broadcast to
        h's shape; every operation rounded to DT as PyTorch eager rounds it. ``ACCURATE_SIN``
        (a sine mode, see :func:`sin_mode`): 0 ``tl.sin`` (the interpreter's numpy sine), 1
        libdevice's accurate ``sinf`` (PyTorch's CUDA sine), 2 :func:`_fast_sin`."""
        inv = _round(tl.math.div_rn(1.0, _round(a + 1e-9, DT)), DT)
        ah = _round(a * h, DT)
        if ACCURATE_SIN == 2:
            sn = _fast_sin(ah)
        elif ACCURATE_SIN == 1:
            sn = libdevice.sin(ah)
        else:
            sn = tl.sin(ah)
        sn = _round(sn, DT)
        return _round(h + _round(inv * _round(sn * sn, DT), DT), DT)

    def _snake_kernel(
        x_ptr, y_ptr, b_ptr, a_ptr, o_ptr, h_ptr,
        C, L, n_cblocks, n_lblocks,
        sxb, sxc, sxl, syb, syc, syl, sob, soc, sol, shb, shc, shl,
        HAS_Y: tl.constexpr,
        HAS_B: tl.constexpr,
        WRITE_H: tl.constexpr,
        BC: tl.constexpr,
        BL: tl.constexpr,
        DT: tl.constexpr,
        ACCURATE_SIN: tl.constexpr,
    ):
        # one flat grid axis (2^31 programs; y/z stop at 65535); the tile indices in int32 (a
        # 64-bit division is a long instruction sequence), the offsets in int64
        pid = tl.program_id(0)
        row = pid // n_lblocks
        b = (row // n_cblocks).to(tl.int64)
        c = (row % n_cblocks) * BC + tl.arange(0, BC)
        l = ((pid % n_lblocks) * BL + tl.arange(0, BL)).to(tl.int64)
        cm = c < C
        m = cm[:, None] & (l < L)[None, :]
        c64 = c.to(tl.int64)
        h = tl.load(x_ptr + b * sxb + c64[:, None] * sxc + l[None, :] * sxl, mask=m, other=0.0).to(tl.float32)
        if HAS_Y:
            yv = tl.load(y_ptr + b * syb + c64[:, None] * syc + l[None, :] * syl, mask=m, other=0.0).to(tl.float32)
            h = _round(h + yv, DT)
        if HAS_B:
            bv = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
            h = _round(h + bv[:, None], DT)
        a = tl.load(a_ptr + c, mask=cm, other=1.0).to(tl.float32)
        s = _snake_math(h, a[:, None], DT, ACCURATE_SIN)
        tl.store(o_ptr + b * sob + c64[:, None] * soc + l[None, :] * sol, s.to(o_ptr.dtype.element_ty), mask=m)
        if WRITE_H:
            tl.store(h_ptr + b * shb + c64[:, None] * shc + l[None, :] * shl, h.to(h_ptr.dtype.element_ty), mask=m)

    if triton_interpreting():
        from triton.runtime.interpreter import InterpretedFunction as _Wrap
    else:
        from triton.runtime.jit import JITFunction as _Wrap

    _fast_sin = _Wrap(_fast_sin_impl)
    _snake_math = _Wrap(_snake_math_impl)

    def _snake_flat_kernel(
        x_ptr, y_ptr, b_ptr, a_ptr, o_ptr, h_ptr,
        N, n_eblocks, sxb, syb, sob, shb,
        C: tl.constexpr,
        HAS_Y: tl.constexpr,
        HAS_B: tl.constexpr,
        WRITE_H: tl.constexpr,
        BLOCK: tl.constexpr,
        DT: tl.constexpr,
        ACCURATE_SIN: tl.constexpr,
    ):
        """Channels-last rows, each batch row one contiguous [L, C] block of N = L*C elements:
        a flat 1-D tile per program (full-width vector loads, no padded channel lanes), the
        channel of element e being e % C."""
        pid = tl.program_id(0)  # B * n_eblocks < 2**31
        b = (pid // n_eblocks).to(tl.int64)
        e = (pid % n_eblocks) * BLOCK + tl.arange(0, BLOCK)
        m = e < N
        c = e % C
        h = tl.load(x_ptr + b * sxb + e, mask=m, other=0.0).to(tl.float32)
        if HAS_Y:
            yv = tl.load(y_ptr + b * syb + e, mask=m, other=0.0).to(tl.float32)
            h = _round(h + yv, DT)
        if HAS_B:
            bv = tl.load(b_ptr + c, mask=m, other=0.0).to(tl.float32)
            h = _round(h + bv, DT)
        a = tl.load(a_ptr + c, mask=m, other=1.0).to(tl.float32)
        s = _snake_math(h, a, DT, ACCURATE_SIN)
        tl.store(o_ptr + b * sob + e, s.to(o_ptr.dtype.element_ty), mask=m)
        if WRITE_H:
            tl.store(h_ptr + b * shb + e, h.to(h_ptr.dtype.element_ty), mask=m)

    @functools.cache
    def _kernel():
        return _Wrap(_snake_kernel)

    @functools.cache
    def _flat_kernel():
        return _Wrap(_snake_flat_kernel)


_FLAT_BLOCK = 2048


def sin_mode(dtype: torch.dtype, interpret: bool) -> int:
    """The Snake kernels' sine (their ``ACCURATE_SIN`` constexpr): 0 under the interpreter
    (libdevice has no interpreter implementation; numpy's sine), 2 the range-reduced SFU sine
    for bf16, whose 8-bit mantissa hides its error (within 1 ulp of PyTorch's Snake, measured
    on an H200), 1 libdevice's accurate ``sinf`` otherwise: fp32, fp16 (whose 11-bit
    significand showed 2-ulp differences with the SFU sine) and every dtype with
    ``SHOAL_SNAKE_ACCURATE_SIN=1``."""
    if interpret:
        return 0
    if dtype != torch.bfloat16 or os.environ.get("SHOAL_SNAKE_ACCURATE_SIN", "0") == "1":
        return 1
    return 2


def _flat_rows(C: int, *ts: Tensor | None) -> bool:
    """Every given tensor stores each batch row as one contiguous [L, C] block (channels-last;
    any batch stride, e.g. a conv buffer after its carried left context)."""
    return C > 1 and all(t is None or (t.stride(1) == 1 and t.stride(2) == C) for t in ts)


def _flat_enabled() -> bool:
    """Channels-last Snakes run the flat 1-D kernel (the same numbers as the tiled one; on an
    H200 at batch 64 it was 1.0-1.4x faster at every decoder rate, 4.2 TB/s with the residual
    add, docs/benchmarks.md); ``SHOAL_SNAKE_FLAT=0`` keeps the tiled kernel."""
    return os.environ.get("SHOAL_SNAKE_FLAT", "1").strip().lower() not in ("0", "false", "no", "off")


def _tile(t: Tensor) -> tuple[int, int]:
    """(BC, BL): a 1024-element tile laid along the contiguous dimension."""
    C = t.shape[1]
    if t.stride(1) == 1 and t.stride(2) != 1 and C > 1:  # channels-last
        bc = min(128, 1 << max(0, (C - 1).bit_length()))
        return bc, max(1, 1024 // bc)
    return 2, 512


def snake_triton(x: Tensor, alpha: Tensor, y: Tensor | None = None, bias: Tensor | None = None, *,
                 out: Tensor | None = None, h_out: Tensor | None = None, write_h: bool = False) -> tuple[Tensor, Tensor | None]:
    """Kernel version of :func:`snake_ref`; returns ``(s, h)`` (``h`` only when ``h_out`` is
    given or ``write_h``; else None)."""
    interpret = _require_kernel(x)
    _check_dtype("x", x)
    if x.dim() != 3:
        raise ValueError(f"x must be [B, C, L], got shape {tuple(x.shape)}")
    B, C, L = x.shape
    if y is not None and (y.shape != x.shape or y.dtype != x.dtype):
        raise ValueError("y must have x's shape and dtype")
    a = _per_channel(alpha, C, "alpha").contiguous()
    bv = _per_channel(bias, C, "bias")
    bv = bv.contiguous() if bv is not None else None
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype}")
    if h_out is None and write_h:
        h_out = torch.empty_like(x)
    if h_out is not None and (h_out.shape != x.shape or h_out.dtype != x.dtype):
        raise ValueError(f"h_out must be {tuple(x.shape)} {x.dtype}")
    if x.numel() == 0:
        return out, h_out
    yy = y if y is not None else x
    hh = h_out if h_out is not None else out
    # int32 element indices: batch rows below 2**31 elements (~500 s of audio at 96 channels);
    # longer rows take the tiled kernel
    if _flat_enabled() and _flat_rows(C, x, y, out, h_out) and L * C < 2**31 - _FLAT_BLOCK \
            and B * triton.cdiv(L * C, _FLAT_BLOCK) < 2**31:
        n = L * C
        n_eb = triton.cdiv(n, _FLAT_BLOCK)
        _flat_kernel()[(B * n_eb,)](
            x, yy, bv if bv is not None else a, a, out, hh,
            n, n_eb, x.stride(0), yy.stride(0), out.stride(0), hh.stride(0),
            C=C, HAS_Y=y is not None, HAS_B=bv is not None, WRITE_H=h_out is not None,
            BLOCK=_FLAT_BLOCK, DT=_DT_CODE[x.dtype], ACCURATE_SIN=sin_mode(x.dtype, interpret),
            **_launch_opts(4),
        )
        return out, h_out
    bc, bl = _tile(x)
    n_cb = triton.cdiv(C, bc)
    n_lb = triton.cdiv(L, bl)
    _kernel()[(B * n_cb * n_lb,)](
        x, yy, bv if bv is not None else a, a, out, hh,
        C, L, n_cb, n_lb,
        *x.stride(), *yy.stride(), *out.stride(), *hh.stride(),
        HAS_Y=y is not None,
        HAS_B=bv is not None,
        WRITE_H=h_out is not None,
        BC=bc, BL=bl,
        DT=_DT_CODE[x.dtype],
        # libdevice has no interpreter implementation; the interpreter's sin is numpy's.
        ACCURATE_SIN=sin_mode(x.dtype, interpret),
        **_launch_opts(4),
    )
    return out, h_out


def snake(x: Tensor, alpha: Tensor, y: Tensor | None = None, bias: Tensor | None = None, *,
          out: Tensor | None = None, h_out: Tensor | None = None, write_h: bool = False) -> tuple[Tensor, Tensor | None]:
    """``(s, h)`` with ``h = x (+ y) (+ bias[c])`` and ``s = Snake_α(h)``.

    ``out`` / ``h_out`` (optional, any strides) receive ``s`` / ``h``. ``h`` is returned when
    ``h_out`` is given or ``write_h`` (on the reference path it is returned whenever computed).
    """
    if use_triton(x):
        return snake_triton(x, alpha, y, bias, out=out, h_out=h_out, write_h=write_h)
    s, h = snake_ref(x, alpha, y, bias)
    if out is not None:
        out.copy_(s)
        s = out
    if h_out is not None:
        h_out.copy_(h)
        h = h_out
    return s, h
