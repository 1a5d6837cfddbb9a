"""The HTTP/WebSocket server under hostile or careless clients: uvicorn on 127.0.0.1 over the
tiny S2 checkpoint on CPU (tests/live_server.py), raw httpx / httpx-ws for the wire, and the ASGI
app called directly where a test needs a client that vanishes mid-body.

The rule checked throughout: bad input gets a Fish-style ``{"status", "message"}`` JSON error
with a 4xx code, never a 500, a hang, or the loss of a stored voice. The first tests are the
defects this audit found (each failed before its fix); the rest pin behaviour that already held.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import queue
from collections.abc import Iterator

import httpx
import numpy as np
import ormsgpack
import pytest
import soundfile as sf
from httpx_ws import WebSocketDisconnect, connect_ws
from live_server import ERROR_KEYS, LiveServer, assert_error, engine_idle, service_fixture, sine_wav, wait_until

from shoal.server.app import create_app
from shoal.server.config import ServerConfig
from shoal.text.normalize import normalize_text

KEY = "adversary-key"
CAP = 2  # frames per request: these tests are about the answers, not the audio


service = service_fixture(max_running=4)


@pytest.fixture(scope="module")
def srv(service, tmp_path_factory) -> Iterator[LiveServer]:
    config = ServerConfig(api_keys=frozenset({KEY}), max_new_tokens_cap=CAP, max_body_bytes=1 << 20,
                          voices_dir=str(tmp_path_factory.mktemp("voices")))
    with LiveServer(create_app(service, config)) as server:
        yield server


def auth() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


def post(srv: LiveServer, path: str, body=None, *, raw: bytes | None = None,
         content_type: str = "application/msgpack", headers: dict | None = None) -> httpx.Response:
    if raw is None:
        raw = ormsgpack.packb(body) if "msgpack" in content_type else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=raw, timeout=60,
                      headers={**auth(), "content-type": content_type, **(headers or {})})


def float_wav(samples: np.ndarray, rate: int = 22050, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    data = samples.astype(np.float32)
    sf.write(buf, data if channels == 1 else np.repeat(data[:, None], channels, 1), rate, format="WAV",
             subtype="FLOAT")
    return buf.getvalue()


def create_voice(srv: LiveServer, title: str) -> str:
    resp = httpx.post(srv.url + "/model", data={"title": title, "texts": ["Sample words."]}, headers=auth(),
                      files=[("voices", ("a.wav", sine_wav(seconds=0.5), "audio/wav"))], timeout=60)
    assert resp.status_code == 201, resp.text
    return resp.json()["_id"]


# =========================================================================== defects found
HUGE_NUMBERS = [  # each was a 500: num2words refuses values past 10**306, int() strings past 4300 digits
    "Pay $" + "9" * 400 + ".99 now.",
    "The " + "1" * 400 + "th time.",
    "About 1/" + "7" * 400 + " of it.",
    "Take 3 1/" + "7" * 400 + " cups.",
]


def test_huge_numbers_are_read_digit_by_digit_not_a_500(srv):
    for text in HUGE_NUMBERS + ["It costs $" + "1" * 4400 + "."]:
        spoken = normalize_text(text, "en")
        assert not any(c.isdigit() for c in spoken), spoken[:80]
    for text in HUGE_NUMBERS:
        resp = post(srv, "/v1/tts", {"text": text, "format": "pcm"})
        assert resp.status_code == 200 and len(resp.content) > 0, (text[:20], resp.status_code, resp.text[:200])
    resp = post(srv, "/v1/audio/speech", {"input": HUGE_NUMBERS[0], "response_format": "pcm"},
                content_type="application/json")
    assert resp.status_code == 200, resp.text[:200]
    # 4,400 digits read one by one outgrow the tiny model's context: a clear 400, not a 500
    assert_error(post(srv, "/v1/tts", {"text": "$" + "1" * 4400}), 400, "context")


def _asgi_call(app, path: str, content_type: str, first_chunk: bytes) -> tuple[list[dict], BaseException | None]:
    """POST ``path`` straight into the ASGI app: the first piece of a larger body, then the
    client disconnects. Returns the messages sent back and what the app raised, if anything."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 80),
             "headers": [(b"host", b"test"), (b"authorization", f"Bearer {KEY}".encode()),
                         (b"content-type", content_type.encode()), (b"content-length", b"100000")]}
    incoming = [{"type": "http.request", "body": first_chunk, "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> BaseException | None:
        try:
            await asyncio.wait_for(app(scope, receive, send), 30)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            return e
        return None

    return sent, asyncio.run(run())


@pytest.mark.parametrize("path,content_type,chunk", [
    ("/v1/tts", "application/msgpack", b"\x82\xa4text"),
    ("/v1/audio/speech", "application/json", b'{"input": "hel'),
    ("/model", "multipart/form-data; boundary=xyz", b'--xyz\r\nContent-Disposition: form-data; name="title"\r\n\r\nT'),
], ids=["tts", "openai", "voices"])
def test_client_gone_mid_body_is_not_a_500(srv, caplog, path, content_type, chunk):
    """A client that drops the connection halfway through its upload was an 'unhandled error'
    (traceback logged, a 500 counted in the metrics, the exception re-raised into the server)."""
    caplog.set_level(logging.ERROR, logger="shoal.server")
    sent, raised = _asgi_call(srv.app, path, content_type, chunk)
    assert raised is None, repr(raised)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert [m["status"] for m in starts] == [499]
    assert not [r for r in caplog.records if "unhandled error" in r.getMessage()]
    assert srv.state.limiter.in_flight(KEY) == 0 and srv.state.service._preparing == 0


def test_head_is_answered_wherever_get_is(srv):
    """HEAD on the GET routes (uptime probes use it) was a 405; the playground already allowed it."""
    vid = create_voice(srv, "Head voice")
    sample = httpx.get(srv.url + f"/model/{vid}", headers=auth()).json()["samples"][0]["audio"]
    for url in ("/v1/health", "/v1/ready", "/metrics", "/model", f"/model/{vid}", sample,
                "/wallet/self/api-credit", "/wallet/self/package"):
        url = url if url.startswith("http") else srv.url + url
        head, get = httpx.head(url, headers=auth()), httpx.get(url, headers=auth())
        assert head.status_code == get.status_code == 200, (url, head.status_code, get.status_code)
        assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"], url
    assert httpx.head(srv.url + "/wallet/self/package").status_code == 401  # auth still applies
    assert httpx.head(srv.url + "/v1/tts", headers=auth()).status_code == 405  # POST-only stays so


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_reference_audio_is_400(srv, value):
    """A float WAV of NaN/inf decoded fine and the codec made a voice of all-zero codes (200);
    the voice library already refused the same file."""
    audio = float_wav(np.full(22050, value))
    body = {"text": "Hello.", "format": "pcm", "references": [{"audio": sine_wav(), "text": "ok"},
                                                               {"audio": audio, "text": "bad"}]}
    assert_error(post(srv, "/v1/tts", body), 400, "references[1]: the audio decodes to non-finite")
    oai = {"input": "Hello.", "references": [{"audio": base64.b64encode(audio).decode(), "text": "bad"}]}
    assert_error(post(srv, "/v1/audio/speech", oai, content_type="application/json"), 400, "non-finite")
    with httpx.Client(base_url=srv.url, headers=auth(), timeout=30) as client, \
            connect_ws("/v1/tts/live", client, keepalive_ping_interval_seconds=None) as ws:
        ws.send_bytes(ormsgpack.packb({"event": "start", "request": {"format": "pcm", "references": [
            {"audio": audio, "text": "bad"}]}}))
        fin = ormsgpack.unpackb(ws.receive_bytes(timeout=20))
    assert fin["event"] == "finish" and fin["reason"] == "error" and "non-finite" in fin["message"], fin


def test_references_past_the_context_stop_encoding_early(srv, service, monkeypatch):
    """Every inline reference was encoded (serialised codec work, ~0.06 s per second of audio on
    this CPU) before the prompt was found too long for the context; a few MB of references bought
    minutes of codec time for a certain 400. Encoding now stops once the codes outgrow it."""
    monkeypatch.setattr(service.engine.engine, "max_seq_len", 256)  # ~11 one-second references
    encoded = []
    real = service.tts.encode_reference
    monkeypatch.setattr(service.tts, "encode_reference", lambda samples: encoded.append(1) or real(samples))
    refs = [{"audio": sine_wav(1000.0 + 37 * i, seconds=1.0, rate=8000), "text": f"r{i}"} for i in range(30)]
    assert_error(post(srv, "/v1/tts", {"text": "Hi.", "references": refs}), 400, "context")
    assert 0 < len(encoded) <= 13, len(encoded)


# =========================================================================== already held: regressions
BAD_FIELDS = [  # (id, raw JSON body, status, message fragment)
    ("temperature-nan", b'{"text": "hi", "temperature": NaN}', 422, "temperature"),
    ("top-p-inf", b'{"text": "hi", "top_p": Infinity}', 422, "top_p"),
    ("speed-nan", b'{"text": "hi", "prosody": {"speed": NaN}}', 422, "speed"),
    ("volume-inf", b'{"text": "hi", "prosody": {"volume": -Infinity}}', 422, "volume"),
    ("max-new-tokens-overflow", b'{"text": "hi", "max_new_tokens": 1e400}', 422, "max_new_tokens"),
    ("max-new-tokens-negative", b'{"text": "hi", "max_new_tokens": -1}', 422, "max_new_tokens"),
    ("chunk-length-fraction", b'{"text": "hi", "chunk_length": 150.5}', 422, "chunk_length"),
    ("seed-64-bit", b'{"text": "hi", "seed": 18446744073709551616}', 422, "seed"),
    ("sample-rate-huge", b'{"text": "hi", "format": "wav", "sample_rate": 1180591620717411303424}', 400,
     "sample_rate"),
    ("sample-rate-negative", b'{"text": "hi", "format": "pcm", "sample_rate": -1}', 400, "sample_rate"),
    ("mp3-bitrate-huge", b'{"text": "hi", "format": "mp3", "mp3_bitrate": 1180591620717411303424}', 400, "bitrate"),
    ("opus-bitrate-zero", b'{"text": "hi", "format": "opus", "opus_bitrate": 0}', 400, "bitrate"),
    ("format-padded", b'{"text": "hi", "format": " wav "}', 400, "format"),
    ("format-number", b'{"text": "hi", "format": 5}', 422, "format"),
    ("normalize-number", b'{"text": "hi", "normalize": 2}', 422, "normalize"),
    ("reference-id-numbers", b'{"text": "hi", "reference_id": [1, 2]}', 422, "reference_id"),
    ("reference-id-traversal", b'{"text": "hi", "reference_id": "../../etc/passwd"}', 404, "reference_id"),
    ("reference-empty-audio", b'{"text": "hi", "references": [{"audio": "", "text": "t"}]}', 400, "references[0]"),
    ("trailing-garbage", b'{"text": "hi"}garbage', 400, "json"),
    ("not-utf8", b'{"text": "\xff"}', 400, "json"),
]


@pytest.mark.parametrize("raw,status,fragment", [c[1:] for c in BAD_FIELDS], ids=[c[0] for c in BAD_FIELDS])
def test_hostile_fields_get_4xx_json(srv, raw, status, fragment):
    assert_error(post(srv, "/v1/tts", raw=raw, content_type="application/json"), status, fragment)


@pytest.mark.parametrize("raw,fragment", [
    (b"\x91" * 100_000 + b"\xc0", "msgpack"),  # nested past the parser's limit
    (b"\x81\xa4text\xd4\x01\x00", "msgpack"),  # an ext type
    (b"\x81\x01\x02", "msgpack"),  # a non-string key
    (b"\x81\xa4text\xdb\x7f\xff\xff\xff", "msgpack"),  # a string that claims 2 GiB
], ids=["deep", "ext", "int-key", "lying-length"])
def test_hostile_msgpack_is_400(srv, raw, fragment):
    assert_error(post(srv, "/v1/tts", raw=raw), 400, fragment)


def test_openai_route_hostile_fields(srv):
    def speech(body: dict) -> httpx.Response:
        return post(srv, "/v1/audio/speech", {"input": "Hi.", "response_format": "pcm", **body},
                    content_type="application/json")

    assert_error(speech({"voice": "../../etc/passwd"}), 404, "reference_id")
    assert_error(speech({"voice": {"id": ""}}), 404, "reference_id")
    assert_error(speech({"voice": ["alloy"]}), 422, "voice")
    assert_error(speech({"speed": 0}), 422, "speed")
    assert_error(speech({"response_format": "ogg"}), 400, "format")
    assert_error(post(srv, "/v1/audio/speech", raw=b'{"input": "hi", "speed": NaN}', content_type="application/json"),
                 422, "speed")
    assert speech({"voice": " ALLOY ", "response_format": "WAV"}).content[:4] == b"RIFF"  # case and spaces


def test_auth_header_edge_cases(srv):
    body = ormsgpack.packb({"text": "Hi.", "format": "pcm"})

    def call(value: str | None) -> httpx.Response:
        headers = {"content-type": "application/msgpack"}
        if value is not None:
            headers["authorization"] = value
        return httpx.post(srv.url + "/v1/tts", content=body, headers=headers, timeout=60)

    for value in (None, "", "Bearer", f"Basic {KEY}", KEY, f"Token {KEY}", f"Bearer {KEY}x", f"Bearer {KEY} extra"):
        resp = call(value)
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer", value
        assert set(resp.json()) == ERROR_KEYS
    assert call(f"bearer {KEY}").status_code == 200  # the scheme is case-insensitive


def test_odd_but_valid_references_are_accepted(srv):
    rng = np.random.default_rng(0)
    for audio in (float_wav(rng.uniform(-0.3, 0.3, 22050), channels=2),  # stereo
                  float_wav(rng.uniform(-0.3, 0.3, 22050), channels=6),  # 5.1
                  float_wav(rng.uniform(-0.3, 0.3, 96000), rate=192000)):  # a high rate
        resp = post(srv, "/v1/tts", {"text": "Hello.", "format": "pcm", "references": [{"audio": audio, "text": "r"}]})
        assert resp.status_code == 200 and len(resp.content) > 0, resp.text[:200]
    truncated = sine_wav()[:1000]  # a valid header but a few samples
    assert_error(post(srv, "/v1/tts", {"text": "Hi.", "references": [{"audio": truncated, "text": "t"}]}), 400,
                 "too short")


def test_concurrent_create_delete_and_use_of_voices(srv):
    """Deletes racing each other, reads, updates and syntheses: every answer a 200 or a JSON 404,
    each voice deleted exactly once, and a voice nobody deleted survives untouched."""
    keep = create_voice(srv, "Bystander")
    ids = [create_voice(srv, f"Racer {i}") for i in range(3)]

    async def race() -> list[tuple[int, str, httpx.Response]]:
        async with httpx.AsyncClient(base_url=srv.url, headers=auth(), timeout=60) as client:
            jobs = []
            for i, vid in enumerate(ids):
                jobs += [(i, "delete", client.delete(f"/model/{vid}")), (i, "delete", client.delete(f"/model/{vid}")),
                         (i, "get", client.get(f"/model/{vid}")),
                         (i, "patch", client.patch(f"/model/{vid}", json={"title": "Renamed"})),
                         (i, "tts", client.post("/v1/tts", content=ormsgpack.packb(
                             {"text": "Hi.", "format": "pcm", "reference_id": vid}),
                             headers={"content-type": "application/msgpack"}))]
            answers = await asyncio.gather(*(j for _, _, j in jobs))
            return [(i, what, r) for (i, what, _), r in zip(jobs, answers)]

    results = asyncio.run(race())
    for i, what, resp in results:
        assert resp.status_code in (200, 404), (what, resp.status_code, resp.text[:200])
        if resp.status_code == 404:
            assert set(resp.json()) == ERROR_KEYS
    for i in range(len(ids)):
        assert sorted(r.status_code for j, what, r in results if j == i and what == "delete") == [200, 404]
        assert_error(httpx.get(srv.url + f"/model/{ids[i]}", headers=auth()), 404)
    got = httpx.get(srv.url + f"/model/{keep}", headers=auth())
    assert got.status_code == 200 and got.json()["title"] == "Bystander"
    assert post(srv, "/v1/tts", {"text": "Still here.", "format": "pcm", "reference_id": keep}).status_code == 200


def _receive_finish(ws, timeout: float = 20.0) -> tuple[dict, int | None]:
    while True:
        ev = ormsgpack.unpackb(ws.receive_bytes(timeout=timeout))
        if ev["event"] == "finish":
            break
    try:
        ws.receive_bytes(timeout=5)
        return ev, None
    except WebSocketDisconnect as e:
        return ev, e.code
    except (TimeoutError, queue.Empty):
        return ev, None


def test_live_garbage_after_start_and_abrupt_disconnects(srv, service):
    with httpx.Client(base_url=srv.url, headers=auth(), timeout=30) as client:
        with connect_ws("/v1/tts/live", client, keepalive_ping_interval_seconds=None) as ws:
            ws.send_bytes(ormsgpack.packb({"event": "start", "request": {"format": "pcm"}}))
            ws.send_bytes(ormsgpack.packb({"event": "text", "text": "Hello. "}))
            ws.send_bytes(b"\xc1 not msgpack")
            fin, code = _receive_finish(ws)
        assert fin["reason"] == "error" and "msgpack" in fin["message"] and code == 1008, (fin, code)
        # gone while the reference is encoded, and gone right after the text: nothing is left behind
        for frames in ([{"event": "start", "request": {"format": "pcm", "references": [
                            {"audio": sine_wav(611.0, seconds=3.0), "text": "r"}]}}],
                       [{"event": "start", "request": {"format": "pcm"}},
                        {"event": "text", "text": "A sentence to say."}]):
            with connect_ws("/v1/tts/live", client, keepalive_ping_interval_seconds=None) as ws:
                for f in frames:
                    ws.send_bytes(ormsgpack.packb(f))
            assert wait_until(lambda: engine_idle(service) and srv.state.limiter.in_flight(KEY) == 0
                              and service._preparing == 0, 15)
