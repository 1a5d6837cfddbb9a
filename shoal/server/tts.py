"""``POST /v1/tts``: Fish Audio's text-to-speech, as the official SDKs call it."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from .errors import APIError, validation_error
from .limits import check_text_length
from .output import AudioPipeline, ProsodySpec
from .schemas import TTSRequestIn
from .state import get_state, sampling_params
from .streaming import audio_chunks, audio_response, parse_body, release_after_error, start_synthesis

router = APIRouter()
ROUTE = "/v1/tts"


@router.post(ROUTE, include_in_schema=True, summary="Text to speech (Fish Audio API)")
async def tts(request: Request) -> Response:
    t0 = time.perf_counter()
    state = get_state(request)
    service, config = state.service, state.config
    lease = state.admit(request)  # 401 / 503 / 429; the `model` header is accepted as-is
    try:
        raw = await parse_body(request, config.max_body_bytes)
        try:
            body = TTSRequestIn.model_validate(raw)
        except ValidationError as e:
            raise validation_error(e) from None
        check_text_length(body.text, config.max_text_length)
        if not body.text.strip():
            raise APIError(400, "text is empty")
        if body.multi_speaker_references and service.family != "s2":
            raise APIError(422, "multi-speaker references (a list of lists) need an S2 model")
        if isinstance(body.reference_id, list) and len(body.reference_id) > 1 and service.family != "s2":
            raise APIError(422, "a list of reference_id (multi-speaker) needs an S2 model")
        bitrate = {"mp3": body.mp3_bitrate, "opus": body.opus_bitrate}.get(body.format)
        prosody = None
        if body.prosody is not None:
            prosody = ProsodySpec(body.prosody.speed, body.prosody.volume, body.prosody.normalize_loudness)
        pipeline = AudioPipeline(body.format, input_rate=service.sample_rate, sample_rate=body.sample_rate,
                                 bitrate=bitrate, prosody=prosody)
        with service.preparing():
            ids = body.reference_ids()
            if ids:  # a voice from the library wins over inline references
                groups = await service.resolve_voices(ids)
            else:
                groups = await service.encode_references(
                    [[(r.audio, r.text) for r in g] for g in body.reference_groups()],
                    nested=body.multi_speaker_references)
            prepared = await service.prepare(body.text, service.speaker_references(groups),
                                             body.chunk_length, body.normalize, body.language)
            syn = await start_synthesis(
                state, request, prepared.session,
                sampling_params(body.temperature, body.top_p, body.top_k, body.repetition_penalty), body)
    except BaseException as e:  # noqa: BLE001 - re-raised unless a 499
        return release_after_error(lease, e)
    chunks = audio_chunks(state, syn, pipeline, lease, route=ROUTE, t0=t0)
    return audio_response(chunks, pipeline.content_type, syn,
                          {"X-Shoal-Sample-Rate": str(pipeline.sample_rate)})
