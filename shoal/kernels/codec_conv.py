"""Causal 1-D convolution of the codec decoder as an implicit GEMM (Triton, channels-last).

The codec decoder's cost is its stride-1 convolutions (the dilated k=7 and the k=1 convs of
the residual units, ~85% of its FLOPs). cuDNN runs these 1-D shapes (96-768 channels, up to
hundreds of thousands of samples per call) at a small fraction of the H200's tensor-core
rate. Written as a GEMM they are plain: with activations stored channels-last
(``[B, L, C]``), output row ``t`` of a conv with kernel ``K`` and dilation ``d`` is

    out[b, t, :] = bias + sum_k  x[b, t + k*d, :] @ Wk,      Wk = weight[:, :, k]^T  [C_in, C_out]

where ``x`` is the conv's input buffer *including* its left context (the carried stream
state, or zeros one-shot), so ``L_out = L_in - (K-1)*d``. :func:`conv1d_cl_triton` computes a tile
of ``BT`` output rows x ``BN`` output channels per program: for each tap and each ``BC``-wide
slice of input channels it loads a shifted ``[BT, BC]`` slab of ``x`` and the matching
``[BC, BN]`` slice of the packed weight ``[K, C_in, C_out]`` and accumulates with ``tl.dot``
in fp32 (fp32 inputs: IEEE products, or TF32 when ``torch.backends.cudnn.allow_tf32`` lets
cuDNN use it too). The bias is added to the fp32
accumulator and the result is rounded once to the storage dtype, as cuDNN does.

Optional fused epilogue (``residual``): ``out = residual + (acc + bias)`` rounded like
PyTorch's ``residual + conv(x)`` (the conv result is rounded first, then the sum).

The kernel runs on CUDA tensors (or anywhere under ``TRITON_INTERPRET=1``); the decoder layers
choose it (``triton_conv``) and fall back to cuDNN elsewhere. :func:`conv1d_cl_ref` is the
PyTorch reference (``F.conv1d``).
Launches depend only on shapes, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from .fused import _DT_CODE, _check_dtype, _next_pow2, _require_kernel
from .paged_attention import HAS_TRITON, tl, triton, triton_interpreting
from .snake import sin_mode

log = logging.getLogger(__name__)

__all__ = ["conv1d_cl_ref", "conv1d_cl_triton", "pack_conv_weight", "conv_config",
           "codec_conv_enabled"]


def codec_conv_enabled(dtype: torch.dtype | None = None) -> bool:
    """Whether the serving decoder runs its convs as these kernels on CUDA:
    ``SHOAL_CODEC_TRITON_CONV=1`` always, ``0`` never (cuDNN), unset (``auto``) for 16-bit
    codecs, where they were measured 13% faster per batch-64 call than cuDNN on an H200
    (docs/benchmarks.md); fp32 codecs stay on cuDNN until measured."""
    if not HAS_TRITON:
        return False
    mode = os.environ.get("SHOAL_CODEC_TRITON_CONV", "").strip().lower()
    if mode in ("1", "true", "yes", "on"):
        return True
    if mode in ("0", "false", "no", "off"):
        return False
    return dtype in (torch.bfloat16, torch.float16)  # "", "auto" (anything else: auto too)


def pack_conv_weight(weight: Tensor) -> Tensor:
    """``[C_out, C_in, K]`` (nn.Conv1d) -> ``[K, C_in, C_out]`` contiguous (what the kernel reads)."""
    if weight.dim() != 3:
        raise ValueError(f"conv weight must be [C_out, C_in, K], got shape {tuple(weight.shape)}")
    return weight.permute(2, 1, 0).contiguous()


def conv1d_cl_ref(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int = 1,
                  residual: Tensor | None = None) -> Tensor:
    """PyTorch reference: ``[residual +] conv1d(x, weight, bias, dilation=dilation)`` (no padding)."""
    y = F.conv1d(x, weight, bias, 1, 0, dilation)
    return y if residual is None else residual + y


# A config: (BT, BN, BC, num_warps, num_stages, TMA, FLAT, BN2). TMA: the operands are read
# through tensor descriptors (one bulk copy per tile); FLAT: one loop over (tap, channel slice)
# instead of the taps unrolled around a channel loop; BN2: a second output-channel tile of this
# width beside the first (0: none), so that a program covers BN + BN2 channels with two MMAs
# on the same input tile -- 96 = 64 + 32 and 192 = 128 + 64 channels without the quarter of
# padded MMA work a single power-of-two tile (128, 256) carries. By (C_in, C_out, K) first,
# then (C_in, C_out).
Config = tuple[int, int, int, int, int, int, int, int]
CONFIG_LEN = 8

# Per conv, the fastest of two sweeps on an H200 (bf16, batch 64 x 32 frames, CUDA-graph replay;
# `python -m shoal.bench.kernels_codec_conv` and docs/benchmarks.md, 2026-12-04): descriptor
# loads and the flat loop took the k=7 convs from 1,986 to 1,311 us (96 channels), 3,162 to 2,207
# (192) and 2,232 to 1,562 (384); K=2 are the transposed convs as 2-tap GEMMs
# (C_out = stride x channels out).
_CONFIGS: dict[tuple[int, ...], Config] = {
    (1024, 1536, 7): (128, 256, 64, 8, 4, 1, 1),
    (1536, 6144, 2): (128, 256, 64, 8, 3, 1, 1),
    (768, 3072, 2): (128, 256, 64, 8, 3, 1, 1),
    (768, 768, 7): (128, 256, 64, 8, 4, 1, 1),
    (768, 768, 1): (128, 128, 64, 8, 3, 1, 0),
    (384, 768, 2): (128, 128, 64, 8, 3, 1, 0),
    (384, 384, 7): (256, 128, 64, 8, 3, 1, 1),
    (384, 384, 1): (128, 128, 64, 8, 3, 1, 0),
    (192, 192, 7): (128, 256, 32, 8, 5, 1, 1),
    (192, 192, 2): (128, 64, 32, 4, 4, 1, 1),
    (192, 192, 1): (128, 64, 32, 4, 4, 1, 0),
    # two tiles, 64 + 32 channels (BN2): 1,155 against 1,354 us for the one padded tile on an
    # H100 (2026-12-05, `--configs split --channels 96`), bit-identical (GPU test)
    (96, 96, 7): (256, 64, 32, 4, 5, 1, 1, 32),
    (96, 96, 1): (128, 128, 32, 4, 4, 1, 0),
    # other kernel sizes of these channel counts (the 2026-11-29 sweep, pointer loads)
    (1024, 1536): (128, 256, 64, 8, 3, 0, 0),
    (768, 768): (128, 256, 64, 8, 3, 0, 0),
    (384, 384): (128, 128, 32, 4, 4, 0, 0),
    (192, 192): (128, 64, 64, 4, 3, 0, 0),
    (96, 96): (128, 128, 32, 4, 4, 0, 0),
}


def conv_config(c_in: int, c_out: int, length: int, k: int | None = None) -> Config:
    """Tile sizes and load variant for a conv with kernel ``k`` (independent of ``length``, so
    that every chunk size shares one compiled variant). ``SHOAL_CODEC_CONV_CFG=BT,BN,BC,warps,
    stages[,tma[,flat[,bn2]]]`` overrides it for tuning sweeps; ``SHOAL_CODEC_CONV_TMA`` /
    ``SHOAL_CODEC_CONV_FLAT`` (``0|1``) override the two flags of every config."""
    env = os.environ.get("SHOAL_CODEC_CONV_CFG")
    if env:
        vals = [int(v) for v in env.split(",")]
        if len(vals) not in range(5, CONFIG_LEN + 1):
            raise ValueError("SHOAL_CODEC_CONV_CFG needs BT,BN,BC,warps,stages[,tma[,flat[,bn2]]]")
        cfg = tuple(vals)
    else:
        cfg = _CONFIGS.get((c_in, c_out, k)) or _CONFIGS.get((c_in, c_out))
        if cfg is None:
            if c_out >= 768:  # wide outputs (the transposed convs as GEMMs)
                cfg = (128, 256, 64, 8, 3, 0, 0)
            else:
                bn = min(128, max(16, _next_pow2(c_out)))
                bc = min(64, max(16, _next_pow2(c_in)))
                # one tile height for every length: a new chunk size must not compile a new variant
                cfg = (128, bn, bc, 4, 3, 0, 0)
    return _with_flag_overrides(cfg)


def full_config(cfg: tuple) -> Config:
    """``cfg`` with the optional trailing fields (TMA, FLAT, BN2) filled with 0."""
    cfg = tuple(int(v) for v in cfg)
    if not 5 <= len(cfg) <= CONFIG_LEN:
        raise ValueError(f"a conv config has 5 to {CONFIG_LEN} fields, got {cfg}")
    cfg = cfg + (0,) * (CONFIG_LEN - len(cfg))
    if cfg[7] and (cfg[7] < 16 or cfg[7] & (cfg[7] - 1)):
        raise ValueError(f"BN2 must be 0 or a power of two >= 16, got {cfg[7]}")
    return cfg


def _with_flag_overrides(cfg: tuple) -> Config:
    cfg = full_config(cfg)
    tma, flat = os.environ.get("SHOAL_CODEC_CONV_TMA"), os.environ.get("SHOAL_CODEC_CONV_FLAT")
    if tma in ("0", "1"):
        cfg = cfg[:5] + (int(tma),) + cfg[6:]
    if flat in ("0", "1"):
        cfg = cfg[:6] + (int(flat),) + cfg[7:]
    return cfg


if HAS_TRITON:
    from .fused import _round  # noqa: F401 - called by name from the kernel
    from .snake import _snake_math  # noqa: F401 - called by name from the kernel

    def _mma_impl(a, w, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        if UPCAST:  # the interpreter's bf16 tl.dot is wrong (triton 3.9); products are exact in fp32
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE or UPCAST:
            return tl.dot(a, w, acc, input_precision="ieee")
        # bf16 / fp16 inputs, or fp32 as TF32 (torch.backends.cudnn.allow_tf32)
        return tl.dot(a, w, acc, input_precision="tf32")

    def _pre_snake_impl(a, p_ptr, c, C_in, DT: tl.constexpr, ACCURATE_SIN: tl.constexpr):
        """Snake_alpha of an input tile (channels ``c``), rounded to the storage dtype as the
        separate Snake kernel rounds it: the conv then reads Snake(x) without it being stored."""
        alpha = tl.load(p_ptr + c, mask=c < C_in, other=1.0).to(tl.float32)
        return _snake_math(a.to(tl.float32), alpha[None, :], DT, ACCURATE_SIN).to(a.dtype)

    def _epilogue_impl(acc, b, t, n, tm, C_out, b_ptr, r_ptr, o_ptr, a_ptr, s_ptr,
                       srb, src, srl, sob, soc, sol, ssb, ssc, ssl,
                       HAS_B: tl.constexpr, BIAS_LATE: tl.constexpr, HAS_R: tl.constexpr,
                       WRITE_O: tl.constexpr, SNAKE: tl.constexpr, ACCURATE_SIN: tl.constexpr,
                       DT: tl.constexpr):
        """Bias, residual, store and the following Snake of one output tile (channels ``n``)."""
        nm = n < C_out
        if HAS_B:
            bias = tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
            if BIAS_LATE:  # round(round(conv) + bias): the bias added by a separate pass
                acc = _round(_round(acc, DT) + bias, DT)
            else:
                acc = acc + bias
        m = tm[:, None] & nm[None, :]
        n64 = n[None, :].to(tl.int64)
        if HAS_R:
            acc = _round(acc, DT)
            r = tl.load(r_ptr + b * srb + n64 * src + t[:, None] * srl, mask=m, other=0.0)
            acc = acc + r.to(tl.float32)
        if WRITE_O:
            tl.store(o_ptr + b * sob + n64 * soc + t[:, None] * sol, acc.to(o_ptr.dtype.element_ty), mask=m)
        if SNAKE:  # the Snake that follows, on the rounded result (as the separate kernel would)
            h = _round(acc, DT)
            alpha = tl.load(a_ptr + n, mask=nm, other=1.0).to(tl.float32)
            sv = _snake_math(h, alpha[None, :], DT, ACCURATE_SIN)
            tl.store(s_ptr + b * ssb + n64 * ssc + t[:, None] * ssl, sv.to(s_ptr.dtype.element_ty), mask=m)

    def _conv_kernel(
        x_ptr, w_ptr, w2_ptr, b_ptr, r_ptr, o_ptr, a_ptr, s_ptr, p_ptr,
        L_out, C_in, C_out, n_tb, n_nb, x_rows,
        sxb, sxc, sxl, srb, src, srl, sob, soc, sol, ssb, ssc, ssl,
        K: tl.constexpr,
        DIL: tl.constexpr,
        HAS_B: tl.constexpr,
        BIAS_LATE: tl.constexpr,
        HAS_R: tl.constexpr,
        WRITE_O: tl.constexpr,
        SNAKE: tl.constexpr,
        PRE_SNAKE: tl.constexpr,
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
    ):
        pid = tl.program_id(0).to(tl.int64)  # one flat axis; output-channel tiles fastest
        nb = pid % n_nb
        rest = pid // n_nb
        tb = rest % n_tb
        b = rest // n_tb
        t = tb * BT + tl.arange(0, BT)
        n = (nb * (BN + BN2) + tl.arange(0, BN)).to(tl.int32)
        tm = t < L_out
        nm = n < C_out
        acc = tl.zeros((BT, BN), dtype=tl.float32)
        if BN2 > 0:  # the second output-channel tile: channels [BN, BN + BN2) of this program's
            n2 = (nb * (BN + BN2) + BN + tl.arange(0, BN2)).to(tl.int32)
            nm2 = n2 < C_out
            acc2 = tl.zeros((BT, BN2), dtype=tl.float32)
        if TMA:  # x_ptr / w_ptr are tensor descriptors (see conv1d_cl_triton): one bulk copy a tile
            row0 = (b * x_rows + tb * BT).to(tl.int32)
            n0 = (nb * (BN + BN2)).to(tl.int32)
            if FLAT:
                n_cc = C_in // BC
                for it in range(0, K * n_cc):
                    k = it // n_cc
                    c0 = (it % n_cc) * BC
                    a = x_ptr.load([row0 + k * DIL, c0])
                    if PRE_SNAKE:
                        a = _pre_snake(a, p_ptr, c0 + tl.arange(0, BC), C_in, DT, ACCURATE_SIN)
                    w = w_ptr.load([k * C_in + c0, n0])
                    acc = _mma(a, w, acc, IEEE, UPCAST)
                    if BN2 > 0:
                        w2 = w2_ptr.load([k * C_in + c0, n0 + BN])
                        acc2 = _mma(a, w2, acc2, IEEE, UPCAST)
            else:
                for k in tl.static_range(K):
                    for c0 in range(0, C_in, BC):
                        a = x_ptr.load([row0 + k * DIL, c0])
                        if PRE_SNAKE:
                            a = _pre_snake(a, p_ptr, c0 + tl.arange(0, BC), C_in, DT, ACCURATE_SIN)
                        w = w_ptr.load([k * C_in + c0, n0])
                        acc = _mma(a, w, acc, IEEE, UPCAST)
                        if BN2 > 0:
                            w2 = w2_ptr.load([k * C_in + c0, n0 + BN])
                            acc2 = _mma(a, w2, acc2, IEEE, UPCAST)
        elif FLAT:  # one loop over (tap, channel slice): a long loop for the software pipeliner
            xb = x_ptr + b * sxb
            n_cc = tl.cdiv(C_in, BC)
            for it in range(0, K * n_cc):
                k = it // n_cc
                c = (it % n_cc) * BC + tl.arange(0, BC)
                cm = c < C_in
                a = tl.load(xb + (t + k * DIL)[:, None] * sxl + c[None, :].to(tl.int64) * sxc,
                            mask=tm[:, None] & cm[None, :], other=0.0)
                if PRE_SNAKE:
                    a = _pre_snake(a, p_ptr, c, C_in, DT, ACCURATE_SIN)
                wrow = (k * C_in + c)[:, None].to(tl.int64) * C_out
                w = tl.load(w_ptr + wrow + n[None, :], mask=cm[:, None] & nm[None, :], other=0.0)
                acc = _mma(a, w, acc, IEEE, UPCAST)
                if BN2 > 0:
                    w2 = tl.load(w_ptr + wrow + n2[None, :], mask=cm[:, None] & nm2[None, :], other=0.0)
                    acc2 = _mma(a, w2, acc2, IEEE, UPCAST)
        else:
            xb = x_ptr + b * sxb
            for k in tl.static_range(K):
                rows = (t + k * DIL)[:, None] * sxl
                for c0 in range(0, C_in, BC):
                    c = c0 + tl.arange(0, BC)
                    cm = c < C_in
                    a = tl.load(xb + rows + c[None, :].to(tl.int64) * sxc, mask=tm[:, None] & cm[None, :], other=0.0)
                    if PRE_SNAKE:
                        a = _pre_snake(a, p_ptr, c, C_in, DT, ACCURATE_SIN)
                    wrow = (k * C_in + c)[:, None].to(tl.int64) * C_out
                    w = tl.load(w_ptr + wrow + n[None, :], mask=cm[:, None] & nm[None, :], other=0.0)
                    acc = _mma(a, w, acc, IEEE, UPCAST)
                    if BN2 > 0:
                        w2 = tl.load(w_ptr + wrow + n2[None, :], mask=cm[:, None] & nm2[None, :], other=0.0)
                        acc2 = _mma(a, w2, acc2, IEEE, UPCAST)
        _epilogue(acc, b, t, n, tm, C_out, b_ptr, r_ptr, o_ptr, a_ptr, s_ptr,
                  srb, src, srl, sob, soc, sol, ssb, ssc, ssl,
                  HAS_B, BIAS_LATE, HAS_R, WRITE_O, SNAKE, ACCURATE_SIN, DT)
        if BN2 > 0:
            _epilogue(acc2, b, t, n2, tm, C_out, b_ptr, r_ptr, o_ptr, a_ptr, s_ptr,
                      srb, src, srl, sob, soc, sol, ssb, ssc, ssl,
                      HAS_B, BIAS_LATE, HAS_R, WRITE_O, SNAKE, ACCURATE_SIN, DT)

    if triton_interpreting():
        from triton.runtime.interpreter import InterpretedFunction as _Wrap
    else:
        from triton.runtime.jit import JITFunction as _Wrap

    _mma = _Wrap(_mma_impl)
    _pre_snake = _Wrap(_pre_snake_impl)
    _epilogue = _Wrap(_epilogue_impl)

    @functools.cache
    def _kernel():
        if triton_interpreting():
            return _Wrap(_conv_kernel)
        # lengths and tile counts change with every chunk size: one compiled variant serves
        # them all. Strides stay specialized: the batch strides are multiples of the channel
        # count (a multiple of 16 in the real codec, so no length compiles a new variant), and
        # only a stride known to be divisible by 16 lets Triton prove the tiles 16-byte
        # aligned and issue vector loads and stores (unspecialized batch strides made every
        # conv 3-6x slower on an H200).
        return _Wrap(_conv_kernel, do_not_specialize=["L_out", "n_tb", "n_nb", "x_rows"])


def _channels_last_empty(B: int, C: int, L: int, like: Tensor) -> Tensor:
    return torch.empty(B, L, C, device=like.device, dtype=like.dtype).transpose(1, 2)


FP32_SMEM_BUDGET = 160 * 1024  # bytes of operand tiles in flight; an H200 SM has 227 KiB


def fp32_tiles(bt: int, bn: int, bc: int, stages: int) -> tuple[int, int]:
    """``(BC, stages)`` of a 16-bit config run on fp32 operands: four-byte tiles take twice
    the shared memory, so the channel slice is capped at 32 and the pipeline shortened until
    its tiles fit ``FP32_SMEM_BUDGET`` (a deep bf16 pipeline would not compile)."""
    bc = min(bc, 32)
    return bc, fit_stages(bt, bn, bc, stages, 4, FP32_SMEM_BUDGET)


def fit_stages(bt: int, bn: int, bc: int, stages: int, elem_bytes: int, budget: int) -> int:
    """The deepest pipeline (at most ``stages``, at least 2) whose operand tiles fit ``budget``
    bytes of shared memory (``bn``: every output-channel tile of the program together)."""
    return max(2, min(stages, budget // ((bt * bc + bc * bn) * elem_bytes)))


@functools.cache
def _smem_bytes(device_index: int) -> int:
    """Shared memory a block of this GPU may use for operand tiles: its opt-in maximum less
    32 KiB for the kernel's other buffers (the epilogue's layout conversions)."""
    props = torch.cuda.get_device_properties(device_index)
    optin = getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024
    return optin - 32 * 1024


@functools.cache
def _has_tma(device_index: int) -> bool:
    """Whether a CUDA device has the tensor-memory accelerator (sm_90 and later); the
    configs' TMA flag was measured there, older GPUs keep pointer loads."""
    if getattr(torch.version, "hip", None):  # ROCm reports its own architecture numbers
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


# descriptor-load variants that failed to build or launch in this process: pointer loads instead
_TMA_FAILED: set[tuple] = set()


def _tma_ok(x: Tensor, packed: Tensor, bc: int) -> bool:
    """Tensor descriptors need a GPU with TMA (or the interpreter), channels-last ``x`` (unit
    channel stride, the batch stride a whole number of rows), 16-byte aligned bases and row
    strides, and whole channel slices (a slice must not run into the next tap's weight rows)."""
    B, C_in, _ = x.shape
    es = x.element_size()
    if x.is_cuda and not triton_interpreting() and not _has_tma(x.device.index or 0):
        return False
    return (x.stride(1) == 1 and x.stride(2) > 0
            and (B == 1 or (x.stride(0) > 0 and x.stride(0) % x.stride(2) == 0))
            and x.data_ptr() % 16 == 0 and packed.data_ptr() % 16 == 0
            and (x.stride(2) * es) % 16 == 0 and (packed.shape[2] * es) % 16 == 0
            and C_in % bc == 0 and (bc * es) % 16 == 0)


def conv_outputs(x: Tensor, shape: tuple[int, int, int], out: Tensor | None, snake_alpha: Tensor | None,
                 snake_out: Tensor | None, write_out: bool) -> Tensor:
    """The tensor a conv kernel writes its result into: ``out`` checked against ``shape``
    (``[B, C_out, L_out]``, x's dtype), or a new channels-last one, or ``snake_out`` when only
    the Snake'd result is written (``write_out=False``); ``snake_out`` checked too."""
    if snake_alpha is not None:
        if snake_out is None or tuple(snake_out.shape) != shape or snake_out.dtype != x.dtype:
            raise ValueError(f"snake_out must be {shape} {x.dtype}")
        if snake_alpha.numel() != shape[1]:
            raise ValueError(f"snake_alpha must have {shape[1]} elements")
    elif not write_out:
        raise ValueError("write_out=False needs a Snake output")
    if out is None:
        return _channels_last_empty(*shape, x) if write_out else snake_out
    if tuple(out.shape) != shape or out.dtype != x.dtype:
        raise ValueError(f"out must be {shape} {x.dtype}")
    return out


def tile_operands(x: Tensor, packed: Tensor, bt: int, bc: int, bn: int, bn2: int) -> tuple:
    """``(x, w, w2, x_rows)`` for a launch with descriptor loads: tensor descriptors of the input
    (as rows of channels) and of the packed weight for each output-channel tile."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, C_in, L_in = x.shape
    K, _, C_out = packed.shape
    # x as rows of channels: batch b's sample t is row b * x_rows + t (channels-last memory:
    # one row stride, the batch stride a whole number of rows). A valid output row reads only
    # its own batch's rows; the tail rows of a tile past L_out may read the next batch's (their
    # outputs are masked), and rows past the last batch's end read as zeros.
    x_rows = x.stride(0) // x.stride(2) if B > 1 else 0
    x_src = TensorDescriptor(x, [(B - 1) * x_rows + L_in, C_in], [x.stride(2), 1], [bt, bc])
    w_src = TensorDescriptor(packed, [K * C_in, C_out], [C_out, 1], [bc, bn])
    w2_src = TensorDescriptor(packed, [K * C_in, C_out], [C_out, 1], [bc, bn2]) if bn2 else packed
    return x_src, w_src, w2_src, x_rows


def launch_with_fallback(launch, variant: tuple, use_tma: bool, tma_args: tuple, plain_args: tuple,
                         what: str) -> None:
    """``launch(*tma_args, True)`` when ``use_tma`` and the variant has not failed before, else
    (or when it raises: a descriptor variant this GPU / Triton cannot build, remembered in
    ``_TMA_FAILED`` and logged once) ``launch(*plain_args, False)``."""
    if use_tma and variant not in _TMA_FAILED:
        try:
            launch(*tma_args, True)
            return
        except Exception as e:  # noqa: BLE001
            _TMA_FAILED.add(variant)
            log.warning("%s: descriptor loads failed (%s: %s); it runs on pointer loads",
                        what, type(e).__name__, str(e)[:200])
    launch(*plain_args, False)


def conv1d_cl_triton(x: Tensor, packed: Tensor, bias: Tensor | None, dilation: int = 1, *,
                     residual: Tensor | None = None, out: Tensor | None = None,
                     snake_alpha: Tensor | None = None, snake_out: Tensor | None = None,
                     write_out: bool = True, pre_snake_alpha: Tensor | None = None,
                     bias_after_rounding: bool = False,
                     config: tuple[int, ...] | None = None) -> Tensor | None:
    """Kernel version of :func:`conv1d_cl_ref` with the weight packed by :func:`pack_conv_weight`.

    ``x`` is ``[B, C_in, L_in]`` with any strides (channels-last memory, ``stride(1) == 1``,
    is what makes the loads coalesced); the result is ``[B, C_out, L_out]`` in channels-last
    memory (or written into ``out``, any strides).

    ``snake_alpha`` / ``snake_out``: also write ``Snake_alpha(result)`` (rounded exactly as
    :func:`shoal.kernels.snake.snake` rounds) into ``snake_out`` (any strides, e.g. the next
    conv's input buffer after its left context). ``write_out=False`` skips storing the result
    itself (returns None) when only its Snake is needed.

    ``pre_snake_alpha`` (``[C_in]``): convolve ``Snake_alpha(x)`` instead of ``x``, each
    loaded input tile passed through the Snake (rounded as the separate kernel rounds it) on
    its way to the MMA, so that a Snake'd input is never written out. Meant for k=1 convs,
    which read each input sample once per output tile; a k=7 conv would evaluate it 7 times.

    ``bias_after_rounding``: the result is ``round(round(conv) + bias)``, as when the conv runs
    without bias and a separate kernel adds it (the transposed convs' 2-tap GEMMs, whose bias
    the following Snake kernel used to add); the default adds it to the fp32 accumulator."""
    interpret = _require_kernel(x)
    _check_dtype("x", x)
    if x.dim() != 3 or packed.dim() != 3:
        raise ValueError("x must be [B, C_in, L] and the packed weight [K, C_in, C_out]")
    K, C_in, C_out = packed.shape
    B, C, L_in = x.shape
    if C != C_in:
        raise ValueError(f"x has {C} channels, the conv expects {C_in}")
    if packed.dtype != x.dtype or not packed.is_contiguous():
        raise ValueError("the packed weight must be contiguous and in x's dtype")
    L_out = L_in - (K - 1) * dilation
    if L_out < 0:
        raise ValueError(f"input of {L_in} samples is shorter than the receptive field")
    out = conv_outputs(x, (B, C_out, L_out), out, snake_alpha, snake_out, write_out)
    if snake_alpha is not None:
        snake_alpha = snake_alpha.reshape(C_out).contiguous()
    if pre_snake_alpha is not None:
        if pre_snake_alpha.numel() != C_in:
            raise ValueError(f"pre_snake_alpha must have {C_in} elements")
        pre_snake_alpha = pre_snake_alpha.reshape(C_in).contiguous()
    if residual is not None and (tuple(residual.shape) != (B, C_out, L_out) or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {(B, C_out, L_out)} {x.dtype}")
    if out.numel() == 0:
        return out if write_out else None
    cfg = full_config(config) if config else conv_config(C_in, C_out, L_out, K)
    bt, bn, bc, warps, stages, tma, flat, bn2 = cfg
    if config is None:
        if x.dtype == torch.float32:
            bc, stages = fp32_tiles(bt, bn + bn2, bc, stages)
        if x.is_cuda and not interpret:
            # the table was measured on an H200: a GPU without TMA gets pointer loads and
            # unrolled taps, and every GPU a pipeline that fits its shared memory (the H200's
            # configs fit its own, so they run unchanged there)
            if not _has_tma(x.device.index or 0):
                tma, flat = 0, 0
            stages = fit_stages(bt, bn + bn2, bc, stages, x.element_size(), _smem_bytes(x.device.index or 0))
    n_tb = triton.cdiv(L_out, bt)
    n_nb = triton.cdiv(C_out, bn + bn2)
    tma = bool(tma) and _tma_ok(x, packed, bc)
    r = residual if residual is not None else out
    opts = {"num_warps": warps}
    if not interpret:
        opts["num_stages"] = stages
        opts["enable_fp_fusion"] = False  # the Snake epilogue rounds like PyTorch (no FMA)
    so = snake_out if snake_alpha is not None else out
    consts = dict(
        K=K, DIL=dilation,
        HAS_B=bias is not None, BIAS_LATE=bias_after_rounding, HAS_R=residual is not None,
        WRITE_O=write_out, SNAKE=snake_alpha is not None, PRE_SNAKE=pre_snake_alpha is not None,
        # the Snakes' sine (see snake.sin_mode); a constant without one, so that the sine
        # setting compiles no extra plain-conv variants
        ACCURATE_SIN=(sin_mode(x.dtype, interpret)
                      if snake_alpha is not None or pre_snake_alpha is not None else 0),
        BT=bt, BN=bn, BC=bc, BN2=bn2,
        DT=_DT_CODE[x.dtype],
        # fp32 follows cuDNN's setting: TF32 tensor cores when torch allows them for convs
        IEEE=x.dtype == torch.float32 and (interpret or not torch.backends.cudnn.allow_tf32),
        UPCAST=interpret and x.dtype != torch.float32,
        FLAT=bool(flat),
        **opts,
    )

    def launch(x_src, w_src, w2_src, x_rows: int, use_tma: bool) -> None:
        _kernel()[(B * n_tb * n_nb,)](
            x_src, w_src, w2_src, bias if bias is not None else packed, r, out,
            snake_alpha if snake_alpha is not None else packed, so,
            pre_snake_alpha if pre_snake_alpha is not None else packed,
            L_out, C_in, C_out, n_tb, n_nb, x_rows,
            *x.stride(), *r.stride(), *out.stride(), *so.stride(),
            TMA=use_tma, **consts,
        )

    variant = ("conv", x.device.type, x.dtype, stages) + tuple(sorted(consts.items()))
    launch_with_fallback(launch, variant, tma, (tile_operands(x, packed, bt, bc, bn, bn2) if tma else ()),
                         (x, packed, packed, 0), f"codec conv ({K}-tap, {x.dtype})")
    return out if write_out else None
