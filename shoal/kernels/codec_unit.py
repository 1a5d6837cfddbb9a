"""A whole residual unit of the codec decoder in one kernel (Triton, channels-last).

A decoder residual unit is ``h' = h + conv1(Snake2(conv7(Snake1(h))))`` followed by the next
Snake (of the next unit, block or the final conv). The serving decoder's ``fused`` mode runs
it as two implicit-GEMM convs (:mod:`shoal.kernels.codec_conv`): the dilated k=7 conv writes
its output ``a``, and the k=1 conv reads ``a`` back, applies ``Snake2`` to the tiles it loads,
adds its bias and the residual ``h`` and writes ``h'`` and ``Snake(h')``. At the decoder's
high rates (96 and 192 channels, up to 2,048 samples per frame) ``a`` is as large as every
other activation: one write and one read of it per unit, and a second launch.

:func:`residual_unit_triton` keeps ``a`` on chip. A program owns ``BT`` output rows and *every*
channel (``C = BN + BN2``, two power-of-two tiles: 96 = 64 + 32, 192 = 128 + 64): it runs the
k=7 conv's loop exactly as the conv kernel does (same tiles, same order), rounds ``a + bias``
to the storage dtype, applies ``Snake2`` (rounded as the Snake kernel rounds), multiplies the
result by the k=1 weight in registers / shared memory, and ends with the k=1 conv's epilogue
(bias, residual, ``h'``, the next Snake). The k=1 products are summed over the input channels
in ascending order, as the k=1 conv kernel's channel loop sums them: on the GPU the result is
the bits of the separate kernels (GPU tests, H100 and H200, 96 and 192 channels). A second
tile narrower than 64 channels runs the k=1 conv transposed (:func:`default_k1_trans`).
Under the interpreter, whose matrix products group their sums by tile, it agrees to rounding.

Inputs follow :func:`shoal.kernels.codec_conv.conv1d_cl_triton`: ``x`` is the k=7 conv's
input buffer ``[B, C, L_in]`` (left context included, ``Snake1`` already applied, channels-last
memory); weights are packed ``[K, C_in, C_out]``. :func:`residual_unit_ref` is the reference
(the two convs through ``F.conv1d`` and the Snake reference, each result rounded).
"""

from __future__ import annotations

import functools
import torch
import torch.nn.functional as F
from torch import Tensor

from ..envutil import env_int
from .codec_conv import (_has_tma, _smem_bytes, _tma_ok, conv_outputs, fit_stages, full_config,
                         launch_with_fallback, tile_operands)
from .fused import _DT_CODE, _check_dtype, _require_kernel
from .paged_attention import HAS_TRITON, tl, triton, triton_interpreting
from .snake import sin_mode, snake_ref

__all__ = ["default_k1_trans", "residual_unit_ref", "residual_unit_triton", "unit_config", "unit_supported"]

# (BT, BN, BC, num_warps, num_stages, TMA, FLAT, BN2) by channel count: the k=7 loop's tiles
# (BN + BN2 = C). 192: the fastest of 7 tiles on an H100 (2026-12-05, 64 x 32-frame call,
# `python -m shoal.bench.kernels_codec_conv --units 192`): 3.54 ms a unit against 4.54 for the
# two kernels, bit-equal. 96: on an H200 (2026-12-05, `benchmarks/scripts/unit96_probe.py`)
# 2.32-2.34 ms a unit with the k=1 conv transposed, against 2.70-2.74 for the k1 mode's three
# kernels, bit-equal.
_UNIT_CONFIGS: dict[int, tuple[int, ...]] = {
    96: (128, 64, 32, 4, 4, 1, 1, 32),
    192: (64, 128, 64, 4, 3, 1, 1, 64),
}
MAX_UNIT_CHANNELS = 192
# the last launch's descriptor / ordering switches (read by the tests)
LAST_LAUNCH: dict[str, bool] = {}


def default_k1_trans(bn2: int) -> bool:
    """Whether the k=1 conv runs transposed by default: when the second channel tile is
    narrower than 64. In the direct form such a tile's Snake'd values go into the k=1 MMAs as
    a register operand 16 or 32 wide, and on Hopper (H100 and H200, Triton 3.6) that tile's
    output channels came out wrong (off by up to 9.7 at 96 = 64 + 32 channels, every tile
    height, pointer and descriptor loads), while a 64-wide second tile and the transposed
    form (the Snake'd tiles read from shared memory) give the separate kernels' bits."""
    return 0 < bn2 < 64


def _split(c: int) -> tuple[int, int]:
    """Two power-of-two tiles covering ``c`` channels with the least padding (BN >= BN2)."""
    bn = 1 << (max(c, 16) - 1).bit_length()
    if bn == c or bn < 32:
        return bn, 0
    half = bn // 2
    rest = c - half
    bn2 = max(16, 1 << (rest - 1).bit_length())
    return (half, bn2) if half + bn2 < bn else (bn, 0)


def unit_supported(c: int) -> bool:
    """Whether a unit of ``c`` channels runs as one kernel: Triton is there and the unit's
    accumulators fit a program."""
    return HAS_TRITON and c <= MAX_UNIT_CHANNELS


def unit_config(c: int) -> tuple[int, ...]:
    """The kernel's tiles for ``c`` channels (the table, else two tiles from :func:`_split`)."""
    cfg = _UNIT_CONFIGS.get(c)
    if cfg is not None:
        return cfg
    bn, bn2 = _split(c)
    bc = min(64, max(16, 1 << (max(c, 16) - 1).bit_length()))
    return (64, bn, bc, 4, 2, 0, 0, bn2)


def residual_unit_ref(x: Tensor, w7: Tensor, b7: Tensor | None, dilation: int, alpha2: Tensor,
                      w1: Tensor, b1: Tensor | None, residual: Tensor,
                      snake_alpha: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``(h', Snake(h'))`` with nn.Conv1d weights (``[C_out, C_in, K]``), each step rounded to
    the storage dtype as the separate kernels round it."""
    a = F.conv1d(x.float(), w7.float(), None if b7 is None else b7.float(), 1, 0, dilation).to(x.dtype)
    s = snake_ref(a, alpha2)[0]
    y = F.conv1d(s.float(), w1.float(), None if b1 is None else b1.float()).to(x.dtype)
    h = (residual.float() + y.float()).to(x.dtype)
    return h, (snake_ref(h, snake_alpha)[0] if snake_alpha is not None else None)


if HAS_TRITON:
    from .codec_conv import _epilogue, _mma  # noqa: F401 - called by name from the kernel
    from .fused import _round  # noqa: F401
    from .snake import _snake_math  # noqa: F401

    def _mid_impl(acc, b_ptr, p_ptr, n, C, DT: tl.constexpr, ACCURATE_SIN: tl.constexpr):
        """The k=7 conv's result as the k=1 conv reads it: ``Snake2(round(acc + bias))``,
        rounded to the storage dtype (padded channels: bias 0, so Snake(0) = 0)."""
        nm = n < C
        bias = tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
        a = _round(acc + bias[None, :], DT)
        alpha = tl.load(p_ptr + n, mask=nm, other=1.0).to(tl.float32)
        return _snake_math(a, alpha[None, :], DT, ACCURATE_SIN)

    def _k1_second_impl(s1, s2, v_ptr, vc_ptr, vd_ptr, n, n2, nm, nm2, C, BT: tl.constexpr,
                        BN: tl.constexpr, BN2: tl.constexpr, V_TMA: tl.constexpr,
                        IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """The k=1 conv's second output tile (channels ``n2``): ``s1 @ W[n, n2] + s2 @ W[n2, n2]``."""
        if V_TMA:
            v_ab = vc_ptr.load([0, BN])
            v_bb = vd_ptr.load([BN, BN])
        else:
            v_ab = tl.load(v_ptr + n[:, None] * C + n2[None, :], mask=nm[:, None] & nm2[None, :], other=0.0)
            v_bb = tl.load(v_ptr + n2[:, None] * C + n2[None, :], mask=nm2[:, None] & nm2[None, :], other=0.0)
        out2 = _mma(s1, v_ab, tl.zeros((BT, BN2), dtype=tl.float32), IEEE, UPCAST)
        return _mma(s2, v_bb, out2, IEEE, UPCAST)

    def _unit_kernel(
        x_ptr, w_ptr, w2_ptr, b7_ptr, p_ptr, v_ptr, va_ptr, vb_ptr, vc_ptr, vd_ptr,
        b1_ptr, r_ptr, o_ptr, a_ptr, s_ptr,
        L_out, C, n_tb, x_rows,
        sxb, sxc, sxl, srb, src, srl, sob, soc, sol, ssb, ssc, ssl,
        K: tl.constexpr,
        DIL: tl.constexpr,
        WRITE_O: tl.constexpr,
        SNAKE: tl.constexpr,
        ACCURATE_SIN: tl.constexpr,
        BT: tl.constexpr,
        BN: tl.constexpr,
        BC: tl.constexpr,
        BN2: tl.constexpr,
        DT: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        FLAT: tl.constexpr,
        TMA: tl.constexpr,
        K1_TRANS: tl.constexpr = False,
        V_TMA: tl.constexpr = False,
        K1_EARLY: tl.constexpr = False,
    ):
        pid = tl.program_id(0).to(tl.int64)
        tb = pid % n_tb
        b = pid // n_tb
        t = tb * BT + tl.arange(0, BT)
        tm = t < L_out
        n = tl.arange(0, BN).to(tl.int32)
        nm = n < C
        acc = tl.zeros((BT, BN), dtype=tl.float32)
        if BN2 > 0:
            n2 = (BN + tl.arange(0, BN2)).to(tl.int32)
            nm2 = n2 < C
            acc2 = tl.zeros((BT, BN2), dtype=tl.float32)
        # ---- the k=7 conv: the conv kernel's loops with one channel block (nb = 0)
        if TMA:
            row0 = (b * x_rows + tb * BT).to(tl.int32)
            if FLAT:
                n_cc = C // BC
                for it in range(0, K * n_cc):
                    k = it // n_cc
                    c0 = (it % n_cc) * BC
                    a = x_ptr.load([row0 + k * DIL, c0])
                    w = w_ptr.load([k * C + c0, 0])
                    acc = _mma(a, w, acc, IEEE, UPCAST)
                    if BN2 > 0:
                        w2 = w2_ptr.load([k * C + c0, BN])
                        acc2 = _mma(a, w2, acc2, IEEE, UPCAST)
            else:
                for k in tl.static_range(K):
                    for c0 in range(0, C, BC):
                        a = x_ptr.load([row0 + k * DIL, c0])
                        w = w_ptr.load([k * C + c0, 0])
                        acc = _mma(a, w, acc, IEEE, UPCAST)
                        if BN2 > 0:
                            w2 = w2_ptr.load([k * C + c0, BN])
                            acc2 = _mma(a, w2, acc2, IEEE, UPCAST)
        else:
            xb = x_ptr + b * sxb
            n_cc = tl.cdiv(C, BC)
            for it in range(0, K * n_cc):
                k = it // n_cc
                c = (it % n_cc) * BC + tl.arange(0, BC)
                cm = c < C
                a = tl.load(xb + (t + k * DIL)[:, None] * sxl + c[None, :].to(tl.int64) * sxc,
                            mask=tm[:, None] & cm[None, :], other=0.0)
                wrow = (k * C + c)[:, None].to(tl.int64) * C
                w = tl.load(w_ptr + wrow + n[None, :], mask=cm[:, None] & nm[None, :], other=0.0)
                acc = _mma(a, w, acc, IEEE, UPCAST)
                if BN2 > 0:
                    w2 = tl.load(w_ptr + wrow + n2[None, :], mask=cm[:, None] & nm2[None, :], other=0.0)
                    acc2 = _mma(a, w2, acc2, IEEE, UPCAST)
        # ---- Snake2 of the k=7 result, kept on chip in the storage dtype
        s1 = _mid(acc, b7_ptr, p_ptr, n, C, DT, ACCURATE_SIN).to(o_ptr.dtype.element_ty)
        if K1_TRANS:
            # the k=1 conv transposed, out^T = W1^T @ Snake2^T: the Snake'd tiles are the MMAs'
            # second operand (shared memory), the k=1 weight's transposed tiles the first. Same
            # products, summed over the input channels in the same ascending order.
            if V_TMA:  # the k=1 weight's tiles straight into shared memory (descriptors)
                vt_aa = tl.trans(va_ptr.load([0, 0]))
            else:
                vt_aa = tl.load(v_ptr + n[None, :] * C + n[:, None], mask=nm[None, :] & nm[:, None], other=0.0)
            o1 = _mma(vt_aa, tl.trans(s1), tl.zeros((BN, BT), dtype=tl.float32), IEEE, UPCAST)
            if BN2 > 0:
                s2 = _mid(acc2, b7_ptr, p_ptr, n2, C, DT, ACCURATE_SIN).to(o_ptr.dtype.element_ty)
                if V_TMA:
                    vt_ab = tl.trans(vb_ptr.load([BN, 0]))
                else:
                    vt_ab = tl.load(v_ptr + n2[None, :] * C + n[:, None], mask=nm2[None, :] & nm[:, None], other=0.0)
                o1 = _mma(vt_ab, tl.trans(s2), o1, IEEE, UPCAST)
            _epilogue(tl.trans(o1), b, t, n, tm, C, b1_ptr, r_ptr, o_ptr, a_ptr, s_ptr,
                      srb, src, srl, sob, soc, sol, ssb, ssc, ssl,
                      True, False, True, WRITE_O, SNAKE, ACCURATE_SIN, DT)
            if BN2 > 0:
                if V_TMA:
                    vt_ba = tl.trans(vc_ptr.load([0, BN]))
                    vt_bb = tl.trans(vd_ptr.load([BN, BN]))
                else:
                    vt_ba = tl.load(v_ptr + n[None, :] * C + n2[:, None], mask=nm[None, :] & nm2[:, None], other=0.0)
                    vt_bb = tl.load(v_ptr + n2[None, :] * C + n2[:, None], mask=nm2[None, :] & nm2[:, None], other=0.0)
                o2 = _mma(vt_ba, tl.trans(s1), tl.zeros((BN2, BT), dtype=tl.float32), IEEE, UPCAST)
                o2 = _mma(vt_bb, tl.trans(s2), o2, IEEE, UPCAST)
                _epilogue(tl.trans(o2), b, t, n2, tm, C, b1_ptr, r_ptr, o_ptr, a_ptr, s_ptr,
                          srb, src, srl, sob, soc, sol, ssb, ssc, ssl,
                          True, False, True, WRITE_O, SNAKE, ACCURATE_SIN, DT)
        else:
            # ---- the k=1 conv over the input channels in ascending order, then its epilogue
            if V_TMA:
                v_aa = va_ptr.load([0, 0])
            else:
                v_aa = tl.load(v_ptr + n[:, None] * C + n[None, :], mask=nm[:, None] & nm[None, :], other=0.0)
            out1 = _mma(s1, v_aa, tl.zeros((BT, BN), dtype=tl.float32), IEEE, UPCAST)
            if BN2 > 0:
                s2 = _mid(acc2, b7_ptr, p_ptr, n2, C, DT, ACCURATE_SIN).to(o_ptr.dtype.element_ty)
                if V_TMA:
                    v_ba = vb_ptr.load([BN, 0])
                else:
                    v_ba = tl.load(v_ptr + n2[:, None] * C + n[None, :], mask=nm2[:, None] & nm[None, :], other=0.0)
                out1 = _mma(s2, v_ba, out1, IEEE, UPCAST)
                if K1_EARLY:  # both k=1 products before the first epilogue (s1, s2 die here)
                    out2 = _k1_second(s1, s2, v_ptr, vc_ptr, vd_ptr, n, n2, nm, nm2, C, BT, BN, BN2,
                                      V_TMA, IEEE, UPCAST)
            _epilogue(out1, b, t, n, tm, C, b1_ptr, r_ptr, o_ptr, a_ptr, s_ptr,
                      srb, src, srl, sob, soc, sol, ssb, ssc, ssl,
                      True, False, True, WRITE_O, SNAKE, ACCURATE_SIN, DT)
            if BN2 > 0:
                if not K1_EARLY:
                    out2 = _k1_second(s1, s2, v_ptr, vc_ptr, vd_ptr, n, n2, nm, nm2, C, BT, BN, BN2,
                                      V_TMA, IEEE, UPCAST)
                _epilogue(out2, b, t, n2, tm, C, b1_ptr, r_ptr, o_ptr, a_ptr, s_ptr,
                          srb, src, srl, sob, soc, sol, ssb, ssc, ssl,
                          True, False, True, WRITE_O, SNAKE, ACCURATE_SIN, DT)

    if triton_interpreting():
        from triton.runtime.interpreter import InterpretedFunction as _Wrap
    else:
        from triton.runtime.jit import JITFunction as _Wrap

    _mid = _Wrap(_mid_impl)
    _k1_second = _Wrap(_k1_second_impl)

    @functools.cache
    def _kernel():
        if triton_interpreting():
            return _Wrap(_unit_kernel)
        return _Wrap(_unit_kernel, do_not_specialize=["L_out", "n_tb", "x_rows"])


def _v_descriptors(w1: Tensor, bn: int, bn2: int) -> tuple:
    """Tensor descriptors of the packed k=1 weight ``[1, C, C]`` (rows: input channels) for its
    four tiles: ``[BN, BN]``, ``[BN2, BN]``, ``[BN, BN2]``, ``[BN2, BN2]``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    C = w1.shape[1]
    return tuple(TensorDescriptor(w1, [C, C], [C, 1], [r, c])
                 for r, c in ((bn, bn), (bn2, bn), (bn, bn2), (bn2, bn2)))


TRANS_MAXNREG = 168


def default_maxnreg(k1_trans: bool, dtype: torch.dtype) -> int:
    """The unit kernel's register cap per thread (0: none). Env ``SHOAL_UNIT_MAXNREG`` (N: that
    cap for every unit, 0: none) wins. Default: :data:`TRANS_MAXNREG` for the transposed form in
    bf16 / fp16 (the 96-channel unit: 2.35 -> 2.19 ms at a 64 x 32-frame call on an H100, bit for
    bit, with ~68 bytes of spills), none for the direct form (the 192-channel unit ran 3.23 ->
    3.74-4.18 ms under a cap of 168) or fp32."""
    cap = env_int("SHOAL_UNIT_MAXNREG", -1)
    if cap >= 0:
        return cap
    return TRANS_MAXNREG if k1_trans and dtype in (torch.bfloat16, torch.float16) else 0


def residual_unit_triton(x: Tensor, w7: Tensor, b7: Tensor | None, dilation: int, alpha2: Tensor,
                         w1: Tensor, b1: Tensor | None, residual: Tensor, *,
                         out: Tensor | None = None, snake_alpha: Tensor | None = None,
                         snake_out: Tensor | None = None, write_out: bool = True,
                         config: tuple[int, ...] | None = None, k1_trans: bool | None = None,
                         v_tma: bool | None = None, k1_early: bool | None = None,
                         maxnreg: int | None = None) -> Tensor | None:
    """One residual unit (see the module docstring); ``w7`` / ``w1`` packed by
    :func:`pack_conv_weight` (``[7, C, C]`` / ``[1, C, C]``). Writes ``h'`` into ``out`` (or a
    new channels-last tensor; skipped with ``write_out=False``) and ``Snake_snake_alpha(h')``
    into ``snake_out`` (any strides: the next conv's input buffer after its context).
    ``k1_trans`` runs the k=1 conv transposed (the Snake'd tiles as the MMAs' second operand;
    default :func:`default_k1_trans` of the tiles). ``v_tma`` reads the k=1 weight's tiles
    through tensor descriptors (into shared memory, not registers) in a descriptor-load launch
    (default: env ``SHOAL_UNIT_V_TMA``, unset: on in the direct form, where the 192-channel
    unit ran 3.54 -> 3.24 ms on an H100, off in the transposed form, 2.37 -> 2.43 ms at 96).
    ``k1_early`` runs the second output tile's k=1 products before the first tile's epilogue
    (direct form only; no faster on an H100; default: env
    ``SHOAL_UNIT_K1_EARLY``, off): the same products in the same order, fewer live registers.
    ``maxnreg`` caps the registers per thread (Triton's compile option; default
    :func:`default_maxnreg`: 168 for the transposed form's 16-bit tiles, the 96-channel units,
    where three programs then share an SM; no cap elsewhere, where the tiles take 255 and two
    4-warp programs fit). Same bits."""
    _check_dtype("x", x)
    B, C, L_in = x.shape
    K = w7.shape[0]
    if w7.shape != (K, C, C) or w1.shape != (1, C, C):
        raise ValueError(f"weights must be packed [K, {C}, {C}] and [1, {C}, {C}], got "
                         f"{tuple(w7.shape)} and {tuple(w1.shape)}")
    for name, w in (("w7", w7), ("w1", w1)):
        if w.dtype != x.dtype or not w.is_contiguous():
            raise ValueError(f"{name} must be contiguous and in x's dtype")
    if C > MAX_UNIT_CHANNELS:
        raise ValueError(f"a unit of {C} channels does not fit one program (at most {MAX_UNIT_CHANNELS})")
    L_out = L_in - (K - 1) * dilation
    if L_out < 0:
        raise ValueError(f"input of {L_in} samples is shorter than the receptive field")
    if tuple(residual.shape) != (B, C, L_out) or residual.dtype != x.dtype:
        raise ValueError(f"residual must be {(B, C, L_out)} {x.dtype}")
    for name, v in (("alpha2", alpha2), ("b7", b7), ("b1", b1)):
        if v is not None and v.numel() != C:
            raise ValueError(f"{name} must have {C} elements")
    out = conv_outputs(x, (B, C, L_out), out, snake_alpha, snake_out, write_out)
    interpret = _require_kernel(x)
    if out.numel() == 0:
        return out if write_out else None
    zeros = None
    if b7 is None or b1 is None:
        zeros = torch.zeros(C, device=x.device, dtype=x.dtype)
    b7 = (b7 if b7 is not None else zeros).reshape(C).contiguous()
    b1 = (b1 if b1 is not None else zeros).reshape(C).contiguous()
    alpha2 = alpha2.reshape(C).contiguous()
    if snake_alpha is not None:
        snake_alpha = snake_alpha.reshape(C).contiguous()
    bt, bn, bc, warps, stages, tma, flat, bn2 = full_config(config or unit_config(C))
    if bn + bn2 < C:
        raise ValueError(f"tiles {bn} + {bn2} do not cover {C} channels")
    if k1_trans is None:
        k1_trans = default_k1_trans(bn2)
    if v_tma is None:  # default: the direct form only (the transposed 96-channel unit was slower)
        v_tma = env_int("SHOAL_UNIT_V_TMA", -1)
        v_tma = (not k1_trans) if v_tma < 0 else v_tma != 0
    if k1_early is None:
        k1_early = env_int("SHOAL_UNIT_K1_EARLY", 0) != 0
    if x.is_cuda and not interpret:
        if not _has_tma(x.device.index or 0):
            tma, flat = 0, 0
        # the k=1 weight and the Snake'd tile stay in shared memory beside the k=7 pipeline
        budget = _smem_bytes(x.device.index or 0) - (C * C + bt * C) * x.element_size()
        stages = fit_stages(bt, bn + bn2, bc, stages, x.element_size(), max(budget, 0))
    n_tb = triton.cdiv(L_out, bt)
    tma = bool(tma) and _tma_ok(x, w7, bc)
    so = snake_out if snake_alpha is not None else out
    opts = {"num_warps": warps}
    if not interpret:
        opts["num_stages"] = stages
        opts["enable_fp_fusion"] = False
        if maxnreg is None:
            maxnreg = default_maxnreg(bool(k1_trans), x.dtype)
        if maxnreg:
            opts["maxnreg"] = int(maxnreg)
    consts = dict(K=K, DIL=dilation, WRITE_O=write_out, SNAKE=snake_alpha is not None,
                  ACCURATE_SIN=sin_mode(x.dtype, interpret), BT=bt, BN=bn, BC=bc, BN2=bn2,
                  DT=_DT_CODE[x.dtype],
                  IEEE=x.dtype == torch.float32 and (interpret or not torch.backends.cudnn.allow_tf32),
                  UPCAST=interpret and x.dtype != torch.float32, FLAT=bool(flat), K1_TRANS=bool(k1_trans),
                  K1_EARLY=bool(k1_early) and not k1_trans and bn2 > 0, **opts)
    v_tma = bool(v_tma) and tma and bn2 > 0

    def launch(xs, ws, w2s, rows: int, use_tma: bool) -> None:
        vs = _v_descriptors(w1, bn, bn2) if use_tma and v_tma else (w1,) * 4
        _kernel()[(B * n_tb,)](
            xs, ws, w2s, b7, alpha2, w1, *vs, b1, residual, out,
            snake_alpha if snake_alpha is not None else alpha2, so,
            L_out, C, n_tb, rows,
            *x.stride(), *residual.stride(), *out.stride(), *so.stride(),
            TMA=use_tma, V_TMA=use_tma and v_tma, **consts)
        LAST_LAUNCH.update(TMA=use_tma, V_TMA=use_tma and v_tma, K1_EARLY=consts["K1_EARLY"])

    variant = ("unit", x.device.type, x.dtype, stages, v_tma) + tuple(sorted(consts.items()))
    launch_with_fallback(launch, variant, tma, (tile_operands(x, w7, bt, bc, bn, bn2) if tma else ()),
                         (x, w7, w7, 0), f"codec unit ({C} channels)")
    return out if write_out else None
