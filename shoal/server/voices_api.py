"""Fish Audio's voice-model API (``/model``) over a :class:`~shoal.voices.VoiceStore`, and the
resolver that turns ``reference_id`` (``/v1/tts``) and ``voice`` (``/v1/audio/speech``) into
prompt references.

* ``POST /model``: multipart (as both SDKs send it), or JSON / msgpack / form-urlencoded with
  base64 or binary ``voices``; ``texts`` are required, one per file (there is no ASR here).
* ``GET /model``: ``page_size`` (1-100), ``page_number`` (1-based), ``title``, ``tag``,
  ``self``, ``author_id``, ``language``, ``title_language``, ``sort_by``.
* ``GET|PATCH|DELETE /model/{id}``; ``GET /model/{id}/cover`` and
  ``/model/{id}/samples/{sample_id}`` serve the files the objects link to.

Objects carry every key both SDKs validate (the new SDK's ``Voice`` needs ``train_mode ==
"fast"``, ``description``, ``cover_image``, ``samples``, ``languages``, ``lock_visibility``).
Ownership: on a server with API keys a voice belongs to the key that created it (the author id
is a hash of the key); only its author may update or delete it, ``self=true`` lists its own,
and other authors' ``private``/``unlist`` voices are left out of listings. Voices added with
``shoal voices add`` belong to ``local``, which is every caller of an open server. Any caller
may *use* (get, synthesise with) any voice whose id it knows.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from ..text import SPEAKER_TAG_RE, Reference
from ..voices import LOCAL_AUTHOR, Voice, VoiceNotFound, VoiceStore, VoiceStoreError
from ..voices.codec import codec_fingerprint
from ..voices.store import SORT_KEYS
from .config import ServerConfig
from .errors import APIError
from .limits import decode_object, read_body
from .service import TTSService
from .state import get_state
from .streaming import MSGPACK_TYPES, media_type

log = logging.getLogger("shoal.server")
router = APIRouter()

FILE_FIELDS = ("voices", "cover_image")
MAX_PAGE_SIZE = 100
FORM_OVERHEAD = 1 << 20  # field parts and multipart framing on top of the file caps


# --------------------------------------------------------------------------- wiring
class StoreVoiceResolver:
    """``reference_id`` -> the voice's references, through the store's code cache.

    A voice becomes ONE :class:`Reference`: its samples' transcripts joined by spaces and their
    codes concatenated in upload order (``merge_samples=False``: one reference per sample).
    One reference per voice keeps the speaker semantics of the prompt builders: a single voice
    is speaker 0 and, for a list of ids, voice i is ``<|speaker:i|>`` (the S2 layout would
    otherwise give each sample of one voice its own speaker index). Speaker tags written in
    stored transcripts are dropped for the same reason. The same voice always yields the same
    text and codes, so its prompt prefix hits the engine's prefix cache.
    """

    def __init__(self, store: VoiceStore, *, merge_samples: bool = True) -> None:
        self.store = store
        self.merge_samples = merge_samples

    def _load(self, reference_id: str) -> list[Reference]:
        pairs = self.store.references(reference_id)
        try:
            self.store.record_use(reference_id)
        except Exception:  # a busy database must not fail the synthesis
            log.warning("could not count a use of voice %r", reference_id, exc_info=True)
        texts = [SPEAKER_TAG_RE.sub("", t).strip() for t, _ in pairs]
        if self.merge_samples and len(pairs) > 1:
            import numpy as np

            return [Reference(" ".join(t for t in texts if t), np.concatenate([c for _, c in pairs], axis=1))]
        return [Reference(t, c) for t, (_, c) in zip(texts, pairs)]

    async def resolve(self, reference_id: str) -> list[Reference]:
        if not isinstance(reference_id, str):
            raise APIError(400, "reference_id must be a string or a list of strings")
        try:
            return await run_in_threadpool(self._load, reference_id)
        except VoiceNotFound:
            raise APIError(404, f"unknown reference_id {reference_id!r}: no such voice on this server "
                                "(GET /model lists them)") from None
        except VoiceStoreError as e:
            raise APIError(e.status, f"reference_id {reference_id!r}: {e.message}") from None


def open_voice_store(service: TTSService, voices_dir: str, **kw: Any) -> VoiceStore:
    """A store over ``voices_dir`` encoding with the service's codec (serialised with the
    service's own reference encoding)."""
    lock = service._codec_lock  # the codec is not thread-safe; share the service's lock

    def encode(samples):
        with lock:
            return service.tts.encode_reference(samples)

    return VoiceStore(voices_dir, encoder=encode, codec_key=codec_fingerprint(service.tts.codec),
                      sample_rate=service.sample_rate, **kw)


def install_voices(app: FastAPI, service: TTSService, config: ServerConfig) -> VoiceStore | None:
    """Add the ``/model`` routes; with ``config.voices_dir`` open the store, keep it on
    ``app.state.voice_store`` and make it the service's ``reference_id`` resolver."""
    app.include_router(router)
    store = None
    if config.voices_dir:
        store = open_voice_store(service, config.voices_dir)
        service.resolver = StoreVoiceResolver(store)
        log.info("voice library: %s (%d voices)", store.root, len(store))
    app.state.voice_store = store
    return store


def get_store(request: Request) -> VoiceStore | None:
    return getattr(request.app.state, "voice_store", None)


def _require_store(request: Request, voice_id: str | None = None) -> VoiceStore:
    store = get_store(request)
    if store is None:
        if voice_id is not None:
            raise APIError(404, f"unknown voice {voice_id!r}: this server has no voice library "
                                "(start it with --voices-dir)")
        raise APIError(501, "this server has no voice library (start it with --voices-dir)")
    return store


async def _store_call(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    try:
        return await run_in_threadpool(fn, *args, **kw)
    except VoiceStoreError as e:
        raise APIError(e.status, e.message) from None


def _caller(request: Request) -> tuple[str, str]:
    """(author id, nickname) of the caller; 401 on a bad key."""
    state = get_state(request)
    key = state.auth.check(request)
    if not state.auth.enabled:
        return LOCAL_AUTHOR, LOCAL_AUTHOR
    digest = hashlib.sha256(b"shoal-author:" + key.encode()).hexdigest()[:24]
    return digest, f"api-key-{digest[:6]}"


def _check_owner(voice: Voice, author: str) -> None:
    if author != LOCAL_AUTHOR and voice.author_id != author:
        raise APIError(403, f"voice {voice.id!r} belongs to another author; only its author may change it")


# --------------------------------------------------------------------------- objects
def voice_json(voice: Voice, request: Request) -> dict[str, Any]:
    """The Fish ``ModelEntity`` of ``voice``: every key both SDK clients require."""
    cover = ""
    if voice.cover:
        cover = f"{request.url_for('voice_cover', voice_id=voice.id)}?rev={voice.rev}"
    samples = [{"title": s.title or f"Sample {s.index + 1}", "text": s.text, "task_id": s.id,
                "audio": str(request.url_for("voice_sample", voice_id=voice.id, sample_id=s.id))}
               for s in voice.samples]
    return {
        "_id": voice.id, "type": "tts", "title": voice.title, "description": voice.description,
        "cover_image": cover, "train_mode": "fast", "state": "trained", "tags": list(voice.tags),
        "samples": samples, "created_at": voice.created_at, "updated_at": voice.updated_at,
        "languages": list(voice.languages), "visibility": voice.visibility, "lock_visibility": False,
        "like_count": 0, "mark_count": 0, "shared_count": 0, "task_count": voice.task_count,
        "liked": False, "marked": False, "unliked": False,
        "default_text": voice.samples[0].text if voice.samples else "",
        "author": {"_id": voice.author_id, "nickname": voice.author_name, "avatar": ""},
    }


# --------------------------------------------------------------------------- bodies
Fields = dict[str, list[str]]
Files = dict[str, list[bytes]]


def _add(fields: Fields, files: Files, name: str, value: Any, nested: bool = False) -> None:
    if isinstance(value, (list, tuple)) and not nested:
        if name not in FILE_FIELDS:
            fields.setdefault(name, [])  # an explicit empty list (JSON / msgpack) clears, e.g. tags
        for v in value:
            _add(fields, files, name, v, nested=True)
    elif isinstance(value, (list, tuple, dict)):  # an object, or a list inside the list
        raise APIError(400, f"{name} must be a string, a number or a list of them, "
                            f"not {'an object' if isinstance(value, dict) else 'a nested list'}")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        files.setdefault(name, []).append(bytes(value))
    elif name in FILE_FIELDS and isinstance(value, str):  # JSON: base64 (optionally a data: URL)
        payload = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value
        try:
            files.setdefault(name, []).append(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError):
            raise APIError(400, f"{name} must be files (multipart), bytes (msgpack) or base64 text") from None
    elif isinstance(value, bool):
        fields.setdefault(name, []).append("true" if value else "false")
    elif value is not None:
        fields.setdefault(name, []).append(str(value))


async def read_form(request: Request, max_bytes: int, max_files: int) -> tuple[Fields, Files]:
    """Text fields and file parts of a multipart, form-urlencoded, JSON or msgpack body;
    413 past ``max_bytes`` (counted while streaming), 415 for other content types."""
    ctype = media_type(request)
    fields: Fields = {}
    files: Files = {}
    if ctype == "multipart/form-data":
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise APIError(413, f"request body is {int(declared)} bytes; the limit is {max_bytes}")

        async def capped():
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes")
                yield chunk

        parser = MultiPartParser(request.headers, capped(), max_files=max_files, max_fields=1000)
        try:
            form = await parser.parse()
        except MultiPartException as e:
            raise APIError(400, f"cannot parse the multipart body: {e.message}") from None
        try:
            for name, value in form.multi_items():
                if isinstance(value, UploadFile):
                    files.setdefault(name, []).append(await value.read())
                elif name in FILE_FIELDS:
                    raise APIError(400, f"{name} must be sent as file parts")
                else:
                    fields.setdefault(name, []).append(value)
        finally:
            await form.close()
        return fields, files
    if ctype == "application/x-www-form-urlencoded":
        raw = await read_body(request, max_bytes)
        try:
            pairs = parse_qsl(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
        except UnicodeDecodeError:
            raise APIError(400, "the form body is not UTF-8") from None
        for name, value in pairs:
            _add(fields, files, name, value)
        return fields, files
    is_json = ctype == "application/json" or ctype.endswith("+json")
    if is_json or ctype in MSGPACK_TYPES:
        raw = await read_body(request, max_bytes)
        data = decode_object(raw, is_json)
        if not isinstance(data, dict):
            raise APIError(400, f"the body must be an object, got {type(data).__name__}")
        for name, value in data.items():
            _add(fields, files, str(name), value)
        return fields, files
    raise APIError(415, f"unsupported Content-Type {ctype or '(none)'!r}; send multipart/form-data, "
                        "application/x-www-form-urlencoded, application/json or application/msgpack")


def _one(fields: Fields, name: str, default: str | None = None) -> str | None:
    values = fields.get(name)
    if not values:
        return default
    if len(values) > 1:
        raise APIError(400, f"{name} was given {len(values)} times; send it once")
    return values[0]


def _bool(value: str | None, name: str, default: bool) -> bool:
    if value is None or value == "":
        return default
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise APIError(422, f"{name} must be true or false, got {value!r}")


def _list(fields: Fields, *names: str) -> list[str] | None:
    """Repeated values of the first present name; None when absent; ``[""]`` clears."""
    for name in names:
        if name in fields:
            return [v for v in fields[name] if v.strip()]
    return None


# --------------------------------------------------------------------------- routes
@router.post("/model", status_code=201, summary="Create a voice (Fish Audio API)")
async def create_voice(request: Request) -> JSONResponse:
    author, nickname = _caller(request)
    store = _require_store(request)
    lim = store.limits
    fields, files = await read_form(request, lim.max_total_bytes + FORM_OVERHEAD, lim.max_samples + 1)
    title = _one(fields, "title")
    if title is None or not title.strip():
        raise APIError(400, "title is required")
    kind = (_one(fields, "type", "tts") or "tts").strip().lower()
    if kind != "tts":
        raise APIError(400, f"type must be 'tts' (this server has no {kind!r} models)")
    train_mode = (_one(fields, "train_mode", "fast") or "fast").strip().lower()
    if train_mode not in ("fast", "full"):
        raise APIError(400, f"train_mode must be 'fast' or 'full', got {train_mode!r}")
    voices = files.get("voices", [])
    if not voices:
        raise APIError(400, "voices: at least one audio file is required")
    if len(voices) > lim.max_samples:
        raise APIError(400, f"{len(voices)} voices files; the limit is {lim.max_samples}")
    texts = fields.get("texts", [])
    if not texts:
        raise APIError(400, "texts are required: this server has no ASR; send one transcript per voices file")
    if len(texts) != len(voices):
        raise APIError(400, f"got {len(voices)} voices files but {len(texts)} texts; send one transcript per file")
    covers = files.get("cover_image", [])
    if len(covers) > 1:
        raise APIError(400, "cover_image was given more than once")
    from ..voices import SampleInput

    voice = await _store_call(
        store.create, title=title, samples=[SampleInput(a, t) for a, t in zip(voices, texts)],
        description=_one(fields, "description", "") or "", visibility=_one(fields, "visibility", "public"),
        tags=_list(fields, "tags", "tag") or [], cover_image=covers[0] if covers else None,
        author_id=author, author_name=nickname,
        enhance_audio_quality=_bool(_one(fields, "enhance_audio_quality"), "enhance_audio_quality", True))
    return JSONResponse(voice_json(voice, request), status_code=201)


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise APIError(422, f"{name} must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise APIError(422, f"{name} must be between {low} and {high}, got {value}")
    return value


@router.head("/model", include_in_schema=False)
@router.get("/model", summary="List voices (Fish Audio API)")
async def list_voices(request: Request) -> JSONResponse:
    author, _ = _caller(request)
    q = request.query_params
    page_size = _int_param(request, "page_size", 10, 1, MAX_PAGE_SIZE)
    page_number = _int_param(request, "page_number", 1, 1, 1 << 30)
    sort_by = q.get("sort_by") or "score"
    if sort_by not in SORT_KEYS:
        raise APIError(422, f"sort_by must be one of {', '.join(SORT_KEYS)}, got {sort_by!r}")
    self_only = _bool(q.get("self"), "self", False)
    store = get_store(request)
    if store is None:
        return JSONResponse({"total": 0, "items": [], "has_more": False, "total_is_exact": True,
                             "window_limited": False})
    total, voices = await _store_call(
        store.list, page_size=page_size, page_number=page_number, title=q.get("title") or None,
        tags=q.getlist("tag") + q.getlist("tags"), author_id=author if self_only else (q.get("author_id") or None),
        languages=q.getlist("language"), title_languages=q.getlist("title_language"), sort_by=sort_by,
        viewer=None if author == LOCAL_AUTHOR else author)
    return JSONResponse({
        "total": total, "items": [voice_json(v, request) for v in voices],
        "has_more": (page_number - 1) * page_size + len(voices) < total,
        "total_is_exact": True, "window_limited": False,
    })


@router.head("/model/{voice_id}", include_in_schema=False)
@router.get("/model/{voice_id}", summary="Get a voice (Fish Audio API)")
async def get_voice(voice_id: str, request: Request) -> JSONResponse:
    _caller(request)
    store = _require_store(request, voice_id)
    return JSONResponse(voice_json(await _store_call(store.get, voice_id), request))


@router.patch("/model/{voice_id}", summary="Update a voice (Fish Audio API)")
async def update_voice(voice_id: str, request: Request) -> JSONResponse:
    author, _ = _caller(request)
    store = _require_store(request, voice_id)
    _check_owner(await _store_call(store.get, voice_id), author)
    fields, files = await read_form(request, store.limits.max_cover_bytes + FORM_OVERHEAD, 2)
    if files.get("voices"):
        raise APIError(400, "the samples of a voice cannot be changed; create a new voice")
    covers = files.get("cover_image", [])
    if len(covers) > 1:
        raise APIError(400, "cover_image was given more than once")
    voice = await _store_call(
        store.update, voice_id, title=_one(fields, "title"), description=_one(fields, "description"),
        visibility=_one(fields, "visibility"), tags=_list(fields, "tags", "tag"),
        cover_image=covers[0] if covers else None)
    return JSONResponse(voice_json(voice, request))


@router.delete("/model/{voice_id}", summary="Delete a voice (Fish Audio API)")
async def delete_voice(voice_id: str, request: Request) -> JSONResponse:
    author, _ = _caller(request)
    store = _require_store(request, voice_id)
    _check_owner(await _store_call(store.get, voice_id), author)
    voice = await _store_call(store.delete, voice_id)
    return JSONResponse({"_id": voice.id, "deleted": True})


@router.head("/model/{voice_id}/cover", include_in_schema=False)
@router.get("/model/{voice_id}/cover", name="voice_cover", summary="A voice's cover image")
async def voice_cover(voice_id: str, request: Request) -> FileResponse:
    _caller(request)
    store = _require_store(request, voice_id)
    voice = await _store_call(store.get, voice_id)
    path = await _store_call(store.cover_path, voice)
    return _file(path, voice.cover_media_type or "application/octet-stream", voice.id)


@router.head("/model/{voice_id}/samples/{sample_id}", include_in_schema=False)
@router.get("/model/{voice_id}/samples/{sample_id}", name="voice_sample", summary="A voice's sample audio")
async def voice_sample(voice_id: str, sample_id: str, request: Request) -> FileResponse:
    _caller(request)
    store = _require_store(request, voice_id)
    voice = await _store_call(store.get, voice_id)
    path, sample = await _store_call(store.sample_path, voice, sample_id)
    return _file(path, sample.media_type, voice.id)


def _file(path, media: str, voice_id: str) -> FileResponse:
    if not path.is_file():  # deleted between the lookup and now
        raise APIError(404, f"unknown voice {voice_id!r}")
    return FileResponse(path, media_type=media, headers={"Cache-Control": "private, max-age=60"})


__all__ = ["StoreVoiceResolver", "get_store", "install_voices", "open_voice_store", "read_form", "router",
           "voice_json"]
