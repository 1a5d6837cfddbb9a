"""The FastAPI application: ``create_app(service, config)``.

The app does not load the model: :meth:`TTSService.load` does (``shoal serve`` calls it before
starting uvicorn, so a bad checkpoint fails at once). The lifespan starts the warm-up in the
background; ``/v1/ready`` and the synthesis routes answer 503 until it is done, while
``/v1/health`` answers from the start. Several apps may share one service (tests do).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from .. import __version__
from .auth import Authenticator, KeyLimiter
from .config import ServerConfig
from .errors import install_error_handlers
from .health import router as health_router
from .metrics import Metrics, MetricsMiddleware
from .metrics import router as metrics_router
from .openai_speech import router as openai_router
from .service import TTSService
from .state import ServerState
from .tts import router as tts_router
from .wallet import router as wallet_router

log = logging.getLogger("shoal.server")


def create_app(service: TTSService, config: ServerConfig | None = None, *,
               owns_service: bool = False) -> FastAPI:
    """Build the app around a loaded ``service``; ``owns_service`` closes it on shutdown."""
    config = config or ServerConfig()
    config.validate()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async def warm() -> None:
            try:
                await service.warmup()
            except Exception:  # stays not-ready; /v1/ready keeps answering 503
                log.exception("warm-up failed")

        task = asyncio.create_task(warm())
        try:
            yield
        finally:
            if not task.done():
                task.cancel()
            if owns_service:
                service.close()

    app = FastAPI(title="shoal", version=__version__, lifespan=lifespan,
                  description="Fish Audio-compatible TTS server (Fish /v1/tts, OpenAI /v1/audio/speech)")
    metrics = Metrics(service.snapshot)
    app.state.shoal = ServerState(service=service, config=config, auth=Authenticator(config.api_keys),
                                  limiter=KeyLimiter(config.max_concurrency_per_key, config.retry_after_s),
                                  metrics=metrics)
    install_error_handlers(app)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    for router in (tts_router, openai_router, health_router, wallet_router, metrics_router):
        app.include_router(router)
    from .playground import router as playground_router; app.include_router(playground_router)  # noqa: E702
    from .voices_api import install_voices; install_voices(app, service, config)  # noqa: E702  (voice library)
    from .live import router as live_router; app.include_router(live_router)  # noqa: E702  # WS /v1/tts/live
    return app
