"""FP8-weight, bf16-activation decode GEMM (Triton): ``y = x @ bf16(dequant(W))^T``.

Why: the block-scaled W8A8 GEMM (:mod:`shoal.kernels.fp8`) applies the two scales to the fp32
partial sum of every 128-wide K block (``acc += dot(x_q, W_q) * sx * sw``), so each program's
MMAs form a serial MMA -> wait -> scale -> add chain; at 64 tokens that chain, not the weight
stream, bounds the decode GEMMs (measured on the H200: gate_up 20.7 us at M = 64 against 16.4
at M = 1). Here the weight block's scale is applied to the *weight* while it is widened to
bf16 in registers (a tile of at most 128 weight rows and 128 columns lies inside one 128x128
scale block, so the scale is one scalar per tile), and the widened tile feeds the MMA as its
A operand (swap-AB: weight rows on the MMA's M axis, tokens on its N axis), accumulating
straight into the fp32 accumulator. The activation stays bf16: no quantize kernel, no
activation scales.

Numerics (exact definition): the weight is dequantized element by element in fp32 (``q *
W_s[n // 128, k // 128]``, one rounding) and rounded to bf16 (nearest even); the GEMM is then
the bf16 GEMM of :mod:`shoal.kernels.dense` on that weight (fp32 products and sums, one final
rounding to bf16). So ``fp8w_gemm(x, W_q, W_s)`` equals ``dense_gemm(x, dequant_weight(W_q,
W_s).bfloat16())`` up to the order of the fp32 additions. Against the W8A8 scheme it keeps the
activation's bf16 precision (no 1x128 e4m3 rounding of x) and adds the weight's bf16 rounding
(2^-9 relative, far below e4m3's 2^-4).

Widening: ``BITS`` (default) moves the e4m3 byte into an fp32 bit pattern with integer
operations (``sar(b << 24, 4) & 0x87F00000``: sign, exponent and mantissa in place, the value
2^-120 times the e4m3 value, subnormals included) and multiplies by ``scale * 2^120``: the
same fp32 product as ``q * scale``. ``BITS=False`` uses Triton's fp8 -> fp32 conversion.

Layouts: ``W_q [N, K]`` e4m3 contiguous, ``W_s [ceil(N/128), ceil(K/128)]`` fp32 contiguous
(:func:`shoal.kernels.fp8.check_weight`), ``x [M, K]`` bf16 with unit stride along K. Split-K
and its reduce are :mod:`shoal.kernels.fp8`'s (per-tile arrival counters, the last program of
a tile adds the partials in split order), or the fp32 partials are returned
(:class:`~shoal.kernels.fp8.SplitKPartials`) for a consumer that sums them while loading.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fp8 import (BLOCK, GemmOut, SplitKPartials, _cdiv, _launch_reduce, _out_buffer, _require_triton, _tile_counters,
                  _tma_ok, check_weight, dequant_weight)
from .paged_attention import HAS_TRITON, pdl_options, tl, triton

__all__ = ["fp8w_config", "fp8w_gemm_ref", "fp8w_gemm_triton", "finish_config"]

TWO_POW_120 = 2.0 ** 120


def fp8w_gemm_ref(x: Tensor, W_q: Tensor, W_s: Tensor) -> Tensor:
    """The reference: the weight dequantized in fp32 and rounded to bf16, then fp32 products
    and sums, one rounding to bf16."""
    w = dequant_weight(W_q, W_s).to(torch.bfloat16)
    return (x.float() @ w.float().t()).to(torch.bfloat16)


if HAS_TRITON:
    from .dense import _dot_acc
    from .fp8 import _gemm_epilogue
    from .fused import _round
    from .paged_attention import pdl_enter

    @triton.jit
    def _widen(w, s, BITS: tl.constexpr):
        """e4m3 tile ``w`` and its fp32 block scale ``s`` (broadcast [rows, 1]) -> bf16 tile of
        ``bf16(q * s)``."""
        if BITS:
            u = w.to(tl.uint8, bitcast=True).to(tl.uint32) << 24
            # arithmetic shift by 4 puts the exponent and mantissa at bits 20..26 and copies the
            # sign into 27..31; the mask keeps bit 31 and 20..26 (0x87F00000 as int32)
            f = ((u.to(tl.int32, bitcast=True) >> 4) & -0x78100000).to(tl.float32, bitcast=True)
            v = f * (s * 1.329227995784916e36)  # 2^120: f is the e4m3 value times 2^-120
        else:
            v = w.to(tl.float32) * s
        return _round(v, 1).to(tl.bfloat16)

    @triton.jit
    def _fp8w_kernel(x_src, w_src, ws_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, KB, stride_xm, stride_ym, k_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                     EVEN_K: tl.constexpr, FUSED_REDUCE: tl.constexpr, UPCAST_DOT: tl.constexpr,
                     BITS: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr = False):
        """Grid (n tiles, m tiles, SPLIT_K). Program (n, m, s): ``acc[BLOCK_N, BLOCK_M] = sum over
        its K range of widen(W[n tile, k blk]) @ x[m tile, k blk]^T``. BLOCK_N and BLOCK_K divide
        128, so a (BLOCK_N x BLOCK_K) weight tile has one scale. TMA: ``x_src`` / ``w_src`` are
        tensor descriptors ([BLOCK_M, BLOCK_K] / [BLOCK_N, BLOCK_K] blocks, zeros outside)."""
        pdl_enter(PDL)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_kk = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        k_lo = pid_k * k_per_split
        # the tile's one scale, loaded per weight row (BLOCK_N equal values): a vector in the
        # MMA operand's row layout lets Triton read the e4m3 tile from shared memory straight
        # into the A-operand registers (a scalar blocks that: widen, store, reload)
        s_ptrs = ws_ptr + (offs_n // 128) * KB
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if not TMA:
            w_ptrs = w_src + offs_n[:, None].to(tl.int64) * K + (k_lo + offs_kk)[None, :]
            x_ptrs = x_src + offs_m[:, None] * stride_xm + (k_lo + offs_kk)[None, :]
        for k0 in range(0, k_per_split, BLOCK_K):
            k = k_lo + k0
            s = tl.load(s_ptrs + k // 128, mask=n_mask & (k < K), other=0.0)
            if TMA:
                w = w_src.load([pid_n * BLOCK_N, k])
                a = x_src.load([pid_m * BLOCK_M, k])
            else:
                if EVEN_K:
                    w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
                    a = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
                else:
                    k_mask = (k + offs_kk) < K
                    w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                    a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                w_ptrs += BLOCK_K
                x_ptrs += BLOCK_K
            acc = _dot_acc(_widen(w, s[:, None], BITS), tl.trans(a), acc, UPCAST_DOT)
        _gemm_epilogue(acc, y_ptr, part_ptr, cnt_ptr, offs_m[None, :] * stride_ym + offs_n[:, None],
                       offs_m[None, :] * N + offs_n[:, None], n_mask[:, None] & m_mask[None, :], M * N, pid_k,
                       pid_m * tl.num_programs(0) + pid_n, SPLIT_K, FUSED_REDUCE)


def finish_config(cfg: dict, K: int) -> dict:
    """Defaults, checks and the derived ``k_per_split`` (a multiple of BLOCK_K; no empty splits).
    BLOCK_N and BLOCK_K must divide 128 (one weight scale per tile)."""
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg.setdefault("BLOCK_M", 16)
    cfg.setdefault("BLOCK_N", 64)
    cfg.setdefault("BLOCK_K", 128)
    cfg.setdefault("num_warps", 4)
    cfg.setdefault("num_stages", 4)
    cfg["BITS"] = bool(cfg.get("BITS", True))
    cfg["TMA"] = bool(cfg.get("TMA", False))
    for key in ("BLOCK_N", "BLOCK_K"):
        if 128 % int(cfg[key]) or int(cfg[key]) < 16:
            raise ValueError(f"fp8w config: {key}={cfg[key]} must divide 128 (one weight scale per tile)")
    bk = int(cfg["BLOCK_K"])
    kblocks = _cdiv(K, bk)
    split = max(1, min(int(cfg.get("SPLIT_K", 1)), kblocks))
    per = _cdiv(kblocks, split)
    cfg["k_per_split"] = per * bk
    cfg["SPLIT_K"] = _cdiv(kblocks, per)
    return cfg


def fp8w_config(M: int, N: int, K: int) -> dict:
    """A launch config for this GEMM: 64 weight rows x 128 columns per tile, the tokens in one
    tile up to 64, K split so that about two programs per SM stream the weight."""
    bm = max(16, min(64, 1 << max(0, M - 1).bit_length()))
    tiles = _cdiv(N, 64) * _cdiv(M, bm)
    split = max(1, min(_cdiv(K, BLOCK) // 2, _cdiv(264, tiles), 8))
    return finish_config({"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": split, "num_stages": 4}, K)


def fp8w_gemm_triton(x: Tensor, W_q: Tensor, W_s: Tensor, *, out: Tensor | None = None, config: dict | None = None,
                     partials: bool = False) -> GemmOut:
    """``x [M, K]`` bf16 (unit stride along K) times the block-scaled e4m3 weight ``W_q [N, K]``
    (``W_s`` its 128x128 block scales) -> bf16 ``[M, N]`` (into ``out`` if given). ``config``
    overrides :func:`fp8w_config`. ``partials``: with a split K, return the fp32 partials
    (:class:`SplitKPartials`) instead of reducing them."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"fp8w_gemm: x must be bf16 [M, K], got {x.dtype} {tuple(x.shape)}")
    N, K = check_weight(W_q, W_s)
    if x.shape[1] != K:
        raise ValueError(f"fp8w_gemm: x has K={x.shape[1]} but the weight has K={K}")
    if K > 1 and x.stride(1) != 1:
        x = x.contiguous()
    interpret = _require_triton(x)
    M = x.shape[0]
    if M == 0 or N == 0 or K == 0:
        y = _out_buffer(out, M, N, x.device)
        return y.zero_() if K == 0 else y
    cfg = finish_config(config, K) if config is not None else fp8w_config(M, N, K)
    split = cfg["SPLIT_K"]
    tiles_m, tiles_n = _cdiv(M, cfg["BLOCK_M"]), _cdiv(N, cfg["BLOCK_N"])
    out = _out_buffer(out, M, N, x.device) if split == 1 or not partials else None
    work = counters = None
    if split > 1:
        work = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        if not partials:
            counters = _tile_counters(x.device, tiles_m * tiles_n)
    xs, ws = x, W_q
    tma = cfg["TMA"] and not interpret and _tma_ok(x, W_q)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xs = TensorDescriptor.from_tensor(x, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
        ws = TensorDescriptor.from_tensor(W_q, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
    kw = {} if interpret else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], **pdl_options(x)}
    y_arg = out if out is not None else work.view(torch.bfloat16)
    _fp8w_kernel[(tiles_n, tiles_m, split)](
        xs, ws, W_s, y_arg, x if work is None else work, W_s if counters is None else counters, M, N, K,
        _cdiv(K, BLOCK), x.stride(0), N if out is None else out.stride(0), cfg["k_per_split"],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split,
        EVEN_K=K % cfg["k_per_split"] == 0, FUSED_REDUCE=counters is not None, UPCAST_DOT=interpret,
        BITS=cfg["BITS"], TMA=tma, **kw)
    if split == 1:
        return out
    if partials:
        return SplitKPartials(work)
    if counters is None:
        _launch_reduce(work, out, M, N, split)
    return out
