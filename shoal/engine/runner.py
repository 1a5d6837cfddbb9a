"""The model runner: owns the device state of every running request and executes steps.

Per-request decode state lives in *slots* of fixed-address device tensors (last column,
position, frame counter, repetition windows, sampling parameters, block table), so a decode
step only needs the list of slot ids: it gathers the rows, runs the slow forward over the paged
cache, samples the main token (constrained head, RAS, counter-based noise), runs the 10-step
fast loop for the whole batch, and scatters the new state back. The step has static shapes per
batch bucket and no host synchronisation, so on CUDA it is captured once per bucket as a graph
and replayed; the only per-step transfers are the slot ids in and the new columns out.

Prefill packs the step's prompt chunks into one token axis; all its inputs (token columns,
positions, cache slots, segment boundaries, start positions, block-table rows) travel as ONE
int64 array and one host-to-device copy, and every layer attends with one paged varlen kernel.
On CUDA the prefill forward is also captured per token bucket (padded: the padding tokens
write their K/V to the scratch block and their attention output is zero), so a prefill step is
one copy from pinned memory plus one graph replay; steps above the largest bucket run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from ..envutil import env_int
from ..model.dualar import DualAR
from .attention import (FastCacheBackend, PagedDecodeBackend, PagedKVCache, PagedPrefillBackend,
                        SegmentedPrefillBackend)
from ..kernels import fp8_cublas, prefill_attention
from ..kernels.paged_attention import pdl_in_prefill, pdl_suppressed
from ..kernels.sampling import s2_main_sample, s2_residual_sample
from .sampling import (DRAWS_PER_FRAME, BatchSampling, SamplingParams, residual_code, residual_noise,
                       s1_main_token, s2_main_token)

WINDOW = 16  # repetition window capacity (S2 RAS uses the last 10, S1 the last 16)
log = logging.getLogger("shoal.engine")


def llm_stream_priority() -> int:
    """Stream priority the LLM's graphs are captured with: the highest the device offers
    (``SHOAL_LLM_PRIORITY=0`` gives the default, i.e. the codec's). A codec decode on the audio
    thread launches large conv kernels; at equal priority a decode step's small kernels queue
    behind their thread blocks, at high priority they take the next free SM. (The engine's
    c=64 audio run measured no difference either way; docs/benchmarks.md.)"""
    if os.environ.get("SHOAL_LLM_PRIORITY", "1") in ("0", ""):
        return 0
    return -100  # torch maps values past the device's range to its highest priority

def sampler_overlap_max_batch() -> int:
    """``SHOAL_SAMPLER_OVERLAP``: in decode steps of at most N rows (batch buckets), the fused
    main-token sampler runs on a side stream beside the fast transformer's position 0 (which
    reads only the slow model's hidden state, not the sampled token), joined before position 1.
    Same kernels, same inputs: the same codes (tests/test_pdl_gpu.py). ``on`` (the default:
    every batch), ``off`` / ``0``, or N. Measured on an H100 (2026-12-06, one machine): the
    engine at one stream 146 -> 148 frames/s, at 64 streams 6,382 -> 6,403."""
    v = os.environ.get("SHOAL_SAMPLER_OVERLAP", "").strip().lower()
    if v in ("", "on", "true", "yes", "all"):
        return 1 << 30
    if v in ("off", "false", "no"):
        return 0
    return env_int("SHOAL_SAMPLER_OVERLAP", 0)


# settings the start-up self-check of the fused sampler draws with (greedy, the nucleus walk,
# the bisection above top_k 64, top_p 1.0, RAS fallbacks)
_CHECK_PARAMS = [SamplingParams(greedy=True), SamplingParams(temperature=0.8, top_p=0.8, top_k=30),
                 SamplingParams(temperature=1.0, top_p=0.95, top_k=200),
                 SamplingParams(temperature=1.2, top_p=1.0, top_k=5000),
                 SamplingParams(temperature=0.7, top_p=0.5, top_k=2)]


def default_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    out = [s for s in sizes if s < max_batch] + [max_batch]
    return sorted(set(out))


MAX_PREFILL_GRAPH_TOKENS = 2048  # larger prefill steps run eagerly (launch overhead amortised)


def default_prefill_buckets(prefill_chunk: int, max_tokens: int = MAX_PREFILL_GRAPH_TOKENS) -> list[int]:
    """Token buckets of the captured prefill graphs: 64, 128, ... below the prefill chunk, and
    the chunk itself (capped at ``max_tokens``)."""
    top = max(1, min(prefill_chunk, max_tokens))
    return sorted({b for b in (64, 128, 256, 512, 1024, 2048) if b < top} | {top})


def prefill_graph_bytes(model_config, tokens: int, itemsize: int) -> int:
    """A generous estimate of the memory the captured prefill graphs keep (their shared pool
    holds one forward's activations at the largest bucket: the codebook-embedding gather, the
    qkv / attention / MLP intermediates of one layer, the residual stream), for sizing the KV
    pool before capture."""
    s = model_config.slow
    per_token = (model_config.num_codebooks * s.dim + 6 * s.dim + 3 * s.intermediate_size
                 + 3 * (s.n_head + 2 * s.n_local_heads) * s.head_dim)
    return int(tokens * per_token * itemsize * 1.5) + (64 << 20)


class _PrefillLayout:
    """Where the prefill inputs sit in one flat int64 array, for ``n`` tokens (padded) and
    ``s`` segments: cu_seqlens [s+1], start positions [s], block-table rows [s], positions [n],
    cache slots [n], token columns [rows, n]. :meth:`views` slices a numpy array or a tensor."""

    def __init__(self, n: int, s: int, rows: int) -> None:
        self.n, self.s, self.rows = n, s, rows
        self._parts = {}
        o = 0
        for name, size in (("cu", s + 1), ("start", s), ("bt_rows", s), ("pos", n), ("slots", n),
                           ("cols", rows * n)):
            self._parts[name] = (o, o + size)
            o += size
        self.size = o

    def views(self, buf):
        v = {name: buf[a:b] for name, (a, b) in self._parts.items()}
        v["cols"] = v["cols"].reshape(self.rows, self.n)
        return v


@dataclass
class RunnerConfig:
    max_slots: int
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int
    cuda_graphs: bool
    graph_buckets: list[int] | None = None
    fused_sampling: bool = False  # S2 draws as Triton kernels (shoal.kernels.sampling)
    # prefill forward captured per token bucket (CUDA, with cuda_graphs; needs the Triton
    # prefill-attention kernel for the model's head size); steps above the largest bucket and
    # with more than prefill_max_segments chunks run eagerly
    prefill_graphs: bool = False
    prefill_buckets: list[int] | None = None  # default: default_prefill_buckets(1024)
    prefill_max_segments: int | None = None  # default: max_slots (every step fits)
    # slow KV cache storage: None = the model's dtype; "fp8" / torch.float8_e4m3fn = e4m3 values
    # with one fp32 scale per (token, KV head) (shoal.quant.kv)
    kv_cache_dtype: torch.dtype | str | None = None


class ModelRunner:
    def __init__(self, model: DualAR, im_end_id: int, cfg: RunnerConfig) -> None:
        self.model = model
        self.cfg = cfg
        mc = model.config
        self.family = mc.family
        self.C = mc.num_codebooks
        self.n_sem = mc.codebook_size
        self.n_res = mc.residual_codebook_size
        self.im_end_id = im_end_id
        dev, dt = model.device, model.dtype
        self.device = dev
        model.set_allowed_tokens([im_end_id])
        if dev.type == "cuda" and any(hasattr(m, "weight_q") for m in model.modules()):
            fp8_cublas.prepare(dev)  # prefill-sized FP8 GEMMs through cuBLAS, if it checks out
        s, f = mc.slow, mc.fast
        # one extra block and one extra slot are scratch space for padding rows
        self.scratch_block = cfg.num_blocks
        self.kv = PagedKVCache(s.n_layer, cfg.num_blocks + 1, cfg.block_size, s.n_local_heads,
                               s.head_dim, dt, dev, kv_dtype=cfg.kv_cache_dtype,
                               group=s.n_head // s.n_local_heads)
        S = cfg.max_slots + 1
        self.scratch_slot = cfg.max_slots
        self.last_col = torch.zeros(S, self.C + 1, dtype=torch.long, device=dev)
        self.position = torch.zeros(S, dtype=torch.long, device=dev)
        self.frame = torch.zeros(S, dtype=torch.long, device=dev)
        self.first = torch.zeros(S, dtype=torch.bool, device=dev)  # next frame opens a text batch
        self.window = torch.full((S, WINDOW), -1, dtype=torch.long, device=dev)
        self.code_hist = torch.full((S, self.C, WINDOW), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.full((S, cfg.max_blocks_per_seq), self.scratch_block,
                                       dtype=torch.int32, device=dev)
        self.sampling = BatchSampling.empty(S, dev)
        self.slot_ids = torch.full((cfg.max_slots,), self.scratch_slot, dtype=torch.long, device=dev)
        self.out_cols = torch.zeros(cfg.max_slots, self.C + 1, dtype=torch.long, device=dev)
        self.decode_backend = PagedDecodeBackend(self.kv, s.n_head, s.head_dim, qk_norm=s.qk_norm)
        self.prefill_backend = PagedPrefillBackend(self.kv, s.n_head, s.n_local_heads, s.head_dim)
        # "paged": one varlen kernel per layer (graph-captured on CUDA); "segmented": the
        # previous per-segment SDPA backend (comparisons, shoal.bench.kernels_prefill)
        self.prefill_impl = "paged"
        self._segmented_backend = SegmentedPrefillBackend(self.kv, s.n_head, s.n_local_heads)
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_buckets = sorted(cfg.prefill_buckets or default_prefill_buckets(1024))
        self.prefill_max_segments = cfg.prefill_max_segments or cfg.max_slots
        self.prefill_graphs_enabled = bool(
            cfg.prefill_graphs and cfg.cuda_graphs and dev.type == "cuda" and prefill_attention.HAS_TRITON
            and prefill_attention.kernel_supported(s.head_dim, dt))
        self._prefill_layouts = {b: _PrefillLayout(b, self.prefill_max_segments, self.C + 1)
                                 for b in self.prefill_buckets}
        self._prefill_static: dict[int, Tensor] = {}  # bucket -> device input array
        self._prefill_pinned: list[Tensor] = []  # two pinned staging arrays (alternating)
        self._prefill_events: list[torch.cuda.Event] = []
        self._prefill_flip = 0
        self.fast_backend = FastCacheBackend(f.n_layer, cfg.max_slots, self.C, f.n_head,
                                             f.n_local_heads, f.head_dim, dt, dev)
        # two host buffers each for slot ids in and columns out: one step may be in flight
        # while the next is launched (Engine keeps one decode step ahead of its bookkeeping)
        pin = dev.type == "cuda"
        self.pinned = [torch.zeros(cfg.max_slots, self.C + 1, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.pinned_ids = [torch.zeros(cfg.max_slots, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if pin else [None, None]
        self._flip = 0
        self.buckets = cfg.graph_buckets or default_buckets(cfg.max_slots)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_pool = None
        self.capture_stream: torch.cuda.Stream | None = None
        self.fused_sampling = cfg.fused_sampling
        if self.fused_sampling and self.family != "s2":
            raise ValueError("fused sampling implements the S2 rule only")
        self._cols = torch.zeros(cfg.max_slots, self.C + 1, dtype=torch.long, device=dev)
        self._idx = torch.zeros(cfg.max_slots, dtype=torch.long, device=dev)
        # the main-token sampler beside the fast position 0 (sampler_overlap_max_batch)
        self.sampler_overlap = sampler_overlap_max_batch() if dev.type == "cuda" else 0
        self._sampler_stream = (torch.cuda.Stream(device=dev, priority=llm_stream_priority())
                                if self.sampler_overlap else None)

    # ------------------------------------------------------------------ slot state
    def _upload(self, a) -> Tensor:
        """A host array on the device without synchronising: a pageable source is staged by the
        driver at once, so the host never waits here for queued work (a decode step in flight)."""
        t = torch.as_tensor(np.ascontiguousarray(a))
        return t.to(self.device, non_blocking=True)

    def assign_slot(self, slot: int, params: SamplingParams, seed: int) -> None:
        row = BatchSampling.from_params([params], [seed], "cpu")
        for name, dst in self.sampling.fields().items():
            dst[slot: slot + 1].copy_(getattr(row, name), non_blocking=True)
        self.window[slot].fill_(-1)
        self.code_hist[slot].fill_(-1)

    def set_block_table(self, slot: int, blocks: list[int]) -> None:
        if len(blocks) > self.cfg.max_blocks_per_seq:
            raise ValueError("sequence longer than the model context")
        row = torch.full((self.cfg.max_blocks_per_seq,), self.scratch_block, dtype=torch.int32)
        row[: len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.block_tables[slot].copy_(row, non_blocking=True)

    def copy_kv_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Execute the pool's queued partial-page prefix copies (stream-ordered before the next
        prefill / decode launch; :meth:`PagedKVCache.copy_blocks`)."""
        self.kv.copy_blocks(copies)

    def set_block(self, slot: int, index: int, block: int) -> None:
        self.block_tables[slot, index] = block

    def set_decode_state(self, slot: int, last_col: np.ndarray, position: int, frame: int,
                         window: list[int], code_hist: np.ndarray | None, first: bool) -> None:
        """(Re)load a request's decode state into its slot (after prefill or a preemption).

        ``last_col`` is the next decode input, written at ``position``; ``first`` marks that the
        frame it produces opens a text batch (that frame never enters a repetition window)."""
        self.last_col[slot].copy_(torch.as_tensor(np.array(last_col, dtype=np.int64)), non_blocking=True)
        self.position[slot] = position
        self.frame[slot] = frame
        self.first[slot] = first
        w = torch.full((WINDOW,), -1, dtype=torch.long)
        if window:
            tail = torch.tensor(window[-WINDOW:], dtype=torch.long)
            w[WINDOW - len(tail):] = tail
        self.window[slot].copy_(w, non_blocking=True)
        h = torch.full((self.C, WINDOW), -1, dtype=torch.long)
        if code_hist is not None and code_hist.shape[1]:
            tail = torch.as_tensor(code_hist[:, -WINDOW:], dtype=torch.long)
            h[:, WINDOW - tail.shape[1]:] = tail
        self.code_hist[slot].copy_(h, non_blocking=True)

    # ------------------------------------------------------------------ frame sampling
    def _gather_sampling(self, slots: Tensor) -> BatchSampling:
        return BatchSampling(**{k: v[slots] for k, v in self.sampling.fields().items()})

    def _sample_frame(self, logits: Tensor, fast_in: Tensor, bs: BatchSampling, frame: Tensor,
                      window: Tensor, code_hist: Tensor, use_windows: bool) -> tuple[Tensor, Tensor]:
        """Main token + 9 residual codes for every row -> (columns [B, 1+C], allowed idx [B])."""
        model = self.model
        B = logits.shape[0]
        if self.family == "s1":
            idx = s1_main_token(logits, bs, frame, window if use_windows else window[:, :0])
        else:
            idx = s2_main_token(logits, bs, frame, window, self.n_sem)
        tok = model.allowed_ids[idx]
        code0 = torch.where(idx < self.n_sem, idx, torch.zeros_like(idx))
        codes = [code0]
        fb = self.fast_backend
        fb._rows = B
        fb.position = 0
        model.forward_fast(fast_in, 0, fb, n_out=0)
        e = model.fast_embeddings(code0)
        noise = residual_noise(bs, frame, self.C, self.n_res)
        for k in range(1, self.C):
            fb.position = k
            fl = model.forward_fast(e, k, fb, n_out=self.n_res)
            win = code_hist[:, k] if (self.family == "s1" and use_windows) else None
            ck = residual_code(fl, bs, frame, k, self.family, win, noise[:, k])
            codes.append(ck)
            e = model.fast_embeddings(ck)
        cols = torch.stack([tok] + codes, dim=1)
        assert cols.shape[0] == B
        return cols, idx

    def _sample_frame_fused(self, logits: Tensor, fast_in: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`_sample_frame` for S2 with one Triton kernel per draw, reading the request
        state at ``slots``; each kernel also gathers the next fast position's embedding."""
        model = self.model
        B = logits.shape[0]
        cols, idx = self._cols[:B], self._idx[:B]
        emb = model.fast_embeddings.weight
        e = torch.empty(B, emb.shape[1], dtype=emb.dtype, device=emb.device)
        logits = logits.contiguous()
        fb = self.fast_backend
        fb._rows = B
        fb.position = 0
        side = self._sampler_stream if B <= self.sampler_overlap else None
        # position 0 reads the slow model's hidden state only: with a side stream the sampler
        # runs beside it (launched without PDL: its predecessor is a cross-stream join) and the
        # main stream waits for it before position 1 reads its embedding
        main = torch.cuda.current_stream(logits.device) if side is not None else None
        if side is not None:
            side.wait_stream(main)
        with torch.cuda.stream(side) if side is not None else nullcontext(), pdl_suppressed(side is not None):
            s2_main_sample(logits, slots, self.frame, self.sampling, self.window, model.allowed_ids,
                           self.n_sem, cols, idx, emb, e, draws_per_frame=DRAWS_PER_FRAME)
        model.forward_fast(fast_in, 0, fb, n_out=0)
        if side is not None:
            main.wait_stream(side)
        for k in range(1, self.C):
            fb.position = k
            fl = model.forward_fast(e, k, fb, n_out=self.n_res)
            last = k == self.C - 1  # the last code's embedding is not needed
            # e was consumed by forward_fast (stream order), so the next embedding reuses it
            s2_residual_sample(fl.contiguous(), slots, self.frame, self.sampling, 1 + k, cols, 1 + k,
                               None if last else emb, None if last else e, draws_per_frame=DRAWS_PER_FRAME)
        return cols, idx

    def verify_fused_sampling(self, rows: int = 8) -> bool:
        """Start-up self-check of the fused sampler on this device and Triton version: draw
        with the kernels and with the PyTorch sampler on the same random logits (the model's
        allowed-logit and residual widths and dtype, a mix of settings incl. RAS windows that
        force the fallback) and keep the kernels only if they compile, run and agree on every
        draw; otherwise fall back to the PyTorch sampler with a warning. Returns the verdict."""
        if not self.fused_sampling:
            return False
        try:
            bad = self._fused_sampling_mismatches(rows)
            reason = f"{bad} of {3 * rows} draws differ from the PyTorch sampler" if bad else ""
        except Exception as e:  # noqa: BLE001 - any failure means: do not use the kernels
            reason = f"{type(e).__name__}: {e}"
        if reason:
            self.fused_sampling = False
            log.warning("fused sampling disabled, using the PyTorch sampler: %s", reason)
        return self.fused_sampling

    def _fused_sampling_mismatches(self, rows: int) -> int:
        dev, dt = self.device, self.model.dtype
        g = torch.Generator(device="cpu").manual_seed(1234)
        A = self.model.allowed_ids.shape[0]
        bs = BatchSampling.from_params([_CHECK_PARAMS[i % len(_CHECK_PARAMS)] for i in range(rows)],
                                       [7919 * i + 1 for i in range(rows)], dev)
        slots = torch.arange(rows, device=dev)
        frame = torch.randint(0, 1 << 20, (rows,), generator=g).to(dev)
        logits = (torch.randn(rows, A, generator=g) * 3).to(dt).to(dev)
        window = torch.randint(-1, A, (rows, WINDOW), generator=g)
        window[::2, -4:] = torch.topk(logits.float().cpu()[::2], 4, dim=1).indices  # RAS fallbacks
        window = window.to(dev)
        fl = (torch.randn(rows, self.n_res, generator=g) * 3).to(dt).to(dev)
        cols = torch.zeros(rows, self.C + 1, dtype=torch.long, device=dev)
        idx = torch.zeros(rows, dtype=torch.long, device=dev)
        s2_main_sample(logits, slots, frame, bs, window, self.model.allowed_ids, self.n_sem, cols, idx,
                       draws_per_frame=DRAWS_PER_FRAME)
        bad = int((idx != s2_main_token(logits, bs, frame, window, self.n_sem)).sum())
        noise = residual_noise(bs, frame, self.C, self.n_res)
        for k in (1, self.C - 1):
            s2_residual_sample(fl, slots, frame, bs, 1 + k, cols, 1 + k, draws_per_frame=DRAWS_PER_FRAME)
            bad += int((cols[:, 1 + k] != residual_code(fl, bs, frame, k, "s2", None, noise[:, k])).sum())
        return bad

    # ------------------------------------------------------------------ prefill
    def prefill(self, chunks: list[tuple[np.ndarray, int, int, list[int], int]]) -> None:
        """Compute K/V for several prompt chunks in one forward: each chunk is (grid, start, end,
        block ids, slot) = columns [start, end) of the sequence in ``slot`` (whose device block
        table row must list ``block ids``). No logits: the last prompt column is the first
        decode input, so the first frame is sampled by the (graph-captured, batched) decode
        step like every other frame. On CUDA a step of at most the largest bucket's tokens
        replays a captured graph (after :meth:`capture_graphs`); others run eagerly."""
        if not chunks:
            return
        if self.prefill_impl == "segmented":
            self._prefill_segmented(chunks)
            return
        n = sum(end - start for _, start, end, _, _ in chunks)
        bucket = self.prefill_bucket_for(n, len(chunks))
        if bucket is not None:
            self._prefill_replay(bucket, chunks)
        else:
            self._prefill_eager(chunks, n)

    def prefill_bucket_for(self, n_tokens: int, n_segments: int) -> int | None:
        """The captured bucket a prefill step of this size replays, or None (eager)."""
        if not self.prefill_graphs or n_segments > self.prefill_max_segments:
            return None
        i = bisect.bisect_left(self.prefill_buckets, n_tokens)
        if i == len(self.prefill_buckets) or self.prefill_buckets[i] not in self.prefill_graphs:
            return None
        return self.prefill_buckets[i]

    def _fill_prefill(self, lay: _PrefillLayout, buf: np.ndarray, chunks) -> tuple[int, int]:
        """Pack ``chunks`` into ``buf`` (layout ``lay``); unused segments get length 0 and the
        scratch slot's table row, padding tokens position 0, token 0 and a scratch-block
        slot. Returns (max context end, max chunk length) for the reference attention."""
        v = lay.views(buf)
        bsz = self.cfg.block_size
        cu, pos_a, slots_a, cols = v["cu"], v["pos"], v["slots"], v["cols"]
        cu[0] = 0
        off = max_end = max_n = 0
        for i, (grid, start, end, blocks, slot) in enumerate(chunks):
            k = end - start
            pos = np.arange(start, end, dtype=np.int64)
            blk = np.asarray(blocks, dtype=np.int64)
            pos_a[off: off + k] = pos
            slots_a[off: off + k] = blk[pos // bsz] * bsz + pos % bsz
            cols[:, off: off + k] = grid[:, start:end]
            v["start"][i] = start
            v["bt_rows"][i] = slot
            off += k
            cu[i + 1] = off
            max_end, max_n = max(max_end, end), max(max_n, k)
        S = len(chunks)
        cu[S + 1:] = off
        v["start"][S:] = 0
        v["bt_rows"][S:] = self.scratch_slot
        pad = lay.n - off
        if pad:
            pos_a[off:] = 0
            slots_a[off:] = self.scratch_block * bsz + np.arange(pad, dtype=np.int64) % bsz
            cols[:, off:] = 0
        return max_end, max_n

    def _bind_prefill(self, lay: _PrefillLayout, t: Tensor, max_context: int | None = None,
                      max_query: int | None = None) -> tuple[Tensor, Tensor]:
        v = lay.views(t)
        self.prefill_backend.set(v["slots"], v["cu"], v["start"], self.block_tables, v["bt_rows"],
                                 max_context=max_context, max_query=max_query)
        return v["cols"][None], v["pos"][None]

    def _prefill_eager(self, chunks, n: int) -> None:
        # CUDA: a fixed segment count (unused ones empty), so the attention kernel compiles
        # once (its segment-vector width is a compile-time constant), not per count seen
        segs = len(chunks) if self.device.type == "cpu" else max(len(chunks), self.prefill_max_segments)
        lay = _PrefillLayout(n, segs, self.C + 1)
        host = np.empty(lay.size, dtype=np.int64)
        max_end, max_n = self._fill_prefill(lay, host, chunks)
        t = torch.from_numpy(host) if self.device.type == "cpu" else self._upload(host)
        x, pos = self._bind_prefill(lay, t, max_end, max_n)
        with pdl_suppressed(not pdl_in_prefill()):
            self.model.prefill_kv(x, pos, self.prefill_backend)

    def _prefill_replay(self, bucket: int, chunks) -> None:
        lay = self._prefill_layouts[bucket]
        i = self._prefill_flip
        self._prefill_flip ^= 1
        self._prefill_events[i].synchronize()  # this staging array's previous copy is done
        host = self._prefill_pinned[i][: lay.size]
        self._fill_prefill(lay, host.numpy(), chunks)
        self._prefill_static[bucket].copy_(host, non_blocking=True)
        self._prefill_events[i].record()
        self.prefill_graphs[bucket].replay()

    def _prefill_body(self, bucket: int) -> None:
        x, pos = self._bind_prefill(self._prefill_layouts[bucket], self._prefill_static[bucket])
        with pdl_suppressed(not pdl_in_prefill()):
            self.model.prefill_kv(x, pos, self.prefill_backend)

    def _prefill_segmented(self, chunks) -> None:
        """The previous prefill: per-segment attention (SegmentedPrefillBackend)."""
        bsz = self.cfg.block_size
        xs, poss, slots, segments = [], [], [], []
        off = 0
        for grid, start, end, blocks, _slot in chunks:
            pos = np.arange(start, end, dtype=np.int64)
            blk = np.asarray(blocks, dtype=np.int64)
            slots.append(blk[pos // bsz] * bsz + pos % bsz)
            poss.append(pos)
            xs.append(np.asarray(grid[:, start:end], dtype=np.int64))
            segments.append((off, end - start, self._upload(blk), start, end))
            off += end - start
        backend = self._segmented_backend
        backend.set(self._upload(np.concatenate(slots)), segments)
        x = self._upload(np.concatenate(xs, axis=1))[None]
        with pdl_suppressed(not pdl_in_prefill()):
            self.model.prefill_kv(x, self._upload(np.concatenate(poss))[None], backend)

    # ------------------------------------------------------------------ decode
    def _decode_body(self, B: int) -> None:
        slots = self.slot_ids[:B]
        bsz = self.cfg.block_size
        cols = self.last_col[slots]
        pos = self.position[slots]
        bt = self.block_tables[slots]
        block_idx = torch.div(pos, bsz, rounding_mode="floor")
        phys = torch.gather(bt, 1, block_idx[:, None])[:, 0].long()
        self.decode_backend.set(phys * bsz + pos % bsz, bt, (pos + 1).to(torch.int32))
        out = self.model.forward_slow(cols[:, :, None], pos[:, None], self.decode_backend, head="allowed")
        if self.fused_sampling:  # reads the state at slots before it is updated below
            new_cols, idx = self._sample_frame_fused(out.logits, out.fast_input, slots)
        frame = self.frame[slots]
        window = self.window[slots]
        hist = self.code_hist[slots]
        if not self.fused_sampling:
            new_cols, idx = self._sample_frame(out.logits, out.fast_input, self._gather_sampling(slots),
                                               frame, window, hist, use_windows=True)
        first = self.first[slots]
        self.last_col[slots] = new_cols
        self.position[slots] = pos + 1
        self.frame[slots] = frame + 1
        # the frame that opens a text batch never enters the repetition windows
        self.window[slots] = torch.where(first[:, None], window, torch.cat([window[:, 1:], idx[:, None]], dim=1))
        self.code_hist[slots] = torch.where(first[:, None, None], hist,
                                            torch.cat([hist[:, :, 1:], new_cols[:, 1:, None]], dim=2))
        self.first[slots] = torch.zeros_like(first)
        # padding rows all point at the scratch slot: keep its position inside its block table
        self.position[self.scratch_slot:].fill_(0)
        self.out_cols[:B] = new_cols

    def bucket_for(self, n: int) -> int:
        i = bisect.bisect_left(self.buckets, n)
        if i == len(self.buckets):
            raise ValueError(f"batch {n} exceeds max_slots {self.cfg.max_slots}")
        return self.buckets[i]

    def launch_decode(self, slots: list[int]) -> tuple[Tensor, torch.cuda.Event | None]:
        """Enqueue one decode step for the requests in ``slots`` and the copy of their new
        columns to a pinned host buffer; returns at once (a handle for :meth:`collect_decode`).
        At most two steps may be outstanding (the buffers alternate)."""
        n = len(slots)
        B = self.bucket_for(n) if self.graphs or self.cfg.cuda_graphs else n
        buf = self._flip
        self._flip ^= 1
        ids = self.pinned_ids[buf][:B]
        ids.fill_(self.scratch_slot)
        ids[:n] = torch.as_tensor(slots, dtype=torch.long)
        self.slot_ids[:B].copy_(ids, non_blocking=True)
        graph = self.graphs.get(B)
        with torch.inference_mode():
            if graph is not None:
                graph.replay()
            else:
                self._decode_body(B)
            out = self.pinned[buf][:n]
            out.copy_(self.out_cols[:n], non_blocking=True)
        event = self._events[buf]
        if event is not None:
            event.record()
        return out, event

    @staticmethod
    def collect_decode(handle: tuple[Tensor, torch.cuda.Event | None]) -> np.ndarray:
        """Wait for a launched step; its new columns [n, 1 + C]."""
        out, event = handle
        if event is not None:
            event.synchronize()
        return out.numpy().copy()

    def decode(self, slots: list[int]) -> np.ndarray:
        """One decode step for the requests in ``slots``; returns their new columns [n, 1 + C]."""
        return self.collect_decode(self.launch_decode(slots))

    def capture_graphs(self, show_progress: bool = True) -> None:
        """Capture one CUDA graph of the decode step per batch bucket (largest first), then
        (``prefill_graphs``) the prefill forward per token bucket, in the same memory pool."""
        if self.device.type != "cuda" or not self.cfg.cuda_graphs:
            return
        self._capture_decode_graphs(show_progress)
        if self.prefill_graphs_enabled:
            try:
                self.capture_prefill_graphs(show_progress)
            except Exception as e:  # noqa: BLE001 - serve with eager prefill rather than not at all
                self.prefill_graphs = {}
                self.prefill_graphs_enabled = False
                log.warning("prefill graphs disabled, prefill runs eagerly: %s: %s", type(e).__name__, e)

    def _capture(self, buckets: list[int], body, warm: list[int], desc: str,
                 show_progress: bool) -> dict[int, "torch.cuda.CUDAGraph"]:
        """Run ``body(b)`` for the ``warm`` buckets outside capture (Triton compiles, cuBLAS
        handles), then capture one graph per bucket in the shared pool. Captured on the
        high-priority stream (see :func:`llm_stream_priority`): PyTorch instantiates graphs with
        per-node priorities, so every replayed kernel of the LLM is scheduled ahead of the
        codec's (default-priority) kernels when both want the SMs."""
        if self.capture_stream is None:
            self.capture_stream = torch.cuda.Stream(self.device, priority=llm_stream_priority())
        graphs = {}
        with torch.inference_mode():
            s = self.capture_stream
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for b in warm:
                    body(b)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            for b in tqdm(buckets, desc=desc, file=sys.stderr, disable=not show_progress):
                g = torch.cuda.CUDAGraph()
                # thread_local: the audio thread may run codec work on its own stream meanwhile
                with torch.cuda.graph(g, pool=self.graph_pool, stream=s, capture_error_mode="thread_local"):
                    body(b)
                graphs[b] = g
        torch.cuda.synchronize()
        return graphs

    def capture_prefill_graphs(self, show_progress: bool = True) -> None:
        """Capture the prefill forward per token bucket (largest first) with fixed-size inputs
        (``prefill_max_segments`` segments); steps are padded to their bucket."""
        if not self.prefill_graphs_enabled or self.prefill_graphs:
            return
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        buckets = sorted(self.prefill_buckets, reverse=True)
        size = max(lay.size for lay in self._prefill_layouts.values())
        self._prefill_pinned = [torch.zeros(size, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._prefill_events = [torch.cuda.Event() for _ in range(2)]
        for b in buckets:  # inputs: no segments, every token padding (writes the scratch block)
            lay = self._prefill_layouts[b]
            host = np.empty(lay.size, dtype=np.int64)
            self._fill_prefill(lay, host, [])
            self._prefill_static[b] = torch.from_numpy(host).to(self.device)
        self.prefill_graphs.update(self._capture(
            buckets, self._prefill_body, buckets, "capturing prefill graphs", show_progress))

    def _capture_decode_graphs(self, show_progress: bool) -> None:
        saved = {k: v.clone() for k, v in (("pos", self.position), ("frame", self.frame),
                                           ("slots", self.slot_ids))}
        self.graph_pool = torch.cuda.graph_pool_handle()
        buckets = sorted(self.buckets, reverse=True)
        with torch.inference_mode():
            self.slot_ids.fill_(self.scratch_slot)
        # every bucket runs once outside capture: launch configs differ by batch size (the dense
        # GEMM's table buckets), so each compiles here rather than inside a capture
        self.graphs.update(self._capture(
            buckets, self._decode_body, buckets, "capturing CUDA graphs", show_progress))
        self.position.copy_(saved["pos"])
        self.frame.copy_(saved["frame"])
        self.slot_ids.copy_(saved["slots"])  # a re-capture leaves the slots being decoded alone
