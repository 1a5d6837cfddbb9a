"""Shared HTTP plumbing for the synthesis routes: body parsing, starting the synthesis and the audio response."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..engine.sampling import SamplingParams
from ..text.prompt import PromptSession
from .auth import Lease
from .errors import APIError
from .output import AudioPipeline
from .service import ClientDisconnected, Synthesis
from .state import ServerState, request_seed

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


async def parse_body(request: Request, max_bytes: int, *, msgpack: bool = True) -> dict[str, Any]:
    """A msgpack or JSON object body; 415 for other content types, 400 when unparseable."""
    from .limits import decode_object, read_body

    ctype = media_type(request)
    is_json = ctype == "application/json" or ctype.endswith("+json")
    is_msgpack = msgpack and ctype in MSGPACK_TYPES
    if not (is_json or is_msgpack):
        accepted = "application/msgpack or application/json" if msgpack else "application/json"
        raise APIError(415, f"unsupported Content-Type {ctype or '(none)'!r}; send {accepted}")
    raw = await read_body(request, max_bytes)
    data = decode_object(raw, is_json=not is_msgpack)
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be an object, got {type(data).__name__}")
    return data


async def wait_disconnect(request: Request) -> None:
    """Completes when the client closes the connection (the body must be read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def start_synthesis(state: ServerState, request: Request, session: PromptSession, params: SamplingParams,
                          body: Any) -> Synthesis:
    """``service.start`` for an HTTP synthesis request: ``body``'s seed, ``max_new_tokens`` (within
    the server's cap) and latency; :class:`ClientDisconnected` when the client goes away first."""
    return await state.service.start(
        session, params=params, seed=request_seed(body.seed),
        max_new_tokens=state.frames_budget(body.max_new_tokens),
        latency=body.latency, disconnected=lambda: wait_disconnect(request))


def release_after_error(lease: Lease, error: BaseException) -> Response:
    """For a synthesis route's ``except BaseException`` before its response: frees the lease;
    a client gone before the first event (:class:`ClientDisconnected`) gets 499, any other
    error is raised again."""
    lease.release()
    if isinstance(error, ClientDisconnected):
        return Response(status_code=499)
    raise error


class AudioStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so the generation is aborted
    and its slot freed even when the send fails between two chunks (client gone)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def audio_chunks(state: ServerState, syn: Synthesis, pipeline: AudioPipeline, lease: Lease, *,
                       route: str, t0: float,
                       wrap: Callable[[bytes], bytes] | None = None,
                       trailer: Callable[[Synthesis], bytes] | None = None) -> AsyncIterator[bytes]:
    """Engine PCM -> encoded bytes as they come; always aborts/frees on exit."""
    metrics = state.metrics
    service = state.service
    metrics.in_flight.inc()
    first = True
    try:
        async for pcm in syn.pcm_chunks():
            data = await service.run_audio(pipeline.feed, pcm)
            if data:
                if first:
                    metrics.ttfa.labels(route).observe(time.perf_counter() - t0)
                    first = False
                yield wrap(data) if wrap else data
        tail = await service.run_audio(pipeline.close)
        if tail:
            if first:
                metrics.ttfa.labels(route).observe(time.perf_counter() - t0)
            yield wrap(tail) if wrap else tail
        metrics.audio_seconds.inc(pipeline.encoder.samples_out / pipeline.sample_rate)
        if trailer is not None:
            yield trailer(syn)
    finally:
        syn.abort()
        lease.release()
        metrics.in_flight.dec()
        await syn.aclose()


def audio_response(body: AsyncIterator[bytes], media_type: str, syn: Synthesis,
                   headers: Mapping[str, str] | None = None) -> AudioStreamingResponse:
    h = {"Cache-Control": "no-store", "X-Request-Id": syn.request_id, "X-Shoal-Seed": str(syn.seed)}
    h.update(headers or {})
    return AudioStreamingResponse(body, media_type=media_type, headers=h)
