"""The HTTP server, tested live: uvicorn on a free 127.0.0.1 port, the tiny S2 checkpoint on CPU,
driven by the official clients (fish-audio-sdk 1.3.0: ``fishaudio`` and legacy
``fish_audio_sdk``; ``openai``) and by raw httpx where a test needs the wire."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import ormsgpack
import pytest
from live_server import (SR, LiveServer, assert_error, decode, engine_idle, server_factory, service_fixture,
                         sine_wav, wait_until)

from shoal.server.app import create_app
from shoal.server.config import ServerConfig
from shoal.server.service import TTSService

KEY, KEY2 = "test-key", "second-key"
FRAME = 2048
CAP = 12  # frames per request on the main server (the legacy SDK cannot set max_new_tokens)


# --------------------------------------------------------------------------- live servers
service = service_fixture(max_running=16)


@pytest.fixture(scope="module")
def main(service) -> Iterator[LiveServer]:
    config = ServerConfig(api_keys=frozenset({KEY, KEY2}), max_new_tokens_cap=CAP, max_text_length=12_000,
                          max_body_bytes=1 << 20)
    with LiveServer(create_app(service, config)) as srv:
        yield srv


@pytest.fixture
def make_server(service) -> Iterator[Callable[..., LiveServer]]:
    """Extra servers over the same service, with their own config (no frame cap by default)."""
    with server_factory(lambda **kw: create_app(service, ServerConfig(**kw))) as make:
        yield make


# --------------------------------------------------------------------------- helpers
def post_tts(srv: LiveServer, body: dict, *, key: str | None = KEY, model: str = "s2-pro",
             content_type: str = "application/msgpack", raw: bytes | None = None) -> httpx.Response:
    headers = {"content-type": content_type, "model": model}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    data = raw if raw is not None else ormsgpack.packb(body)
    return httpx.post(srv.url + "/v1/tts", content=data, headers=headers, timeout=60)


# --------------------------------------------------------------------------- official SDKs
def test_fishaudio_sdk_convert_and_stream(main):
    from fishaudio import AsyncFishAudio, FishAudio, TTSConfig

    with FishAudio(api_key=KEY, base_url=main.url) as client:
        wav = client.tts.convert(text="Hello from shoal.", config=TTSConfig(format="wav", max_new_tokens=8))
        assert wav[:4] == b"RIFF"
        audio, rate = decode("wav", wav)
        assert rate == SR and 0 < len(audio) <= 8 * FRAME and len(audio) % FRAME == 0

        chunks = list(client.tts.stream(text="Streaming, please.", format="pcm", latency="balanced"))
        assert chunks and all(isinstance(c, bytes) for c in chunks)
        n = len(b"".join(chunks)) // 2
        assert 0 < n <= CAP * FRAME and n % FRAME == 0  # the server caps frames at CAP

        mp3 = client.tts.stream(text="Collect it.", config=TTSConfig(format="mp3", max_new_tokens=6)).collect()
        audio, rate = decode("mp3", mp3)
        assert rate == SR and len(audio) > 0

    async def run_async():
        async with AsyncFishAudio(api_key=KEY, base_url=main.url) as client:
            return await client.tts.convert(text="Async hello.", format="opus",
                                            config=TTSConfig(max_new_tokens=6))

    opus = asyncio.run(run_async())
    assert opus[:4] == b"OggS"


def test_fishaudio_sdk_cloning_and_speed(main):
    from fishaudio import FishAudio, ReferenceAudio, TTSConfig

    ref = ReferenceAudio(audio=sine_wav(), text="A reference transcript.")
    with FishAudio(api_key=KEY, base_url=main.url) as client:
        out = client.tts.convert(text="Clone this voice.", references=[ref], speed=1.5,
                                 config=TTSConfig(format="wav", max_new_tokens=6))
    audio, rate = decode("wav", out)
    assert rate == SR and len(audio) > 0


def test_legacy_sdk_streams(main):
    from fish_audio_sdk import Prosody, ReferenceAudio, Session, TTSRequest

    session = Session(KEY, base_url=main.url)
    chunks = list(session.tts(TTSRequest(text="Legacy client here.", format="mp3")))
    assert len(chunks) >= 1
    audio, rate = decode("mp3", b"".join(chunks))
    assert rate == SR and len(audio) > 0

    req = TTSRequest(text="Legacy cloning.", format="wav",
                     references=[ReferenceAudio(audio=sine_wav(), text="Reference words.")],
                     prosody=Prosody(speed=1.0, volume=3.0))
    audio, rate = decode("wav", b"".join(session.tts(req, backend="s2-pro")))
    assert rate == SR and len(audio) > 0


def test_openai_sdk(main):
    from openai import NotFoundError, OpenAI

    client = OpenAI(api_key=KEY, base_url=main.url + "/v1")
    extra = {"max_new_tokens": 8, "seed": 11}
    resp = client.audio.speech.create(model="tts-1", voice="alloy", input="Hello OpenAI.",
                                      response_format="wav", extra_body=extra)
    wav = resp.read()
    audio, rate = decode("wav", wav)
    assert rate == SR and len(audio) > 0
    frames = len(audio) // FRAME

    with client.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice="echo", input="Hello OpenAI.", response_format="pcm",
            extra_body=extra) as streamed:
        assert streamed.headers["x-shoal-sample-rate"] == "24000"
        pcm = b"".join(streamed.iter_bytes())
    want = frames * FRAME * 24000 / SR  # OpenAI pcm: 24 kHz s16le
    assert abs(len(pcm) // 2 - want) <= 4

    mp3 = client.audio.speech.create(model="tts-1", voice="nova", input="Default format.",
                                     extra_body=extra).read()
    assert decode("mp3", mp3)[1] == SR

    sse = client.audio.speech.create(model="tts-1", voice="alloy", input="Hello OpenAI.",
                                     response_format="pcm", stream_format="sse", extra_body=extra).read()
    events = [json.loads(line[6:]) for line in sse.decode().splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done"
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == frames and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == pcm  # same seed, same audio

    with pytest.raises(NotFoundError):
        client.audio.speech.create(model="tts-1", voice="my-cloned-voice-id", input="x")


# --------------------------------------------------------------------------- formats and prosody
FORMAT_CASES = [  # (format, sample_rate asked, rate expected, duration tolerance in s)
    ("wav", None, 44100, 0.002), ("wav", 16000, 16000, 0.002), ("pcm", 24000, 24000, 0.002),
    ("pcm", 8000, 8000, 0.002), ("mp3", None, 44100, 0.08), ("mp3", 32000, 32000, 0.08),
    ("opus", None, 48000, 0.03), ("flac", None, 44100, 0.002), ("aac", None, 44100, 0.08),
]


def test_every_format_decodes_at_its_rate_and_length(main):
    body = {"text": "Formats are fun.", "seed": 5, "max_new_tokens": CAP}
    resp = post_tts(main, {**body, "format": "pcm"}, model="s2.1-pro-free")  # any model header value
    assert resp.status_code == 200 and resp.headers["content-type"] == "audio/pcm"
    n = len(resp.content) // 2
    assert n > 0 and n % FRAME == 0
    seconds = n / SR  # frames x 2048 / 44100
    for fmt, asked, rate, tol in FORMAT_CASES:
        resp = post_tts(main, {**body, "format": fmt, "sample_rate": asked})
        assert resp.status_code == 200, (fmt, resp.text)
        assert resp.headers["x-shoal-sample-rate"] == str(rate)
        audio, got_rate = decode(fmt, resp.content, pcm_rate=rate)
        assert got_rate == rate, (fmt, got_rate)
        assert abs(len(audio) / got_rate - seconds) <= tol, (fmt, asked, len(audio) / got_rate, seconds)
    wav = post_tts(main, {**body, "format": "wav"}).content
    assert int.from_bytes(wav[4:8], "little") == 4294967076  # streamed-WAV placeholder, as hosted


def test_prosody_speed_changes_duration(main):
    body = {"text": "Speed me up.", "seed": 9, "format": "pcm", "max_new_tokens": CAP}
    base = len(post_tts(main, body).content) // 2
    fast = len(post_tts(main, {**body, "prosody": {"speed": 2.0, "volume": 0}}).content) // 2
    slow = len(post_tts(main, {**body, "prosody": {"speed": 0.5, "volume": -6}}).content) // 2
    assert abs(fast - base / 2) <= 2 and abs(slow - base * 2) <= 2

    client = httpx.Client(base_url=main.url, headers={"authorization": f"Bearer {KEY}"})
    openai_body = {"model": "tts-1", "voice": "alloy", "input": "Speed me up.", "response_format": "pcm",
                   "sample_rate": 44100, "seed": 9, "max_new_tokens": CAP}
    r = client.post("/v1/audio/speech", json={**openai_body, "speed": 4.0})  # clamped to 2.0
    assert r.status_code == 200 and r.headers["x-shoal-speed"] == "2"
    assert abs(len(r.content) // 2 - base / 2) <= 2


def test_nil_fields_are_absent_and_references(main):
    legacy_like = {"text": "Nil means absent.", "sample_rate": None, "reference_id": None, "prosody": None,
                   "format": "wav", "latency": "low", "features": ["quality-guard"], "max_new_tokens": 4}
    assert post_tts(main, legacy_like).status_code == 200
    ref = {"audio": sine_wav(), "text": "Reference."}
    flat = {"text": "Cloned.", "references": [ref], "format": "pcm", "max_new_tokens": 4}
    assert post_tts(main, flat).status_code == 200
    dialogue = {"text": "<|speaker:0|>Hi there.<|speaker:1|>Hello back.", "format": "pcm",
                "references": [[ref], [ref]], "max_new_tokens": 4}
    assert post_tts(main, dialogue).status_code == 200
    as_json = {"text": "JSON body.", "format": "pcm", "max_new_tokens": 4,
               "references": [{"audio": base64.b64encode(sine_wav()).decode(), "text": "r"}]}
    r = httpx.post(main.url + "/v1/tts", json=as_json, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and len(r.content) > 0


# --------------------------------------------------------------------------- errors
def test_auth_failures(main):
    from fish_audio_sdk import HttpCodeErr, Session, TTSRequest
    from fishaudio import FishAudio
    from fishaudio.exceptions import AuthenticationError

    assert_error(post_tts(main, {"text": "x"}, key=None), 401, "missing")
    assert_error(post_tts(main, {"text": "x"}, key="nope"), 401, "invalid")
    r = httpx.post(main.url + "/v1/audio/speech", json={"input": "x"}, headers={"authorization": "Bearer bad"})
    assert_error(r, 401)
    assert_error(httpx.get(main.url + "/wallet/self/api-credit"), 401)
    with FishAudio(api_key="wrong", base_url=main.url) as client, pytest.raises(AuthenticationError):
        client.tts.convert(text="x")
    with pytest.raises(HttpCodeErr) as err:
        list(Session("wrong", base_url=main.url).tts(TTSRequest(text="x")))
    assert err.value.status == 401
    assert post_tts(main, {"text": "x", "max_new_tokens": 2}, key=KEY2).status_code == 200


def _bad_audio_ref() -> dict:
    return {"text": "hi", "references": [{"audio": sine_wav(), "text": "ok"}, {"audio": b"not audio", "text": "t"}]}


BAD_INPUTS = [  # (id, body or raw bytes, content type, status, message fragment)
    ("text-plain", b"text", "text/plain", 415, "content-type"),
    ("no-content-type", b"", "", 415, ""),
    ("garbage-msgpack", b"\xc1\xc1", "application/msgpack", 400, "msgpack"),
    ("garbage-json", b"{nope", "application/json", 400, "json"),
    ("not-an-object", ormsgpack.packb([1, 2]), "application/msgpack", 400, "object"),
    ("missing-text", {}, None, 422, "text"),
    ("text-not-str", {"text": 5}, None, 422, "text"),
    ("chunk-length", {"text": "hi", "chunk_length": 50}, None, 422, "chunk_length"),
    ("top-p", {"text": "hi", "top_p": 1.5}, None, 422, "top_p"),
    ("temperature", {"text": "hi", "temperature": -1}, None, 422, "temperature"),
    ("speed", {"text": "hi", "prosody": {"speed": 3.0}}, None, 422, "speed"),
    ("volume", {"text": "hi", "prosody": {"volume": 40}}, None, 422, "volume"),
    ("latency", {"text": "hi", "latency": "ultra"}, None, 422, "latency"),
    ("format", {"text": "hi", "format": "ogg"}, None, 400, "format"),
    ("sample-rate", {"text": "hi", "format": "wav", "sample_rate": 4000}, None, 400, "sample_rate"),
    ("opus-rate", {"text": "hi", "format": "opus", "sample_rate": 44100}, None, 400, "sample_rate"),
    ("mp3-bitrate", {"text": "hi", "format": "mp3", "mp3_bitrate": 5000}, None, 400, "bitrate"),
    ("empty-text", {"text": "   "}, None, 400, "empty"),
    ("text-too-long", {"text": "a" * 12_001}, None, 400, "limit"),
    ("bad-reference", _bad_audio_ref(), None, 400, "references[1]"),
    ("reference-id", {"text": "hi", "reference_id": "802e3bc2b27e49c2995d23ef70e6ac89"}, None, 404, "reference_id"),
    ("context-overflow", {"text": "x " * 5000}, None, 400, "context"),  # raised by the engine itself
    ("body-too-large", b"\x00" * ((1 << 20) + 1), "application/msgpack", 413, "limit"),
]


@pytest.mark.parametrize("body,ctype,status,fragment", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_get_status_and_exact_json(main, body, ctype, status, fragment):
    if isinstance(body, bytes):
        resp = post_tts(main, {}, raw=body, content_type=ctype)
    else:
        resp = post_tts(main, body)
    assert_error(resp, status, fragment)


def test_routing_and_openai_errors(main):
    headers = {"authorization": f"Bearer {KEY}"}
    assert_error(httpx.get(main.url + "/v1/nope", headers=headers), 404)
    assert_error(httpx.get(main.url + "/v1/tts", headers=headers), 405)
    speech = main.url + "/v1/audio/speech"
    assert_error(httpx.post(speech, json={"input": "x", "speed": 9}, headers=headers), 422, "speed")
    assert_error(httpx.post(speech, json={"input": "x", "response_format": "ogg"}, headers=headers), 400)
    assert_error(httpx.post(speech, json={"voice": "alloy"}, headers=headers), 422, "input")
    assert_error(httpx.post(speech, content=b"x", headers={**headers, "content-type": "application/msgpack"}), 415)
    assert_error(httpx.post(speech, json={"input": "x", "voice": {"id": "v1"}}, headers=headers), 404)


def test_sdk_errors_are_typed(main):
    from fish_audio_sdk import HttpCodeErr, Session, TTSRequest
    from fishaudio import FishAudio
    from fishaudio.exceptions import NotFoundError

    with FishAudio(api_key=KEY, base_url=main.url) as client, pytest.raises(NotFoundError):
        client.tts.convert(text="hi", reference_id="unknown-voice")
    with pytest.raises(HttpCodeErr) as err:
        list(Session(KEY, base_url=main.url).tts(TTSRequest(text="hi", reference_id="unknown-voice")))
    assert err.value.status == 404


# --------------------------------------------------------------------------- limits
def _hold_stream(srv: LiveServer, key: str = KEY):
    """Open a long synthesis and read its first bytes; returns (client, response, byte iterator).
    Keep the iterator referenced: dropping it closes the connection."""
    client = httpx.Client(timeout=30)
    req = client.build_request("POST", srv.url + "/v1/tts", content=ormsgpack.packb(
        {"text": "A very long story.", "format": "pcm", "max_new_tokens": 3000, "latency": "low"}),
        headers={"content-type": "application/msgpack", "authorization": f"Bearer {key}"})
    resp = client.send(req, stream=True)
    assert resp.status_code == 200
    chunks = resp.iter_raw()
    assert len(next(chunks)) > 0
    return client, resp, chunks


def test_disconnect_cancels_generation_and_frees_slot(make_server, service):
    srv = make_server()
    client, resp, chunks = _hold_stream(srv)
    # the first audio arrived while the engine is still generating: streamed, not buffered
    time.sleep(0.3)
    assert service.engine.num_running == 1 and srv.state.limiter.in_flight(KEY) == 1
    assert len(next(chunks)) > 0
    resp.close()
    client.close()
    assert wait_until(lambda: engine_idle(service), 10), "the slot was not freed after the disconnect"
    assert wait_until(lambda: srv.state.metrics.in_flight._value.get() == 0, 5)


def test_per_key_concurrency_limit_429(make_server, service):
    srv = make_server(api_keys=frozenset({KEY, KEY2}), max_concurrency_per_key=1, retry_after_s=2)
    client, resp, _chunks = _hold_stream(srv, KEY)
    try:
        r = post_tts(srv, {"text": "second", "max_new_tokens": 2})
        assert_error(r, 429, "concurrency")
        assert r.headers["retry-after"] == "2"
        assert post_tts(srv, {"text": "other key", "max_new_tokens": 2}, key=KEY2).status_code == 200
    finally:
        resp.close()
        client.close()
    assert wait_until(lambda: srv.state.limiter.in_flight(KEY) == 0 and engine_idle(service))
    assert post_tts(srv, {"text": "again", "max_new_tokens": 2}).status_code == 200


def test_overload_503(make_server, service):
    srv = make_server(max_pending=1)
    client, resp, _chunks = _hold_stream(srv, "anyone")  # open server: any token
    try:
        r = post_tts(srv, {"text": "one more", "max_new_tokens": 2}, key=None)
        assert_error(r, 503, "overloaded")
        assert "retry-after" in r.headers
    finally:
        resp.close()
        client.close()
    assert wait_until(lambda: engine_idle(service))


# --------------------------------------------------------------------------- concurrency
def test_16_concurrent_requests_equal_their_solo_output(main):
    """Same seed, same output, whatever the batch. The engine's codes are bit-exact across batch
    compositions (tests/test_async_engine.py); the codec decodes concurrent requests in one batched
    call whose float rounding differs from a batch of one by ~2e-6, which can flip an int16 by
    one step. So: same length, |diff| <= 1 LSB, nearly all samples identical."""
    bodies = [{"text": f"Request number {i} speaks.", "seed": 100 + i, "format": "pcm",
               "max_new_tokens": CAP} for i in range(16)]
    solo = [np.frombuffer(post_tts(main, b).content, "<i2") for b in bodies]

    async def run_all():
        async with httpx.AsyncClient(base_url=main.url, timeout=120,
                                     limits=httpx.Limits(max_connections=32)) as client:
            async def one(b):
                r = await client.post("/v1/tts", content=ormsgpack.packb(b), headers={
                    "content-type": "application/msgpack", "authorization": f"Bearer {KEY}"})
                assert r.status_code == 200, r.text
                return np.frombuffer(r.content, "<i2")
            return await asyncio.gather(*(one(b) for b in bodies))

    together = asyncio.run(run_all())
    for i, (a, b) in enumerate(zip(solo, together)):
        assert len(a) == len(b) > 0, i
        diff = np.abs(a.astype(np.int32) - b.astype(np.int32))
        assert diff.max() <= 1 and (diff > 0).mean() < 0.2, (i, diff.max(), (diff > 0).mean())
    assert np.abs(solo[0][:1000].astype(np.int32) - solo[1][:1000]).max() > 100  # seeds matter


# --------------------------------------------------------------------------- health, wallet, metrics
def test_wallet_via_sdks(main):
    from fish_audio_sdk import Session
    from fishaudio import FishAudio

    with FishAudio(api_key=KEY, base_url=main.url) as client:
        credits = client.account.get_credits(check_free_credit=True)
        assert credits.credit > 1000
        assert client.account.get_package().balance > 0
    session = Session(KEY, base_url=main.url)
    assert session.get_api_credit().credit > 1000
    assert session.get_package().finished_at


def test_metrics_exposed(main):
    post_tts(main, {"text": "metrics", "max_new_tokens": 2})
    text = httpx.get(main.url + "/metrics").text
    for name in ("shoal_http_requests_total", "shoal_queue_depth", "shoal_running_requests", "shoal_frames_total",
                 "shoal_time_to_first_audio_seconds_bucket", "shoal_kv_cache_usage_ratio",
                 "shoal_prefix_cache_hit_rate", "shoal_prefix_cache_copied_tokens_total",
                 "shoal_requests_in_flight", "shoal_ready",
                 "shoal_codec_calls_total", "shoal_codec_frames_total",
                 'shoal_codec_first_chunk_queue_seconds{quantile="0.5"}', 'shoal_codec_call_seconds{quantile="0.99"}'):
        assert name in text, name
    mem = {ln.split('"')[1]: float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("shoal_memory_bytes{")}
    assert set(mem) >= {"model_weights", "codec_weights", "kv_cache"} and all(v > 0 for v in mem.values()), mem
    calls = [ln for ln in text.splitlines() if ln.startswith("shoal_codec_calls_total")]
    assert calls and float(calls[0].split()[-1]) >= 1  # the request's audio went through the codec
    assert 'route="/v1/tts"' in text and 'status="200"' in text


class _SlowService:
    """Just enough of TTSService for readiness: warm-up waits for a gate."""

    family, sample_rate, max_running = "s2", SR, 4

    def __init__(self) -> None:
        self.ready = False
        self.gate = threading.Event()

    async def warmup(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.gate.wait, 30)
        self.ready = True

    def pending(self) -> int:
        return 0

    def snapshot(self) -> dict[str, float]:
        return dict.fromkeys(("waiting", "running", "preparing", "frames_total", "kv_usage", "prefix_hit_tokens",
                              "prefix_queried_tokens", "prefix_hit_rate", "max_running", "ready"), 0.0)


def test_ready_is_503_until_warm():
    stub = _SlowService()
    srv = LiveServer(create_app(stub, ServerConfig()), ready=False)  # type: ignore[arg-type]
    try:
        assert httpx.get(srv.url + "/v1/health").json() == {"status": "ok"}
        r = httpx.get(srv.url + "/v1/ready")
        assert_error(r, 503, "warming")
        assert "retry-after" in r.headers
        assert_error(post_tts(srv, {"text": "x"}), 503, "warming")
        stub.gate.set()
        assert wait_until(lambda: httpx.get(srv.url + "/v1/ready").status_code == 200)
    finally:
        stub.gate.set()
        srv.stop()


# --------------------------------------------------------------------------- service internals
def _first_chunk_frames(service: TTSService, latency: str) -> int:
    from shoal.engine.sampling import SamplingParams

    async def run():
        prepared = await service.prepare("Chunk sizes.", [], None)
        syn = await service.start(prepared.session, params=SamplingParams(greedy=True), seed=1,
                                  max_new_tokens=40, latency=latency)
        try:
            async for pcm in syn.pcm_chunks():
                return len(pcm) // FRAME
        finally:
            await syn.aclose()

    return asyncio.run(run())


def test_latency_sets_the_first_chunk(service):
    from shoal.server.service import LATENCY_SCHEDULES, PER_REQUEST_SCHEDULE

    got = {lat: _first_chunk_frames(service, lat) for lat in ("low", "balanced", "normal")}
    if PER_REQUEST_SCHEDULE:  # EngineRequest.audio_schedule exists: one schedule per request
        assert got == {lat: LATENCY_SCHEDULES[lat].first for lat in got}
    else:  # engine-wide schedule (the "balanced" one) for everybody
        assert set(got.values()) == {LATENCY_SCHEDULES["balanced"].first}
    assert wait_until(lambda: engine_idle(service))


def test_client_gone_before_first_event_aborts(service):
    from shoal.engine.sampling import SamplingParams
    from shoal.server.service import ClientDisconnected

    async def run():
        prepared = await service.prepare("Nobody is listening.", [], None)

        async def gone() -> None:
            return None

        with pytest.raises(ClientDisconnected):
            await service.start(prepared.session, params=SamplingParams(), seed=1, max_new_tokens=500,
                                disconnected=gone)

    asyncio.run(run())
    assert wait_until(lambda: engine_idle(service))


def test_serve_parser_and_keys_file(tmp_path):
    import argparse

    from shoal.server.auth import load_api_keys
    from shoal.server.cli import add_serve_parser, cmd_serve

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--port", "9000", "--api-key", "a", "--api-key", "b",
                              "--max-concurrency-per-key", "5", "--max-running", "8", "--max-text-length", "99"])
    assert args.func is cmd_serve and args.port == 9000 and args.api_key == ["a", "b"]
    assert args.checkpoint is None and args.host == "127.0.0.1" and args.max_running == 8

    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nk1\n\n  k2  # laptop\n")
    assert load_api_keys(["a"], keys) == {"a", "k1", "k2"}
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ValueError, match="no key"):
        load_api_keys([], tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys([], tmp_path / "missing.txt")
