"""The continuous-batching engine: requests in, frames / audio / summaries out.

:class:`Engine` is synchronous: ``add_request`` then call ``step`` until idle; each step
admits, prefills (chunked) and decodes one frame for every running request. The
:class:`AsyncEngine` in ``async_engine.py`` runs it on its own thread, so it owns the device and
callers never block on it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..model.dualar import DualAR
from ..quant.kv import parse_kv_cache_dtype
from .attention import PagedKVCache
from .audio import AudioStreamer, AudioWorker, ChunkSchedule
from .kv_cache import BlockPool
from .request import AudioEvent, EngineRequest, Event, FinishEvent, FramesEvent, Status
from .runner import (
    ModelRunner,
    RunnerConfig,
    default_prefill_buckets,
    prefill_graph_bytes,
)
from .scheduler import Scheduler


@dataclass
class EngineConfig:
    max_running: int | None = None  # default 128 on CUDA, 16 on CPU
    # KV-cache page size in tokens; default 64 on CUDA, 16 on CPU. 64-token pages let the FP8
    # cache's decode attention read a page per tile through TMA (H200, c=64: +4.5% frames/s with
    # an FP8 cache, +1.2-1.7% with bf16, docs/benchmarks.md). Prefix hits do not depend on it:
    # whole pages are shared and a partially shared page is copied (prefix_copy_partial).
    block_size: int | None = None
    num_blocks: int | None = None  # default: from kv_memory_fraction on CUDA; enough on CPU
    kv_memory_fraction: float = 0.85  # of the memory free after weights (CUDA)
    prefill_chunk: int = 1024  # prompt tokens per step
    cuda_graphs: bool = True
    fused_kernels: bool | None = None  # fused Triton decode kernels (default: on CUDA)
    # one Triton kernel per S2 draw (default: on CUDA; env SHOAL_FUSED_SAMPLING=0 turns it off)
    fused_sampling: bool | None = None
    enable_prefix_cache: bool = True
    # a prompt that shares only the first columns of a cached page gets a copy of that page's
    # K/V and skips those columns (prefix hits to the token, not to the page)
    prefix_copy_partial: bool = True
    # a waiting request whose prompt continues with pages an admitted request is computing
    # (a burst cloning one voice) is admitted once they are cached, a prefill step later
    prefix_wait: bool = True
    max_seq_len: int | None = None  # cap the context (default: the model's)
    audio_schedule: ChunkSchedule = field(default_factory=ChunkSchedule)
    audio_thread: bool | None = None  # codec on its own thread/stream (default: on CUDA)
    # streams per codec call (most urgent first); bounds how long a first chunk can wait
    # behind one call of other streams' later chunks; None = one call per chunk size
    audio_max_call_streams: int | None = 32
    # a codec call's spare rows take playing streams holding at least its chunk size of frames
    # (shorter chunks for them, fewer and fuller calls): on an H200 at c=64 it took playback
    # underruns from 57 of 128 streams to none at the same throughput (docs/benchmarks.md);
    # default on, env SHOAL_AUDIO_FILL=0 turns it off
    audio_fill_calls: bool | None = None
    # hold back a codec call of later chunks while it has fewer than audio_hold_streams streams
    # (default: audio_max_call_streams) and each still has audio_hold_s seconds of audio to play,
    # so calls are fuller and cheaper per frame; first chunks and last chunks are never held.
    # On an H200 at c=64 (0.5 s) it gave +2.6-3.0% frames/s with audio out, the same first
    # audio and no underruns (docs/benchmarks.md). None = env SHOAL_AUDIO_HOLD_S (default 0.5;
    # 0 turns it off) / SHOAL_AUDIO_HOLD_STREAMS
    audio_hold_s: float | None = None
    audio_hold_streams: int | None = None
    # confine the codec's stream to this many SMs (a CUDA green context,
    # shoal.engine.sm_partition), so its convolutions never hold the SMs the decode step needs;
    # None = env SHOAL_AUDIO_SMS (unset or 0: an ordinary stream that may use every SM)
    audio_sms: int | None = None
    # a starting stream's chunks on a codec lane of their own (second decoder and CUDA stream),
    # so its first audio never waits behind a long call of later chunks. Off by default: on an
    # H200 at c=64 it cut first audio p50 (shared voices) from ~206 to 144-176 ms but gave
    # 27-50 of 128 streams playback underruns (docs/benchmarks.md); needs the threaded worker
    # on CUDA; env SHOAL_AUDIO_FIRST_LANE=1 turns it on
    audio_first_lane: bool | None = None
    # how many of a stream's first chunks take the first lane (env SHOAL_AUDIO_FIRST_LANE_CHUNKS)
    audio_first_lane_chunks: int | None = None
    # keep one decode step in flight: the host reads step N while the device runs step N+1
    # (default on; env SHOAL_DECODE_OVERLAP=0 turns it off)
    overlap_decode: bool | None = None
    # prefill steps replay CUDA graphs captured per token bucket (64 ... min(prefill_chunk,
    # 2048)); default on with cuda_graphs on CUDA; env SHOAL_PREFILL_GRAPHS=0 turns it off
    prefill_graphs: bool | None = None
    # slow KV cache storage: "auto" (the model's dtype) or "fp8" (e4m3 with one fp32 scale per
    # token and KV head, shoal.quant.kv: half the bytes the decode attention reads, twice the
    # tokens per GiB; not faster on an H200, docs/benchmarks.md); None = "auto". The CLIs take
    # --kv-cache-dtype or env SHOAL_KV_CACHE_DTYPE (shoal.quant.kv.kv_cache_dtype_arg)
    kv_cache_dtype: str | None = None


def _tensor_bytes(module) -> int:
    """Bytes of a module's parameters and buffers (each storage counted once)."""
    seen: set[tuple[int, int]] = set()
    n = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device.type == "meta":
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key in seen:
            continue
        seen.add(key)
        n += t.untyped_storage().nbytes()
    return n


def _env_flag(name: str, default: bool) -> bool:
    """An on/off environment switch: unset or empty gives ``default``; 0/false/no/off are off."""
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value not in ("0", "false", "no", "off")


def _fused_sampling(cfg: EngineConfig, model: DualAR) -> bool:
    """The fused S2 sampling kernels: S2 models on CUDA unless configured or SHOAL_FUSED_SAMPLING=0."""
    from ..kernels.sampling import HAS_TRITON

    if model.config.family != "s2" or model.dtype not in (torch.bfloat16, torch.float32):
        return False  # the kernels implement the S2 rule for bf16 / fp32 logits
    if cfg.fused_sampling is not None:
        return cfg.fused_sampling
    return (HAS_TRITON and model.device.type == "cuda"
            and os.environ.get("SHOAL_FUSED_SAMPLING", "1") != "0")


class Engine:
    def __init__(self, model: DualAR, im_end_id: int, codec=None,
                 config: EngineConfig | None = None) -> None:
        cfg = config or EngineConfig()
        self.model = model
        self.im_end_id = im_end_id
        dev = model.device
        on_cuda = dev.type == "cuda"
        if cfg.block_size is None:
            cfg = dataclasses.replace(cfg, block_size=64 if on_cuda else 16)
        elif cfg.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {cfg.block_size}")
        self.config = cfg
        max_running = cfg.max_running or (128 if on_cuda else 16)
        if cfg.fused_kernels if cfg.fused_kernels is not None else on_cuda:
            model.enable_fused_kernels()
        self.max_seq_len = min(cfg.max_seq_len or model.config.max_seq_len, model.config.max_seq_len)
        max_blocks_per_seq = -(-self.max_seq_len // cfg.block_size)
        self.prefill_graphs = bool(cfg.cuda_graphs and on_cuda and (
            cfg.prefill_graphs if cfg.prefill_graphs is not None
            else os.environ.get("SHOAL_PREFILL_GRAPHS", "1") != "0"))
        self.prefill_buckets = default_prefill_buckets(cfg.prefill_chunk)
        self.audio: AudioWorker | None = None
        # GPU memory by part, bytes (Engine.memory_bytes; /metrics shoal_memory_bytes{part})
        self._memory: dict[str, int] = {"model_weights": _tensor_bytes(model)}
        if codec is not None:
            r0 = torch.cuda.memory_reserved(dev) if on_cuda else 0
            threaded = (cfg.audio_thread if cfg.audio_thread is not None
                        else os.environ.get("SHOAL_AUDIO_THREAD", "1" if on_cuda else "0") != "0")
            fill = cfg.audio_fill_calls
            if fill is None:
                fill = _env_flag("SHOAL_AUDIO_FILL", True)
            first_lane = cfg.audio_first_lane
            if first_lane is None:
                first_lane = threaded and on_cuda and _env_flag("SHOAL_AUDIO_FIRST_LANE", False)
            lane_chunks = cfg.audio_first_lane_chunks or int(os.environ.get("SHOAL_AUDIO_FIRST_LANE_CHUNKS", "2"))
            hold_s = cfg.audio_hold_s
            if hold_s is None:
                hold_s = float(os.environ.get("SHOAL_AUDIO_HOLD_S", "0.5") or 0)
            hold_streams = cfg.audio_hold_streams or int(os.environ.get("SHOAL_AUDIO_HOLD_STREAMS", "0") or 0)
            streamer = AudioStreamer(codec, max_running, cfg.audio_schedule, cfg.audio_max_call_streams,
                                     fill_calls=fill, first_lane=first_lane, first_lane_chunks=lane_chunks,
                                     hold_s=hold_s, hold_streams=hold_streams or cfg.audio_max_call_streams or 32)
            sms = cfg.audio_sms
            if sms is None:
                sms = int(os.environ.get("SHOAL_AUDIO_SMS", "0") or 0)
            # before the warm-up: graphs captured on a partition stream stay in the partition
            self.audio = AudioWorker(streamer, threaded, sms=sms or None)
            # after the streamer set the serving layout (stride-1 conv weights are then views of
            # their packed form: counted here; the transposed convs' packed copies are not)
            self._memory["codec_weights"] = _tensor_bytes(codec)
            if on_cuda and cfg.num_blocks is None:
                # the codec's graphs and workspaces are allocated before the KV pool takes its
                # share of the free memory (lazily captured graphs ran the GPU out of memory)
                streamer.warmup()
                torch.cuda.empty_cache()  # the eager warm-up calls' blocks go back before sizing
                # what serving audio holds beyond the codec's weights: stream slots, packed
                # conv weights, graph pools, workspaces (every graph is captured by now)
                self._memory["codec_streamer"] = max(0, torch.cuda.memory_reserved(dev) - r0)
        self.kv_cache_dtype = parse_kv_cache_dtype(cfg.kv_cache_dtype)
        num_blocks = cfg.num_blocks or self._auto_blocks(max_running, max_blocks_per_seq)
        self._memory["kv_cache"] = num_blocks * self._kv_block_bytes()
        self.pool = BlockPool(num_blocks, cfg.block_size, enable_prefix_cache=cfg.enable_prefix_cache,
                              copy_partial=cfg.prefix_copy_partial)
        self.runner = ModelRunner(model, im_end_id, RunnerConfig(
            max_slots=max_running, num_blocks=num_blocks, block_size=cfg.block_size,
            max_blocks_per_seq=max_blocks_per_seq, cuda_graphs=cfg.cuda_graphs and on_cuda,
            fused_sampling=_fused_sampling(cfg, model), prefill_graphs=self.prefill_graphs,
            prefill_buckets=self.prefill_buckets, kv_cache_dtype=self.kv_cache_dtype))
        if on_cuda:  # kernels that fail to compile or disagree on this GPU are not used
            self.runner.verify_fused_sampling()
        self.scheduler = Scheduler(self.pool, max_running, cfg.prefill_chunk, wait_for_prefix=cfg.prefix_wait)
        self._audio_pending: dict[str, tuple[EngineRequest, str]] = {}  # finished, audio not yet out
        self.requests: dict[str, EngineRequest] = {}
        self.max_running = max_running
        self.stats = {"steps": 0, "frames": 0, "prefill_tokens": 0, "preemptions": 0,
                      "finished": 0, "decode_s": 0.0, "prefill_s": 0.0, "audio_s": 0.0}
        self._last_block_count: dict[str, int] = {}
        # the decode step launched last and not yet read: (requests, their decode_gen, handle)
        self._inflight: tuple[list[EngineRequest], list[int], object] | None = None
        self.overlap_decode = (cfg.overlap_decode if cfg.overlap_decode is not None
                               else os.environ.get("SHOAL_DECODE_OVERLAP", "1") != "0")

    @property
    def memory_bytes(self) -> dict[str, int]:
        """GPU (or, on CPU, host) memory by part: ``model_weights`` (the DualAR's parameters
        and buffers), ``codec_weights`` (both codec sides), ``codec_streamer`` (CUDA, when the
        codec warmed up at start: stream slots, packed conv weights, CUDA-graph pools and
        workspaces, measured as reserved memory) and ``kv_cache`` (the paged pool)."""
        return dict(self._memory)

    def _kv_block_bytes(self) -> int:
        s = self.model.config.slow
        return PagedKVCache.bytes_per_block(s.n_layer, self.config.block_size, s.n_local_heads, s.head_dim,
                                            self.model.dtype, self.kv_cache_dtype)

    def _auto_blocks(self, max_running: int, max_blocks_per_seq: int) -> int:
        cfg = self.config
        per_block = self._kv_block_bytes()
        if self.model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.model.device)
            reserve = 6 << 30  # activations, LLM graphs, codec eager fallbacks
            if self.prefill_graphs:  # the prefill graphs' pool is held beside eager activations
                reserve += prefill_graph_bytes(self.model.config, max(self.prefill_buckets),
                                               self.model.dtype.itemsize)
            return max(int((free - reserve) * cfg.kv_memory_fraction) // per_block, 2 * max_blocks_per_seq)
        # CPU: room for every slot at 1/4 of the context, capped at 256 MiB
        want = max_running * max(max_blocks_per_seq // 4, 4)
        return max(min(want, (256 << 20) // per_block), max_blocks_per_seq + 1)

    def warmup(self, show_progress: bool = True, prefill: bool | None = None) -> None:
        """Capture the decode graphs and the prefill graphs (and the codec's), then
        (``prefill``, default on CUDA) run
        throw-away prefills of lengths that cover every launch-config bucket and Triton
        specialization of the prefill kernels, so no kernel compiles while serving (a cold FP8
        prefill compiled its GEMM variants inside the first requests)."""
        self.runner.capture_graphs(show_progress)
        if self.audio is not None:
            self.audio.streamer.warmup()  # no-op when already captured (or on CPU)
        if prefill if prefill is not None else self.model.device.type == "cuda":
            self.warm_prefill()

    def warm_prefill(self) -> None:
        from .request import GridSession

        if self.requests:  # never step real requests here (their events would be lost)
            return
        cfg = self.model.config
        chunk = self.config.prefill_chunk
        lengths = sorted({n for n in (7, 10, 16, 20, 32, 33, 64, 100, 128, 300, chunk - 3, chunk)
                          if 2 <= n < self.max_seq_len})
        saved = dict(self.stats)
        for i, n in enumerate(lengths):
            grid = np.zeros((cfg.num_codebooks + 1, n), dtype=np.int64)
            text_ids = min(cfg.semantic_begin_id or cfg.vocab_size, cfg.vocab_size)
            grid[0] = (np.arange(n) * 7919 + 104729 * (i + 1)) % text_ids  # plain text ids
            self.add_request(EngineRequest(session=GridSession(grid), prefill_only=True,
                                           request_id=f"__warm_prefill_{i}"))
            self.run_until_done()
        self.stats = saved
        self.pool.reset_prefix_cache()  # no warm-up blocks stay cached
        self.pool.reset_stats()

    # ------------------------------------------------------------------ requests
    def add_request(self, req: EngineRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id}")
        req.params.validate()
        if req.params.ras_window > 16:
            raise ValueError("ras_window must be <= 16")
        if req.stream_audio and self.audio is None:
            raise ValueError("audio streaming needs an engine with a codec")
        if req.audio_schedule is not None:
            req.audio_schedule.validate()
        self._start_batch(req)
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def _start_batch(self, req: EngineRequest) -> None:
        grid = req.session.grid()
        T = grid.shape[1]
        if T < 2:
            raise ValueError("prompt must have at least 2 tokens")
        if T >= self.max_seq_len:
            raise ValueError(f"prompt has {T} tokens but the context is {self.max_seq_len}")
        # a sequence larger than the whole KV pool could never be admitted (and would block
        # the queue behind it): reject it, and stop generation before it outgrows the pool
        capacity = self.pool.num_blocks * self.pool.block_size
        if T >= capacity:
            raise ValueError(f"prompt has {T} tokens but the KV cache holds {capacity} "
                             "(a shorter prompt, or more free GPU memory for the cache)")
        room = min(self.max_seq_len, capacity) - T
        req.grid = grid
        req.prompt_len = T
        req.budget = room if not req.max_new_tokens else min(req.max_new_tokens, room)
        req.new_columns = []
        req.ras_window = []
        req.num_computed = 0

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            req.cancelled = True

    def has_work(self) -> bool:
        return bool(self.requests) or bool(self._audio_pending) or self._inflight is not None

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _full(req: EngineRequest) -> np.ndarray:
        if not req.new_columns:
            return req.grid
        return np.concatenate([req.grid, np.stack(req.new_columns, axis=1)], axis=1)

    def _sequence(self, req: EngineRequest) -> np.ndarray:
        """Grid columns to prefill: everything but the last column (prompt + generated so far),
        which is the next decode input. A fresh batch's first frame is thus sampled by the
        batched decode step, exactly like a request resumed after preemption."""
        return self._full(req)[:, :-1]

    def _sync_blocks(self, req: EngineRequest) -> None:
        table = self.pool.block_table(req.request_id)
        known = self._last_block_count.get(req.request_id, -1)
        if known == -1 or len(table) < known:
            self.runner.set_block_table(req.slot, table)
        else:
            for i in range(known, len(table)):
                self.runner.set_block(req.slot, i, table[i])
        self._last_block_count[req.request_id] = len(table)

    def _finish(self, req: EngineRequest, reason: str, events: list[Event], error: str | None = None) -> None:
        self.scheduler.remove(req)
        req.invalidate_pending()
        self._last_block_count.pop(req.request_id, None)
        self.requests.pop(req.request_id, None)
        req.status = Status.FINISHED
        req.finish_time = time.perf_counter()
        if self.audio is not None and req.stream_audio:
            if reason in ("cancelled", "error"):
                self.audio.release(req.request_id)
            else:  # the summary follows the request's last audio chunk
                self.audio.finish(req.request_id)
                self._audio_pending[req.request_id] = (req, reason)
                return
        events.append(self._finish_event(req, reason, error))

    def _finish_event(self, req: EngineRequest, reason: str, error: str | None = None) -> FinishEvent:
        codes = np.concatenate(req.all_codes, axis=1) if req.all_codes else np.zeros((10, 0), np.int64)
        timings = {"queued_to_first_frame_s": (req.first_frame_time or req.finish_time) - req.arrival,
                   "total_s": req.finish_time - req.arrival, "frames": float(codes.shape[1]),
                   "preemptions": float(req.preemptions)}
        if req.first_audio_time is not None:
            timings["first_audio_s"] = req.first_audio_time - req.arrival
        self.stats["finished"] += 1
        return FinishEvent(req.request_id, reason, codes, timings, error)

    def _on_column(self, req: EngineRequest, col: np.ndarray, first_of_batch: bool,
                   events: list[Event]) -> None:
        """Book-keep one generated column; may end the text batch or the request."""
        now = time.perf_counter()
        if req.first_frame_time is None:
            req.first_frame_time = now
        req.new_columns.append(col)
        req.frames_total += 1
        eos = int(col[0]) == self.im_end_id and not req.ignore_eos
        if not eos:
            self.stats["frames"] += 1
            if not first_of_batch:  # allowed-space index, as the device window holds it
                mc = self.model.config
                tok = int(col[0])
                req.ras_window.append(tok - mc.semantic_begin_id if tok != self.im_end_id else mc.codebook_size)
            frame = col[1:, None].astype(np.int64)
            events.append(FramesEvent(req.request_id, frame, req.batch_index))
            if self.audio is not None and req.stream_audio:
                self.audio.push(req.request_id, frame, req.audio_schedule)
        if eos or len(req.new_columns) >= req.budget:
            kept = req.new_columns[:-1] if eos else req.new_columns
            codes = np.stack(kept, axis=1)[1:] if kept else np.zeros((10, 0), np.int64)
            req.all_codes.append(codes)
            req.session.commit(codes)
            if req.session.done():
                self._finish(req, "eos" if eos else "length", events)
            else:  # next text batch: its prompt extends this one, so the prefix cache hits
                self.scheduler.remove(req)
                req.invalidate_pending()
                self._last_block_count.pop(req.request_id, None)
                req.batch_index += 1
                try:
                    self._start_batch(req)
                except ValueError as e:  # the dialogue outgrew the context: end this request only
                    self.requests[req.request_id] = req
                    self._finish(req, "error", events, error=str(e))
                    return
                self.scheduler.add(req)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[Event]:
        events: list[Event] = []
        for req in [r for r in self.requests.values() if r.cancelled]:
            self._finish(req, "cancelled", events)
        plan = self.scheduler.schedule(self._sequence)
        copies = self.pool.take_copies()
        if copies:  # partial-page prefix hits: before any forward touches those pages
            self.runner.copy_kv_blocks(copies)
        self.stats["preemptions"] += len(plan.preempted)
        for req in plan.preempted:
            self._last_block_count.pop(req.request_id, None)
        runner = self.runner
        t0 = time.perf_counter()
        chunks, full_seqs = [], []
        for req, start, end in plan.prefill:
            if req.request_id not in self._last_block_count:  # first chunk since admission
                runner.assign_slot(req.slot, req.params, req.seed)
            self._sync_blocks(req)
            full = self._full(req)
            full_seqs.append(full)
            if end > start:
                chunks.append((full[:, :-1], start, end, self.pool.block_table(req.request_id), req.slot))
        with torch.inference_mode():
            runner.prefill(chunks)
        for (req, start, end), full in zip(plan.prefill, full_seqs):
            seq = full[:, :-1]  # what was prefilled: everything but the next decode input
            if end > start:
                self.pool.commit_tokens(req.request_id, seq[:, start:end])
            self.stats["prefill_tokens"] += end - start
            req.num_computed = end
            if end < seq.shape[1]:
                continue
            if req.prefill_only:  # realtime warm-up: the prompt's full blocks stay cached
                self._finish(req, "prefilled", events)
                continue
            req.status = Status.DECODE
            gen = np.stack(req.new_columns, axis=1) if req.new_columns else None
            hist = gen[1:, 1:] if gen is not None and gen.shape[1] > 1 else None
            runner.set_decode_state(req.slot, full[:, -1], full.shape[1] - 1, req.frames_total,
                                    req.ras_window, hist, first=not req.new_columns)
            req.last_input = full[:, -1]
        t1 = time.perf_counter()
        decode = [r for r in plan.decode if r.status is Status.DECODE and r.request_id in self.requests
                  and r.slot is not None]
        launched = None
        if decode:  # launch this step, then read the previous one while the device runs it
            for req in decode:
                self._sync_blocks(req)
                req.pending += 1
            launched = (decode, [r.decode_gen for r in decode], runner.launch_decode([r.slot for r in decode]))
        if self._inflight is not None:
            self._read_columns(*self._inflight, events)
        self._inflight = launched
        if launched is not None and not self.overlap_decode:
            self._read_columns(*launched, events)
            self._inflight = None
        t2 = time.perf_counter()
        if self.audio is not None:
            events.extend(self._audio_events())
        t3 = time.perf_counter()
        self.stats["steps"] += 1
        self.stats["prefill_s"] += t1 - t0
        self.stats["decode_s"] += t2 - t1
        self.stats["audio_s"] += t3 - t2
        return events

    def _read_columns(self, decode: list[EngineRequest], gens: list[int], handle, events: list[Event]) -> None:
        """Book-keep the columns of a finished decode step. A request preempted, finished or
        moved to its next text batch after the launch drops its column: its state no longer
        includes that step (a resumed request samples the same frame again: counter noise)."""
        cols = self.runner.collect_decode(handle)
        for req, gen, col in zip(decode, gens, cols):
            if req.decode_gen != gen or self.requests.get(req.request_id) is not req:
                continue
            req.pending -= 1
            self.pool.commit_tokens(req.request_id, req.last_input[:, None])
            req.last_input = col
            self._on_column(req, col, not req.new_columns, events)

    def _audio_events(self) -> list[Event]:
        out: list[Event] = []
        idle = not self.requests and bool(self._audio_pending)
        for item in self.audio.poll(timeout=0.01 if idle else 0.0):
            rid = item[1]
            pending = self._audio_pending.get(rid)
            req = self.requests.get(rid) or (pending[0] if pending else None)
            if item[0] == "audio":
                if req is None:  # its request already ended (e.g. failed): no audio after the summary
                    continue
                if req.first_audio_time is None:
                    req.first_audio_time = time.perf_counter()
                out.append(AudioEvent(rid, item[2], self.audio.sample_rate))
            elif item[0] == "error":  # the codec failed on this request's audio
                if rid in self.requests:
                    self._finish(self.requests[rid], "error", out, error=item[2])
                elif pending is not None:
                    del self._audio_pending[rid]
                    out.append(self._finish_event(pending[0], "error", item[2]))
            elif pending is not None:  # "done": the request's audio is all out
                del self._audio_pending[rid]
                out.append(self._finish_event(pending[0], pending[1]))
        return out

    def run_until_done(self) -> list[Event]:
        events: list[Event] = []
        while self.has_work():
            events.extend(self.step())
        return events
