"""Request limits: body size (413), text length (400), engine overload (503 + Retry-After)."""

from __future__ import annotations

from typing import Protocol

from fastapi import Request

from .errors import APIError


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole request body, or 413 as soon as it exceeds ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > max_bytes:
                raise APIError(413, f"request body is {int(declared)} bytes; the limit is {max_bytes}")
        except ValueError:
            raise APIError(400, "invalid Content-Length header") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def check_text_length(text: str, limit: int, field: str = "text") -> None:
    if len(text) > limit:
        raise APIError(400, f"{field} is {len(text)} characters; the limit is {limit}")


class Load(Protocol):
    def pending(self) -> int: ...


def check_overload(load: Load, threshold: int, retry_after_s: int) -> None:
    """503 when the engine already holds ``threshold`` requests (waiting + running + preparing)."""
    n = load.pending()
    if n >= threshold:
        raise APIError(503, f"server is overloaded ({n} requests pending, limit {threshold}); retry later",
                       {"Retry-After": str(retry_after_s)})


def decode_object(raw: bytes, is_json: bool) -> object:
    """A JSON or msgpack body decoded; 400 (never a 500) when it does not parse, nests too deep
    for the parser, or holds a string that is not Unicode text (JSON's ``"\\ud800"``: a lone
    surrogate, which no tokenizer, database or UTF-8 encoder accepts)."""
    import json

    import ormsgpack

    kind = "JSON" if is_json else "msgpack"
    try:
        data = json.loads(raw) if is_json else ormsgpack.unpackb(raw)
    except (ormsgpack.MsgpackDecodeError, ValueError, TypeError) as e:
        raise APIError(400, f"cannot parse the {kind} body: {e}") from None
    except RecursionError:
        raise APIError(400, f"cannot parse the {kind} body: nested too deeply") from None
    stack = [data]
    while stack:  # iterative: the body's depth is the client's choice
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, f"the {kind} body holds a string that is not valid Unicode "
                                    "(a lone surrogate escape)") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return data
