"""``GET /v1/health`` (liveness: the process answers) and ``GET /v1/ready`` (503 until warm-up)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .errors import error_response
from .state import get_state

router = APIRouter()


@router.head("/v1/health", include_in_schema=False)  # uptime probes send HEAD
@router.get("/v1/health", summary="Liveness")
async def health() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.head("/v1/ready", include_in_schema=False)
@router.get("/v1/ready", summary="Readiness: 200 once warm-up is done, else 503")
async def ready(request: Request) -> JSONResponse:
    state = get_state(request)
    service = state.service
    if not service.ready:
        return error_response(503, "warming up", {"Retry-After": str(state.config.retry_after_s)})
    body = {"status": "ready", "model_family": service.family, "sample_rate": service.sample_rate,
            "max_running": service.max_running, "model": getattr(service, "model_name", "")}
    kv = getattr(service, "kv_cache_dtype", None)  # "fp8" or the model's dtype
    if kv:
        body["kv_cache_dtype"] = kv
    codec_dtype = getattr(service, "codec_dtype", None)  # {"encode": "fp32", "decode": "bf16"}
    if codec_dtype:
        body["codec_dtype"] = codec_dtype
    if getattr(service, "random_weights", False):  # shoal serve --random-model
        body["random_weights"] = True
        body["warning"] = "random weights: benchmark only, the audio is noise"
    return JSONResponse(body)
