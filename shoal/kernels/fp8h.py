"""FP8-weight, fp16-activation decode GEMM (Triton): ``y = x @ fp16(q * h)^T * 2^E``.

Why: the W8A8 GEMM (:mod:`shoal.kernels.fp8`) applies two scales to the fp32 partial sum of
every 128-wide K block, a serial MMA -> wait -> scale -> add chain per program that bounds it
at 64 tokens. A weight-only kernel that widens the e4m3 weight in registers and accumulates
straight into the MMA's accumulator avoids the chain, but widening to bf16 costs ~3 conversion
instructions per element (e4m3 -> f16 -> f32, the scale, f32 -> bf16): the bf16 form of this
kernel (commit 9ba70f1, removed) lost every cell. Widening to **fp16** is one hardware
instruction per *two* elements (``cvt.rn.f16x2.e4m3x2``) plus one packed fp16 multiply by the
block's scale, and the MMA runs in fp16 with fp32 accumulation.

Numerics (exact definition, see :func:`fp8h_gemm_ref`):

* weight multipliers ``h = fp16(W_s * 2^-E)`` with one exponent ``E`` per weight tensor (the
  largest block scale's, so ``h`` lies in (0, 2)): :func:`fp16_weight_scales`. The fp32 block
  scales of a trained weight span far less than fp16's 2^-14..2 normal range; the function
  reports the smallest nonzero ratio so a caller can refuse a tensor that would go subnormal.
* the widened weight element is ``fp16(q * h)`` (q an e4m3 value, exactly representable in
  fp16; one rounding of the product, 2^-11 relative);
* ``x`` is fp16 (a bf16 activation converts exactly while ``|x| < 65504``; an optional per-token
  power-of-two ``x_scale`` lets a producer scale rows that would not fit);
* fp32 products and sums, times ``2^E`` (and ``x_scale[m]``), one rounding to bf16.

So against the W8A8 scheme the activation keeps (more than) its bf16 precision, and the weight
gains one fp16 rounding, far below e4m3's own. Layouts: ``W_q [N, K]`` e4m3 contiguous, ``W_h
[ceil(N/128), ceil(K/128)]`` fp16 contiguous, ``x [M, K]`` fp16 with unit stride along K.
Split-K and its fused ordered reduce are :mod:`shoal.kernels.fp8`'s.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .fp8 import (BLOCK, _cdiv, _launch_reduce, _out_buffer, _require_triton, _tile_counters, _tma_ok, check_weight)
from .paged_attention import HAS_TRITON, pdl_options, tl, triton

__all__ = ["fp16_weight_scales", "fp8h_config", "fp8h_finish_config", "fp8h_gemm_ref", "fp8h_gemm_triton"]

FP16_MIN_NORMAL = 2.0 ** -14


def fp16_weight_scales(W_s: Tensor) -> tuple[Tensor, float, float]:
    """fp32 block scales ``W_s`` -> ``(W_h, out_scale, min_ratio)``: ``W_h = fp16(W_s * 2^-E)``
    with ``E = floor(log2(max W_s))`` (so ``W_h`` < 2), ``out_scale = 2^E``, and the smallest
    nonzero ``W_s / 2^E`` (below :data:`FP16_MIN_NORMAL` those multipliers are fp16 subnormals
    and lose precision)."""
    if W_s.dtype != torch.float32 or W_s.dim() != 2:
        raise ValueError(f"fp16_weight_scales: W_s must be fp32 [NB, KB], got {W_s.dtype} {tuple(W_s.shape)}")
    top = float(W_s.max()) if W_s.numel() else 0.0
    if not math.isfinite(top) or top <= 0.0:
        raise ValueError(f"fp16_weight_scales: block scales must be finite and positive (max {top})")
    E = math.floor(math.log2(top))
    r = W_s * (2.0 ** -E)
    nz = r[r > 0]
    min_ratio = float(nz.min()) if nz.numel() else 0.0
    return r.to(torch.float16).contiguous(), 2.0 ** E, min_ratio


def fp8h_gemm_ref(x: Tensor, W_q: Tensor, W_h: Tensor, out_scale: float, x_scale: Tensor | None = None) -> Tensor:
    """The reference: ``fp16(q * h)`` element by element, fp32 products and sums of the fp16 ``x``,
    times ``out_scale`` (and ``x_scale[m]``), one rounding to bf16."""
    N, K = W_q.shape
    h = W_h.float().repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    w = (W_q.float() * h).to(torch.float16).float()
    y = (x.float() @ w.t()) * out_scale
    if x_scale is not None:
        y = y * x_scale.float()[:, None]
    return y.to(torch.bfloat16)


if HAS_TRITON:
    from .dense import _dot_acc
    from .fp8 import _gemm_epilogue
    from .paged_attention import pdl_enter

    @triton.jit
    def _scale_f16(w, h, PACKED_MUL: tl.constexpr):
        """``fp16(w * h)`` (one rounding): PACKED_MUL as ``mul.rn.f16x2`` on pairs of elements
        (the compiler emits one scalar ``mul.f16`` per element for the plain product), else the
        plain product (the interpreter)."""
        if PACKED_MUL:
            return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [w, tl.broadcast_to(h, w.shape)],
                                             dtype=tl.float16, is_pure=True, pack=2)
        return w * h

    @triton.jit
    def _fp8h_kernel(x_src, w_src, wh_ptr, xs_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, KB, stride_xm, stride_ym,
                     k_per_split, out_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, FUSED_REDUCE: tl.constexpr,
                     UPCAST_DOT: tl.constexpr, HAS_XS: tl.constexpr, TMA: tl.constexpr, PACKED_MUL: tl.constexpr = False,
                     PDL: tl.constexpr = False):
        """Grid (n tiles, m tiles, SPLIT_K). Program (n, m, s): ``acc[BLOCK_N, BLOCK_M] = sum over
        its K range of fp16(W[n tile, k blk] * h) @ x[m tile, k blk]^T`` (swap-AB: weight rows on
        the MMA's M axis, the widened tile its register A operand), then ``* out_scale``
        (``* x_scale[m]``). BLOCK_N and BLOCK_K divide 128: one multiplier per weight tile."""
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
        # the tile's one multiplier, loaded per weight row: a vector in the operand's row layout
        h_ptrs = wh_ptr + (offs_n // 128) * KB
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if not TMA:
            w_ptrs = w_src + offs_n[:, None].to(tl.int64) * K + (k_lo + offs_kk)[None, :]
            x_ptrs = x_src + offs_m[:, None] * stride_xm + (k_lo + offs_kk)[None, :]
        for k0 in range(0, k_per_split, BLOCK_K):
            k = k_lo + k0
            h = tl.load(h_ptrs + k // 128, mask=n_mask & ((offs_n * 0 + k) < K), other=0.0)
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
            wh = _scale_f16(w.to(tl.float16), h[:, None], PACKED_MUL)
            acc = _dot_acc(wh, tl.trans(a), acc, UPCAST_DOT)
        acc = acc * out_scale
        if HAS_XS:
            acc = acc * tl.load(xs_ptr + offs_m, mask=m_mask, other=1.0)[None, :]
        _gemm_epilogue(acc, y_ptr, part_ptr, cnt_ptr, offs_m[None, :] * stride_ym + offs_n[:, None],
                       offs_m[None, :] * N + offs_n[:, None], n_mask[:, None] & m_mask[None, :], M * N, pid_k,
                       pid_m * tl.num_programs(0) + pid_n, SPLIT_K, FUSED_REDUCE)


def fp8h_finish_config(cfg: dict, K: int) -> dict:
    """Defaults, checks and the derived ``k_per_split`` (a multiple of BLOCK_K; no empty
    splits). BLOCK_N and BLOCK_K must divide 128 (one weight multiplier per tile)."""
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg.setdefault("BLOCK_M", 16)
    cfg.setdefault("BLOCK_N", 64)
    cfg.setdefault("BLOCK_K", 128)
    cfg.setdefault("num_warps", 4)
    cfg.setdefault("num_stages", 4)
    cfg["TMA"] = bool(cfg.get("TMA", False))
    cfg["PACKED_MUL"] = bool(cfg.get("PACKED_MUL", True))
    for key in ("BLOCK_N", "BLOCK_K"):
        if 128 % int(cfg[key]) or int(cfg[key]) < 16:
            raise ValueError(f"fp8h config: {key}={cfg[key]} must divide 128 (one weight multiplier per tile)")
    bk = int(cfg["BLOCK_K"])
    kblocks = _cdiv(K, bk)
    split = max(1, min(int(cfg.get("SPLIT_K", 1)), kblocks))
    per = _cdiv(kblocks, split)
    cfg["k_per_split"] = per * bk
    cfg["SPLIT_K"] = _cdiv(kblocks, per)
    return cfg


def fp8h_config(M: int, N: int, K: int) -> dict:
    """A launch config: 64 weight rows x 128 columns per tile, the tokens in one tile up to 64,
    K split so that about two programs per SM stream the weight."""
    bm = max(16, min(64, 1 << max(0, M - 1).bit_length()))
    tiles = _cdiv(N, 64) * _cdiv(M, bm)
    split = max(1, min(_cdiv(K, BLOCK) // 2, _cdiv(264, tiles), 8))
    return fp8h_finish_config({"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": split}, K)


def fp8h_gemm_triton(x: Tensor, W_q: Tensor, W_h: Tensor, out_scale: float, *, x_scale: Tensor | None = None,
                     out: Tensor | None = None, config: dict | None = None) -> Tensor:
    """``x [M, K]`` fp16 (unit stride along K) times the e4m3 weight ``W_q [N, K]`` with its fp16
    block multipliers ``W_h`` (:func:`fp16_weight_scales`) -> bf16 ``[M, N]`` (into ``out`` if
    given). ``x_scale`` (fp32 ``[M]``, optional) multiplies each token's row. ``config``
    overrides :func:`fp8h_config`."""
    if x.dim() != 2 or x.dtype != torch.float16:
        raise ValueError(f"fp8h_gemm: x must be fp16 [M, K], got {x.dtype} {tuple(x.shape)}")
    if W_q.dim() != 2:
        raise ValueError(f"fp8h_gemm: W_q must be [N, K], got {tuple(W_q.shape)}")
    N, K = W_q.shape
    if W_h.dtype != torch.float16:
        raise ValueError(f"fp8h_gemm: W_h must be fp16, got {W_h.dtype}")
    check_weight(W_q, W_h.float())  # dtype, shape (not its transpose) and contiguity of the grid
    if not W_h.is_contiguous():
        raise ValueError("fp8h_gemm: W_h must be contiguous")
    if x.shape[1] != K:
        raise ValueError(f"fp8h_gemm: x has K={x.shape[1]} but the weight has K={K}")
    M = x.shape[0]
    if x_scale is not None and (x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (M,)):
        raise ValueError(f"fp8h_gemm: x_scale must be fp32 [{M}], got {x_scale.dtype} {tuple(x_scale.shape)}")
    if K > 1 and x.stride(1) != 1:
        x = x.contiguous()
    interpret = _require_triton(x)
    if M == 0 or N == 0 or K == 0:
        y = _out_buffer(out, M, N, x.device)
        return y.zero_() if K == 0 else y
    cfg = fp8h_finish_config(config, K) if config is not None else fp8h_config(M, N, K)
    split = cfg["SPLIT_K"]
    tiles_m, tiles_n = _cdiv(M, cfg["BLOCK_M"]), _cdiv(N, cfg["BLOCK_N"])
    out = _out_buffer(out, M, N, x.device)
    work = counters = None
    if split > 1:
        work = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        counters = _tile_counters(x.device, tiles_m * tiles_n)
    xs, ws = x, W_q
    tma = cfg["TMA"] and not interpret and _tma_ok(x, W_q)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xs = TensorDescriptor.from_tensor(x, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
        ws = TensorDescriptor.from_tensor(W_q, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
    kw = {} if interpret else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], **pdl_options(x)}
    _fp8h_kernel[(tiles_n, tiles_m, split)](
        xs, ws, W_h, W_h if x_scale is None else x_scale, out, x if work is None else work,
        W_h if counters is None else counters, M, N, K, _cdiv(K, BLOCK), x.stride(0), out.stride(0),
        cfg["k_per_split"], float(out_scale), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split, EVEN_K=K % cfg["k_per_split"] == 0,
        FUSED_REDUCE=counters is not None, UPCAST_DOT=interpret, HAS_XS=x_scale is not None, TMA=tma,
        PACKED_MUL=cfg["PACKED_MUL"] and not interpret, **kw)
    if split > 1 and counters is None:
        _launch_reduce(work, out, M, N, split)
    return out
