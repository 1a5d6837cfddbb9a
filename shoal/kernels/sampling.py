"""Fused S2 sampling for the engine's decode step: one Triton program per batch row.

The PyTorch sampler (:mod:`shoal.engine.sampling`) spends ~40 small kernels per draw (sort,
softmax, cumsum, scatter, masks, the noise hash, argmax); the decode step draws 11 times per
frame, hundreds of launches per step.
Here one kernel does a whole draw and reads the per-request state straight from the runner's
slot tensors (no gathers):

* :func:`s2_main_sample` -- the main token over the allowed logits ``[B, A]`` (A = semantic ids
  then ``<|im_end|>``): both draws of a frame (normal, RAS fallback) from one sort, the RAS
  window test, and the outputs the step needs (allowed index, token id, code 0, the fast
  embedding of code 0);
* :func:`s2_residual_sample` -- one residual codebook from fast logits ``[B, n]``: the code
  written into the frame's column buffer and its fast embedding for the next fast position.

Numerics (the S2 rule of :mod:`shoal.engine.sampling`, per row, in the logits dtype): the
nucleus is the prefix of the descending order (ties: lower index first, as a stable sort)
whose ranks r satisfy r == 0 or (r < top_k and cum_r <= top_p), where cum_r is the fp32 running
sum of the softmax values (each rounded to the logits dtype) rounded to the logits dtype --
PyTorch's CPU cumsum; its CUDA bf16 cumsum rounds the running sum at every step. No sort: the
kernel walks the ranks in order, eight at a time from one reduction that merges sorted top-8
lists, until every draw has stopped keeping them (top_k 30 bounds the walk at 30: four
reductions), then draws vectorized over the row: the first
index of ``max(probs / q)`` with ``probs = softmax(logits / temperature)`` over the kept set
and the counter-hash noise ``q = -log U``. Exponentials, logarithms and divisions are
IEEE-accurate (libdevice, ``div_rn``), so the kernel draws what the PyTorch sampler draws
except where a different summation order rounds a value differently at a boundary or two race
scores tie within an fp32 ulp (tests/test_sampling_kernels.py counts them: 0 so far).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from .fused import _next_pow2
from .paged_attention import HAS_TRITON, pdl_options, tl, triton, triton_interpreting

__all__ = ["s2_main_sample", "s2_residual_sample"]

WALK_MAX = 64  # top_k up to this: rank walk (one reduction per kept rank); above: bisection


if HAS_TRITON:
    from triton.language.extra import libdevice

    from .fp8 import _round_bf16
    from .paged_attention import pdl_enter

    @triton.jit
    def _round_dt(x, ROUND: tl.constexpr):
        """fp32 -> the nearest bf16 value (round to nearest even) when ROUND, else x."""
        if ROUND:
            x = _round_bf16(x)
        return x

    @triton.jit
    def _exp(x, ACCURATE: tl.constexpr):
        """expf: libdevice's accurate one on the GPU (``tl.exp`` compiles to ``ex2.approx``);
        libdevice has no interpreter implementation, where ``tl.exp`` is numpy's."""
        if ACCURATE:
            y = libdevice.exp(x)
        else:
            y = tl.exp(x)
        return y

    @triton.jit
    def _log(x, ACCURATE: tl.constexpr):
        if ACCURATE:
            y = libdevice.log(x)
        else:
            y = tl.log(x)
        return y

    @triton.jit
    def _mix32(x):
        x = ((x >> 16) ^ x) * 0x45D9F3B
        x = ((x >> 16) ^ x) * 0x45D9F3B
        return (x >> 16) ^ x

    @triton.jit
    def _draw_key(seed, counter):
        """The per-(request, draw) key of :func:`shoal.engine.sampling.hash_uniform`."""
        lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        c = (counter & 0xFFFFFFFF).to(tl.uint32)
        return _mix32(lo ^ _mix32(hi ^ _mix32(c)))

    @triton.jit
    def _race_noise(key, idx, ACCURATE: tl.constexpr):
        """q = -log U for vocabulary indices ``idx`` (int32), floored at the smallest normal
        fp32 like :func:`shoal.engine.sampling.hash_exponential` (U == 1 gives -log U == 0)."""
        h = _mix32(key ^ _mix32(idx.to(tl.uint32) * 0x9E37 + 0x7F4A7C15))
        u = ((h >> 8) + 1).to(tl.float32) * (1.0 / 16777216.0)
        return tl.maximum(-_log(u, ACCURATE), 1.1754943508222875e-38)

    @triton.jit
    def _row(row_ptr, V, BLOCK: tl.constexpr, KEY32: tl.constexpr):
        """Load a logits row -> (values fp32, indices, keys): ``key`` orders the entries as a
        stable descending sort does (value first, then lower index first) and is unique;
        padding lanes are -inf below every real entry. ``KEY32`` (bf16 logits, V <= 65536):
        int32 keys, the bf16 bits over the inverted index; else int64 (fp32 bits)."""
        offs = tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        x = x + 0.0  # -0.0 -> +0.0: equal logits must tie
        b = x.to(tl.int32, bitcast=True)
        ordered = b ^ ((b >> 31) & 0x7FFFFFFF)  # monotone in the float value
        if KEY32:  # a bf16 value's fp32 bits end in 16 zero bits: keep the top half
            key = (ordered & -65536) | (65535 - offs)
        else:
            key = (ordered.to(tl.int64) << 32) | (BLOCK - 1 - offs).to(tl.int64)
        return x, offs, key

    @triton.jit
    def _key_value(key, KEY32: tl.constexpr):
        if KEY32:
            hi = key >> 16
            bits = (hi ^ ((hi >> 15) & 0x7FFF)) << 16
        else:
            hi = (key >> 32).to(tl.int32)
            bits = hi ^ ((hi >> 31) & 0x7FFFFFFF)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _bisect(key, sm, valid, k, p, ROUND: tl.constexpr):
        """Key of the last kept rank by bisection over the key range: the smallest key t with
        ``count(key >= t) == 1`` or ``count <= top_k and round(sum of sm over key >= t) <=
        top_p`` -- the same prefix as the walk, in <= 32 (64) steps whatever top_k is."""
        hi = tl.max(key, 0)  # rank 0 alone: always kept
        lo = tl.min(tl.where(valid, key, hi), 0)
        while lo < hi:
            mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2), no overflow
            sel = key >= mid
            cnt = tl.sum(sel.to(tl.int32), 0)
            mass = _round_dt(tl.sum(tl.where(sel, sm, 0.0), 0), ROUND)
            ok = (cnt <= 1) | ((cnt <= k) & (mass <= p))
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid + 1)
        return hi

    @triton.jit
    def _cswap(a, b):
        """A compare-exchange: (larger, smaller)."""
        return tl.maximum(a, b), tl.minimum(a, b)

    @triton.jit
    def _top8_merge(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7):
        """The 8 largest of two descending 8-lists, descending (a bitonic merge: the elementwise
        max of one list and the other reversed holds them as a bitonic sequence, then three
        half-cleaner stages sort it)."""
        m0 = tl.maximum(a0, b7)
        m1 = tl.maximum(a1, b6)
        m2 = tl.maximum(a2, b5)
        m3 = tl.maximum(a3, b4)
        m4 = tl.maximum(a4, b3)
        m5 = tl.maximum(a5, b2)
        m6 = tl.maximum(a6, b1)
        m7 = tl.maximum(a7, b0)
        m0, m4 = _cswap(m0, m4)
        m1, m5 = _cswap(m1, m5)
        m2, m6 = _cswap(m2, m6)
        m3, m7 = _cswap(m3, m7)
        m0, m2 = _cswap(m0, m2)
        m1, m3 = _cswap(m1, m3)
        m4, m6 = _cswap(m4, m6)
        m5, m7 = _cswap(m5, m7)
        m0, m1 = _cswap(m0, m1)
        m2, m3 = _cswap(m2, m3)
        m4, m5 = _cswap(m4, m5)
        m6, m7 = _cswap(m6, m7)
        return m0, m1, m2, m3, m4, m5, m6, m7

    @triton.jit
    def _walk_rank(cur, r, cum, alive_a, alive_b, thr_a, thr_b, m, S, V, k, p_a, p_b, ROUND: tl.constexpr,
                   ACCURATE: tl.constexpr, KEY32: tl.constexpr):
        """Rank ``r`` (key ``cur``) of the nucleus walk: its rounded softmax value joins the
        running sum, and each draw that still keeps ranks keeps this one if ``r < top_k`` and
        the rounded sum is within its top_p. Past the row's last rank (``r >= V``) nothing is
        kept (``cur`` is then a sentinel)."""
        cum = cum + _round_dt(tl.math.div_rn(_exp(_key_value(cur, KEY32) - m, ACCURATE), S), ROUND)
        c = _round_dt(cum, ROUND)
        keep = (r < V) & (r < k)
        alive_a = alive_a & keep & (c <= p_a)
        alive_b = alive_b & keep & (c <= p_b)
        thr_a = tl.where(alive_a, cur, thr_a)
        thr_b = tl.where(alive_b, cur, thr_b)
        return r + 1, cum, alive_a, alive_b, thr_a, thr_b

    @triton.jit
    def _nucleus(x, key, V, k, p_a, p_b, TWO: tl.constexpr, ROUND: tl.constexpr, ACCURATE: tl.constexpr,
                 KEY32: tl.constexpr, WALK_MAX: tl.constexpr, WALK8: tl.constexpr):
        """The kept sets of the S2 rule without a sort -> (key of draw a's last kept rank, the
        same for draw b). Rank r >= 1 is kept while r < top_k and
        ``cum_r = round(fp32 sum of round(softmax)_0..r) <= top_p``; kept sets are prefixes.
        top_k <= WALK_MAX: walk the ranks in order (eight per top-8 reduction; one per max
        reduction without WALK8) while a draw still keeps them (top_k 30: at most 30 steps,
        usually a few); larger top_k: bisection."""
        m = tl.max(x, 0)
        S = tl.sum(_exp(x - m, ACCURATE), 0)
        p_a = _round_dt(p_a, ROUND)
        p_b = _round_dt(p_b, ROUND)
        prev = tl.max(key, 0)  # rank 0: always kept
        thr_a = prev
        thr_b = prev
        if k <= WALK_MAX:
            cum = _round_dt(tl.math.div_rn(_exp(_key_value(prev, KEY32) - m, ACCURATE), S), ROUND)
            alive_a = k > 1
            if TWO:
                alive_b = k > 1
            else:
                alive_b = k < 0
            if KEY32:
                sent = tl.full(key.shape, -2147483647, key.dtype)
            else:
                sent = tl.full(key.shape, -9223372036854775807, key.dtype)
            r = 1
            if WALK8:
                while (alive_a | alive_b) & (r < V):
                    # the next 8 ranks (the 8 largest keys below the last one taken) in one
                    # reduction, then walked one by one: the same ranks in the same order as one
                    # max reduction per rank, with an eighth of the reductions
                    cs = tl.reduce((tl.where(key < prev, key, sent), sent, sent, sent, sent, sent, sent, sent), 0,
                                   _top8_merge)
                    for j in tl.static_range(8):
                        r, cum, alive_a, alive_b, thr_a, thr_b = _walk_rank(cs[j], r, cum, alive_a, alive_b, thr_a,
                                                                            thr_b, m, S, V, k, p_a, p_b, ROUND,
                                                                            ACCURATE, KEY32)
                    prev = cs[7]
            else:
                while (alive_a | alive_b) & (r < V):  # one rank per max reduction
                    cur = tl.max(tl.where(key < prev, key, sent), 0)
                    r, cum, alive_a, alive_b, thr_a, thr_b = _walk_rank(cur, r, cum, alive_a, alive_b, thr_a, thr_b, m, S, V,
                                                                        k, p_a, p_b, ROUND, ACCURATE, KEY32)
                    prev = cur
        else:
            sm = _round_dt(tl.math.div_rn(_exp(x - m, ACCURATE), tl.zeros_like(x) + S), ROUND)
            valid = tl.arange(0, x.shape[0]) < V
            thr_a = _bisect(key, sm, valid, k, p_a, ROUND)
            if TWO:
                thr_b = _bisect(key, sm, valid, k, p_b, ROUND)
            else:
                thr_b = thr_a
        return thr_a, thr_b

    @triton.jit
    def _race(x, offs, key, thr, temperature, rkey, TMIN: tl.constexpr, ROUND: tl.constexpr,
              ACCURATE: tl.constexpr):
        """One draw over the kept set ``key >= thr``: softmax(x / temperature) there (in the
        logits dtype), then the first index of max(probs / q) -> int32 scalar."""
        kept = key >= thr
        t = tl.maximum(_round_dt(temperature, ROUND), TMIN)
        scaled = _round_dt(tl.math.div_rn(x, tl.zeros_like(x) + t), ROUND)
        scaled = tl.where(kept, scaled, float("-inf"))
        m = tl.max(scaled, 0)
        e = _exp(scaled - m, ACCURATE)
        s = tl.sum(e, 0)
        probs = _round_dt(tl.math.div_rn(e, tl.zeros_like(e) + s), ROUND)
        score = tl.where(kept, tl.math.div_rn(probs, _race_noise(rkey, offs, ACCURATE)), -1.0)
        best = tl.max(score, 0)
        return tl.min(tl.where(score == best, offs, 2147483647), 0)

    @triton.jit
    def _first_argmax(x, offs):
        return tl.min(tl.where(x == tl.max(x, 0), offs, 2147483647), 0)

    @triton.jit
    def _copy_embedding(emb_ptr, stride_e, code, out_ptr, D, BLOCK_D: tl.constexpr):
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            tl.store(out_ptr + d, tl.load(emb_ptr + code.to(tl.int64) * stride_e + d, mask=d < D), mask=d < D)

    @triton.jit
    def _s2_main_kernel(logits_ptr, stride_l, A, slots_ptr, frame_ptr, temp_ptr, top_p_ptr, top_k_ptr,
                        greedy_ptr, ras_temp_ptr, ras_top_p_ptr, ras_window_ptr, seed_ptr,
                        window_ptr, stride_w, allowed_ptr, n_sem, idx_ptr, cols_ptr, stride_c,
                        emb_ptr, stride_e, emb_out_ptr, stride_eo, D,
                        W: tl.constexpr, DRAWS: tl.constexpr, TMIN: tl.constexpr, WALK_MAX: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr,
                        ACCURATE: tl.constexpr, EMB: tl.constexpr, BLOCK_D: tl.constexpr,
                        PDL: tl.constexpr = False, WALK8: tl.constexpr = True):
        pdl_enter(PDL)
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row)
        x, offs, key = _row(logits_ptr + row.to(tl.int64) * stride_l, A, BLOCK, ROUND)
        # every per-request value is loaded before the first reduction (a load after one waits
        # for it and then pays its own round trip)
        counter = tl.load(frame_ptr + slot) * DRAWS
        seed = tl.load(seed_ptr + slot)
        greedy = tl.load(greedy_ptr + slot).to(tl.int32)
        top_k = tl.load(top_k_ptr + slot)
        top_p = tl.load(top_p_ptr + slot)
        ras_top_p = tl.load(ras_top_p_ptr + slot)
        temp = tl.load(temp_ptr + slot)
        ras_temp = tl.load(ras_temp_ptr + slot)
        wo = tl.arange(0, W)
        win = tl.load(window_ptr + slot * stride_w + wo)
        ras_window = tl.load(ras_window_ptr + slot)
        k = tl.where(greedy != 0, 1, top_k)  # greedy rows: no nucleus walk
        thr_n, thr_h = _nucleus(x, key, A, k, top_p, ras_top_p, True, ROUND, ACCURATE, ROUND, WALK_MAX, WALK8)
        normal = _race(x, offs, key, thr_n, temp, _draw_key(seed, counter), TMIN, ROUND, ACCURATE)
        high = _race(x, offs, key, thr_h, ras_temp, _draw_key(seed, counter + 1), TMIN, ROUND, ACCURATE)
        top1 = _first_argmax(x, offs)
        live = wo >= W - ras_window
        repeated = tl.max(((win == normal) & live).to(tl.int32), 0) > 0
        use_high = repeated & (normal < n_sem) & (greedy == 0)
        choice = tl.where(greedy != 0, top1, tl.where(use_high, high, normal))
        code0 = tl.where(choice < n_sem, choice, 0)
        tl.store(idx_ptr + row, choice.to(tl.int64))
        tl.store(cols_ptr + row * stride_c, tl.load(allowed_ptr + choice))
        tl.store(cols_ptr + row * stride_c + 1, code0.to(tl.int64))
        if EMB:
            _copy_embedding(emb_ptr, stride_e, code0, emb_out_ptr + row.to(tl.int64) * stride_eo, D, BLOCK_D)

    @triton.jit
    def _s2_residual_kernel(logits_ptr, stride_l, n, slots_ptr, frame_ptr, temp_ptr, top_p_ptr, top_k_ptr,
                            greedy_ptr, seed_ptr, draw, cols_ptr, stride_c, col,
                            emb_ptr, stride_e, emb_out_ptr, stride_eo, D,
                            DRAWS: tl.constexpr, TMIN: tl.constexpr, WALK_MAX: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr,
                            ACCURATE: tl.constexpr, EMB: tl.constexpr, BLOCK_D: tl.constexpr,
                            PDL: tl.constexpr = False, WALK8: tl.constexpr = True):
        pdl_enter(PDL)
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row)
        x, offs, key = _row(logits_ptr + row.to(tl.int64) * stride_l, n, BLOCK, ROUND)
        counter = tl.load(frame_ptr + slot) * DRAWS + draw
        top_p = tl.load(top_p_ptr + slot)
        greedy = tl.load(greedy_ptr + slot).to(tl.int32)
        top_k = tl.load(top_k_ptr + slot)
        temp = tl.load(temp_ptr + slot)  # loaded before the first reduction, as in the main kernel
        seed = tl.load(seed_ptr + slot)
        k = tl.where(greedy != 0, 1, top_k)  # greedy rows: no nucleus walk
        thr, _ = _nucleus(x, key, n, k, top_p, top_p, False, ROUND, ACCURATE, ROUND, WALK_MAX, WALK8)
        pick = _race(x, offs, key, thr, temp, _draw_key(seed, counter), TMIN, ROUND, ACCURATE)
        top1 = _first_argmax(x, offs)
        code = tl.where(greedy != 0, top1, pick)
        tl.store(cols_ptr + row * stride_c + col, code.to(tl.int64))
        if EMB:
            _copy_embedding(emb_ptr, stride_e, code, emb_out_ptr + row.to(tl.int64) * stride_eo, D, BLOCK_D)


WALK8_ENV = "SHOAL_SAMPLER_WALK8"


@functools.cache
def walk8() -> bool:
    """Whether the nucleus walk takes eight ranks per reduction (``SHOAL_SAMPLER_WALK8``, default
    on; ``0``: one max reduction per rank). The same ranks in the same order, so the same draws."""
    return os.environ.get(WALK8_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _round_flag(logits: Tensor) -> bool:
    if logits.dtype == torch.bfloat16:
        return True
    if logits.dtype == torch.float32:
        return False
    raise ValueError(f"fused sampling supports fp32 and bf16 logits, got {logits.dtype}")


def _tmin(logits: Tensor) -> float:
    """The temperature floor 1e-5 as the reference holds it (in the logits dtype)."""
    return float(torch.tensor(1e-5, dtype=logits.dtype))


WARPS_ENV = "SHOAL_SAMPLER_WARPS"


def _num_warps(block: int, kind: str) -> int:
    """Warps of one sampling program (a row): ``SHOAL_SAMPLER_WARPS="main=N,residual=N"``
    overrides the default (8 for rows of >= 4,096 entries, else 4)."""
    return _warps_table(os.environ.get(WARPS_ENV, "")).get(kind, 8 if block >= 4096 else 4)


@functools.lru_cache(maxsize=8)
def _warps_table(env: str) -> dict:
    out = {}
    for item in filter(None, env.split(",")):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in ("main", "residual"):
            raise ValueError(f"{WARPS_ENV}: unknown key {key!r} (main, residual)")
        n = int(value)
        if n < 1 or n & (n - 1) or n > 32:
            raise ValueError(f"{WARPS_ENV}: {key} needs a power of two from 1 to 32, got {n}")
        out[key] = n
    return out


def _check_rows(logits: Tensor, slots: Tensor, cols: Tensor) -> int:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be [B, V] with unit stride along V")
    B = logits.shape[0]
    if slots.shape != (B,) or slots.dtype != torch.long:
        raise ValueError("slots must be int64 [B]")
    if logits.dtype == torch.bfloat16 and logits.shape[1] > 65536:
        raise ValueError("bf16 rows longer than 65,536 entries are not supported (int32 sort keys)")
    if cols.dim() != 2 or cols.shape[0] < B or cols.dtype != torch.long or cols.stride(1) != 1:
        raise ValueError("cols must be int64 [>= B, 1 + C] with unit stride")
    return B


def s2_main_sample(logits: Tensor, slots: Tensor, frame: Tensor, sampling, window: Tensor,
                   allowed_ids: Tensor, semantic_count: int, cols: Tensor, idx_out: Tensor,
                   embedding: Tensor | None = None, emb_out: Tensor | None = None,
                   draws_per_frame: int = 16) -> None:
    """Main token of every row (S2 rule + RAS) into ``cols[:, 0]`` (token id), ``cols[:, 1]``
    (code 0) and ``idx_out`` (allowed-space index); ``emb_out[b] = embedding[code 0]`` if given.

    Per-request state is read at ``slots`` [B]: ``frame`` [S], ``sampling`` (a
    :class:`~shoal.engine.sampling.BatchSampling` of [S] tensors), ``window`` [S, W]
    (allowed-space indices of the last main tokens, -1 = empty, newest last)."""
    B = _check_rows(logits, slots, cols)
    if B == 0:
        return
    A = logits.shape[1]
    W = window.shape[1]
    if W & (W - 1) or window.stride(1) != 1:
        raise ValueError("window width must be a power of two with unit stride")
    block = _next_pow2(A)
    D = embedding.shape[1] if embedding is not None else 0
    bs = sampling
    _s2_main_kernel[(B,)](
        logits, logits.stride(0), A, slots, frame, bs.temperature, bs.top_p, bs.top_k, bs.greedy,
        bs.ras_temperature, bs.ras_top_p, bs.ras_window, bs.seed, window, window.stride(0),
        allowed_ids, semantic_count, idx_out, cols, cols.stride(0),
        embedding if embedding is not None else logits, embedding.stride(0) if embedding is not None else 0,
        emb_out if emb_out is not None else logits, emb_out.stride(0) if emb_out is not None else 0, D,
        W=W, DRAWS=draws_per_frame, TMIN=_tmin(logits), WALK_MAX=WALK_MAX, BLOCK=block, ROUND=_round_flag(logits), ACCURATE=not triton_interpreting(), EMB=embedding is not None,
        BLOCK_D=min(1024, _next_pow2(max(D, 16))), num_warps=_num_warps(block, "main"), WALK8=walk8(), **pdl_options(logits))


def s2_residual_sample(logits: Tensor, slots: Tensor, frame: Tensor, sampling, draw: int, cols: Tensor,
                       col: int, embedding: Tensor | None = None, emb_out: Tensor | None = None,
                       draws_per_frame: int = 16) -> None:
    """One residual code per row (S2 rule with the request's temperature / top_p / top_k) from
    ``logits`` [B, n] into ``cols[:, col]``, with noise counter ``frame * draws_per_frame +
    draw``; ``emb_out[b] = embedding[code]`` if given (the next fast position's input)."""
    B = _check_rows(logits, slots, cols)
    if B == 0:
        return
    n = logits.shape[1]
    block = _next_pow2(n)
    D = embedding.shape[1] if embedding is not None else 0
    bs = sampling
    _s2_residual_kernel[(B,)](
        logits, logits.stride(0), n, slots, frame, bs.temperature, bs.top_p, bs.top_k, bs.greedy, bs.seed,
        draw, cols, cols.stride(0), col,
        embedding if embedding is not None else logits, embedding.stride(0) if embedding is not None else 0,
        emb_out if emb_out is not None else logits, emb_out.stride(0) if emb_out is not None else 0, D,
        DRAWS=draws_per_frame, TMIN=_tmin(logits), WALK_MAX=WALK_MAX, BLOCK=block, ROUND=_round_flag(logits), ACCURATE=not triton_interpreting(), EMB=embedding is not None,
        BLOCK_D=min(1024, _next_pow2(max(D, 16))), num_warps=_num_warps(block, "residual"), WALK8=walk8(), **pdl_options(logits))
