"""Streaming audio for the engine: frames in, PCM chunks out, batched across requests.

Each streaming request owns a row of one batched :class:`StreamingDecoder` state (carried conv
contexts and windowed-attention KV), so every frame is decoded exactly once. The first chunk of
a request leaves after ``ChunkSchedule.first`` frames; later chunks grow geometrically up to
``max_frames`` (small first chunk = low time to first audio; large later chunks = efficient
batched decode). Requests whose next chunk has the same size are decoded in one call.

Codec calls are scheduled earliest deadline first: a stream's deadline is the moment the audio
it has received so far finishes playing (a stream with no audio yet is due now), so first
chunks go ahead of the later chunks of streams that are still playing. A call decodes at most
``max_call_streams`` streams. Calls are asynchronous: the threaded worker launches a call
(its PCM copied to pinned memory behind a CUDA event), goes back to its inbox, and delivers the
audio when the event completes, so a first chunk waits behind at most one bounded call rather
than behind every ready chunk. A new stream's state row is reset when its first frames arrive.

With ``first_lane`` (opt-in: it trades playback underruns for first-audio latency, see
``EngineConfig.audio_first_lane``), a starting stream's chunks (its first
``first_lane_chunks``, while it has little audio in hand) do not wait even for that: they have
a lane of their own -- a second decoder (own CUDA graphs and static buffers) on a second CUDA
stream of higher priority than the later chunks' -- with at most one call in flight per lane.
The two lanes share the per-stream state rows; a call waits (on the GPU) for the last call of
another lane that touched one of its rows, a row is reset on the first lane's stream, and the
first lane's audio is delivered before a later call's (a stream's chunks stay in order).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..codec.streaming import serving_decoder


@dataclass(frozen=True)
class ChunkSchedule:
    first: int = 4  # frames in the first audio chunk (4 frames = 186 ms of audio)
    growth: float = 2.0
    max_frames: int = 32

    def size(self, index: int) -> int:
        return int(min(self.max_frames, max(1, round(self.first * self.growth ** index))))

    def validate(self) -> None:
        if self.first < 1 or self.max_frames < self.first or self.growth < 1.0:
            raise ValueError("chunk schedule needs 1 <= first <= max_frames and growth >= 1")


class AudioStreamer:
    def __init__(self, codec, max_streams: int, schedule: ChunkSchedule = ChunkSchedule(),
                 max_call_streams: int | None = 32, clock=time.perf_counter, fill_calls: bool = False,
                 first_lane: bool = False, first_lane_chunks: int = 2, hold_s: float = 0.0,
                 hold_streams: int = 0) -> None:
        schedule.validate()
        if max_call_streams is not None and max_call_streams < 1:
            raise ValueError("max_call_streams must be >= 1 (or None for no limit)")
        if hold_s < 0 or hold_streams < 0:
            raise ValueError("hold_s and hold_streams must be >= 0")
        # hold back a call of later chunks while it would decode fewer than hold_streams streams
        # and each of them still has at least hold_s seconds of audio to play: fewer, fuller
        # codec calls (cheaper per frame) at no risk to playback; first chunks and the last
        # chunks of finished requests are never held (see next_call)
        self.hold_s = float(hold_s)
        self.hold_streams = int(hold_streams)
        self.held_until: float | None = None  # when the call the last next_call held back falls due
        self.codec = codec
        self.schedule = schedule
        self.max_call_streams = max_call_streams
        # fill a call's spare rows with playing streams that hold at least its chunk size of
        # frames though their own next chunk is not complete (they get a shorter chunk, earlier)
        self.fill_calls = fill_calls
        self.clock = clock
        self.play_end: dict[str, float] = {}  # when the audio delivered so far finishes playing
        self.since: dict[str, float] = {}  # when a stream's first frames arrived
        self.failed: set[str] = set()  # streams whose codec call raised, not yet released
        # all frames in, remaining chunks still to decode (a dict: kept in finishing order)
        self.finishing: dict[str, None] = {}
        self._done: list[str] = []
        # CUDA graphs on GPU, else eager; buckets up to the largest call (no graph for a batch
        # no call ever has: the bucket sets what the graphs keep of state and activations)
        self.decoder = serving_decoder(codec, max_batch=min(max_call_streams or max_streams, max_streams))
        self.sample_rate = codec.sample_rate
        self.device = next(codec.parameters()).device
        self.max_streams = max_streams
        self.free_rows = list(range(max_streams - 1, -1, -1))
        # frames decoded into each live row (host ints): the pool's position bound is their
        # maximum, so it follows the longest live stream, not the traffic the pool has seen
        self.row_frames: dict[int, int] = {}
        self.rows: dict[str, int] = {}
        self.pending: dict[str, list[np.ndarray]] = {}
        self.chunks: dict[str, int] = {}
        self.schedules: dict[str, ChunkSchedule] = {}
        self._gen: dict[str, int] = {}  # a stream's row generation (a released id may come back)
        self._inflight: dict[str, int] = {}  # calls launched, not yet delivered, per stream
        self._row_event: dict[int, tuple["_Lane", object]] = {}  # last call that touched a row
        self._failed_calls: list[tuple[str, str]] = []
        self._gen_counter = 0
        self._first_ready: dict[str, float] = {}  # when a stream's first chunk was complete
        self.stats = AudioStats()
        self.bulk = _Lane("bulk", self.decoder)
        self.first: _Lane | None = None
        if first_lane_chunks < 1:
            raise ValueError("first_lane_chunks must be >= 1")
        self.first_lane_chunks = first_lane_chunks  # a stream's chunks on the first lane
        if first_lane:
            first_calls = min(max_call_streams or max_streams, max_streams)
            sizes = tuple(sorted({schedule.size(i) for i in range(first_lane_chunks)}))
            dec = serving_decoder(codec, max_batch=first_calls, chunk_frames=sizes)
            self.first = _Lane("first", dec)
        self.lanes = [lane for lane in (self.first, self.bulk) if lane is not None]
        # the streams' state slots. A graphed lane (SHOAL_CODEC_BIND_POOL=0: off) decodes its rows
        # in place (no state copy of its own) and gets a scratch row past the streams' for its
        # padding rows (GPU test: tests/test_audio_lanes_gpu.py)
        bind = os.environ.get("SHOAL_CODEC_BIND_POOL", "1").strip().lower() not in ("0", "", "false", "no", "off")
        bound = [lane for lane in self.lanes
                 if bind and hasattr(lane.decoder, "bind") and lane.decoder.enabled]
        self.state = self.decoder.new_state(max_streams + len(bound))
        for i, lane in enumerate(bound):
            lane.decoder.bind(self.state, max_streams + i)

    def _row(self, rid: str, schedule: ChunkSchedule | None = None) -> int:
        row = self.rows.get(rid)
        if row is None:
            if not self.free_rows:
                raise RuntimeError("no free audio stream rows")
            row = self.free_rows.pop()
            self._reset_row(row)
            self.rows[rid] = row
            self._gen_counter += 1
            self._gen[rid] = self._gen_counter
            self.pending[rid] = []
            self.chunks[rid] = 0
            self.schedules[rid] = schedule or self.schedule
            self.since[rid] = self.clock()
        return row

    def _reset_row(self, row: int) -> None:
        """Make ``row`` a fresh stream on the stream of its first call (the first lane's, if
        any: every first chunk runs there), after the last call of another lane that used it.
        Done when the stream's first frames arrive, off its first chunk's critical path."""
        lane = self.first or self.bulk
        with self._on(lane):
            self._wait_other_lanes(lane, [row])
            self._row_event.pop(row, None)
            self.state.reset_([row])
        self.row_frames[row] = 0
        self._set_bounds()

    def _set_bounds(self) -> None:
        """The pool's position bound (what an eager call sizes its RoPE table from) = the most
        frames any live row has decoded. A scalar per pool that only grows would, on a server
        that reuses rows, follow the total traffic and keep doubling the table."""
        bound = max(self.row_frames.values(), default=0)
        for k in self.state.bounds:
            self.state.bounds[k] = bound

    def _on(self, lane: "_Lane"):
        """Context: ``lane``'s CUDA stream current (a no-op off CUDA or without one)."""
        if self.device.type == "cuda" and lane.stream is not None:
            return torch.cuda.stream(lane.stream)
        return contextlib.nullcontext()

    def _wait_other_lanes(self, lane: "_Lane", rows: list[int]) -> None:
        """Make the current stream wait for the last call of another lane that touched ``rows``."""
        if self.device.type != "cuda":
            return
        events = {id(ev): ev for lane_ev, ev in (self._row_event.get(r, (None, None)) for r in rows)
                  if ev is not None and lane_ev is not lane}
        stream = torch.cuda.current_stream(self.device)
        for ev in events.values():
            stream.wait_event(ev)

    def warmup(self) -> None:
        """Capture the codec's CUDA graphs (every batch bucket x chunk size) before traffic."""
        for lane in self.lanes:
            if hasattr(lane.decoder, "warmup"):
                lane.decoder.warmup()

    def push(self, rid: str, frames: np.ndarray, schedule: ChunkSchedule | None = None) -> None:
        """Queue frames of ``rid``; ``schedule`` (first push only) overrides the default.
        Frames of a stream whose codec call failed are dropped until it is released or
        finished (the engine is failing that request; a new row must not restart it)."""
        if rid in self.failed:
            return
        self._row(rid, schedule)
        self.pending[rid].append(frames)
        if self.chunks[rid] == 0 and rid not in self._first_ready:
            if sum(f.shape[1] for f in self.pending[rid]) >= self.schedules[rid].size(0):
                self._first_ready[rid] = self.clock()

    def _decode(self, rids: list[str], n: int, lane: "_Lane | None" = None) -> "_Call":
        """Launch one codec call of ``n`` frames for ``rids`` on ``lane`` (default: the bulk
        lane) and return it; its audio is read by :meth:`_complete`. On CUDA the call runs
        asynchronously on the lane's stream (None: the current stream)."""
        lane = lane or self.bulk
        rows = [self.rows[r] for r in rids]
        codes = []
        for r in rids:
            buf = np.concatenate(self.pending[r], axis=1)
            codes.append(buf[:, :n])
            rest = buf[:, n:]
            self.pending[r] = [rest] if rest.shape[1] else []
        cuda = self.device.type == "cuda"
        with self._on(lane), torch.inference_mode():
            self._wait_other_lanes(lane, rows)
            event = None
            try:
                batch = torch.as_tensor(np.stack(codes), dtype=torch.long).to(self.device, non_blocking=cuda)
                index = torch.tensor(rows).to(self.device, non_blocking=cuda)
                audio = lane.decoder.decode_rows(batch, self.state, index)  # rows gathered, advanced, written back
                for row in rows:
                    self.row_frames[row] = self.row_frames.get(row, 0) + n
                self._set_bounds()
                pcm = audio[:, 0].float()
                if cuda:
                    host = torch.empty(pcm.shape, dtype=pcm.dtype, pin_memory=True)
                    host.copy_(pcm, non_blocking=True)
                    pcm = host
            finally:
                if cuda:  # also after a failure: whatever was queued on these rows is ordered
                    event = torch.cuda.Event()
                    event.record()
                    for row in rows:
                        self._row_event[row] = (lane, event)
        now = self.clock()
        for r in rids:
            ready = self._first_ready.pop(r, None)
            if ready is not None:
                self.stats.first_queue_s.append(now - ready)
            self.chunks[r] += 1
            self._inflight[r] = self._inflight.get(r, 0) + 1
        self.stats.calls += 1
        self.stats.call_streams += len(rids)
        self.stats.call_frames += len(rids) * n
        return _Call(lane, list(rids), [self._gen[r] for r in rids], pcm, event, now)

    def _complete(self, call: "_Call") -> list[tuple[str, np.ndarray]]:
        """Deliver a finished call: ``(rid, pcm)`` of its streams that still hold their row."""
        now = self.clock()
        self.stats.call_s.append(now - call.launched)
        pcm = call.pcm.numpy()
        if call.event is not None:
            pcm = pcm.copy()  # the consumer keeps pageable memory, the pinned block goes back
        out = []
        for i, (rid, gen) in enumerate(zip(call.rids, call.gens)):
            if self._gen.get(rid) != gen:
                continue  # released (cancelled or failed) after the launch: not this stream's
            if self._inflight.get(rid):
                self._inflight[rid] -= 1
            # playback (re)starts at delivery if the stream ran dry
            self.play_end[rid] = max(self.play_end.get(rid, now), now) + pcm.shape[1] / self.sample_rate
            out.append((rid, pcm[i]))
        return out

    def _ready(self) -> list[tuple[float, int, str, int]]:
        """(deadline, row, rid, chunk frames) of every stream whose next chunk is complete."""
        ready = []
        for rid, frames in self.pending.items():
            need = self.schedules[rid].size(self.chunks[rid])
            have = sum(f.shape[1] for f in frames)
            if rid in self.finishing and 0 < have < need:
                need = have  # the last, shorter chunk of a finished request
            if have >= need and have > 0:
                # no audio yet: due since its first frames arrived (overdue, so ahead of any
                # stream that still has audio to play)
                ready.append((self.play_end.get(rid, self.since[rid]), self.rows[rid], rid, need))
        return ready

    def has_ready(self) -> bool:
        return bool(self._ready())

    def next_call(self, lane: "_Lane | None" = None, hold: bool = True) -> tuple[int, list[str]] | None:
        """The next codec call, ``(frames, rids)``: the most urgent ready stream and the other
        ready streams of its chunk size, most urgent first, at most ``max_call_streams``.
        With a first-chunk lane, ``lane`` picks among first chunks (that lane) or later chunks
        (the bulk lane; None: any). ``hold`` (with ``hold_s`` set): None while the call is
        held back; ``held_until`` then says when it falls due (else None)."""
        call = self._candidate(lane)
        held = call is not None and hold and call[2] > self.clock()
        self.held_until = call[2] if held else None
        if call is None or held:
            return None
        return call[0], call[1]

    def _candidate(self, lane: "_Lane | None") -> tuple[int, list[str], float] | None:
        """``(frames, rids, held until)`` of the next call (see :meth:`next_call`): the most
        urgent stream's chunk-size group, or, while that one is held back, the most urgent
        group that is not (a finished request's last chunk); when all are, the first group and
        the earliest time one of them falls due."""
        ready = sorted(self._ready())
        if self.first is not None and lane is not None:
            want_first = lane is self.first
            ready = [r for r in ready if self._starting(r[2]) == want_first]
        if not ready:
            return None
        first = None
        for n in dict.fromkeys(need for _, _, _, need in ready):  # chunk sizes, most urgent first
            group = [r for r in ready if r[3] == n]
            rids = self._call_rids(n, [rid for _, _, rid, _ in group])
            until = self._hold_until(group[0][0], rids)
            if until <= self.clock():
                return n, rids, until
            first = (n, rids, until) if first is None else (first[0], first[1], min(first[2], until))
        return first

    def _call_rids(self, n: int, rids: list[str]) -> list[str]:
        """A call's streams: the ready ``rids`` of chunk size ``n``, riders (fill_calls), at most
        max_call_streams."""
        if self.fill_calls and (self.max_call_streams is None or len(rids) < self.max_call_streams):
            # with two lanes, riders come from the call's own lane (a stream's chunks stay in
            # one lane while it starts): a starting stream that already plays its first chunk
            # rides a first-lane call, as it rides any call with one lane
            lane_first = self._starting(rids[0]) if self.first is not None else None
            rids = rids + [rid for _, _, rid in self._fillers(n, set(rids), lane_first)]
        return rids[: self.max_call_streams] if self.max_call_streams else rids

    def _hold_until(self, deadline: float, rids: list[str]) -> float:
        """Until when a call of ``rids`` (its most urgent deadline ``deadline``) is held back:
        ``deadline - hold_s`` while it has fewer than ``hold_streams`` streams (at most
        ``max_call_streams``), all of them already playing and none finishing; else -inf."""
        full = min(self.hold_streams, self.max_call_streams or self.hold_streams)
        if (self.hold_s <= 0 or len(rids) >= full
                or any(r not in self.play_end or r in self.finishing for r in rids)):
            return float("-inf")
        return deadline - self.hold_s

    def lane_of(self, rids: list[str]) -> "_Lane":
        """The lane a call of these streams runs on: starting streams on the first lane (if any)."""
        if self.first is not None and self._starting(rids[0]):
            return self.first
        return self.bulk

    def _starting(self, rid: str) -> bool:
        """``rid``'s next chunk is one of its first ``first_lane_chunks`` (the first lane's)."""
        return self.chunks[rid] < self.first_lane_chunks

    def _fillers(self, n: int, taken: set[str], starting: bool | None = None) -> list[tuple[float, int, str]]:
        """(deadline, row, rid) of streams outside ``taken`` that already play audio and hold at
        least ``n`` pending frames: riders for a call of ``n`` frames (most urgent first). A
        stream with no audio yet waits for its full first chunk. ``starting`` (two lanes): only
        streams that are (True) or are not (False) starting, i.e. of the call's lane."""
        out = []
        for rid, frames in self.pending.items():
            if rid in taken or rid not in self.play_end:
                continue
            if starting is not None and self._starting(rid) != starting:
                continue  # the other lane's: a stream's chunks stay in order in its lane
            if sum(f.shape[1] for f in frames) >= n:
                out.append((self.play_end[rid], self.rows[rid], rid))
        return sorted(out)

    def launch(self, lane: "_Lane", hold: bool = True) -> bool:
        """Launch the next call of ``lane`` if it is idle and has one (not held back, unless
        ``hold`` is False); True when launched. A call that raises (e.g. out of memory)
        releases its streams and reports them through :meth:`collect`."""
        self.held_until = None
        if lane.inflight is not None:
            return False
        call = self.next_call(lane if self.first is not None else None, hold=hold)
        if call is None:
            return False
        n, rids = call
        try:
            lane.inflight = self._decode(rids, n, lane)
        except Exception as e:  # noqa: BLE001 - reported per request, the worker lives on
            for rid in rids:
                more = rid not in self.finishing  # the engine may still push frames
                self.release(rid)
                if more:
                    self.failed.add(rid)
                self._failed_calls.append((rid, f"audio decode failed: {type(e).__name__}: {e}"[:300]))
        return True

    def busy(self) -> bool:
        """Some call is launched and not yet collected."""
        return any(lane.inflight is not None for lane in self.lanes)

    def finished_any(self) -> bool:
        """Some launched call has finished on the device (cheap: one event query per lane)."""
        return any(lane.inflight is not None and (lane.inflight.event is None or lane.inflight.event.query())
                   for lane in self.lanes)

    def collect(self, wait: bool = False) -> tuple[list[tuple[str, np.ndarray]], list[tuple[str, str]]]:
        """``(audio, failed)`` of the calls that have finished (``wait``: of every launched
        call), in launch order of their lanes' calls."""
        out: list[tuple[str, np.ndarray]] = []
        # which calls are done, asked later lanes first: a bulk call may have waited (on the
        # device) for a first-lane call of the same stream, so when it is done, so is that one,
        # and the first lane's audio is delivered ahead of it (a stream's chunks stay in order)
        done = {}
        for lane in reversed(self.lanes):
            call = lane.inflight
            if call is not None:
                if call.event is not None and wait:
                    call.event.synchronize()
                done[lane.name] = call.event is None or wait or call.event.query()
        for lane in self.lanes:
            if done.get(lane.name):
                call, lane.inflight = lane.inflight, None
                out += self._complete(call)
        failed, self._failed_calls = self._failed_calls, []
        return out, failed

    def decode_ready(self, max_calls: int | None = None) -> tuple[list[tuple[str, np.ndarray]], list[tuple[str, str]]]:
        """Decode ready chunks, most urgent first (see :meth:`next_call`), until none is left
        or ``max_calls`` calls were made, waiting for each (the synchronous form of
        :meth:`launch` + :meth:`collect`). Returns ``(audio, failed)``: a codec call that
        raises (e.g. out of memory) releases its streams and lists them as ``(rid, message)``;
        the other streams go on."""
        out: list[tuple[str, np.ndarray]] = []
        failed: list[tuple[str, str]] = []
        calls = 0
        while max_calls is None or calls < max_calls:
            ready = self._ready()
            if not ready:
                break
            calls += 1
            self.launch(self.lane_of([min(ready)[2]]), hold=False)  # the most urgent stream's lane
            audio, bad = self.collect(wait=True)
            out += audio
            failed += bad
        return out, failed

    def finish(self, rid: str) -> None:
        """``rid`` has all its frames: its remaining chunks (the last one possibly shorter) are
        decoded in deadline order like any other, batched with other streams of that size;
        :meth:`take_done` then reports it and frees its row."""
        self.failed.discard(rid)
        if rid in self.rows:
            self.finishing[rid] = None
        else:
            self._done.append(rid)

    def take_done(self) -> list[str]:
        """Finished streams whose last audio is out (rows freed), in finishing order."""
        for rid in list(self.finishing):
            if not any(f.shape[1] for f in self.pending[rid]) and not self._inflight.get(rid):
                self.release(rid)
                self._done.append(rid)
        done, self._done = self._done, []
        return done

    def release(self, rid: str) -> None:
        """Free ``rid``'s row (a cancelled or failed request); it may start afresh later."""
        self.failed.discard(rid)
        self.finishing.pop(rid, None)
        if rid in self.rows:
            row = self.rows.pop(rid)
            self.free_rows.append(row)
            self.row_frames.pop(row, None)
            self.pending.pop(rid, None)
            self.chunks.pop(rid, None)
            self.schedules.pop(rid, None)
            self.play_end.pop(rid, None)
            self.since.pop(rid, None)
            self._gen.pop(rid, None)
            self._inflight.pop(rid, None)
            self._first_ready.pop(rid, None)


@dataclass
class AudioStats:
    """Codec-call counters of an :class:`AudioStreamer` (recent samples in bounded deques):
    ``first_queue_s`` is how long a stream's complete first chunk waited for its call's launch,
    ``call_s`` a call's time from launch to delivery (the worker notices completion within
    about a millisecond). :meth:`summary` gives p50 / p99 in ms; :meth:`reset` starts afresh."""
    calls: int = 0
    call_streams: int = 0
    call_frames: int = 0
    first_queue_s: deque = field(default_factory=lambda: deque(maxlen=100_000))
    call_s: deque = field(default_factory=lambda: deque(maxlen=100_000))

    def reset(self) -> None:
        self.__init__()

    def summary(self) -> dict:
        def pct(xs, q):
            xs = xs.copy()  # one C call: safe while the worker thread appends
            return float(np.percentile(np.fromiter(xs, float, len(xs)), q) * 1e3) if xs else None

        return {"codec_calls": self.calls,
                "streams_per_call": self.call_streams / self.calls if self.calls else None,
                "frames_per_call": self.call_frames / self.calls if self.calls else None,
                "first_chunk_queue_p50_ms": pct(self.first_queue_s, 50),
                "first_chunk_queue_p99_ms": pct(self.first_queue_s, 99),
                "codec_call_p50_ms": pct(self.call_s, 50), "codec_call_p99_ms": pct(self.call_s, 99)}


@dataclass
class _Lane:
    """A sequence of codec calls: a decoder (own graphs and static buffers) and the CUDA stream
    its calls run on (None: the caller's current stream); at most one call in flight."""
    name: str
    decoder: object
    stream: object = None
    inflight: "_Call | None" = None


@dataclass
class _Call:
    lane: _Lane
    rids: list[str]
    gens: list[int]
    pcm: torch.Tensor  # [B, samples] float32 on the host (pinned on CUDA: valid once event is done)
    event: object = None
    launched: float = 0.0  # streamer clock at launch


class AudioWorker:
    """Drives an :class:`AudioStreamer` from the engine, inline or on its own thread.

    The engine only enqueues commands (``push`` frames, ``finish`` or ``release`` a request) and
    ``poll``s results: ``("audio", rid, pcm)``, once a finished request's last audio is out
    ``("done", rid)``, and ``("error", rid, message)`` when the codec failed on a request's audio
    (that request alone fails; e.g. an out-of-memory decode does not stop the worker). Threaded, the codec runs beside the LLM decode (on its own CUDA stream
    on GPU), so decode steps never wait for audio; inline (CPU, tests), the same commands are
    processed when polled. Commands of one request are processed in order; the audio is the same
    either way (streaming decode is chunk-schedule invariant).
    """

    def __init__(self, streamer: AudioStreamer, threaded: bool = False, sms: int | None = None) -> None:
        import queue
        import threading

        self.streamer = streamer
        self.sample_rate = streamer.sample_rate
        self.threaded = threaded
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self.sms: int | None = None  # SMs the codec's stream is confined to (None: all)
        self._cuda_stream = None
        self._held_until: float | None = None  # the earliest call the last round held back falls due
        if threaded and streamer.device.type == "cuda":
            self._cuda_stream = self._stream(streamer.device, sms)
            if self.sms is not None and hasattr(streamer.decoder, "capture_stream"):
                # a CUDA graph runs on the SMs of the stream it was captured on, whatever
                # stream replays it: the codec's graphs are captured on the partition stream
                streamer.decoder.capture_stream = self._cuda_stream
            if streamer.first is not None:
                # first chunks: a stream of higher priority than the later chunks' (graph
                # kernels take the priority of the stream they were captured on)
                prio = int(os.environ.get("SHOAL_AUDIO_FIRST_LANE_PRIORITY", "-1"))
                streamer.first.stream = self._stream(streamer.device, sms, priority=prio)
                if hasattr(streamer.first.decoder, "capture_stream"):
                    streamer.first.decoder.capture_stream = streamer.first.stream
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="shoal-audio", daemon=True)
            self._thread.start()

    def _stream(self, device: torch.device, sms: int | None, priority: int = 0):
        """A CUDA stream for the worker: confined to ``sms`` SMs when asked and possible (a
        driver without green contexts gets an ordinary stream and a warning)."""
        if sms:
            from .sm_partition import SMPartitionError, sm_partition

            try:
                part = sm_partition(device, sms)
                self.sms = part.sm_count
                return part.stream(priority)
            except SMPartitionError as e:
                import warnings

                warnings.warn(f"codec stream not confined to {sms} SMs ({e}); it may use every SM",
                              RuntimeWarning, stacklevel=3)
        return torch.cuda.Stream(device, priority=priority)

    # ------------------------------------------------------------------ engine side
    def warmup(self) -> None:
        """Capture the codec's CUDA graphs (every batch bucket x chunk size) before traffic."""
        self.streamer.warmup()

    def push(self, rid: str, frames: np.ndarray, schedule: ChunkSchedule | None = None) -> None:
        self._inbox.put(("push", rid, frames, schedule))

    def finish(self, rid: str) -> None:
        self._inbox.put(("finish", rid, None, None))

    def release(self, rid: str) -> None:
        self._inbox.put(("release", rid, None, None))

    def poll(self, timeout: float = 0.0) -> list[tuple]:
        """Results so far; with ``timeout`` > 0 (threaded), wait that long for the first one."""
        import queue

        if not self.threaded:
            self._process(self._drain())
        out = []
        try:
            if timeout > 0 and self.threaded:
                out.append(self._outbox.get(timeout=timeout))
            while True:
                out.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        if self._error is not None:
            raise RuntimeError(f"audio worker failed: {self._error!r}") from self._error
        return out

    # ------------------------------------------------------------------ worker side
    def _drain(self) -> list[tuple]:
        import queue

        cmds = []
        try:
            while True:
                cmds.append(self._inbox.get_nowait())
        except queue.Empty:
            return cmds

    def _apply(self, cmds: list[tuple]) -> None:
        s = self.streamer
        for kind, rid, frames, schedule in cmds:
            if kind == "push":
                s.push(rid, frames, schedule)
            elif kind == "finish":
                s.finish(rid)
            else:
                s.release(rid)

    def _deliver(self, audio, failed) -> None:
        for rid, pcm in audio:
            self._outbox.put(("audio", rid, pcm))
        for rid, msg in failed:
            self._outbox.put(("error", rid, msg))
        for rid in self.streamer.take_done():  # after the stream's last audio
            self._outbox.put(("done", rid))

    def _process(self, cmds: list[tuple], max_calls: int | None = None) -> None:
        """Inline form: apply the commands, decode what is ready (waiting for each call)."""
        self._apply(cmds)
        self._deliver(*self.streamer.decode_ready(max_calls))

    def _round(self, cmds: list[tuple]) -> None:
        """Threaded form: apply the commands, deliver the calls that finished, then launch the
        next call on every idle lane (asynchronous: the loop is back at its inbox at once)."""
        s = self.streamer
        self._apply(cmds)
        self._deliver(*s.collect())
        held = []
        for lane in s.lanes:
            s.launch(lane)
            if s.held_until is not None:
                held.append(s.held_until)
        self._held_until = min(held) if held else None
        if s._failed_calls:  # report a failed launch now (with any audio collected alongside)
            self._deliver(*s.collect())

    def _loop(self) -> None:
        import queue

        ctx = torch.cuda.stream(self._cuda_stream) if self._cuda_stream is not None else contextlib.nullcontext()
        s = self.streamer
        try:
            with ctx:
                while True:
                    # one call per lane at a time, then the inbox again: a first chunk that
                    # arrives meanwhile is launched next (on its own lane when there is one)
                    if s.busy():
                        try:  # calls in flight: poll their events about every millisecond
                            cmds = [self._inbox.get(timeout=0.001)] + self._drain()
                        except queue.Empty:
                            if not s.finished_any():
                                continue  # nothing new: no scheduling work (the GIL stays free)
                            cmds = []
                    elif s.has_ready():
                        # a call held back by the last round: wake for new frames or when it falls due
                        wait = 0.0 if self._held_until is None else self._held_until - s.clock()
                        if wait > 0:
                            try:
                                cmds = [self._inbox.get(timeout=min(wait, 0.05))] + self._drain()
                            except queue.Empty:
                                cmds = []
                        else:
                            cmds = self._drain()
                    else:
                        cmds = [self._inbox.get()] + self._drain()
                    self._round(cmds)
        except BaseException as e:  # surfaced to the engine by poll()
            self._error = e
