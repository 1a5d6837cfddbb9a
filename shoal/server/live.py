"""``WS /v1/tts/live``: Fish Audio's live (WebSocket) text to speech.

Protocol (docs/live.md; Fish API spec §5): every frame, both ways, is one **binary** MessagePack
map with an ``event`` key. The client sends ``start{request}`` (a ``/v1/tts`` request body, its
``text`` normally empty), then any number of ``text{text}`` / ``flush``, then ``stop``. The
server answers ``audio{audio: bin}`` frames as the audio is generated and ends every socket with
exactly one ``finish{reason: "stop" | "error", message?}`` (then closes: 1000 after ``stop``).

How a socket is served:

* **handshake**: the same admission as ``POST /v1/tts`` (bearer key 401, warming up 503,
  overload 503, per-key concurrency 429: a socket holds one slot of its key for its lifetime),
  answered as an HTTP denial response before the upgrade when the server supports it;
* **start**: the request is validated like ``/v1/tts`` (errors -> ``finish{error}``); inline
  references are encoded (or ``reference_id`` resolved); then a *prefill-only* engine request
  (``Priority.REALTIME``) computes the K/V of the voice prefix, the part of the prompt that
  does not depend on the text (:func:`voice_prefix_grid`), into the engine's prefix cache
  before any text arrives, so time to first audio is the text's prefill + decode only;
* **text**: buffered and cut into segments (:class:`TextSegmenter`) at sentence ends, when the
  buffer passes ``chunk_length`` UTF-8 bytes, or on ``flush``/``stop``; each segment is one
  engine request (REALTIME, the socket's seed and sampling parameters) whose PCM goes through
  the segment's prosody and the socket's single encoder and streams back as ``audio`` frames
  while more text keeps arriving. Segments are synthesised strictly in order; the next
  ``lookahead`` segments are submitted while the current one streams (their audio waits in
  their engine queues), but audio of two segments is never interleaved;
* the event loop never blocks: model work runs in the engine thread, prompts and references in
  the service's prep threads, encoding and prosody in its audio threads; uvicorn answers pings
  throughout;
* a disconnect, an error or an idle timeout aborts every engine request of the socket.

A segment's audio equals ``POST /v1/tts`` for the segment's text with the same seed and
parameters (its prosody runs per segment, like a request's); the socket's audio is one stream
in ``format`` (one WAV header, one MP3/Ogg stream).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ormsgpack
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError
from starlette.responses import JSONResponse

from ..engine.async_engine import EngineStopped
from ..engine.request import EngineRequest, FinishEvent, GridSession, Priority
from ..text import SPEAKER_TAG_RE, Reference, build_session, encode_parts
from ..text.prompt import TextPart, VQPart
from .errors import APIError, error_body, error_response, format_validation_errors
from .limits import check_text_length
from .output import AudioPipeline, ProsodySpec
from .prosody import ProsodyProcessor
from .schemas import TTSRequestIn
from .service import Synthesis, TTSService
from .state import ServerState, request_seed, sampling_params

log = logging.getLogger("shoal.server.live")

router = APIRouter()
ROUTE = "/v1/tts/live"

# close codes after the finish frame
CLOSE_NORMAL = 1000  # after finish{stop}
CLOSE_UNSUPPORTED = 1003  # a text frame
CLOSE_POLICY = 1008  # bad request / protocol violation / idle timeout
CLOSE_INTERNAL = 1011  # server-side failure


# ---------------------------------------------------------------------- settings
@dataclass(frozen=True)
class LiveConfig:
    """Settings of the live route. Set ``app.state.live_config`` to override; otherwise read
    from the environment (``SHOAL_LIVE_IDLE_TIMEOUT`` seconds, ``SHOAL_LIVE_LOOKAHEAD``)."""

    idle_timeout_s: float = 60.0  # no client event while nothing is generating -> finish{error}
    lookahead: int = 1  # segments submitted to the engine ahead of the one streaming (0 = serial)
    prefill_on_start: bool = True  # prefill the voice prefix at `start`

    @classmethod
    def from_env(cls) -> LiveConfig:
        return cls(idle_timeout_s=float(os.environ.get("SHOAL_LIVE_IDLE_TIMEOUT", cls.idle_timeout_s)),
                   lookahead=int(os.environ.get("SHOAL_LIVE_LOOKAHEAD", cls.lookahead)))

    def validate(self) -> None:
        if not self.idle_timeout_s > 0:
            raise ValueError("idle_timeout_s must be > 0")
        if self.lookahead < 0:
            raise ValueError("lookahead must be >= 0")


def live_config(app) -> LiveConfig:
    cfg = getattr(app.state, "live_config", None)
    if cfg is None:
        cfg = LiveConfig.from_env()
        cfg.validate()
        app.state.live_config = cfg
    return cfg


# ---------------------------------------------------------------------- text segmentation
_IMMEDIATE_ENDS = frozenset("。！？；…\n")  # a sentence end wherever it is
_ASCII_ENDS = frozenset(".!?")  # a sentence end before whitespace, or at the end of the buffer
_CLOSERS = frozenset("\"')]}”’»」』）")  # kept with the sentence they close
_SOFT_BREAKS = frozenset(",;:，、；：")  # preferred cut points of an over-long buffer


class TextSegmenter:
    """Cuts streamed text into synthesis segments (stripped; whitespace-only ones dropped).

    A segment ends at a sentence end: ``。！？；…`` or a newline wherever they are, or ``.!?``
    (runs like ``?!`` or ``...``, plus closing quotes/brackets) followed by whitespace or at the
    end of the buffer; a ``.`` right after a digit at the end of the buffer waits for the next
    text (``3.`` may become ``3.14``). A buffer longer than ``max_bytes`` UTF-8 bytes is cut at
    the last ``,;:`` or space within the limit (else at the limit). :meth:`flush` returns the
    rest. In an S2 dialogue (``<|speaker:N|>`` tags) a segment that does not start with a tag
    is given the tag of the speaker still talking.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self.buffer = ""
        self.speaker: str | None = None  # the last <|speaker:N|> tag seen

    def feed(self, text: str) -> list[str]:
        self.buffer += text
        out: list[str] = []
        while True:
            cut = self._sentence_end()
            if cut is None and len(self.buffer.encode("utf-8")) > self.max_bytes:
                cut = self._soft_cut()
            if cut is None:
                return out
            seg, self.buffer = self.buffer[:cut], self.buffer[cut:]
            seg = self._tagged(seg)
            if seg:
                out.append(seg)

    def flush(self) -> list[str]:
        seg, self.buffer = self._tagged(self.buffer), ""
        return [seg] if seg else []

    def _tagged(self, seg: str) -> str:
        """Strip; a dialogue's segment without a leading speaker tag gets the current speaker's."""
        seg = seg.strip()
        if not seg:
            return seg
        tags = SPEAKER_TAG_RE.findall(seg)
        if self.speaker is not None and not SPEAKER_TAG_RE.match(seg):
            seg = self.speaker + seg
        if tags:
            self.speaker = tags[-1]
        return seg

    def _sentence_end(self) -> int | None:
        buf = self.buffer
        n = len(buf)
        i = 0
        while i < n:
            ch = buf[i]
            if ch in _IMMEDIATE_ENDS:
                j = i + 1
                while j < n and (buf[j] in _CLOSERS or buf[j] in _IMMEDIATE_ENDS):
                    j += 1
                return j
            if ch in _ASCII_ENDS:
                j = i + 1
                while j < n and buf[j] in _ASCII_ENDS:
                    j += 1
                while j < n and buf[j] in _CLOSERS:
                    j += 1
                if j == n:
                    if buf[j - 1] == "." and j >= 2 and buf[j - 2].isdigit():
                        return None  # "3." may continue as "3.14"
                    return j
                if buf[j].isspace():
                    return j
                i = j
                continue
            i += 1
        return None

    def _soft_cut(self) -> int:
        buf = self.buffer
        size, limit = 0, 0
        for k, ch in enumerate(buf):  # longest prefix within max_bytes
            size += len(ch.encode("utf-8"))
            if size > self.max_bytes:
                break
            limit = k + 1
        limit = max(limit, 1)
        for k in range(limit - 1, 0, -1):
            if buf[k] in _SOFT_BREAKS and (k + 1 >= len(buf) or buf[k + 1].isspace()):
                return k + 1
        for k in range(limit, 0, -1):
            if k < len(buf) and buf[k].isspace():
                return k
        return limit


def has_speech(text: str) -> bool:
    """A segment with no letter or digit (``...``, ``!?``) is not synthesised."""
    return any(ch.isalnum() for ch in text)


# ---------------------------------------------------------------------- the voice prefix
def _same_part(a, b) -> bool:
    if isinstance(a, TextPart) and isinstance(b, TextPart):
        return a.text == b.text
    if isinstance(a, VQPart) and isinstance(b, VQPart):
        return a.codes.shape == b.codes.shape and bool(np.array_equal(a.codes, b.codes))
    return False


def voice_prefix_grid(family: str, tokenizer, references: Sequence[Reference],
                      chunk_length: int | None = None) -> np.ndarray:
    """The prompt columns that do not depend on the text: ``int64 [1 + C, L]``.

    Every prompt part is tokenised on its own, so the grid of any text starts with the columns
    of the parts that two prompts for different texts share: for S2 the system message
    (instruction, reference transcripts, reference codes) and the ``<|im_start|>user\\n``
    header; for S1 everything up to the last ``<|speaker:0|>``.
    """
    a = build_session(family, tokenizer, "a", references, chunk_length).parts()
    b = build_session(family, tokenizer, "b", references, chunk_length).parts()
    n = 0
    while n < min(len(a), len(b)) and _same_part(a[n], b[n]):
        n += 1
    return encode_parts(tokenizer, a[:n])


# ---------------------------------------------------------------------- errors
class LiveError(Exception):
    """Ends the socket with ``finish{reason: "error", message}`` and a close code."""

    def __init__(self, message: str, status: int = 400, code: int = CLOSE_POLICY) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code

    @classmethod
    def from_api(cls, e: APIError) -> LiveError:
        return cls(e.message, e.status, CLOSE_INTERNAL if e.status >= 500 else CLOSE_POLICY)


class _Gone(Exception):
    """The client went away (a send failed or a disconnect arrived)."""


# what a send to a client that went away raises (Starlette: WebSocketDisconnect for an
# OSError underneath; RuntimeError once the socket is closed)
_SEND_ERRORS = (WebSocketDisconnect, OSError, RuntimeError)

_STOP = object()
_DRAIN = object()  # after a flush: push the encoder's held tail out when nothing follows

# Silence (input samples, 44.1 kHz) that pushes every real sample out of a streaming encoder:
# LAME holds ~110 ms, AAC ~50 ms, Opus ~25 ms, FLAC a 4096-sample block, a resampler a few ms.
# Fed only after a `flush` with nothing queued behind it (docs/live.md), never for pcm/wav at
# the model's rate (nothing is held).
DRAIN_PAD = {"mp3": 6144, "aac": 3072, "opus": 2048, "flac": 4096}
DRAIN_PAD_RESAMPLED = 2048


# ---------------------------------------------------------------------- one socket
class LiveSession:
    def __init__(self, ws: WebSocket, state: ServerState, cfg: LiveConfig) -> None:
        self.ws = ws
        self.state = state
        self.service: TTSService = state.service
        self.cfg = cfg
        self.send_lock = asyncio.Lock()
        self.finished = False  # a finish frame went out (or the socket is closed)
        self.started = False
        self.stopped = False
        self.body: TTSRequestIn | None = None
        self.segmenter: TextSegmenter | None = None
        self.segments: asyncio.Queue = asyncio.Queue()  # str | _STOP, in order
        self.outstanding = 0  # segments queued or being synthesised
        self.idle_since = time.monotonic()
        self.worker: asyncio.Task | None = None
        self.prefill: asyncio.Task | None = None
        self.starts: set[asyncio.Task] = set()  # segment submissions in flight
        self.synths: set[Synthesis] = set()
        self.t_first_text: float | None = None
        self.first_audio_sent = False
        self.audio_bytes = 0
        self.fed_samples = 0
        self.drained_at = 0
        # filled by start / setup
        self.pipeline: AudioPipeline | None = None
        self.prosody: ProsodySpec | None = None
        self.references: list[Reference] = []
        self.params = None
        self.seed = 0

    # -------------------------------------------------------------- sending
    async def send(self, event: dict[str, Any]) -> None:
        data = ormsgpack.packb(event)
        async with self.send_lock:
            if self.finished:
                raise _Gone()
            try:
                await self.ws.send_bytes(data)
            except _SEND_ERRORS:
                self.finished = True
                raise _Gone() from None

    async def send_audio(self, data: bytes) -> None:
        await self.send({"event": "audio", "audio": data})
        self.audio_bytes += len(data)
        if not self.first_audio_sent:
            self.first_audio_sent = True
            if self.t_first_text is not None:
                self.state.metrics.live_ttfa.observe(time.perf_counter() - self.t_first_text)

    async def finish(self, reason: str, code: int, message: str | None = None,
                     status: int | None = None) -> None:
        """The one finish frame, then close (no-op once finished)."""
        event: dict[str, Any] = {"event": "finish", "reason": reason}
        if message is not None:
            event["message"] = message
        if status is not None:
            event["status"] = status
        async with self.send_lock:
            if self.finished:
                return
            self.finished = True
            try:
                await self.ws.send_bytes(ormsgpack.packb(event))
                await self.ws.close(code)
            except _SEND_ERRORS:
                log.debug("live socket: the client left before the finish frame")

    # -------------------------------------------------------------- the receive loop
    @property
    def busy(self) -> bool:
        return self.outstanding > 0 or self.stopped

    async def run(self) -> None:
        recv: asyncio.Task | None = None
        last_event = time.monotonic()
        try:
            while True:
                if recv is None:
                    recv = asyncio.ensure_future(self.ws.receive())
                waits: set[asyncio.Task] = {recv}
                if self.worker is not None:
                    waits.add(self.worker)
                if self.prefill is not None and not self.prefill.done():
                    waits.add(self.prefill)  # a failed prefill ends the socket at once
                idle_timeout = self.cfg.idle_timeout_s
                if self.busy:  # the idle clock is stopped; look again soon
                    timeout = min(1.0, idle_timeout)
                else:
                    timeout = max(max(last_event, self.idle_since) + idle_timeout - time.monotonic(), 0.0)
                done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if self.worker is not None and self.worker in done:
                    exc = self.worker.exception()
                    if exc is not None:
                        raise exc
                    return  # finished normally (finish{stop} sent)
                if self.prefill is not None and self.prefill in done and self.prefill.exception() is not None:
                    raise self.prefill.exception()  # type: ignore[misc]
                if recv in done:
                    message = recv.result()
                    recv = None
                    if message["type"] == "websocket.disconnect":
                        self.finished = True
                        return
                    last_event = time.monotonic()
                    await self.handle(message)
                    last_event = time.monotonic()
                elif not self.busy and time.monotonic() >= max(last_event, self.idle_since) + idle_timeout:
                    raise LiveError(f"idle timeout: no event for {idle_timeout:g} s", 408, CLOSE_POLICY)
        except _Gone:
            pass
        except LiveError as e:
            await self.finish("error", e.code, e.message, e.status)
        except APIError as e:
            err = LiveError.from_api(e)
            await self.finish("error", err.code, err.message, err.status)
        except Exception as e:  # a bug or an engine failure
            log.exception("live socket failed")
            await self.finish("error", CLOSE_INTERNAL, f"internal error: {e}", 500)
        finally:
            if recv is not None:
                recv.cancel()
            await self.cancel_all()

    async def cancel_all(self) -> None:
        """Abort every engine request of this socket (disconnect, error, or after finishing)."""
        for syn in list(self.synths):
            syn.abort()
        tasks = [t for t in (self.worker, self.prefill, *self.starts) if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for t in list(self.starts):  # submissions that completed but were never streamed
            if not t.cancelled() and t.exception() is None and t.result() is not None:
                await t.result().aclose()
        for syn in list(self.synths):
            await syn.aclose()
        self.synths.clear()

    # -------------------------------------------------------------- client events
    async def handle(self, message: dict[str, Any]) -> None:
        raw = message.get("bytes")
        if raw is None:
            raise LiveError("text frames are not supported: send binary MessagePack frames",
                            400, CLOSE_UNSUPPORTED)
        if len(raw) > self.state.config.max_body_bytes:
            raise LiveError(f"frame is {len(raw)} bytes; the limit is {self.state.config.max_body_bytes}", 413)
        try:
            data = ormsgpack.unpackb(raw)
        except (ormsgpack.MsgpackDecodeError, ValueError, TypeError) as e:
            raise LiveError(f"cannot parse the msgpack frame: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("event"), str):
            raise LiveError("every frame must be a msgpack map with an 'event' string")
        event = data["event"]
        if event == "start":
            await self.on_start(data)
            return
        if event not in ("text", "flush", "stop"):
            raise LiveError(f"unknown event {event!r}; expected start, text, flush or stop")
        if not self.started:
            raise LiveError(f"'{event}' before 'start': the first event must be 'start'")
        if self.stopped:  # after stop: nothing more is read; ignore stragglers
            return
        if event == "text":
            text = data.get("text")
            if not isinstance(text, str):
                raise LiveError("'text' event needs a 'text' string")
            self.add_text(text)
        elif event == "flush":
            self.enqueue(self.segmenter.flush())  # type: ignore[union-attr]
            self.segments.put_nowait(_DRAIN)
        else:  # stop
            self.stopped = True
            self.enqueue(self.segmenter.flush())  # type: ignore[union-attr]
            self.segments.put_nowait(_STOP)

    def add_text(self, text: str) -> None:
        check = self.state.config.max_text_length
        if len(text) > check:
            raise LiveError(f"text event is {len(text)} characters; the limit is {check}")
        if self.t_first_text is None and text:
            self.t_first_text = time.perf_counter()
        self.enqueue(self.segmenter.feed(text))  # type: ignore[union-attr]

    def enqueue(self, segments: list[str]) -> None:
        for seg in segments:
            self.outstanding += 1
            self.segments.put_nowait(seg)

    async def on_start(self, data: dict[str, Any]) -> None:
        if self.started:
            raise LiveError("'start' was already received")
        req = data.get("request")
        if not isinstance(req, dict):
            raise LiveError("'start' needs a 'request' map (a /v1/tts request body)")
        req = dict(req)
        if req.get("text") is None:
            req["text"] = ""
        try:
            body = TTSRequestIn.model_validate(req)
        except ValidationError as e:
            raise LiveError(format_validation_errors(e.errors()), 422) from None
        service, config = self.service, self.state.config
        try:
            check_text_length(body.text, config.max_text_length)
            if body.multi_speaker_references and service.family != "s2":
                raise APIError(422, "multi-speaker references (a list of lists) need an S2 model")
            if isinstance(body.reference_id, list) and len(body.reference_id) > 1 and service.family != "s2":
                raise APIError(422, "a list of reference_id (multi-speaker) needs an S2 model")
            bitrate = {"mp3": body.mp3_bitrate, "opus": body.opus_bitrate}.get(body.format)
            self.pipeline = AudioPipeline(body.format, input_rate=service.sample_rate,
                                          sample_rate=body.sample_rate, bitrate=bitrate, prosody=None)
            if body.prosody is not None:
                spec = ProsodySpec(body.prosody.speed, body.prosody.volume, body.prosody.normalize_loudness)
                if not spec.is_identity:
                    self.prosody = spec
                    self.new_prosody()  # validates
            self.params = sampling_params(body.temperature, body.top_p, body.top_k, body.repetition_penalty)
            try:
                self.params.validate()
            except ValueError as e:
                raise APIError(400, str(e)) from None
        except APIError as e:
            raise LiveError.from_api(e) from None
        self.body = body
        self.seed = request_seed(body.seed)
        self.segmenter = TextSegmenter(body.chunk_length)
        self.started = True
        try:
            await self.setup()
        except APIError as e:
            raise LiveError.from_api(e) from None
        self.worker = asyncio.ensure_future(self.work())
        if body.text:
            self.add_text(body.text)

    def new_prosody(self) -> ProsodyProcessor | None:
        p = self.prosody
        if p is None:
            return None
        try:
            return ProsodyProcessor(self.service.sample_rate, speed=p.speed, volume_db=p.volume_db,
                                    normalize_loudness=p.normalize_loudness)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    # -------------------------------------------------------------- synthesis
    async def setup(self) -> None:
        """References -> voice prefix -> prefill-only engine request (not awaited here)."""
        service, body = self.service, self.body
        assert body is not None
        with service.preparing():
            ids = body.reference_ids()
            if ids:
                groups = await service.resolve_voices(ids)
            else:
                groups = await service.encode_references(
                    [[(r.audio, r.text) for r in g] for g in body.reference_groups()],
                    nested=body.multi_speaker_references)
        self.references = service.speaker_references(groups)
        if self.cfg.prefill_on_start:
            try:
                grid = await asyncio.to_thread(voice_prefix_grid, service.family, service.tts.tokenizer,
                                               self.references, body.chunk_length)
            except (ValueError, TypeError) as e:
                raise APIError(400, str(e)) from None
            if grid.shape[1] >= 2:
                self.prefill = asyncio.ensure_future(self.prefill_prefix(grid))

    async def prefill_prefix(self, grid: np.ndarray) -> None:
        req = EngineRequest(session=GridSession(grid), params=self.params, seed=self.seed,
                            max_new_tokens=1, priority=Priority.REALTIME, prefill_only=True)
        try:
            async for ev in self.service.engine.generate(req):
                if isinstance(ev, FinishEvent) and ev.reason == "error":
                    raise APIError(400, f"voice prefill failed: {ev.error}")
        except ValueError as e:  # rejected by the engine: the voice alone outgrows the context
            raise APIError(400, f"the voice prompt is too long: {e}") from None
        except EngineStopped as e:
            raise APIError(503, f"the engine is not running: {e}") from None

    async def start_segment(self, text: str) -> Synthesis | None:
        """Prompt + engine submission of one segment (None: nothing to say). The prompt is
        built while the voice prefill may still run; the submission waits for the prefill, so
        the segment's prompt finds the voice's K/V in the prefix cache."""
        if not has_speech(text):
            return None
        body, service = self.body, self.service
        assert body is not None
        try:
            prepared = await service.prepare(text, self.references, body.chunk_length, body.normalize,
                                             body.language)
        except APIError as e:
            if e.status == 400 and e.message == "text is empty":  # normalised to nothing
                return None
            raise
        if self.prefill is not None:
            await asyncio.wait({self.prefill})  # (never cancels the prefill)
            if not self.prefill.cancelled() and self.prefill.exception() is not None:
                raise self.prefill.exception()  # type: ignore[misc]
        return await service.start(prepared.session, params=self.params, seed=self.seed,
                                   max_new_tokens=self.state.frames_budget(body.max_new_tokens),
                                   latency=body.latency, priority=Priority.REALTIME)

    async def work(self) -> None:
        """Submit segments (up to ``lookahead`` ahead of the one streaming); stream them in order."""
        ready: asyncio.Queue = asyncio.Queue()  # start tasks in order, then _STOP
        room = asyncio.Semaphore(self.cfg.lookahead + 1)

        async def submit() -> None:
            while True:
                seg = await self.segments.get()
                if seg is _STOP:
                    ready.put_nowait(_STOP)
                    return
                if seg is _DRAIN:
                    ready.put_nowait(_DRAIN)
                    continue
                await room.acquire()
                task = asyncio.ensure_future(self.start_segment(seg))
                self.starts.add(task)
                ready.put_nowait(task)

        submitter = asyncio.ensure_future(submit())
        try:
            while True:
                item = await ready.get()
                if item is _STOP:
                    break
                if item is _DRAIN:
                    if self.outstanding == 0:  # no segment behind the flush (yet)
                        await self.drain()
                    continue
                try:
                    syn = await item
                    self.starts.discard(item)
                    if syn is not None:
                        await self.stream(syn)
                finally:
                    room.release()
                    self.outstanding -= 1
                    if self.outstanding == 0:
                        self.idle_since = time.monotonic()
            if self.fed_samples:  # (no audio at all: no bytes, not even a WAV header)
                tail = await self.service.run_audio(self.pipeline.close)  # type: ignore[union-attr]
                if tail:
                    await self.send_audio(tail)
            seconds = self.pipeline.encoder.samples_out / self.pipeline.sample_rate  # type: ignore[union-attr]
            self.state.metrics.audio_seconds.inc(seconds)
            await self.finish("stop", CLOSE_NORMAL)
        finally:
            submitter.cancel()
            await asyncio.gather(submitter, return_exceptions=True)

    async def drain(self) -> None:
        """Feed the encoder enough silence to release the audio it holds (lossy formats,
        resampling), so a flushed sentence is heard in full before more text arrives."""
        pipeline = self.pipeline
        assert pipeline is not None
        if self.fed_samples == self.drained_at:  # nothing new since the last drain
            return
        pad = DRAIN_PAD.get(pipeline.format, 0)
        if not pad and pipeline.sample_rate != self.service.sample_rate:
            pad = DRAIN_PAD_RESAMPLED
        if not pad:
            return
        self.drained_at = self.fed_samples = self.fed_samples + pad
        data = await self.service.run_audio(pipeline.feed, np.zeros(pad, np.float32))
        if data:
            await self.send_audio(data)

    async def stream(self, syn: Synthesis) -> None:
        """One segment: engine PCM -> prosody -> the socket's encoder -> audio frames."""
        self.synths.add(syn)
        prosody = self.new_prosody()
        pipeline = self.pipeline
        assert pipeline is not None
        metrics = self.state.metrics
        metrics.in_flight.inc()

        def feed(pcm: np.ndarray) -> bytes:
            self.fed_samples += len(pcm)
            x = prosody.feed(pcm) if prosody is not None else pcm
            return pipeline.feed(x) if len(x) else b""

        def end() -> bytes:
            if prosody is None:
                return b""
            tail = prosody.close()
            return pipeline.feed(tail) if len(tail) else b""

        try:
            try:
                async for pcm in syn.pcm_chunks():
                    data = await self.service.run_audio(feed, pcm)
                    if data:
                        await self.send_audio(data)
            except RuntimeError as e:  # the engine failed this request
                raise LiveError(str(e), 500, CLOSE_INTERNAL) from None
            data = await self.service.run_audio(end)
            if data:
                await self.send_audio(data)
        finally:
            metrics.in_flight.dec()
            self.synths.discard(syn)
            await syn.aclose()


# ---------------------------------------------------------------------- the route
async def _deny(ws: WebSocket, e: APIError) -> None:
    """Reject before the upgrade: an HTTP error response when the server can send one (the
    SDKs raise ``WebSocketUpgradeError`` carrying it), else a plain 403."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(JSONResponse(error_body(e.status, e.message), status_code=e.status,
                                                   headers=e.headers))
    else:
        await ws.close(CLOSE_POLICY)


@router.api_route(ROUTE, methods=["GET", "POST"], include_in_schema=False)
async def tts_live_plain_http() -> JSONResponse:
    """A plain HTTP request to the WebSocket route: 426 with the upgrade it needs (a 404 or
    405 would suggest the route does not exist)."""
    return error_response(426, f"{ROUTE} is a WebSocket endpoint: connect with a WebSocket upgrade "
                          "(ws:// or wss://); for one request over HTTP use POST /v1/tts",
                          headers={"Upgrade": "websocket", "Connection": "Upgrade"})


@router.websocket(ROUTE)
async def tts_live(websocket: WebSocket) -> None:
    state: ServerState = websocket.app.state.shoal
    cfg = live_config(websocket.app)
    try:
        lease = state.admit(websocket)  # type: ignore[arg-type]  # auth 401, ready/overload 503, 429
    except APIError as e:
        await _deny(websocket, e)
        return
    try:
        await websocket.accept()
        await LiveSession(websocket, state, cfg).run()
    finally:
        lease.release()
