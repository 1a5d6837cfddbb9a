"""bf16 GEMM for decode shapes (Triton): ``y[M, N] = x[M, K] @ W[N, K]^T`` with small M.

Why: a decode step streams every weight once per token position (S2-Pro: 15.3 GB per frame,
36 slow + 4 x 10 fast layer passes), so at M = 1..128 a GEMM is a weight stream and its
speed is the fraction of HBM bandwidth it reaches. cuBLAS reaches ~3.1 TB/s on the wide
shapes (gate_up) but only 1.9-2.7 TB/s on the narrow ones (wo, down, wqkv; measured on the
H200, ``benchmarks/results/2026-12-01-h200-kernels-fp8-9c9a376.json``), where its tiles leave
too few bytes in flight. This kernel is the swap-AB structure of the FP8 decode GEMM
(:mod:`shoal.kernels.fp8`) for bf16 weights: ``acc^T[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T``
with 64-128 weight rows on the MMA's M axis (wgmma on sm_90) and the few tokens on its N axis,
the K loop split over ``SPLIT_K`` programs so all SMs stream, and the split-K partials added
by the last program of each tile to finish (per-tile arrival counters, split order from 0,
one rounding to bf16: deterministic, no second launch; the epilogue of :mod:`shoal.kernels.fp8`).

Numerics: fp32 accumulation of bf16 products, one round-to-nearest-even to bf16 at the end,
as cuBLAS (which also splits K at these shapes). Results differ from cuBLAS only in the order
of fp32 additions.

Dispatch: :func:`dense_linear` runs the kernel when a tuned launch config exists for the
GEMM's (N, K) and M bucket (``dense_tuned.json`` beside this file, written on an H200 by
``python -m shoal.bench.tune_dense``, which keeps a config only where it beat cuBLAS on cold
weights) and the tensors are CUDA bf16 on a GPU with the SM count it was tuned on; otherwise
``F.linear``. Grids depend on shapes only and nothing syncs with the host, so it is CUDA-graph
capturable (each config compiles at its first call, outside a capture: the engine's warm-up).
``SHOAL_DENSE_GEMM=0`` turns the kernel off (every GEMM through cuBLAS);
``SHOAL_DENSE_TUNED=PATH`` reads another table. A config's ``KIND`` picks the kernel: the
swap-AB MMA kernel (default), "tile" (TMA, tokens on the MMA's M axis), "streamk", or "gemv"
(one token: weight rows straight into registers and fp32 FMAs, no tensor cores; faster than
the MMA kernel back to back but not in the decode step, so the packaged table has none).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .fp8 import _cdiv, _device_sms, _launch_reduce, _out_buffer, _require_triton, _tile_counters, _tma_ok
from .fused import silu_mul
from .paged_attention import HAS_TRITON, note_foreign_kernel, pdl_options, tl, triton

__all__ = ["MAX_M", "dense_gemm_ref", "dense_gemm_triton", "dense_linear", "dense_config", "set_dense_table",
           "dense_swiglu", "dense_swiglu_triton", "swiglu_config"]

MAX_M = 128  # larger M (prefill) always goes to cuBLAS
TABLE_ENV = "SHOAL_DENSE_TUNED"
ENABLE_ENV = "SHOAL_DENSE_GEMM"
TUNED_SMS = 132  # SM count of a table without an "sms" entry (the packaged one: an H200)


def dense_gemm_ref(x: Tensor, w: Tensor) -> Tensor:
    """The reference: fp32 products and sums, one rounding to ``x``'s dtype."""
    return (x.float() @ w.float().t()).to(x.dtype)


if HAS_TRITON:
    from triton.language.extra import libdevice

    from .fp8 import _gemm_epilogue, _round_bf16
    from .paged_attention import gdc_launch_dependents, gdc_wait, pdl_enter

    @triton.jit
    def _prefetch_l2(ptrs):
        """One L2 prefetch per pointer of ``ptrs`` (valid addresses); a hint with no result,
        kept because the asm is not pure."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _dot_acc(a, b, acc, UPCAST_DOT: tl.constexpr):
        """``acc + a @ b`` in fp32. UPCAST_DOT (the interpreter, whose bf16 dot multiplies raw bit
        patterns): the products in fp32 on the bf16 values, which is what the tensor core does."""
        if UPCAST_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _swap_tile(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (n, m, s) of a (weight tile, token tile, split) grid: its ids, weight rows,
        token rows and the K offsets within a block."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        return (pid_n, pid_m, pid_k, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), pid_m * BLOCK_M + tl.arange(0, BLOCK_M),
                tl.arange(0, BLOCK_K))

    @triton.jit
    def _load_w(w_ptrs, n_mask, k_mask, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
        """One K block of a weight tile (masks only where the shape needs them)."""
        if EVEN_K:
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        return w

    @triton.jit
    def _load_x(x_ptrs, m_mask, k_mask, EVEN_K: tl.constexpr):
        """One K block of the activation tile (token rows past M read as zeros)."""
        if EVEN_K:
            a = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        return a

    @triton.jit
    def _load_operands(w_ptrs, x_ptrs, n_mask, m_mask, k_mask, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
        """One K block of the weight and activation tiles (masks only where the shape needs
        them: ragged K, ragged N; token rows past M always)."""
        return _load_w(w_ptrs, n_mask, k_mask, EVEN_K, EVEN_N), _load_x(x_ptrs, m_mask, k_mask, EVEN_K)

    @triton.jit
    def _swiglu_bf16(g, u, ACCURATE_EXP: tl.constexpr):
        """``silu(g) * u`` of bf16-valued fp32 tiles, rounded as ``fused._silu_mul_kernel``
        rounds (silu to bf16, then the product to bf16)."""
        if ACCURATE_EXP:
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        return _round_bf16(_round_bf16(tl.math.div_rn(g, 1.0 + e)) * u)

    @triton.jit
    def _dense_swiglu_kernel(x_src, w_src, y_ptr, part_ptr, cnt_ptr, M, I, K, stride_xm, stride_ym, k_per_split,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                             TMA: tl.constexpr, UPCAST_DOT: tl.constexpr, ACCURATE_EXP: tl.constexpr,
                             PDL: tl.constexpr = False):
        """The gate_up GEMM with SwiGLU in its epilogue: ``y[M, I] = silu(x @ W[:I]^T) * (x @
        W[I:]^T)`` for the stacked ``W = cat(w1, w3)`` [2I, K] as stored. Program (n, m, s)
        accumulates the gate rows ``n`` and the up rows ``I + n`` of its tile over its K range
        (the swap-AB product of ``_dense_swap_kernel``, two weight tiles per K block), rounds
        both to bf16 and writes the SwiGLU; with SPLIT_K > 1 the last split of the tile to
        arrive adds the fp32 partials (gate ``part[s]``, up ``part[SPLIT_K + s]``) in split order
        first. The same sums and roundings as that kernel with BLOCK_N rows followed by
        ``silu_mul``: the [M, 2I] intermediate and one launch disappear. TMA: descriptors
        (a gate tile's rows past I read up rows; they are never stored)."""
        pdl_enter(PDL)
        pid_n, pid_m, pid_k, offs_n, offs_m, offs_kk = _swap_tile(BLOCK_M, BLOCK_N, BLOCK_K)
        n_mask = offs_n < I
        m_mask = offs_m < M
        k_lo = pid_k * k_per_split
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            if TMA:
                wg = w_src.load([pid_n * BLOCK_N, k_lo + k0])
                wu = w_src.load([I + pid_n * BLOCK_N, k_lo + k0])
                a = x_src.load([pid_m * BLOCK_M, k_lo + k0])
            else:
                offs_k = k_lo + k0 + offs_kk
                k_mask = offs_k < K
                wg = _load_w(w_src + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], n_mask, k_mask, EVEN_K,
                             EVEN_N)
                wu = _load_w(w_src + (offs_n + I)[:, None].to(tl.int64) * K + offs_k[None, :], n_mask, k_mask,
                             EVEN_K, EVEN_N)
                a = _load_x(x_src + offs_m[:, None] * stride_xm + offs_k[None, :], m_mask, k_mask, EVEN_K)
            at = tl.trans(a)
            acc_g = _dot_acc(wg, at, acc_g, UPCAST_DOT)
            acc_u = _dot_acc(wu, at, acc_u, UPCAST_DOT)
        mask = n_mask[:, None] & m_mask[None, :]
        y_offs = offs_m[None, :] * stride_ym + offs_n[:, None]
        if SPLIT_K == 1:
            h = _swiglu_bf16(_round_bf16(acc_g), _round_bf16(acc_u), ACCURATE_EXP)
            tl.store(y_ptr + y_offs, h.to(tl.bfloat16), mask=mask)
        else:
            MI = M * I
            p_offs = offs_m[None, :] * I + offs_n[:, None]
            tl.store(part_ptr + pid_k * MI + p_offs, acc_g, mask=mask)
            tl.store(part_ptr + (SPLIT_K + pid_k) * MI + p_offs, acc_u, mask=mask)
            tl.debug_barrier()  # every thread's partials stored before the (release) arrival
            tile_id = pid_m * tl.num_programs(0) + pid_n
            prev = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
            if prev == SPLIT_K - 1:
                tg = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                tu = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for sp in tl.static_range(SPLIT_K):
                    tg += tl.load(part_ptr + sp * MI + p_offs, mask=mask, other=0.0, cache_modifier=".cg")
                    tu += tl.load(part_ptr + (SPLIT_K + sp) * MI + p_offs, mask=mask, other=0.0,
                                  cache_modifier=".cg")
                h = _swiglu_bf16(_round_bf16(tg), _round_bf16(tu), ACCURATE_EXP)
                tl.store(y_ptr + y_offs, h.to(tl.bfloat16), mask=mask)
                tl.atomic_xchg(cnt_ptr + tile_id, 0)

    @triton.jit
    def _dense_swap_kernel(x_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym, k_per_split,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                           FUSED_REDUCE: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr = False,
                           PREFETCH: tl.constexpr = 0):
        """Grid (n tiles, m tiles, SPLIT_K). Program (n, m, s) accumulates ``W[n tile, ks] @
        x[m tile, ks]^T`` over its K range ``ks = [s * k_per_split, (s + 1) * k_per_split)``
        (``k_per_split`` a multiple of BLOCK_K) in fp32 and hands it to the epilogue. EVEN_K:
        K is a multiple of ``k_per_split`` (no K masks); EVEN_N: N a multiple of BLOCK_N.
        UPCAST_DOT: see ``_dot_acc``. PREFETCH (with PDL):
        before waiting for the previous kernel, prefetch the first PREFETCH columns of this
        program's weight rows into L2 (the weights are never written by a kernel, so reading
        them early is safe): the weight stream starts while the predecessor finishes."""
        pid_n, pid_m, pid_k, offs_n, offs_m, offs_kk = _swap_tile(BLOCK_M, BLOCK_N, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        k_lo = pid_k * k_per_split
        if PDL and PREFETCH > 0:
            gdc_launch_dependents()
            rows = tl.minimum(offs_n, N - 1).to(tl.int64)
            cols = tl.minimum(k_lo + tl.arange(0, PREFETCH // 64) * 64, K - 1)  # one per 128-byte line
            _prefetch_l2(w_ptr + rows[:, None] * K + cols[None, :])
            gdc_wait()
        else:
            pdl_enter(PDL)
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + (k_lo + offs_kk)[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_kk)[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            w, a = _load_operands(w_ptrs, x_ptrs, n_mask, m_mask, (k_lo + k0 + offs_kk) < K, EVEN_K, EVEN_N)
            acc = _dot_acc(w, tl.trans(a), acc, UPCAST_DOT)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        _gemm_epilogue(acc, y_ptr, part_ptr, cnt_ptr, offs_m[None, :] * stride_ym + offs_n[:, None],
                       offs_m[None, :] * N + offs_n[:, None], n_mask[:, None] & m_mask[None, :], M * N, pid_k,
                       pid_m * tl.num_programs(0) + pid_n, SPLIT_K, FUSED_REDUCE)

    @triton.jit
    def _dense_gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym, k_per_split,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                           EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, FUSED_REDUCE: tl.constexpr,
                           PDL: tl.constexpr = False):
        """KIND "gemv" (one token; for M = 1): grid (n tiles, M, SPLIT_K). Program (n, m, s)
        loads its BLOCK_N weight rows straight into registers (no shared-memory staging, no
        tensor cores), multiplies them by token ``m``'s activation in fp32 into a
        [BLOCK_N, BLOCK_K] accumulator over its K range, and reduces that once at the end: a
        memory-bound GEMV with nothing between the loads and the FMAs. fp32 products and sums
        (another order than the MMA's), then ``_gemm_epilogue`` (split-K partials summed in
        split order)."""
        pdl_enter(PDL)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        k_lo = pid_k * k_per_split
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + (k_lo + offs_k)[None, :]
        x_ptrs = x_ptr + pid_m.to(tl.int64) * stride_xm + k_lo + offs_k
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            k_mask = (k_lo + k0 + offs_k) < K
            w = _load_w(w_ptrs, n_mask, k_mask, EVEN_K, EVEN_N).to(tl.float32)
            if EVEN_K:
                x = tl.load(x_ptrs).to(tl.float32)
            else:
                x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            acc += w * x[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        y = tl.sum(acc, axis=1)
        _gemm_epilogue(y, y_ptr, part_ptr, cnt_ptr, pid_m * stride_ym + offs_n, pid_m * N + offs_n, n_mask,
                       M * N, pid_k, pid_m * tl.num_programs(0) + pid_n, SPLIT_K, FUSED_REDUCE)

    @triton.jit
    def _dense_tma_kernel(x_desc, w_desc, y_ptr, part_ptr, cnt_ptr, M, N, stride_ym, k_per_split,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr, FUSED_REDUCE: tl.constexpr, UPCAST_DOT: tl.constexpr,
                          PDL: tl.constexpr = False, SWAP: tl.constexpr = True, W_KBT: tl.constexpr = 0):
        """``_dense_swap_kernel`` with both operands read through tensor descriptors (TMA on
        sm_90: one bulk copy per tile into shared memory, out-of-range rows and columns read as
        zeros, so no masks); the same products, sums and epilogue. ``SWAP=False`` (config
        ``KIND`` "tile", for M >= 64): the MMA computes ``x_tile @ W_tile^T`` with the tokens on
        its M axis and up to 256 weight rows on its N axis (the wide wgmma shape), transposed
        in registers for the epilogue; the same sums. ``W_KBT > 0``: ``w_desc`` describes the
        weight in tile-blocked order (``[N / BLOCK_N, W_KBT, BLOCK_N, BLOCK_K]`` viewed as rows
        of BLOCK_K, ``W_KBT = K / BLOCK_K``), so each tile is one contiguous block of memory."""
        pdl_enter(PDL)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        k_lo = pid_k * k_per_split
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc_t = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            if W_KBT > 0:
                w = w_desc.load([(pid_n * W_KBT + (k_lo + k0) // BLOCK_K) * BLOCK_N, 0])
            else:
                w = w_desc.load([pid_n * BLOCK_N, k_lo + k0])
            a = x_desc.load([pid_m * BLOCK_M, k_lo + k0])
            if SWAP:
                acc = _dot_acc(w, tl.trans(a), acc, UPCAST_DOT)
            else:
                acc_t = _dot_acc(a, tl.trans(w), acc_t, UPCAST_DOT)
        if not SWAP:
            acc = tl.trans(acc_t)
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        _gemm_epilogue(acc, y_ptr, part_ptr, cnt_ptr, offs_m[None, :] * stride_ym + offs_n[:, None],
                       offs_m[None, :] * N + offs_n[:, None], mask, M * N, pid_k,
                       pid_m * tl.num_programs(0) + pid_n, SPLIT_K, FUSED_REDUCE)


    @triton.jit
    def _dense_streamk_kernel(x_src, w_src, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym,
                              tiles_n, KBT, iters, progs, MAXC,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              TMA: tl.constexpr, EVEN_K: tl.constexpr,
                              EVEN_N: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr = False):
        """Stream-K form of the swap-AB GEMM: a grid of ``progs`` programs shares the
        ``iters = tiles x KBT`` (output tile, K block of BLOCK_K) iterations equally, program
        ``p`` taking ``[p * iters // progs, (p + 1) * iters // progs)``, so every SM streams
        the same number of weight bytes whatever the tile count (a fixed split-K leaves SMs
        idle or a partial wave: 40 tiles x 2 splits = 80 programs on 132 SMs). A program's
        range crosses tile boundaries; each (tile, K range) segment that is a whole tile is
        rounded and stored, the others store their fp32 partial in slot ``j`` (the program's
        rank among the tile's contributors, which follow from the range formula) and the
        last contributor to arrive (per-tile arrival counter, reset by it) adds the slots in
        order ``j = 0, 1, ...`` (K order) and rounds once. Deterministic for a given
        ``progs``. TMA: ``x_src`` / ``w_src`` are tensor descriptors (out-of-range reads are
        zeros), else pointers (masks unless EVEN_K / EVEN_N)."""
        pdl_enter(PDL)
        pid = tl.program_id(0)
        it = (pid * iters) // progs
        end = ((pid + 1) * iters) // progs
        offs_kk = tl.arange(0, BLOCK_K)
        loc = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        while it < end:
            tile = it // KBT
            kb0 = it - tile * KBT
            kb1 = tl.minimum(KBT, kb0 + (end - it))
            pid_n = tile % tiles_n
            pid_m = tile // tiles_n
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            n_mask = offs_n < N
            m_mask = offs_m < M
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for kb in range(kb0, kb1):
                if TMA:
                    w = w_src.load([pid_n * BLOCK_N, kb * BLOCK_K])
                    a = x_src.load([pid_m * BLOCK_M, kb * BLOCK_K])
                else:
                    offs_k = kb * BLOCK_K + offs_kk
                    w, a = _load_operands(w_src + offs_n[:, None].to(tl.int64) * K + offs_k[None, :],
                                          x_src + offs_m[:, None] * stride_xm + offs_k[None, :],
                                          n_mask, m_mask, offs_k < K, EVEN_K, EVEN_N)
                acc = _dot_acc(w, tl.trans(a), acc, UPCAST_DOT)
            mask = n_mask[:, None] & m_mask[None, :]
            y_offs = offs_m[None, :] * stride_ym + offs_n[:, None]
            # the tile's contributors: the owners of its first and last iteration
            p_first = ((tile * KBT + 1) * progs - 1) // iters
            p_last = ((tile * KBT + KBT) * progs - 1) // iters
            if p_first == p_last:  # the whole tile in this program
                tl.store(y_ptr + y_offs, _round_bf16(acc).to(tl.bfloat16), mask=mask)
            else:
                slot = part_ptr + tile * (MAXC * BLOCK_N * BLOCK_M)
                tl.store(slot + (pid - p_first) * (BLOCK_N * BLOCK_M) + loc, acc)
                tl.debug_barrier()  # every thread's partial stored before the (release) arrival
                prev = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
                if prev == p_last - p_first:
                    tot = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                    for j in range(0, p_last - p_first + 1):
                        tot += tl.load(slot + j * (BLOCK_N * BLOCK_M) + loc, cache_modifier=".cg")
                    tl.store(y_ptr + y_offs, _round_bf16(tot).to(tl.bfloat16), mask=mask)
                    tl.atomic_xchg(cnt_ptr + tile, 0)
            it += kb1 - kb0

# --------------------------------------------------------------------------------------
# Launch configs
# --------------------------------------------------------------------------------------

_table_override: list = []


def set_dense_table(path=None) -> None:
    """Read the tuned table at ``path`` from now on (``None``: ``$SHOAL_DENSE_TUNED`` or the
    packaged ``dense_tuned.json``); clears the config cache."""
    _table_override[:] = [] if path is None else [str(path)]
    _table_doc.cache_clear()
    dense_config.cache_clear()
    swiglu_config.cache_clear()


@functools.cache
def _table_doc() -> dict:
    override = _table_override[0] if _table_override else os.environ.get(TABLE_ENV)
    path = Path(override) if override else Path(__file__).with_name("dense_tuned.json")
    if path.is_dir():
        path = path / "dense_tuned.json"
    try:
        doc = json.loads(path.read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _table() -> dict:
    """``{"N,K": {"M": config}}``; a bucket M serves every batch size up to it."""
    return _table_doc().get("configs", {})


def table_sms() -> int:
    """The SM count of the GPU the active table was tuned on (its ``"sms"``; 132, the H200,
    when absent): the table is used only on GPUs with that many SMs."""
    return int(_table_doc().get("sms") or TUNED_SMS)


def finish_config(cfg: dict, K: int) -> dict:
    """Fill defaults and derive ``k_per_split`` (a multiple of BLOCK_K; no empty splits)."""
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg.setdefault("BLOCK_M", 16)
    cfg.setdefault("BLOCK_N", 64)
    cfg.setdefault("BLOCK_K", 128)
    cfg.setdefault("num_warps", 4)
    cfg.setdefault("num_stages", 4)
    bk = int(cfg["BLOCK_K"])
    kblocks = _cdiv(K, bk)
    split = max(1, min(int(cfg.get("SPLIT_K", 1)), kblocks))
    per = _cdiv(kblocks, split)
    cfg["k_per_split"] = per * bk
    cfg["SPLIT_K"] = _cdiv(kblocks, per)
    # KIND "tile" (TMA kernel only): tokens on the MMA's M axis; "streamk": the swap-AB
    # product with PROGRAMS programs sharing the (tile, K block) iterations; "gemv": the
    # CUDA-core GEMV for one token (benchmarks/scripts/gemv_table.py); otherwise swap-AB
    kind = cfg.get("KIND")
    if kind == "streamk":
        cfg["SPLIT_K"], cfg["k_per_split"] = 1, kblocks * bk
        cfg["PROGRAMS"] = max(1, int(cfg.get("PROGRAMS") or TUNED_SMS))
        cfg["PREFETCH"] = 0
        return cfg
    cfg.pop("PROGRAMS", None)
    if kind == "gemv":  # one token per program row; pointer loads only
        cfg["KIND"], cfg["TMA"], cfg["PREFETCH"], cfg["BLOCK_M"] = "gemv", False, 0, 1
        return cfg
    cfg["KIND"] = "tile" if kind == "tile" and cfg.get("TMA") else "swap"
    # PREFETCH (pointer kernel only): weight columns per row prefetched into L2 before the PDL
    # wait, a power of two from 64 up to the program's K range; 0 = none
    pf = 0 if cfg.get("TMA") else min(int(cfg.get("PREFETCH") or 0), cfg["k_per_split"])
    cfg["PREFETCH"] = 1 << (pf.bit_length() - 1) if pf >= 64 else 0
    return cfg


@functools.lru_cache(maxsize=4096)
def dense_config(M: int, N: int, K: int) -> dict | None:
    """The tuned config for this GEMM (the smallest bucket >= M of its (N, K) entry), or None
    when there is none (cuBLAS is used)."""
    return _bucket(_table().get(f"{N},{K}"), M, K)


def _bucket(entry: dict | None, M: int, K: int) -> dict | None:
    """The config of the smallest bucket >= M of a table entry (None: none, or cuBLAS)."""
    if not entry or M < 1 or M > MAX_M:
        return None
    for b in sorted(int(m) for m in entry):
        if M <= b:
            cfg = entry[str(b)]
            return finish_config(cfg, K) if cfg else None
    return None


@functools.cache
def _enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") not in ("0", "false", "no", "off")


# --------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------


def _operands(what: str, x: Tensor, w: Tensor, w_desc: str, even_rows: bool = False) -> tuple[Tensor, Tensor, bool]:
    """Checked kernel operands: ``x [M, K]`` with unit stride along K, ``w`` contiguous, both
    bf16 (``even_rows``: w has an even row count); and whether Triton interprets."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or (even_rows and w.shape[0] % 2):
        raise ValueError(f"{what}: x [M, K] and {w_desc} expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise ValueError(f"{what}: bf16 operands expected, got {x.dtype} and {w.dtype}")
    interpret = _require_triton(x)
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    if not w.is_contiguous():
        w = w.contiguous()
    return x, w, interpret


def _launch_kw(cfg: dict, x: Tensor, interpret: bool) -> dict:
    """Launch options of a config (none under the interpreter), with PDL where enabled."""
    return {} if interpret else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], **pdl_options(x)}


def _descriptors(x: Tensor, w: Tensor, cfg: dict) -> tuple:
    """``(x, w, tma)``: tensor descriptors of the config's tiles when it asks for TMA and the
    operands allow it (16-byte aligned), else the tensors themselves and False."""
    if not (cfg.get("TMA") and _tma_ok(x, w)):
        return x, w, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor.from_tensor(x, [cfg["BLOCK_M"], cfg["BLOCK_K"]]),
            TensorDescriptor.from_tensor(w, [cfg["BLOCK_N"], cfg["BLOCK_K"]]), True)


def dense_gemm_triton(x: Tensor, w: Tensor, *, out: Tensor | None = None, config: dict | None = None) -> Tensor:
    """The Triton kernel: ``x [M, K]`` (bf16, unit stride along K) times ``w [N, K]^T`` (bf16,
    contiguous) -> bf16 ``[M, N]`` (into ``out`` if given: bf16 ``[M, N]``, unit stride along N).
    ``config`` (BLOCK_M/N/K, SPLIT_K, num_warps, num_stages, TMA, PREFETCH, KIND) overrides the table (tuning and
    tests); without either, a plain default. ``TMA``: read the operands through tensor
    descriptors (``_dense_tma_kernel``; pointer loads when a base or row stride is not 16-byte
    aligned)."""
    x, w, interpret = _operands("dense_gemm", x, w, "w [N, K]")
    M, K = x.shape
    N = w.shape[0]
    out = _out_buffer(out, M, N, x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    cfg = finish_config(config if config is not None else (dense_config(M, N, K) or {}), K)
    if cfg["KIND"] == "streamk":
        counters = _tile_counters(x.device, _cdiv(M, cfg["BLOCK_M"]) * _cdiv(N, cfg["BLOCK_N"]))
        if counters is not None:
            _launch_streamk(x, w, out, counters, cfg, interpret)
            return out
        # no arrival counters (first use inside a graph capture, which the engine's warm-up
        # precedes): one program per tile -- the same products, summed in plain K order
        # rather than by stream-K segments, so the last fp32 bits can differ
        cfg = finish_config({k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages",
                                                 "TMA") if k in cfg}, K)
    split = cfg["SPLIT_K"]
    tiles_m, tiles_n = _cdiv(M, cfg["BLOCK_M"]), _cdiv(N, cfg["BLOCK_N"])
    work = counters = None
    if split > 1:
        work = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        counters = _tile_counters(x.device, tiles_m * tiles_n)
    even_k = K % cfg["k_per_split"] == 0
    kw = _launch_kw(cfg, x, interpret)
    prefetch = cfg["PREFETCH"] if kw.get("PDL") else 0
    grid = (tiles_n, tiles_m, split)
    part = x if work is None else work
    cnt = out if counters is None else counters
    x_desc, w_desc, tma = _descriptors(x, w, cfg)
    if cfg["KIND"] == "gemv":
        _dense_gemv_kernel[grid](x, w, out, part, cnt, M, N, K, x.stride(0), out.stride(0), cfg["k_per_split"],
                                 BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split, EVEN_K=even_k,
                                 EVEN_N=N % cfg["BLOCK_N"] == 0, FUSED_REDUCE=counters is not None, **kw)
    elif tma:
        _dense_tma_kernel[grid](x_desc, w_desc, out, part, cnt, M, N, out.stride(0), cfg["k_per_split"],
                                BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                                SPLIT_K=split, FUSED_REDUCE=counters is not None, UPCAST_DOT=interpret,
                                SWAP=cfg.get("KIND") != "tile", **kw)
    else:
        _dense_swap_kernel[grid](
            x, w, out, part, cnt, M, N, K, x.stride(0), out.stride(0), cfg["k_per_split"], BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split, EVEN_K=even_k,
            EVEN_N=N % cfg["BLOCK_N"] == 0, FUSED_REDUCE=counters is not None, UPCAST_DOT=interpret,
            PREFETCH=prefetch, **kw)
    if split > 1 and counters is None:
        _launch_reduce(work, out, M, N, split)
    return out


@functools.lru_cache(maxsize=4096)
def streamk_plan(M: int, N: int, K: int, block_m: int, block_n: int, block_k: int, programs: int) -> tuple:
    """``(tiles_n, KBT, iters, progs, maxc)`` of a stream-K launch: K blocks per tile, total
    iterations, programs (at most one per iteration) and the most programs sharing one tile
    (the partial slots per tile), from the same range formula as the kernel."""
    tiles_n, tiles = _cdiv(N, block_n), _cdiv(N, block_n) * _cdiv(M, block_m)
    kbt = _cdiv(K, block_k)
    iters = tiles * kbt
    progs = max(1, min(programs, iters))
    maxc = max(((t * kbt + kbt) * progs - 1) // iters - ((t * kbt + 1) * progs - 1) // iters + 1
               for t in range(tiles))
    return tiles_n, kbt, iters, progs, maxc


def _launch_streamk(x: Tensor, w: Tensor, out: Tensor, counters: Tensor, cfg: dict, interpret: bool) -> None:
    M, K = x.shape
    N = w.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles_n, kbt, iters, progs, maxc = streamk_plan(M, N, K, bm, bn, bk, cfg["PROGRAMS"])
    tiles = iters // kbt
    part = torch.empty(tiles * maxc * bn * bm if maxc > 1 else 1, dtype=torch.float32, device=x.device)
    kw = _launch_kw(cfg, x, interpret)
    xs, ws, tma = _descriptors(x, w, cfg)
    _dense_streamk_kernel[(progs,)](xs, ws, out, part, counters, M, N, K, x.stride(0), out.stride(0),
                                    tiles_n, kbt, iters, progs, maxc, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                    TMA=tma, EVEN_K=K % bk == 0, EVEN_N=N % bn == 0,
                                    UPCAST_DOT=interpret, **kw)


SWIGLU_ENV = "SHOAL_DENSE_SWIGLU"


@functools.lru_cache(maxsize=4096)
def swiglu_config(M: int, N2: int, K: int) -> dict | None:
    """The fused gate_up + SwiGLU launch for ``w13 [N2 = 2I, K]``: the table's ``"swiglu:N2,K"``
    entry when it has one (``tune_dense --swiglu``; a null bucket, or none >= M: unfused),
    else the gate_up GEMM's own tuned swap-AB config -- the same tiles, K order and MMA
    shape as the unfused path, so the same bits (each program then reads BLOCK_N gate and
    BLOCK_N up rows) -- or None (no tuned swap config). A tuned entry may pick other tiles: its
    sums equal the unfused kernel's with those tiles, which can differ from the default
    path's in the last fp32 bits (the usual split / order freedom of a GEMM)."""
    if N2 % 2:
        return None
    entry = _table().get(f"swiglu:{N2},{K}")
    if entry:
        cfg = _bucket(entry, M, K)
        return cfg if cfg is None or cfg["KIND"] == "swap" else None
    cfg = dense_config(M, N2, K)
    if cfg is None or cfg["KIND"] != "swap":
        return None
    return finish_config({k: v for k, v in cfg.items() if k not in ("k_per_split", "KIND", "PREFETCH")}, K)


def dense_swiglu_triton(x: Tensor, w13: Tensor, *, out: Tensor | None = None, config: dict | None = None) -> Tensor:
    """``silu(x @ w13[:I]^T) * (x @ w13[I:]^T)`` -> bf16 ``[M, I]`` in one kernel
    (``_dense_swiglu_kernel``; ``w13 = cat(w1, w3)`` [2I, K] as the model stores it).
    ``config``: BLOCK_M/N/K, SPLIT_K, num_warps, num_stages, TMA (swap-AB only). Without
    arrival counters for a split config (first use inside a graph capture) it runs the GEMM
    with the same tiles and then ``silu_mul``: the same bits."""
    x, w13, interpret = _operands("dense_swiglu", x, w13, "w13 [2I, K]", even_rows=True)
    M, K = x.shape
    inter = w13.shape[0] // 2
    cfg = finish_config(config if config is not None else (swiglu_config(M, 2 * inter, K) or {}), K)
    if cfg["KIND"] != "swap":
        raise ValueError(f"dense_swiglu: swap-AB configs only, got KIND {cfg['KIND']!r}")
    out = _out_buffer(out, M, inter, x.device)
    if M == 0 or inter == 0:
        return out
    split = cfg["SPLIT_K"]
    tiles_m, tiles_n = _cdiv(M, cfg["BLOCK_M"]), _cdiv(inter, cfg["BLOCK_N"])
    counters = _tile_counters(x.device, tiles_m * tiles_n) if split > 1 else None
    if K == 0 or (split > 1 and counters is None):
        return silu_mul(dense_gemm_triton(x, w13, config=cfg), out=out)
    part = torch.empty(2 * split, M, inter, dtype=torch.float32, device=x.device) if split > 1 else x
    kw = _launch_kw(cfg, x, interpret)
    xs, ws, tma = _descriptors(x, w13, cfg)
    _dense_swiglu_kernel[(tiles_n, tiles_m, split)](
        xs, ws, out, part, counters if counters is not None else out, M, inter, K, x.stride(0), out.stride(0),
        cfg["k_per_split"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split,
        EVEN_K=K % cfg["k_per_split"] == 0, EVEN_N=inter % cfg["BLOCK_N"] == 0, TMA=tma, UPCAST_DOT=interpret,
        ACCURATE_EXP=not interpret, **kw)
    return out


@functools.cache
def _swiglu_enabled() -> bool:
    return os.environ.get(SWIGLU_ENV, "0") in ("1", "true", "yes", "on")


def dense_swiglu(x: Tensor, w13: Tensor) -> Tensor:
    """``silu_mul(dense_linear(x, w13))`` for any leading dims; with ``SHOAL_DENSE_SWIGLU=1``
    (off by default until it is measured on a GPU) the fused kernel where the tuned table has
    a swap-AB gate_up config: the same bits without the [M, 2I] intermediate and one launch."""
    if _swiglu_enabled() and x.dim() >= 2 and x.is_cuda and 0 < x.numel() <= MAX_M * x.shape[-1]:
        x2 = x.reshape(-1, x.shape[-1])
        if _eligible(x2, w13) and swiglu_config(x2.shape[0], w13.shape[0], w13.shape[1]) is not None:
            return dense_swiglu_triton(x2, w13).view(*x.shape[:-1], w13.shape[0] // 2)
    return silu_mul(dense_linear(x, w13))


def _eligible(x: Tensor, w: Tensor) -> bool:
    """2-D bf16 CUDA operands (contiguous weight) on a GPU of the table's SM count, kernels on."""
    if not (HAS_TRITON and x.is_cuda and _enabled()) or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    return x.dim() == 2 and w.is_contiguous() and _device_sms(x) == table_sms()


def use_dense_kernel(x: Tensor, w: Tensor) -> bool:
    """True when :func:`dense_linear` would run the Triton kernel for these operands."""
    return _eligible(x, w) and dense_config(x.shape[0], w.shape[0], w.shape[1]) is not None


def dense_linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, w, bias)`` for any leading dims; the decode kernel where the tuned table
    says it beats cuBLAS (see the module docstring), else ``F.linear``."""
    if bias is None and x.dim() >= 2 and x.is_cuda and 0 < x.numel() <= MAX_M * x.shape[-1]:  # cheap tests first
        x2 = x.reshape(-1, x.shape[-1])
        if use_dense_kernel(x2, w):
            return dense_gemm_triton(x2, w).view(*x.shape[:-1], w.shape[0])
    y = F.linear(x, w, bias)
    note_foreign_kernel(x)
    return y
