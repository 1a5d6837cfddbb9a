"""Every error leaves as JSON with exactly ``{"status": N, "message": "..."}``.

The legacy ``fish_audio_sdk`` builds its exception as ``HttpCodeErr(**resp.json())``, so any
extra key (``reason``, ``detail``) or a bare list breaks it; the new ``fishaudio`` client reads
``message``. FastAPI's own validation errors, unknown routes (404), wrong methods (405) and
unexpected exceptions (500) are mapped into the same shape.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

log = logging.getLogger("shoal.server")

REASONS = {400: "bad request", 401: "unauthorized", 402: "payment required", 403: "forbidden",
           404: "not found", 405: "method not allowed", 413: "request too large",
           415: "unsupported media type", 422: "validation error", 429: "too many requests",
           500: "internal server error", 503: "service unavailable"}


class APIError(Exception):
    """An error answered to the client: ``status`` and a human-readable ``message``."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = str(message)
        self.headers = dict(headers or {})

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r})"


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"status": int(status), "message": str(message)}


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=dict(headers or {}))


def format_validation_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    """pydantic / FastAPI error list -> one line: ``field.path: message; ...``."""
    parts = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        where = ".".join(loc) or "body"
        msg = str(err.get("msg", "invalid value"))
        parts.append(f"{where}: {msg}")
    return "; ".join(parts) or "invalid request"


def validation_error(exc: ValidationError | RequestValidationError, status: int = 422) -> APIError:
    return APIError(status, format_validation_errors(exc.errors()))


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.headers)


async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(422, format_validation_errors(exc.errors()))


async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    if status == 404:
        message = f"no route for {request.method} {request.url.path}"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = exc.detail if isinstance(exc.detail, str) else REASONS.get(status, "error")
    return error_response(status, message, getattr(exc, "headers", None))


async def _client_disconnect(request: Request, exc: ClientDisconnect) -> Response:
    """The client closed the connection while its body was being read: nobody to answer and
    nothing wrong here, so no 500 and no traceback; 499 (as for a client gone before the first
    audio, :func:`~shoal.server.streaming.release_after_error`) is what the metrics count."""
    log.debug("client left during the request body on %s %s", request.method, request.url.path)
    return Response(status_code=499)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, f"internal server error ({type(exc).__name__})")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _request_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnect, _client_disconnect)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
