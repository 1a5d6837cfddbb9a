"""``GET /``: the browser playground (docs/playground.md).

A single page (``static/index.html`` + ``app.js`` + ``style.css``, package data, no build step,
nothing fetched from elsewhere) that calls the server's own public API from the browser:
``POST /v1/tts`` streaming raw PCM into Web Audio, ``GET /v1/ready`` and, where the server has
one, ``GET /model`` for the voice list. The page itself needs no API key; the key typed into it
is sent as ``Authorization: Bearer`` on the API calls.

Caching: the page is ``no-cache`` (revalidated through its ``ETag``) and links its assets with
``?v=<content hash>``; an asset requested with its current hash is ``immutable`` for a year,
any other request of it is ``no-cache``. ``If-None-Match`` gets a 304.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response

router = APIRouter()

STATIC_PACKAGE = __package__ or "shoal.server"
ASSET_TYPES = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
INDEX_TYPE = "text/html; charset=utf-8"
IMMUTABLE = "public, max-age=31536000, immutable"
REVALIDATE = "no-cache"
# Everything the page loads or calls is same-origin; audio is played through Web Audio and
# downloads are blob: URLs.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "media-src 'self' blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    media_type: str
    version: str  # content hash, also the ETag's value

    @property
    def etag(self) -> str:
        return f'"{self.version}"'


def _read(name: str) -> bytes:
    return (resources.files(STATIC_PACKAGE) / "static" / name).read_bytes()


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


@lru_cache(maxsize=None)
def asset(name: str) -> StaticFile:
    body = _read(name)
    return StaticFile(body, ASSET_TYPES[name], _digest(body))


@lru_cache(maxsize=1)
def index() -> StaticFile:
    """index.html with ``{{app.js}}``-style placeholders replaced by the assets' hashes."""
    text = _read("index.html").decode("utf-8")
    for name in ASSET_TYPES:
        text = text.replace("{{" + name + "}}", asset(name).version)
    body = text.encode("utf-8")
    return StaticFile(body, INDEX_TYPE, _digest(body))


def _not_modified(request: Request, f: StaticFile) -> bool:
    header = request.headers.get("if-none-match")
    if not header:
        return False
    tags = {t.strip().removeprefix("W/") for t in header.split(",")}
    return f.etag in tags or "*" in tags


def _serve(request: Request, f: StaticFile, cache_control: str, extra: dict[str, str] | None = None
           ) -> Response:
    headers = {"ETag": f.etag, "Cache-Control": cache_control, "X-Content-Type-Options": "nosniff"}
    headers.update(extra or {})
    if _not_modified(request, f):
        return Response(status_code=304, headers=headers)
    return Response(f.body, media_type=f.media_type, headers=headers)


def _serve_asset(request: Request, name: str) -> Response:
    f = asset(name)
    cache = IMMUTABLE if request.query_params.get("v") == f.version else REVALIDATE
    return _serve(request, f, cache)


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def playground_index(request: Request) -> Response:
    return _serve(request, index(), REVALIDATE,
                  {"Content-Security-Policy": CSP, "Referrer-Policy": "no-referrer"})


@router.api_route("/playground/app.js", methods=["GET", "HEAD"], include_in_schema=False)
async def playground_js(request: Request) -> Response:
    return _serve_asset(request, "app.js")


@router.api_route("/playground/style.css", methods=["GET", "HEAD"], include_in_schema=False)
async def playground_css(request: Request) -> Response:
    return _serve_asset(request, "style.css")
