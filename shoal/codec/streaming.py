"""Streaming decode: a few frames at a time, with carried causal state.

Every operator of the decode path (codes → z_q → post_module → upsample →
decoder) is causal, so the output samples of frames [a, a+t) depend only on
frames < a+t.  :class:`StreamingDecoder` keeps exactly the context each
operator needs and never re-decodes a past frame; the concatenation of
chunk outputs equals the one-shot :meth:`Codec.decode` (up to fp rounding)
for any chunk schedule.

State layout (:class:`DecoderState`, one row per stream; all tensors have
the stream index as dim 0, so rows can be gathered, scattered, stacked and
reset independently, e.g. one row per engine request slot):

======================================================  ==============================  =====
key                                                     shape (per stream)              what
======================================================  ==============================  =====
``quantizer.post_module.pos``                           [] int64                        frames consumed (RoPE position of the next frame)
``quantizer.post_module.layers.{i}.k`` / ``.v``         [H, window−1, head_dim]         rotated keys / values of the last window−1 frames
``quantizer.post_module.layers.{i}.h`` (instead)        [window−1, dim]                 the layer's normed inputs (``window_state="hidden"``)
``quantizer.upsample.{j}.0``                            [C, k − stride]                 transposed-conv overlap tail (absent when k == stride)
``quantizer.upsample.{j}.1.dwconv``                     [C, kernel − 1]                 ConvNeXt depthwise-conv input context
``decoder.model.0`` …                                   [C_in, (k−1)·dilation]          causal-conv input context (k = 1 convs carry none)
``decoder.model.{b}.block.1``                           [C_out, k − stride]             decoder transposed-conv overlap tail
======================================================  ==============================  =====

Fresh streams are all-zero rows (zero context == the one-shot zero padding;
cache slots at negative positions are masked).  ``state.bounds`` holds a
host-side upper bound of positions so the RoPE table is sized without a
device sync.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..envutil import env_flag, env_int
from .layers import IndexedState, StreamState, rope_table
from .model import Codec

log = logging.getLogger(__name__)

__all__ = ["DecoderState", "StreamingDecoder", "GraphedStreamingDecoder", "serving_decoder"]

DecoderState = StreamState


class StreamingDecoder:
    """Batched streaming decoder over a loaded :class:`Codec`.

    >>> dec = StreamingDecoder(codec)
    >>> state = dec.new_state(batch_size=2)
    >>> audio = dec.decode_chunk(codes[:, :, :3], state)   # [2, 1, 3·2048], state advanced
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self.frame_length = codec.frame_length
        self.num_codebooks = codec.num_codebooks
        self._stateful = [
            m
            for root in (codec.quantizer.post_module, codec.quantizer.upsample, codec.decoder)
            for m in root.modules()
            if hasattr(m, "init_stream_state")
        ]

    def new_state(self, batch_size: int = 1, device=None, dtype=None) -> DecoderState:
        """Fresh state for ``batch_size`` independent streams. Each module's state is in that
        module's own precision (``post_module`` KV window, upsample and decoder conv contexts;
        they differ only if a caller cast parts of the decode side apart), unless ``dtype``
        forces one for all."""
        device = self.codec.device if device is None else device
        tensors: dict[str, Tensor] = {}
        for m in self._stateful:  # shapes and dtypes only: a fresh stream's state is all zeros
            tensors.update(m.init_stream_state(
                batch_size, "meta", dtype if dtype is not None else _module_dtype(m, self.codec.dtype)))
        bounds = {self.codec.quantizer.post_module.state_key: 0}
        if torch.device(device).type == "meta":
            return DecoderState(tensors, bounds)
        self.codec.quantizer.post_module.states_made = True  # laid out in the current window state
        # packed: a stream's whole row is gathered / scattered in one op per dtype
        return DecoderState.packed_zeros(tensors, bounds, device)

    def state_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-stream shape and dtype of every state tensor (for preallocating slot pools)."""
        st = self.new_state(1, device="meta")
        return {k: (tuple(v.shape[1:]), v.dtype) for k, v in st.tensors.items()}

    def state_nbytes_per_stream(self) -> int:
        return self.new_state(1, device="meta").nbytes()

    @torch.no_grad()
    def decode_chunk(self, codes: Tensor, state: DecoderState) -> Tensor:
        """codes [B, 10, t] (next t frames of each stream) → audio [B, 1, 2048·t]; advances ``state``.

        Out-of-range codes are clamped like :meth:`Codec.decode` (on a copy).
        """
        if codes.dim() == 2:
            codes = codes[None]
        if codes.dim() != 3 or codes.shape[1] != self.num_codebooks:
            raise ValueError(f"codes must be [B, {self.num_codebooks}, t], got shape {tuple(codes.shape)}")
        B, _, t = codes.shape
        if B != state.batch_size:
            raise ValueError(f"codes have batch {B} but the state holds {state.batch_size} streams")
        if t == 0:
            return torch.zeros(B, 1, 0, device=self.codec.device, dtype=self.codec.dtype)
        return self._decode(codes, state)

    def _decode(self, codes: Tensor, state: DecoderState, rope: Tensor | None = None) -> Tensor:
        """The decode itself (no checks); what a CUDA graph captures (with a fixed ``rope``)."""
        z = self.codec.decode_latent(codes, state, rope)
        return self.codec.decoder(z, state)

    @torch.no_grad()
    def decode_rows(self, codes: Tensor, pool: DecoderState, index: Tensor) -> Tensor:
        """Decode the next frames of rows ``index`` of a pooled state (one row per stream slot);
        the rows are gathered, advanced and written back."""
        sub = pool.select(index)
        out = self.decode_chunk(codes, sub)
        pool.update_(index, sub)
        return out


def _module_dtype(m: torch.nn.Module, default: torch.dtype) -> torch.dtype:
    """The precision of ``m``'s first floating parameter (``default`` if it has none)."""
    for p in m.parameters():
        if p.is_floating_point():
            return p.dtype
    return default


def _pow2_buckets(max_batch: int) -> tuple[int, ...]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return tuple(out)


@dataclass
class _Graph:
    graph: object
    codes: Tensor
    out: Tensor


@dataclass
class GraphStats:
    replays: int = 0
    eager: int = 0
    captures: int = 0
    capture_s: float = 0.0
    eager_reasons: dict = field(default_factory=dict)
    primed_bytes: int = 0  # the graph pool's first segment (GraphedStreamingDecoder._prime)
    # graphs whose audio stays in the pool (no view of the shared output buffer fit the call)
    own_outputs: int = 0


def prime_bytes(peak: int, margin_mib: int = 0) -> int:
    """The graph pool's primed segment for a call whose peak is ``peak`` bytes: the peak plus
    ``margin_mib`` MiB, rounded up to whole 2 MiB pages (0 when there is nothing to prime)."""
    n = max(int(peak), 0)
    if n == 0:
        return 0
    n += max(int(margin_mib), 0) << 20
    page = 2 << 20
    return -(-n // page) * page


def warmup_order(batches, chunk_frames) -> list[tuple[int, int]]:
    """(batch, frames) pairs to capture, largest call (batch x frames) first; ties by batch."""
    return sorted(((int(b), int(t)) for b in batches for t in chunk_frames),
                  key=lambda bt: (-bt[0] * bt[1], -bt[0]))


class GraphedStreamingDecoder(StreamingDecoder):
    """:class:`StreamingDecoder` whose ``decode_chunk`` replays CUDA graphs.

    A graph is captured (lazily, or ahead with :meth:`capture`) per (batch bucket, chunk
    frames); a call with ``B`` streams and ``t`` frames runs the graph of the smallest bucket
    ``>= B`` when ``t`` is one of ``chunk_frames``: the codes and the ``B`` state rows are
    copied into static buffers (one static state of ``max(batch_buckets)`` rows shared by all
    graphs), the graph is replayed, the rows are copied back and the output is returned (a
    copy). Padding rows decode zero codes at position 0 and are ignored. Anything else -- CPU,
    other chunk sizes, bigger batches -- runs the eager path, which computes exactly the same
    function (the graph is a recording of it; :meth:`run_static` is the uncaptured code path,
    testable on CPU). The graphs read RoPE from a table preallocated for ``max_frames``
    positions (2^16 by default: 51 min of audio, more than the 32,768-token context of any
    released model can generate); a call whose positions may run past it (the state's bound)
    runs eagerly.

    Not thread-safe across concurrent callers (static buffers); captures use
    ``capture_error_mode="thread_local"`` so another thread may keep using CUDA meanwhile.
    """

    def __init__(self, codec: Codec, batch_buckets: tuple[int, ...] | None = None,
                 chunk_frames: tuple[int, ...] = (4, 8, 16, 32), max_frames: int = 1 << 16,
                 max_batch: int = 64, enabled: bool | None = None):
        super().__init__(codec)
        self.batch_buckets = tuple(sorted(batch_buckets)) if batch_buckets else _pow2_buckets(max_batch)
        self.chunk_frames = tuple(sorted(set(chunk_frames)))
        self.max_frames = int(max_frames)
        self.enabled = (codec.device.type == "cuda") if enabled is None else bool(enabled)
        pm = codec.quantizer.post_module
        self._pos_key = f"{pm.state_key}.pos"
        self._bound_key = pm.state_key
        # every position a graph may see; held here so the graphs' pointer stays valid
        self.rope = rope_table(self.max_frames, pm.cfg.head_dim, pm.cfg.rope_base, codec.device)
        self._static_state: DecoderState | None = None  # allocated on first unbound use
        # bound (see bind): graphs decode rows of one slot pool in place, through an index
        self.pool: DecoderState | None = None
        self.scratch_row: int | None = None
        self._index: Tensor | None = None
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.stats = GraphStats()
        self._pool = None
        self._lock = threading.RLock()
        self._failed: dict[tuple[int, int], str] = {}
        # the stream graphs are warmed up and captured on (None: a fresh side stream). A graph
        # keeps the SM partition of the stream it was captured on (a green-context stream,
        # shoal.engine.sm_partition), not of the stream it is replayed on.
        self.capture_stream: torch.cuda.Stream | None = None
        self._side: torch.cuda.Stream | None = None
        # one pool segment of the first capture's peak before anything is recorded (_prime);
        # SHOAL_CODEC_PRIME_POOL=0 turns it off
        self.prime_pool = os.environ.get("SHOAL_CODEC_PRIME_POOL", "1").strip().lower() not in ("0", "false", "no", "off")
        # MiB added to the measured peak (SHOAL_CODEC_PRIME_MARGIN_MIB): on an H200 the captures
        # of a segment of exactly the peak still opened ~100 MiB of further segments
        # (docs/benchmarks.md, 2026-12-06), so a margin may keep the pool to one segment
        self.prime_margin_mib = env_int("SHOAL_CODEC_PRIME_MARGIN_MIB", 0)
        # SHOAL_CODEC_STATIC_OUT=1 (opt-in): every graph copies its audio into one buffer
        # allocated outside the graph pool (_out_view), so no graph's output stays live inside
        # the pool between captures. Measured on an H100 (2026-12-07): the pool's segments stay
        # as they are (0.316 vs 0.318 GiB) and the buffer opens its own 20 MiB segment, so
        # resident memory at 64 slots is 0.992 GiB with it and 0.972 without; off by default
        self.static_out = env_flag("SHOAL_CODEC_STATIC_OUT") is True
        self._out_buf: Tensor | None = None
        self._primer: torch.cuda.CUDAGraph | None = None

    # ------------------------------------------------------------------ graph path
    @property
    def static_state(self) -> DecoderState:
        """The graphs' own state rows (``max(batch_buckets)`` streams) of an unbound decoder."""
        if self._static_state is None:
            self._static_state = super().new_state(self.batch_buckets[-1])
        return self._static_state

    def bind(self, pool: DecoderState, scratch_row: int) -> None:
        """Decode the rows of ``pool`` in place: every graph is recorded over an
        :class:`IndexedState` of ``pool`` (a static index buffer says which rows), so the
        graphs keep no state of their own. ``decode_rows(codes, pool, index)`` then replays
        with ``index`` copied into the buffer; a bucket's padding rows all point at
        ``scratch_row`` (a row of ``pool`` no stream uses; reset before each call). Must be
        called before any graph is captured; ``pool`` must stay the same object."""
        if self.graphs:
            raise RuntimeError("bind() before the first graph is captured")
        if not 0 <= scratch_row < pool.batch_size:
            raise ValueError(f"scratch row {scratch_row} is not a row of the pool ({pool.batch_size} rows)")
        self.pool, self.scratch_row = pool, int(scratch_row)
        dev = next(iter(pool.tensors.values())).device
        self._index = torch.full((self.batch_buckets[-1],), self.scratch_row, dtype=torch.long, device=dev)
        self._static_state = None

    def _bound_view(self, bb: int) -> IndexedState:
        return IndexedState(self.pool, self._index[:bb], bounds={})

    def _load_bound(self, codes_buf: Tensor, codes: Tensor, index: Tensor) -> None:
        B = codes.shape[0]
        codes_buf[:B].copy_(codes)
        codes_buf[B:].zero_()
        self._index[:B].copy_(index)
        self._reset_scratch(B)

    def _reset_scratch(self, start: int = 0) -> None:
        """Index entries from ``start`` on point at the scratch row, made a fresh stream
        (position 0, zero context): what the padding rows decode."""
        self._index[start:].fill_(self.scratch_row)
        for v in (self.pool.flat.values() if self.pool.flat is not None else self.pool.tensors.values()):
            v[self.scratch_row].zero_()

    def _is_bound_call(self, state: DecoderState, index: Tensor | None) -> bool:
        return self.pool is not None and state is self.pool and index is not None

    def bucket(self, batch: int) -> int | None:
        for b in self.batch_buckets:
            if b >= batch:
                return b
        return None

    def _views(self, bb: int) -> DecoderState:
        return DecoderState({k: v[:bb] for k, v in self.static_state.tensors.items()})

    def _row_pairs(self, state: DecoderState, B: int) -> list[tuple[Tensor, Tensor]]:
        """(state tensor, its first ``B`` static rows) pairs to gather / scatter: one pair per
        dtype when both states are packed alike, else one per state tensor."""
        if state.same_packing(self.static_state):
            return [(v, self.static_state.flat[dt][:B]) for dt, v in state.flat.items()]
        return [(v, self.static_state.tensors[k][:B]) for k, v in state.tensors.items()]

    def _load(self, codes_buf: Tensor, codes: Tensor, state: DecoderState, index: Tensor | None) -> None:
        B = codes.shape[0]
        codes_buf[:B].copy_(codes)
        codes_buf[B:].zero_()
        for v, dst in self._row_pairs(state, B):
            if index is None:
                dst.copy_(v)
            else:
                torch.index_select(v, 0, index, out=dst)
        # padding rows restart at position 0 (their RoPE index stays inside the table)
        self.static_state.tensors[self._pos_key][B: codes_buf.shape[0]].zero_()

    def _store(self, B: int, state: DecoderState, index: Tensor | None, t: int) -> None:
        for v, src in self._row_pairs(state, B):
            if index is None:
                v.copy_(src)
            else:
                v.index_copy_(0, index, src)
        self._advance_bounds(state, t)

    def run_static(self, codes: Tensor, state: DecoderState, index: Tensor | None = None) -> Tensor:
        """The graph's code path without capture (static buffers, padded bucket, fixed RoPE
        table; in place through the index for a bound decoder's pool): what a replay
        computes. For tests and CPU."""
        B, _, t = codes.shape
        bb = self.bucket(B)
        if bb is None:
            raise ValueError(f"batch {B} exceeds the largest bucket {self.batch_buckets[-1]}")
        buf = torch.zeros(bb, codes.shape[1], t, dtype=torch.long, device=self.codec.device)
        if self._is_bound_call(state, index):
            self._load_bound(buf, codes, index.to(self._index.device, torch.long))
            with torch.no_grad():
                out = self._decode(buf, self._bound_view(bb), self.rope)
            self._advance_bounds(state, t)
            return self._to_static_out(out, bb, t)[:B].clone()
        self._load(buf, codes, state, index)
        with torch.no_grad():
            out = self._decode(buf, self._views(bb), self.rope)
        self._store(B, state, index, t)
        return self._to_static_out(out, bb, t)[:B].clone()

    def _out_view(self, like: Tensor, bb: int, t: int) -> Tensor | None:
        """``[bb, channels, samples]`` view of the shared output buffer for a call like
        ``like`` (``bb`` rows, ``t`` frames), allocated on first use for the largest bucket and
        chunk; None when static outputs are off or ``like`` does not fit its layout."""
        if not self.static_out or like.dim() != 3 or like.shape[0] != bb or like.shape[-1] % t:
            return None
        buf = self._out_buf
        if buf is None:
            buf = self._alloc_out_buf(like.shape[1], like.shape[-1] // t, like.dtype)
        if (buf.dtype != like.dtype or buf.device != like.device or buf.shape[1] != like.shape[1]
                or bb > buf.shape[0] or like.shape[-1] > buf.shape[-1]):
            return None
        return buf[:bb, :, : like.shape[-1]]

    def _alloc_out_buf(self, channels: int = 1, per_frame: int | None = None,
                       dtype: torch.dtype | None = None) -> Tensor:
        """The shared output buffer: the largest bucket x the longest chunk of audio."""
        per_frame = self.codec.frame_length if per_frame is None else per_frame
        # a normal tensor even when the first call runs under inference_mode (an inference
        # tensor could not be written by a later capture or call outside it)
        with torch.inference_mode(False):
            self._out_buf = torch.empty(self.batch_buckets[-1], channels, per_frame * max(self.chunk_frames),
                                        dtype=self.codec.dtype if dtype is None else dtype, device=self.codec.device)
        return self._out_buf

    def _to_static_out(self, out: Tensor, bb: int, t: int) -> Tensor:
        """``out`` copied into its view of the shared output buffer (what a graph's last
        node does), or ``out`` itself where there is none."""
        view = self._out_view(out, bb, t)
        if view is None:
            return out
        view.copy_(out)
        return view

    def _advance_bounds(self, state: DecoderState, t: int) -> None:
        state.bounds[self._bound_key] = state.bounds.get(self._bound_key, 0) + t

    def _eager_reason(self, B: int, t: int, state: DecoderState) -> str | None:
        if not self.enabled:
            return "disabled"
        if t not in self.chunk_frames:
            return f"t={t}"
        if self.bucket(B) is None:
            return "batch"
        if (self.bucket(B), t) in self._failed:
            return "capture failed"
        # the graphs read a fixed RoPE table; a call whose positions may run past it (the
        # state's host-side bound: the most frames any of its rows has decoded) runs eagerly,
        # where the shared table grows
        if state.bounds.get(self._bound_key, 0) + t > self.rope.shape[0]:
            return "positions past the RoPE table"
        return None

    def capture(self, batch: int, t: int) -> _Graph:
        """Capture (or return) the graph for ``batch``'s bucket and ``t`` frames."""
        import time

        bb = self.bucket(batch)
        if bb is None or t not in self.chunk_frames:
            raise ValueError(f"no graph for batch {batch}, {t} frames")
        g = self.graphs.get((bb, t))
        if g is not None:
            return g
        t0 = time.perf_counter()
        dev = self.codec.device
        codes = torch.zeros(bb, self.num_codebooks, t, dtype=torch.long, device=dev)
        if self.pool is not None:
            # warm-up and capture decode padding rows only (the scratch row), never a stream
            self._reset_scratch()
            views = self._bound_view(bb)
        else:
            views = self._views(bb)
        if self.static_out and self._out_buf is None:
            self._alloc_out_buf()  # before any activation, so it sits beside none of them
        side = self.capture_stream if self.capture_stream is not None else self._side_stream()
        side.wait_stream(torch.cuda.current_stream(dev))
        first = self._pool is None
        with torch.no_grad():
            with torch.cuda.stream(side):  # warm-up: cuDNN autotuning, Triton compilation
                self._decode(codes, views, self.rope)
                if first and self.prime_pool:
                    # the second run's peak: what one call of this size keeps live at once
                    # (the first one's includes autotuning workspaces)
                    side.synchronize()
                    base = torch.cuda.memory_allocated(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                like = self._decode(codes, views, self.rope)
            torch.cuda.current_stream(dev).wait_stream(side)
            # this call's view of the shared output buffer (None: the graph keeps its own)
            static = self._out_view(like, bb, t)
            if static is None and self.static_out:
                self.stats.own_outputs += 1
                log.warning("codec graph (%d streams, %d frames): output %s %s does not fit the shared "
                            "output buffer; it stays in the graph pool", bb, t, tuple(like.shape), like.dtype)
            del like
            if first:
                self._pool = torch.cuda.graph_pool_handle()
                if self.prime_pool:
                    side.synchronize()
                    self._prime(prime_bytes(torch.cuda.max_memory_allocated(dev) - base,
                                            self.prime_margin_mib), side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=side,
                                  capture_error_mode="thread_local"):
                out = self._decode(codes, views, self.rope)
                if static is not None:  # the pool keeps no live block of this graph's
                    static.copy_(out)
                    del out
                    out = static
        g = _Graph(graph, codes, out)
        self.graphs[(bb, t)] = g
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - t0
        return g

    def _prime(self, nbytes: int, side: torch.cuda.Stream) -> None:
        """Give the graph pool one segment of ``nbytes`` (the first, largest capture's peak)
        before anything is captured into it. Every capture then splits its blocks out of that
        segment, and blocks freed in a capture merge back with their neighbours, so the pool
        stays near one call's peak. Without it the allocator opens a segment per large
        request as the capture makes them, sized to that request, and a later request of
        another size opens another: 0.44 GiB of segments for a 0.29 GiB peak (H200, 24
        graphs of up to 32 x 32 frames). The priming graph only allocates and frees; it is
        kept because the pool lives as long as a graph recorded into it."""
        if nbytes <= 0:
            return
        dev = self.codec.device
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            buf[:1].zero_()  # one node: an empty capture is an error on some drivers
            del buf
        self._primer = graph
        self.stats.primed_bytes = nbytes

    def _side_stream(self) -> torch.cuda.Stream:
        """The one stream this decoder warms up and captures on when no ``capture_stream`` is
        set. One, not a fresh one per capture: every stream cuBLAS runs on gets its own
        workspace (32 MiB on sm_90), kept for the life of the process."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.codec.device)
        return self._side

    def warmup(self, batches: tuple[int, ...] | None = None, chunk_frames: tuple[int, ...] | None = None) -> None:
        """Capture every (bucket, chunk size) pair ahead of traffic, the largest call first:
        the graphs share one memory pool, and a capture reuses the blocks the captures before
        it freed only where they are big enough, so smallest-first leaves every larger capture
        new segments on top of the old ones (``warmup_order``)."""
        if not self.enabled:
            return
        with self._lock:
            for b, t in warmup_order(batches or self.batch_buckets, chunk_frames or self.chunk_frames):
                self.capture(b, t)

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def decode_chunk(self, codes: Tensor, state: DecoderState) -> Tensor:
        return self._run(codes, state, None)

    @torch.no_grad()
    def decode_rows(self, codes: Tensor, pool: DecoderState, index: Tensor) -> Tensor:
        """Like :meth:`StreamingDecoder.decode_rows`, gathering the rows straight into the
        graph's static state (no intermediate copy)."""
        return self._run(codes, pool, index)

    def _run(self, codes: Tensor, state: DecoderState, index: Tensor | None) -> Tensor:
        if codes.dim() == 2:
            codes = codes[None]
        B, C, t = codes.shape if codes.dim() == 3 else (0, 0, 0)
        n_rows = state.batch_size if index is None else len(index)
        reason = self._eager_reason(B, t, state) if (B == n_rows and C == self.num_codebooks) else "shape"
        if reason is None and self.pool is not None and not self._is_bound_call(state, index):
            reason = "not the bound pool"  # the graphs are recorded over the pool's rows
        if reason is None:
            with self._lock:
                try:
                    self.capture(B, t)
                except Exception as e:  # noqa: BLE001 - serve on eagerly, keep the reason
                    self._failed[(self.bucket(B), t)] = f"{type(e).__name__}: {e}"
                    reason = "capture failed"
        if reason is not None:
            self.stats.eager += 1
            self.stats.eager_reasons[reason] = self.stats.eager_reasons.get(reason, 0) + 1
            if index is None:
                return StreamingDecoder.decode_chunk(self, codes, state)
            return StreamingDecoder.decode_rows(self, codes, state, index)
        if codes.is_floating_point():
            raise ValueError("codes must be an integer tensor")
        with self._lock:
            g = self.graphs[(self.bucket(B), t)]
            if index is not None:
                index = index.to(self.codec.device, torch.long)
            if self._is_bound_call(state, index):
                self._load_bound(g.codes, codes, index)
                g.graph.replay()
                self._advance_bounds(state, t)
            else:
                self._load(g.codes, codes, state, index)
                g.graph.replay()
                self._store(B, state, index, t)
            self.stats.replays += 1
            return g.out[:B].clone()


def snake_epilogue_mode() -> bool | str:
    """The serving decoder's Snake placement, ``SHOAL_CODEC_CONV_EPILOGUE``: ``k1``
    the k=1 convs' residual + Snake epilogues with the k=7 convs' Snakes as separate kernels,
    ``0`` separate Snake kernels only, ``1`` every Snake in a conv epilogue, ``fused`` the k=1
    epilogues, each k=7 conv's Snake applied by the k=1 conv to the tiles it loads, and each
    block's bias + first Snake in its transposed-conv GEMM's epilogue (see
    ``Codec.configure_serving``; all four give the same bits), ``unit`` as ``k1`` with each
    residual unit that :func:`shoal.kernels.codec_unit.unit_supported` accepts one kernel (the
    same function, summed as the k=1 kernel sums; the default). ``k1`` was the fastest of the
    first four at every measured call size on an H200 (docs/benchmarks.md, 2026-12-02); ``unit``
    gives its bits and took a 64 x 32-frame call from 51.3 to 49.3 ms on an H100 (2026-12-05).
    Unset or empty: ``unit``."""
    v = os.environ.get("SHOAL_CODEC_CONV_EPILOGUE", "unit").strip().lower()
    if v in ("unit", ""):
        return "unit"
    if v == "k1":
        return "k1"
    if v == "fused":  # k1 plus the Snakes in the k=1 prologues and the GEMM epilogues (opt-in)
        return "fused"
    if v in ("1", "true", "yes", "on", "all"):
        return True
    if v in ("0", "false", "no", "off", "none"):
        return False
    raise ValueError(f"SHOAL_CODEC_CONV_EPILOGUE must be k1, fused, unit, 1 (all) or 0 (none), got {v!r}")


def group_positions_default() -> int | None:
    """The serving decoder's row-group size, ``SHOAL_CODEC_GROUP_POSITIONS``: the decoder's
    high-rate blocks run over groups of streams holding at most this many input positions
    (streams x 4 x frames; default 512, i.e. 4 streams x 32 frames), which bounds what a call
    -- and the CUDA-graph pool that records it -- keeps of activations; ``0`` turns it off.
    512 against 1,024: a graph pool of 0.29 GiB against 0.98 for 24 graphs of up to 32 x 32
    frames, for calls ~2-3% slower (H200, docs/benchmarks.md 2026-12-04)."""
    return env_int("SHOAL_CODEC_GROUP_POSITIONS", 512) or None


def pack_conv_weights(codec: Codec) -> int:
    """Build the Triton convs' packed weights now, on the current stream, ahead of any
    activation: packed lazily inside the first (warm-up) call, each one lands between that
    call's activations and keeps their segments reserved after they are freed. A stride-1
    conv's ``conv.weight`` becomes a view of its packed weight (``share_packed_weight``), so
    the decoder holds each such weight once. Returns the bytes packed."""
    from .layers import CausalConv1d, CausalConvTranspose1d

    n = 0
    for m in codec.decoder.modules():
        if not getattr(m, "triton_conv", False):
            continue
        if isinstance(m, CausalConv1d) and m.stride == 1 and m.groups == 1:
            w = m.share_packed_weight()  # the weight becomes a view of its packed form
        elif isinstance(m, CausalConvTranspose1d) and m.as_gemm:
            w = m.share_packed_weight()  # packed over the weight's own storage, one copy kept
        else:
            continue  # not run as the Triton kernel
        n += w.numel() * w.element_size()
    # the fused Snake mode's per-column bias and Snake alpha of each block's GEMM (tiny, but
    # built here too rather than inside the first call)
    for blk in list(codec.decoder.model)[1:-3]:
        ct, units = blk.block[1], list(blk.block)[2:]
        if isinstance(ct, CausalConvTranspose1d) and ct.as_gemm and units:
            if ct.conv.bias is not None:
                ct._tiled(ct.conv.bias)
            ct._tiled(units[0].block[0].alpha)
    return n


def window_state_default() -> str | None:
    """What a serving stream carries of the codec transformer's window,
    ``SHOAL_CODEC_WINDOW_STATE``: ``kv`` (keys and values, 4.0 MiB per stream for the real
    codec; a codec's own default), ``hidden`` (each layer's normed inputs, 2.0 MiB; keys and
    values recomputed each call) or ``ring`` (the keys and values in ring order, 4.0 MiB, read
    and written in place by the window-attention kernel). None when unset: ``ring`` on the
    CUDA Triton path (:data:`SERVING_DEFAULTS`) unless set through ``configure_serving``, else
    the codec's own setting."""
    v = os.environ.get("SHOAL_CODEC_WINDOW_STATE", "").strip().lower()
    if not v:
        return None
    from .layers import WindowLimitedTransformer

    if v not in WindowLimitedTransformer.WINDOW_STATES:
        raise ValueError(f"SHOAL_CODEC_WINDOW_STATE must be one of {WindowLimitedTransformer.WINDOW_STATES}, "
                         f"got {v!r}")
    return v


def transformer_kernels_default() -> bool | None:
    """``SHOAL_CODEC_TRANSFORMER_KERNELS``: ``1`` runs the codec transformer's streaming calls
    through the fused kernels (``Codec.configure_serving(transformer_kernels=True)``), ``0``
    through the modules. None when unset: on for the CUDA Triton path (:data:`SERVING_DEFAULTS`)
    unless set through ``configure_serving``, else the codec's own setting (off until set)."""
    return env_flag("SHOAL_CODEC_TRANSFORMER_KERNELS")


def tconv_snake_default() -> bool | None:
    """``SHOAL_CODEC_TCONV_SNAKE``: ``1`` computes each decoder block's bias + first Snake in
    its transposed conv's GEMM epilogue (``Codec.configure_serving(tconv_snake=True)``; the
    ``fused`` mode's entry, here with the ``unit`` / ``k1`` modes), ``0`` in the separate Snake
    kernel. None when unset: on for the CUDA Triton path (:data:`SERVING_DEFAULTS`) unless set
    through ``configure_serving``, else the codec's own setting (off until set)."""
    return env_flag("SHOAL_CODEC_TCONV_SNAKE")


# the Triton decode path's defaults on CUDA for the options below (H100, 2026-12-07, 64 x 32-frame
# calls: 46.7 ms with kv / modules / separate Snakes, 41.9 ms with these; engine with audio at
# c=64: +1.8% frames/s, first audio p50 -14%; docs/benchmarks.md)
SERVING_DEFAULTS: dict[str, object] = {"window_state": "ring", "transformer_kernels": True, "tconv_snake": True}


def apply_serving_defaults(codec: Codec, triton_path: bool) -> None:
    """The codec transformer's window state, its fused kernels and the blocks' entry Snakes:
    the environment's choice where set; else, on the Triton decode path (``triton_path``: a
    CUDA codec whose convs run as Triton kernels), :data:`SERVING_DEFAULTS` unless the caller
    set the option through ``Codec.configure_serving``; else the codec's own setting. The
    default window state is not applied over stream states already made in another layout."""
    caller_set = set(codec.serving_set)
    tr = codec.quantizer.post_module
    try:
        for name, env_value in (("window_state", window_state_default()),
                                ("transformer_kernels", transformer_kernels_default()),
                                ("tconv_snake", tconv_snake_default())):
            value = env_value
            if value is None and triton_path and name not in caller_set:
                value = SERVING_DEFAULTS[name]
                if name == "window_state" and tr.states_made and tr.window_state != value:
                    # stream states exist in the current layout (kv and ring states have the same
                    # tensors, ordered differently): the default does not reorder them
                    log.warning("codec window state stays %r: stream states were made before the "
                                "serving defaults (set SHOAL_CODEC_WINDOW_STATE or "
                                "configure_serving(window_state=) before making states)", tr.window_state)
                    continue
            if value is not None:
                codec.configure_serving(**{name: value})
    finally:  # neither the defaults nor the environment count as the caller's choice
        codec.serving_set.clear()
        codec.serving_set.update(caller_set)


def configure_serving_layout(codec: Codec) -> str:
    """Put the codec's decoder in the layout serving uses (see :func:`serving_decoder`); returns
    it: "triton" (Triton implicit-GEMM convs, channels-last), "cudnn-cl" or "cudnn"."""
    from ..kernels.codec_conv import codec_conv_enabled

    if codec.device.type == "cuda":
        codec.configure_serving(group_positions=group_positions_default(),
                                group_head_blocks=env_int("SHOAL_CODEC_GROUP_HEAD_BLOCKS", 1))
    # the decode side's precision (a codec may encode in fp32 and decode in bf16)
    triton_path = codec.device.type == "cuda" and codec_conv_enabled(codec.dtype)
    apply_serving_defaults(codec, triton_path)
    if triton_path:
        codec.configure_serving(channels_last=True, triton_conv=True, snake_epilogue=snake_epilogue_mode())
        pack_conv_weights(codec)
        return "triton"
    if os.environ.get("SHOAL_CODEC_CHANNELS_LAST"):
        cl = os.environ["SHOAL_CODEC_CHANNELS_LAST"] not in ("0", "")
        codec.configure_serving(channels_last=cl, triton_conv=False)
        return "cudnn-cl" if cl else "cudnn"
    return "cudnn-cl" if codec.decoder.channels_last else "cudnn"


def serving_decoder(codec: Codec, graphs: bool | None = None, **kwargs) -> StreamingDecoder:
    """The streaming decoder for serving: CUDA graphs on a CUDA codec unless disabled
    (``graphs=False`` or ``SHOAL_CODEC_GRAPHS=0``), else the eager :class:`StreamingDecoder`.
    On CUDA a bf16 / fp16 codec's convolutions run as the Triton implicit-GEMM kernels
    (:mod:`shoal.kernels.codec_conv`, channels-last, the k=1 convs' Snakes in their epilogues,
    the rest in the separate fused Snake kernel, and each 192-channel residual unit one kernel,
    :mod:`shoal.kernels.codec_unit`; ``SHOAL_CODEC_CONV_EPILOGUE=k1|0|1|fused`` for no unit
    kernels / none / all in epilogues / the opt-in fused Snakes, see :func:`snake_epilogue_mode`);
    ``SHOAL_CODEC_TRITON_CONV=1`` forces them for fp32 too, ``=0`` gives cuDNN, with
    ``SHOAL_CODEC_CHANNELS_LAST=0|1`` picking its layout."""
    configure_serving_layout(codec)
    if graphs is None:
        graphs = os.environ.get("SHOAL_CODEC_GRAPHS", "1") not in ("0", "")
    if graphs and codec.device.type == "cuda":
        return GraphedStreamingDecoder(codec, **kwargs)
    return StreamingDecoder(codec)
