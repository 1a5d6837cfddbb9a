"""TTSService: owns the model bundle (:class:`~shoal.tts.TTS`) and the :class:`AsyncEngine`.

A request goes through four steps, none of which blocks the event loop:

1. ``encode_references`` / ``resolve_voices``: inline reference audio is decoded and encoded
   to codes in a worker thread (codec use serialised by a lock; results cached by content
   hash, so a repeated voice costs nothing and its prompt prefix hits the engine's cache);
2. ``prepare``: text normalisation and the prompt session (tokenisation), in a worker thread;
3. ``start``: the engine request is submitted and its *first event awaited*, so engine-side
   failures (prompt longer than the context, engine down) still become a JSON error before
   any audio byte is sent;
4. :meth:`Synthesis.pcm_chunks` yields the engine's PCM chunks as they arrive; closing the
   :class:`Synthesis` early aborts the engine request and frees its slot and KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..codec.audio import AudioDecodeError, load_audio
from ..engine.async_engine import AsyncEngine, EngineStopped
from ..engine.audio import ChunkSchedule
from ..engine.engine import Engine, EngineConfig
from ..engine.request import AudioEvent, EngineRequest, Event, FinishEvent, FramesEvent, Priority
from ..engine.sampling import SamplingParams
from ..text import Reference, build_session
from ..text.normalize import normalize_text
from ..text.prompt import PromptSession
from ..tts import TTS
from ..voices.store import StoreLimits
from .errors import APIError

log = logging.getLogger("shoal.server")

# an inline reference longer than this is refused from its header, before decoding: the voice
# library's per-sample limit (a prompt fits far less anyway)
MAX_REFERENCE_SECONDS = StoreLimits.max_sample_seconds

# ``latency`` -> audio chunk schedule. Smaller first chunk = earlier first audio, more codec
# calls; later chunks grow to 32 frames (1.49 s) for efficient batched decode. The streaming
# decoder gives the same audio (up to float rounding) for any chunking: latency changes only
# when the audio arrives.
LATENCY_SCHEDULES: dict[str, ChunkSchedule] = {
    "low": ChunkSchedule(first=2, growth=2.0, max_frames=32),  # ~93 ms of audio first
    "balanced": ChunkSchedule(first=4, growth=2.0, max_frames=32),  # ~186 ms
    "normal": ChunkSchedule(first=8, growth=2.0, max_frames=32),  # ~372 ms
}
DEFAULT_LATENCY = "balanced"

# Per-request schedules need ``EngineRequest.audio_schedule`` (see docs/server.md); without
# it every request streams with the engine-wide schedule (the "balanced" one).
PER_REQUEST_SCHEDULE = "audio_schedule" in {f.name for f in dataclasses.fields(EngineRequest)}


def guess_language(text: str) -> str:
    """``zh`` when Han characters outnumber Latin letters, else ``auto`` (English rules, which
    leave other scripts alone). The Fish API carries no language for TTS."""
    han = sum(1 for c in text if "\u4e00" <= c <= "\u9fff" or "\u3400" <= c <= "\u4dbf")
    latin = sum(1 for c in text if c.isascii() and c.isalpha())
    return "zh" if han > latin else "auto"


class ClientDisconnected(Exception):
    """The client went away before the first event; the engine request was aborted."""


class VoiceResolver(Protocol):
    """Turns a ``reference_id`` into the references of one speaker (a voice library)."""

    async def resolve(self, reference_id: str) -> list[Reference]: ...


class NoVoiceLibrary:
    async def resolve(self, reference_id: str) -> list[Reference]:
        raise APIError(404, f"unknown reference_id {reference_id!r}: no voice library is configured "
                            "on this server; send the voice as inline 'references' instead")


@dataclasses.dataclass
class Prepared:
    session: PromptSession
    input_tokens: int  # text tokens of the (normalised) input, for usage accounting
    text: str  # the text the model reads


class Synthesis:
    """One running engine request whose first event is already in hand."""

    def __init__(self, engine: AsyncEngine, request: EngineRequest, agen: AsyncIterator[Event],
                 first: Event) -> None:
        self._engine = engine
        self.request = request
        self._agen = agen
        self._first: Event | None = first
        self.frames = 0
        self.finish: FinishEvent | None = None
        self.audio_samples = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def seed(self) -> int:
        return self.request.seed

    async def pcm_chunks(self) -> AsyncIterator[np.ndarray]:
        """Float32 PCM chunks at the codec rate, in order; raises if the engine fails mid-way."""
        while self.finish is None:
            if self._first is not None:
                ev, self._first = self._first, None
            else:
                ev = await self._agen.__anext__()
            if isinstance(ev, AudioEvent):
                if len(ev.pcm):
                    self.audio_samples += len(ev.pcm)
                    yield ev.pcm
            elif isinstance(ev, FramesEvent):
                self.frames += int(ev.codes.shape[1])
            elif isinstance(ev, FinishEvent):
                self.finish = ev
                if ev.reason == "error":
                    raise RuntimeError(f"generation failed: {ev.error}")

    def abort(self) -> None:
        """Stop the engine request now (idempotent; a no-op once it has finished)."""
        if self.finish is None:
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()
        try:
            await self._agen.aclose()  # type: ignore[attr-defined]
        except RuntimeError:  # still running in a cancelled task: it aborts on its own
            pass


class TTSService:
    def __init__(self, tts: TTS, engine: AsyncEngine, *, resolver: VoiceResolver | None = None,
                 prep_workers: int = 2, audio_workers: int = 4, reference_cache_size: int = 64,
                 model_name: str = "", random_weights: bool = False) -> None:
        self.tts = tts
        self.engine = engine
        self.model_name = model_name  # what /v1/ready reports (a checkpoint path, "random s2-pro")
        # benchmark-only models (``shoal serve --random-model``): <|im_end|> does not end a
        # request, so every request yields exactly its (capped) max_new_tokens frames
        self.random_weights = random_weights
        self.resolver: VoiceResolver = resolver or NoVoiceLibrary()
        self.ready = False
        self._prep = ThreadPoolExecutor(prep_workers, thread_name_prefix="shoal-prep")
        self._audio = ThreadPoolExecutor(audio_workers, thread_name_prefix="shoal-audio")
        self._codec_lock = threading.Lock()
        self._ref_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._ref_cache_size = reference_cache_size
        self._preparing = 0
        self._warm_lock: asyncio.Lock | None = None
        self.started_at = time.time()

    @classmethod
    def load(cls, checkpoint: str | Path, *, device: str | None = None, dtype: str | None = None,
             max_running: int | None = None, max_seq_len: int | None = None,
             resolver: VoiceResolver | None = None, quantization: str | None = None,
             codec_dtype: str | None = None, prefill_chunk: int | None = None,
             kv_cache_dtype: str | None = None, kv_block_size: int | None = None) -> TTSService:
        tts = TTS.load(checkpoint, device=device, dtype=dtype, quantization=quantization,
                       codec_dtype=codec_dtype)
        return cls.from_tts(tts, max_running=max_running, max_seq_len=max_seq_len, resolver=resolver,
                            model_name=str(checkpoint), prefill_chunk=prefill_chunk,
                            kv_cache_dtype=kv_cache_dtype, kv_block_size=kv_block_size)

    @classmethod
    def from_tts(cls, tts: TTS, *, max_running: int | None = None, max_seq_len: int | None = None,
                 resolver: VoiceResolver | None = None, model_name: str = "",
                 random_weights: bool = False, prefill_chunk: int | None = None,
                 kv_cache_dtype: str | None = None, kv_block_size: int | None = None) -> TTSService:
        """A service over a model bundle already in memory (e.g. ``shoal.bench.random_tts``).
        ``kv_cache_dtype``: "auto" (the model's dtype) or "fp8" (docs/quantization.md);
        ``kv_block_size``: the KV-cache page size in tokens (default: the engine's)."""
        if prefill_chunk is not None and prefill_chunk < 16:
            raise ValueError(f"prefill_chunk must be >= 16 tokens, got {prefill_chunk}")
        config = EngineConfig(max_running=max_running, max_seq_len=max_seq_len,
                              audio_schedule=LATENCY_SCHEDULES[DEFAULT_LATENCY], kv_cache_dtype=kv_cache_dtype,
                              **({"prefill_chunk": prefill_chunk} if prefill_chunk else {}),
                              **({"block_size": kv_block_size} if kv_block_size else {}))
        engine = Engine(tts.model, tts.tokenizer.im_end_id, codec=tts.codec, config=config)
        return cls(tts, AsyncEngine(engine), resolver=resolver, model_name=model_name,
                   random_weights=random_weights)

    # ------------------------------------------------------------------ facts
    @property
    def family(self) -> str:
        return self.tts.family

    @property
    def sample_rate(self) -> int:
        return self.tts.sample_rate

    @property
    def max_running(self) -> int:
        return self.engine.engine.max_running

    @property
    def max_seq_len(self) -> int:
        """The engine's context in tokens (one per reference codec frame, among others)."""
        return self.engine.engine.max_seq_len

    @property
    def kv_cache_dtype(self) -> str:
        """The engine's slow KV cache storage: "fp8" or the model's dtype name."""
        from ..checkpoint import dtype_name

        eng = self.engine.engine
        return "fp8" if eng.kv_cache_dtype is not None else dtype_name(eng.model.dtype)

    @property
    def codec_dtype(self) -> dict[str, str] | None:
        """The codec's precisions, ``{"encode": "fp32", "decode": "bf16"}`` (``--codec-dtype``)."""
        from ..checkpoint import dtype_name

        codec = getattr(self.tts, "codec", None)
        if codec is None or not hasattr(codec, "encode_dtype"):
            return None
        return {"encode": dtype_name(codec.encode_dtype), "decode": dtype_name(codec.dtype)}

    def pending(self) -> int:
        """Requests the server holds: preparing (references, prompt) + engine waiting + running."""
        return self._preparing + self.engine.num_waiting + self.engine.num_running

    @contextmanager
    def preparing(self):
        self._preparing += 1
        try:
            yield
        finally:
            self._preparing -= 1

    async def run_audio(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run CPU work (encoding, prosody) for the audio path off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._audio, fn, *args)

    async def _run_prep(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._prep, fn, *args)

    # ------------------------------------------------------------------ warm-up
    async def warmup(self) -> None:
        """Capture graphs (CUDA) and run one tiny request end to end, then mark ready."""
        if self.ready:
            return
        if self._warm_lock is None:
            self._warm_lock = asyncio.Lock()
        async with self._warm_lock:
            if self.ready:
                return
            t = time.perf_counter()
            # graph capture runs on the engine thread, between steps
            await asyncio.wrap_future(self.engine.call(self.engine.engine.warmup, False))
            prepared = await self.prepare("Warm-up.", [], None, normalize=False)
            syn = await self.start(prepared.session, params=SamplingParams(greedy=True), seed=0,
                                   max_new_tokens=2, latency=DEFAULT_LATENCY)
            try:
                async for _ in syn.pcm_chunks():
                    pass
            finally:
                await syn.aclose()
            self.ready = True
            log.info("warm-up done in %.2f s", time.perf_counter() - t)
            mem = self.engine.engine.memory_bytes
            if mem:
                log.info("memory: %s", ", ".join(f"{k} {v / 2 ** 30:.2f} GiB" for k, v in mem.items()))

    # ------------------------------------------------------------------ references
    def _encode_one(self, audio: bytes, where: str) -> np.ndarray:
        key = hashlib.sha256(audio).hexdigest()
        with self._codec_lock:
            hit = self._ref_cache.get(key)
            if hit is not None:
                self._ref_cache.move_to_end(key)
                return hit
        try:
            samples = load_audio(audio, self.sample_rate, max_seconds=MAX_REFERENCE_SECONDS)
        except AudioDecodeError as e:
            raise APIError(400, f"{where}: {e}") from None
        if samples.size < 2048:
            raise APIError(400, f"{where}: audio is too short ({samples.size} samples at "
                                f"{self.sample_rate} Hz)")
        if not np.isfinite(samples).all():  # the codec would turn them into a voice of zeros
            raise APIError(400, f"{where}: the audio decodes to non-finite samples (NaN or infinity)")
        with self._codec_lock:
            codes = self.tts.encode_reference(samples)
            self._ref_cache[key] = codes
            while len(self._ref_cache) > self._ref_cache_size:
                self._ref_cache.popitem(last=False)
        return codes

    async def encode_references(self, groups: Sequence[Sequence[tuple[bytes, str]]],
                                nested: bool = False) -> list[list[Reference]]:
        """Inline references -> :class:`Reference` per speaker group.

        Errors name the reference (``references[2]``, or ``references[1][0]`` when nested).
        Encoding stops at the first reference that takes the codes past the context: every
        codec frame is a prompt token, so such a prompt could only be refused afterwards.
        """
        out: list[list[Reference]] = []
        frames = 0
        for i, group in enumerate(groups):
            refs = []
            for j, (audio, text) in enumerate(group):
                where = f"references[{i}][{j}]" if nested else f"references[{i}]"
                codes = await self._run_prep(self._encode_one, audio, where)
                frames += codes.shape[1]
                if frames >= self.max_seq_len:
                    raise APIError(400, f"{where}: the references so far are {frames} codec frames, more "
                                        f"than the model's context of {self.max_seq_len} tokens holds; "
                                        "send shorter or fewer references")
                refs.append(Reference(text, codes))
            out.append(refs)
        return out

    async def resolve_voices(self, reference_ids: Sequence[str]) -> list[list[Reference]]:
        return [await self.resolver.resolve(rid) for rid in reference_ids]

    @staticmethod
    def speaker_references(groups: Sequence[Sequence[Reference]]) -> list[Reference]:
        """Flatten per-speaker groups; with more than one group each reference text is tagged
        ``<|speaker:i|>`` (unless it carries a tag already), i being its group."""
        from ..text import SPEAKER_TAG_RE

        if len(groups) <= 1:
            return [r for g in groups for r in g]
        flat = []
        for i, group in enumerate(groups):
            for r in group:
                text = r.text if SPEAKER_TAG_RE.search(r.text) else f"<|speaker:{i}|>{r.text}"
                flat.append(Reference(text, r.codes))
        return flat

    # ------------------------------------------------------------------ prompt
    def _prepare_sync(self, text: str, references: list[Reference], chunk_length: int | None,
                      normalize: bool, language: str | None) -> Prepared:
        if normalize:
            text = normalize_text(text, language or guess_language(text))
        if not text.strip():
            raise APIError(400, "text is empty")
        try:
            session = build_session(self.family, self.tts.tokenizer, text, references, chunk_length)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        return Prepared(session, len(self.tts.tokenizer.encode(text)), text)

    async def prepare(self, text: str, references: list[Reference], chunk_length: int | None,
                      normalize: bool = True, language: str | None = None) -> Prepared:
        """``language`` (normalisation only): None = guessed from the script."""
        return await self._run_prep(self._prepare_sync, text, references, chunk_length, normalize,
                                    language)

    # ------------------------------------------------------------------ generation
    async def start(self, session: PromptSession, *, params: SamplingParams, seed: int,
                    max_new_tokens: int, latency: str = DEFAULT_LATENCY,
                    priority: Priority = Priority.INTERACTIVE,
                    disconnected: Callable[[], Awaitable[None]] | None = None) -> Synthesis:
        """Submit the request and wait for its first event (errors -> :class:`APIError`).

        ``disconnected`` (optional) completes when the client goes away; the request is then
        aborted and :class:`ClientDisconnected` raised.
        """
        try:
            params.validate()
        except ValueError as e:
            raise APIError(400, str(e)) from None
        extra: dict[str, Any] = {}
        if PER_REQUEST_SCHEDULE:
            extra["audio_schedule"] = LATENCY_SCHEDULES.get(latency, LATENCY_SCHEDULES[DEFAULT_LATENCY])
        req = EngineRequest(session=session, params=params, seed=seed, max_new_tokens=max_new_tokens,
                            priority=priority, stream_audio=True, ignore_eos=self.random_weights, **extra)
        agen = self.engine.generate(req)
        first_task = asyncio.ensure_future(agen.__anext__())
        watch = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        try:
            waiting = {first_task} | ({watch} if watch is not None else set())
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # our own task was cancelled
            first_task.cancel()
            self.engine.abort(req.request_id)
            raise
        finally:
            if watch is not None and not watch.done():
                watch.cancel()
        if first_task not in done:
            first_task.cancel()
            await asyncio.gather(first_task, return_exceptions=True)
            self.engine.abort(req.request_id)
            raise ClientDisconnected()
        try:
            first = first_task.result()
        except ValueError as e:  # rejected by the engine (e.g. prompt longer than the context)
            raise APIError(400, str(e)) from None
        except EngineStopped as e:
            raise APIError(503, f"the engine is not running: {e}") from None
        except StopAsyncIteration:
            raise APIError(500, "the engine ended the request without an event") from None
        if isinstance(first, FinishEvent) and first.reason == "error":
            raise APIError(400, f"generation failed: {first.error}")
        return Synthesis(self.engine, req, agen, first)

    # ------------------------------------------------------------------ metrics snapshot
    def snapshot(self) -> dict[str, float]:
        eng = self.engine.engine
        pool = eng.pool
        return {
            "waiting": float(self.engine.num_waiting),
            "running": float(self.engine.num_running),
            "preparing": float(self._preparing),
            "frames_total": float(eng.stats.get("frames", 0)),
            "kv_usage": float(pool.usage()),
            "prefix_hit_tokens": float(pool.hit_tokens),
            "prefix_queried_tokens": float(pool.queried_tokens),
            "prefix_hit_rate": float(pool.hit_rate),
            "prefix_copied_tokens": float(pool.copied_tokens),
            "max_running": float(eng.max_running),
            "ready": 1.0 if self.ready else 0.0,
            **{f"memory_bytes.{k}": float(v) for k, v in eng.memory_bytes.items()},
            **self._codec_snapshot(eng),
        }

    @staticmethod
    def _codec_snapshot(eng) -> dict[str, float]:
        if eng.audio is None:
            return {}
        st = eng.audio.streamer.stats
        summ = st.summary()
        nan = float("nan")
        return {"codec_calls_total": float(st.calls), "codec_frames_total": float(st.call_frames),
                "codec_first_chunk_queue_p50_s": (summ["first_chunk_queue_p50_ms"] or nan) / 1e3,
                "codec_first_chunk_queue_p99_s": (summ["first_chunk_queue_p99_ms"] or nan) / 1e3,
                "codec_call_p50_s": (summ["codec_call_p50_ms"] or nan) / 1e3,
                "codec_call_p99_s": (summ["codec_call_p99_ms"] or nan) / 1e3}

    def close(self) -> None:
        self.engine.shutdown()
        self._prep.shutdown(wait=False, cancel_futures=True)
        self._audio.shutdown(wait=False, cancel_futures=True)
