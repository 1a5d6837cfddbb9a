"""``POST /v1/audio/speech``: OpenAI's speech endpoint (``openai`` SDK with ``base_url=.../v1``).

* ``voice``: OpenAI's built-in names (alloy, echo, ...) all mean the model's default voice (no
  reference); any other string, or ``{"id": ...}``, is a voice id for the voice library.
* ``response_format``: mp3 (default), opus, aac, flac, wav, pcm. ``pcm`` is 24 kHz s16le mono
  like OpenAI's unless ``sample_rate`` is given; the other formats use the encoder's default.
* ``speed``: OpenAI range 0.25-4.0 (422 outside it); the time-stretcher supports 0.5-2.0, so
  values beyond are clamped to it (``X-Shoal-Speed`` reports the speed applied).
* ``stream_format``: ``audio`` (raw bytes, chunked) or ``sse``: ``speech.audio.delta`` events
  with base64 ``audio``, then ``speech.audio.done`` with ``usage`` (input_tokens = text tokens,
  output_tokens = audio frames generated).
Extensions (``extra_body``): sample_rate, references [{audio: base64, text}], normalize,
latency, temperature, top_p, top_k, max_new_tokens, seed.
"""

from __future__ import annotations

import base64
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from .errors import APIError, validation_error
from .limits import check_text_length
from .output import AudioPipeline, ProsodySpec, clamp_speed
from .schemas import SpeechRequestIn
from .service import Synthesis
from .state import get_state, sampling_params
from .streaming import audio_chunks, audio_response, parse_body, release_after_error, start_synthesis

router = APIRouter()
ROUTE = "/v1/audio/speech"


def _sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


@router.post(ROUTE, summary="Text to speech (OpenAI-compatible)")
async def speech(request: Request) -> Response:
    t0 = time.perf_counter()
    state = get_state(request)
    service, config = state.service, state.config
    lease = state.admit(request)
    try:
        raw = await parse_body(request, config.max_body_bytes, msgpack=False)
        try:
            body = SpeechRequestIn.model_validate(raw)
        except ValidationError as e:
            raise validation_error(e) from None
        check_text_length(body.input, config.max_text_length, "input")
        if not body.input.strip():
            raise APIError(400, "input is empty")
        speed = clamp_speed(body.speed)
        sample_rate = body.sample_rate
        if sample_rate is None and body.response_format == "pcm":
            sample_rate = config.openai_pcm_sample_rate
        pipeline = AudioPipeline(body.response_format, input_rate=service.sample_rate,
                                 sample_rate=sample_rate, bitrate=None,
                                 prosody=ProsodySpec(speed=speed))
        with service.preparing():
            rid = body.reference_id()
            if rid is not None:
                groups = await service.resolve_voices([rid])
            else:
                groups = await service.encode_references([[(r.audio, r.text) for r in body.references]]
                                                         if body.references else [])
            prepared = await service.prepare(body.input, service.speaker_references(groups), None,
                                             body.normalize, body.language)
            syn = await start_synthesis(state, request, prepared.session,
                                        sampling_params(body.temperature, body.top_p, body.top_k), body)
    except BaseException as e:  # noqa: BLE001 - re-raised unless a 499
        return release_after_error(lease, e)
    headers = {"X-Shoal-Sample-Rate": str(pipeline.sample_rate), "X-Shoal-Speed": f"{speed:g}"}
    if body.stream_format == "sse":
        def delta(data: bytes) -> bytes:
            return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

        def done(s: Synthesis) -> bytes:
            out_tokens = s.frames
            return _sse({"type": "speech.audio.done",
                         "usage": {"input_tokens": prepared.input_tokens, "output_tokens": out_tokens,
                                   "total_tokens": prepared.input_tokens + out_tokens}})

        chunks = audio_chunks(state, syn, pipeline, lease, route=ROUTE, t0=t0, wrap=delta, trailer=done)
        return audio_response(chunks, "text/event-stream", syn, headers)
    chunks = audio_chunks(state, syn, pipeline, lease, route=ROUTE, t0=t0)
    return audio_response(chunks, pipeline.content_type, syn, headers)
