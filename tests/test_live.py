"""``WS /v1/tts/live``, tested live: uvicorn on a free 127.0.0.1 port, the tiny S2 checkpoint on CPU,
driven by the official SDK (fish-audio-sdk 1.3.0: ``tts.stream_websocket`` sync and async, legacy
``WebSocketSession``) and by raw httpx-ws where a test needs the wire (seeds, frames, close codes,
pings)."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import numpy as np
import ormsgpack
import pytest
from httpx_ws import WebSocketDisconnect, WebSocketUpgradeError, connect_ws
from live_server import SR, LiveServer, decode, engine_idle, server_factory, service_fixture, sine_wav, wait_until

from shoal.server.app import create_app
from shoal.server.config import ServerConfig
from shoal.server.live import LiveConfig, TextSegmenter, voice_prefix_grid

KEY = "live-key"
FRAME = 2048
CAP = 10  # frames per segment on the main server (the legacy SDK cannot set max_new_tokens)


# --------------------------------------------------------------------------- live servers
service = service_fixture(max_running=16)


def _app(service, live: LiveConfig | None = None, **kw):
    app = create_app(service, ServerConfig(**kw))
    if live is not None:
        app.state.live_config = live
    return app


@pytest.fixture(scope="module")
def main(service) -> Iterator[LiveServer]:
    with LiveServer(_app(service, api_keys=frozenset({KEY}), max_new_tokens_cap=CAP)) as srv:
        yield srv


@pytest.fixture
def make_server(service) -> Iterator[Callable[..., LiveServer]]:
    with server_factory(lambda live=None, **kw: _app(service, live, **kw)) as make:
        yield make


# --------------------------------------------------------------------------- raw wire helpers
@contextmanager
def live_ws(srv: LiveServer, key: str | None = KEY) -> Iterator:
    headers = {"model": "s2-pro"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    with (httpx.Client(base_url=srv.url, headers=headers, timeout=30) as client,
          connect_ws("/v1/tts/live", client, keepalive_ping_interval_seconds=None) as ws):
        yield ws


def send(ws, event: dict) -> None:
    ws.send_bytes(ormsgpack.packb(event))


def start_event(**request) -> dict:
    base = {"text": "", "format": "pcm", "chunk_length": 200, "latency": "balanced", "references": [],
            "reference_id": None, "prosody": None, "sample_rate": None}
    return {"event": "start", "request": {**base, **request}}


def collect(ws, timeout: float = 60.0) -> tuple[bytes, dict, int | None]:
    """Audio until finish; then the close code (None when the socket stayed open)."""
    audio = []
    deadline = time.monotonic() + timeout
    while True:
        ev = ormsgpack.unpackb(ws.receive_bytes(timeout=max(deadline - time.monotonic(), 0.1)))
        assert isinstance(ev, dict) and "event" in ev, ev
        if ev["event"] == "audio":
            assert isinstance(ev["audio"], bytes)
            audio.append(ev["audio"])
        elif ev["event"] == "finish":
            break
    try:
        ws.receive_bytes(timeout=10)
        code = None
    except WebSocketDisconnect as e:
        code = e.code
    return b"".join(audio), ev, code


def run_live(srv: LiveServer, words: list[str], *, flush_each: bool = False, **request) -> bytes:
    with live_ws(srv) as ws:
        send(ws, start_event(**request))
        for w in words:
            send(ws, {"event": "text", "text": w})
            if flush_each:
                send(ws, {"event": "flush"})
        send(ws, {"event": "stop"})
        audio, fin, code = collect(ws)
    assert fin == {"event": "finish", "reason": "stop"} and code == 1000, (fin, code)
    return audio


def post_tts(srv: LiveServer, body: dict) -> bytes:
    r = httpx.post(srv.url + "/v1/tts", content=ormsgpack.packb(body), timeout=60,
                   headers={"content-type": "application/msgpack", "authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.content


def s16(b: bytes) -> np.ndarray:
    return np.frombuffer(b, "<i2").astype(np.int32)


def assert_close_lsb(a: bytes, b: bytes, what="") -> None:
    """Same length, within 1 LSB, nearly all samples identical: concurrent requests' audio is
    decoded in one batched codec call whose float rounding can flip an int16 by one step (see
    tests/test_server.py::test_16_concurrent_requests_equal_their_solo_output)."""
    x, y = s16(a), s16(b)
    assert len(x) == len(y) > 0, (what, len(x), len(y))
    d = np.abs(x - y)
    assert d.max() <= 1 and (d > 0).mean() < 0.2, (what, d.max(), (d > 0).mean())


# --------------------------------------------------------------------------- segmentation
def test_text_segmenter():
    seg = TextSegmenter(100)
    out = []
    for w in ["Hello", "there.", "How", "are", "you", "today?", "I", "am", "fine"]:
        out += seg.feed(w + " ")
    assert out == ["Hello there.", "How are you today?"] and seg.buffer.strip() == "I am fine"
    assert seg.flush() == ["I am fine"] and seg.flush() == []

    assert TextSegmenter(100).feed("Wait...") == ["Wait..."]  # a sentence end at the end of the buffer
    s = TextSegmenter(100)
    assert s.feed("It costs 3.") == [] and s.feed("14 dollars. Ok") == ["It costs 3.14 dollars."]
    assert TextSegmenter(100).feed("He said \"go!\" and left") == ["He said \"go!\""]
    assert TextSegmenter(100).feed("你好。今天好吗？很好") == ["你好。", "今天好吗？"]
    assert TextSegmenter(100).feed("line one\nline two") == ["line one"]
    assert TextSegmenter(100).feed("v1.2 is out") == []  # no space after the dot: not an end

    dialogue = TextSegmenter(100)  # the speaker still talking carries over to the next segment
    assert dialogue.feed("<|speaker:0|>Hi there. How are you? <|speaker:1|>Fine. Thanks") == [
        "<|speaker:0|>Hi there.", "<|speaker:0|>How are you?", "<|speaker:1|>Fine."]
    assert dialogue.flush() == ["<|speaker:1|>Thanks"]

    long = TextSegmenter(100)  # over chunk_length bytes: cut at the last soft break within it
    pieces = long.feed("word " * 15 + "clause, " + "more " * 20)
    assert pieces and all(len(p.encode()) <= 100 for p in pieces) and pieces[0].endswith("clause,")
    cjk = TextSegmenter(100)  # 3-byte characters, no space at all: a hard cut at the limit
    pieces = cjk.feed("字" * 70)
    assert [len(p) for p in pieces] == [33, 33] and cjk.buffer == "字" * 4


# --------------------------------------------------------------------------- official SDKs
def test_sdk_stream_websocket_new_client_sync_and_async(main):
    from fishaudio import (
        AsyncFishAudio,
        FishAudio,
        FlushEvent,
        ReferenceAudio,
        TTSConfig,
    )

    def words():
        yield from ["Hello ", "from ", "the ", "live ", "socket. "]
        yield FlushEvent()
        yield from ["And ", "a second ", "sentence."]

    with FishAudio(api_key=KEY, base_url=main.url) as client:
        chunks = list(client.tts.stream_websocket(words(), config=TTSConfig(format="pcm", max_new_tokens=8)))
        assert chunks and all(isinstance(c, bytes) for c in chunks)
        n = len(b"".join(chunks)) // 2
        assert n == 2 * 8 * FRAME  # two segments, 8 frames each (the tiny model never stops early)

        wav = b"".join(client.tts.stream_websocket(iter(["Cloned voice, wav."]), format="wav",
                                                   references=[ReferenceAudio(audio=sine_wav(), text="Ref.")],
                                                   config=TTSConfig(max_new_tokens=6)))
        assert wav[:4] == b"RIFF"
        audio, rate = decode("wav", wav)
        assert rate == SR and len(audio) == 6 * FRAME

        mp3 = b"".join(client.tts.stream_websocket(iter(["Default mp3 at speed."]), speed=1.5))
        audio, rate = decode("mp3", mp3)
        assert rate == SR and len(audio) > 0

        assert list(client.tts.stream_websocket(iter([]))) == []  # empty input: finish, no audio

    async def run_async():
        async def agen():
            for w in ["Async ", "words ", "arrive. ", "Then more."]:
                await asyncio.sleep(0.01)
                yield w

        async with AsyncFishAudio(api_key=KEY, base_url=main.url) as client:
            out = [c async for c in client.tts.stream_websocket(agen(), format="opus")]

            async def nothing():
                return
                yield

            empty = [c async for c in client.tts.stream_websocket(nothing())]
        return out, empty

    chunks, empty = asyncio.run(run_async())
    assert b"".join(chunks)[:4] == b"OggS" and empty == []
    audio, rate = decode("opus", b"".join(chunks))
    assert rate == 48000 and len(audio) > 0


def test_sdk_legacy_websocket_session(main):
    from fish_audio_sdk import (
        AsyncWebSocketSession,
        ReferenceAudio,
        TTSRequest,
        WebSocketSession,
    )

    ws = WebSocketSession(KEY, base_url=main.url)
    req = TTSRequest(text="", format="pcm", references=[ReferenceAudio(audio=sine_wav(330), text="Hi.")])
    chunks = list(ws.tts(req, iter(["Legacy ", "session ", "speaking. ", "Done"]), backend="s2-pro"))
    assert len(b"".join(chunks)) // 2 == 2 * CAP * FRAME  # the server caps frames at CAP per segment

    async def run_async():
        session = AsyncWebSocketSession(KEY, base_url=main.url)

        async def text():
            yield "Legacy async."

        return [c async for c in session.tts(TTSRequest(text="", format="mp3"), text())]

    audio, rate = decode("mp3", b"".join(asyncio.run(run_async())))
    assert rate == SR and len(audio) > 0


def test_bad_key_is_rejected_before_the_upgrade(main):
    from fishaudio import FishAudio

    with pytest.raises(WebSocketUpgradeError) as err, live_ws(main, key="wrong"):
        pass
    assert err.value.response.status_code == 401
    with pytest.raises(WebSocketUpgradeError), FishAudio(api_key="wrong", base_url=main.url) as client:
        list(client.tts.stream_websocket(iter(["x"])))


def test_plain_http_to_the_websocket_route_is_426(main):
    import httpx

    for method in ("GET", "POST"):
        r = httpx.request(method, main.url + "/v1/tts/live", json={"text": "x"} if method == "POST" else None)
        assert r.status_code == 426, (method, r.status_code, r.text)
        assert r.headers["upgrade"] == "websocket"
        body = r.json()
        assert body["status"] == 426 and "WebSocket" in body["message"]


# --------------------------------------------------------------------------- same audio as /v1/tts
EQUAL_TEXT = ["Hello ", "there, ", "my ", "friend. ", "How ", "are ", "you ", "today?"]
EQUAL_SEGMENTS = ["Hello there, my friend.", "How are you today?"]


@pytest.mark.parametrize("lookahead", [0, 1])
def test_output_equals_v1_tts_per_segment(make_server, lookahead):
    """The socket's audio for a fixed seed = the concatenation of /v1/tts for each segment
    (same seed, same parameters). Serial segments (lookahead 0) are bit-exact; pipelined ones
    may be decoded in one codec batch with the previous segment (1 LSB)."""
    srv = make_server(LiveConfig(lookahead=lookahead))
    common = {"seed": 1234, "max_new_tokens": 12, "format": "pcm", "temperature": 0.7, "top_p": 0.7, "latency": "balanced",
              "chunk_length": 200}
    got = run_live(srv, EQUAL_TEXT, **common)
    want = b"".join(post_tts(srv, {**common, "text": seg}) for seg in EQUAL_SEGMENTS)
    if lookahead == 0:
        assert got == want
    else:
        assert_close_lsb(got, want)

    # prosody runs per segment, as per request; an inline voice
    ref = [{"audio": sine_wav(275), "text": "A voice."}]
    extra = {**common, "prosody": {"speed": 1.25, "volume": -3.0}, "references": ref}
    got = run_live(srv, EQUAL_TEXT, flush_each=False, **extra)
    want = b"".join(post_tts(srv, {**extra, "text": seg}) for seg in EQUAL_SEGMENTS)
    if lookahead == 0:
        assert got == want
    else:
        assert_close_lsb(got, want)


def test_flush_forces_synthesis_and_drains_lossy_encoders(main):
    """`flush` synthesises the buffer now (no sentence end needed) and, for a lossy format,
    releases the encoder's held tail; the socket stays open for more text."""
    with live_ws(main) as ws:
        send(ws, start_event(format="mp3", seed=3, max_new_tokens=6))
        send(ws, {"event": "text", "text": "no sentence end here"})
        with pytest.raises((TimeoutError, queue.Empty)):  # buffered: nothing is synthesised yet
            ws.receive_bytes(timeout=0.6)
        send(ws, {"event": "flush"})
        got = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # all of it arrives without more text
            try:
                ev = ormsgpack.unpackb(ws.receive_bytes(timeout=1.0))
            except (TimeoutError, queue.Empty):
                if got:
                    break
                continue
            assert ev["event"] == "audio"
            got.append(ev["audio"])
        audio, _ = decode("mp3", b"".join(got))
        assert len(audio) >= 6 * FRAME  # every generated sample is out (plus the drain's silence)
        send(ws, {"event": "stop"})
        _, fin, code = collect(ws)
        assert fin["reason"] == "stop" and code == 1000


def test_reference_id_goes_through_the_resolver(make_server, service):
    """`reference_id` resolves through the service's voice resolver (the voice library's hook):
    the same audio as the same voice sent inline, and as /v1/tts with that reference_id."""
    from shoal.server.errors import APIError

    ref_audio, ref_text = sine_wav(390.0), "A voice from the library."
    refs = asyncio.run(service.encode_references([[(ref_audio, ref_text)]]))[0]

    class Library:
        async def resolve(self, reference_id: str):
            if reference_id == "lib-voice":
                return refs
            raise APIError(404, f"unknown reference_id {reference_id!r}")

    srv = make_server(LiveConfig(lookahead=0))
    saved, service.resolver = service.resolver, Library()
    try:
        common = {"seed": 77, "max_new_tokens": 6, "latency": "balanced"}
        by_id = run_live(srv, ["Spoken by ", "a library voice."], reference_id="lib-voice", **common)
        inline = run_live(srv, ["Spoken by ", "a library voice."],
                          references=[{"audio": ref_audio, "text": ref_text}], **common)
        http = post_tts(srv, {**common, "format": "pcm", "reference_id": "lib-voice",
                              "text": "Spoken by a library voice."})
        assert by_id == inline == http and len(by_id) == 6 * FRAME * 2
    finally:
        service.resolver = saved


# --------------------------------------------------------------------------- prefill at start
def test_start_prefills_the_voice_prefix(main, service):
    pool = service.engine.engine.pool
    ref_audio, ref_text = sine_wav(517.0, seconds=1.5), "A unique voice for the prefill test."

    async def prefix() -> np.ndarray:
        groups = await service.encode_references([[(ref_audio, ref_text)]])
        refs = service.speaker_references(groups)
        return voice_prefix_grid(service.family, service.tts.tokenizer, refs, 200)

    grid = asyncio.run(prefix())
    blocks = (grid.shape[1] - 1) // pool.block_size  # the prefill computes all but the last column
    assert blocks >= 4
    # before the socket: at most the shared system-instruction blocks are cached, not the voice
    assert pool.peek_prefix(grid) <= (blocks - 2) * pool.block_size

    with live_ws(main) as ws:
        send(ws, start_event(references=[{"audio": ref_audio, "text": ref_text}], seed=5, max_new_tokens=4))
        # before any text: the prefix's K/V is computed and sits in the prefix cache, to the
        # token (its full pages shared, the open last page kept as a copy source)
        assert wait_until(lambda: pool.peek_prefix(grid) == grid.shape[1] - 1, 10)
        assert wait_until(lambda: engine_idle(service), 10)
        hits = pool.hit_tokens
        send(ws, {"event": "text", "text": "Now the text arrives."})
        send(ws, {"event": "stop"})
        audio, fin, code = collect(ws)
    assert fin["reason"] == "stop" and code == 1000 and len(audio) == 4 * FRAME * 2
    assert pool.hit_tokens - hits >= grid.shape[1] - 1  # the first text request hit all of it

    text = httpx.get(main.url + "/metrics").text
    count = [ln for ln in text.splitlines() if ln.startswith("shoal_live_time_to_first_audio_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1


# --------------------------------------------------------------------------- concurrency
def test_8_concurrent_sockets_with_different_voices_never_mix(main, service):
    jobs = [{"seed": 40 + i, "max_new_tokens": 8,
             "references": [{"audio": sine_wav(180.0 + 45 * i), "text": f"Voice number {i}."}]}
            for i in range(8)]
    words = ["Every ", "socket ", "has ", "its ", "own ", "voice. ", "Two ", "segments."]
    solo = [run_live(main, words, **job) for job in jobs]

    results: list[bytes | BaseException] = [b""] * len(jobs)

    def one(i: int) -> None:
        try:
            with live_ws(main) as ws:
                send(ws, start_event(**jobs[i]))
                for w in words:
                    send(ws, {"event": "text", "text": w})
                    time.sleep(0.005)
                send(ws, {"event": "stop"})
                audio, fin, code = collect(ws)
                assert fin["reason"] == "stop" and code == 1000, fin
                results[i] = audio
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = e

    peak = 0
    watching = True

    def watch() -> None:
        nonlocal peak
        while watching:
            peak = max(peak, service.engine.num_running)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    watching = False
    watcher.join()
    assert peak >= 4, peak  # the sockets really were decoded together
    for i, (a, b) in enumerate(zip(solo, results)):
        assert isinstance(b, bytes), b
        assert_close_lsb(a, b, f"socket {i}")
    assert len({s[: 4 * FRAME] for s in solo}) == len(solo)  # the voices/seeds really differ
    assert wait_until(lambda: engine_idle(service))


# --------------------------------------------------------------------------- errors
ERROR_CASES = [  # (id, frames to send, close code, message fragment)
    ("malformed-msgpack", [b"\xc1\xc1\xc1"], 1008, "msgpack"),
    ("text-frame", ["a text frame"], 1003, "binary"),
    ("not-a-map", [ormsgpack.packb([1, 2, 3])], 1008, "map"),
    ("no-event", [ormsgpack.packb({"text": "hi"})], 1008, "event"),
    ("text-before-start", [ormsgpack.packb({"event": "text", "text": "hi"})], 1008, "before 'start'"),
    ("stop-before-start", [ormsgpack.packb({"event": "stop"})], 1008, "before 'start'"),
    ("unknown-event", [ormsgpack.packb(start_event()), ormsgpack.packb({"event": "dance"})], 1008, "unknown event"),
    ("double-start", [ormsgpack.packb(start_event()), ormsgpack.packb(start_event())], 1008, "already"),
    ("start-without-request", [ormsgpack.packb({"event": "start"})], 1008, "request"),
    ("bad-chunk-length", [ormsgpack.packb(start_event(chunk_length=50))], 1008, "chunk_length"),
    ("bad-format", [ormsgpack.packb(start_event(format="ogg"))], 1008, "format"),
    ("bad-speed", [ormsgpack.packb(start_event(prosody={"speed": 5.0, "volume": 0}))], 1008, "speed"),
    ("text-not-a-string", [ormsgpack.packb(start_event()), ormsgpack.packb({"event": "text", "text": 5})],
     1008, "string"),
    ("bad-reference-audio", [ormsgpack.packb(start_event(references=[{"audio": b"nope", "text": "t"}])),
                             ormsgpack.packb({"event": "text", "text": "hi."})], 1008, "references[0]"),
    ("unknown-reference-id", [ormsgpack.packb(start_event(reference_id="no-such-voice"))], 1008, "reference_id"),
    ("text-too-long", [ormsgpack.packb(start_event()), ormsgpack.packb({"event": "text", "text": "x " * 9000})],
     1008, "limit"),
    ("voice-outgrows-context", [ormsgpack.packb(start_event(references=[{"audio": sine_wav(), "text": "x " * 4900}]))],
     1008, "context"),  # rejected by the engine at the prefill
]


@pytest.mark.parametrize("frames,close_code,fragment", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_errors_finish_with_error_not_a_hang(main, service, frames, close_code, fragment):
    with live_ws(main) as ws:
        for f in frames:
            if isinstance(f, str):
                ws.send_text(f)
            else:
                ws.send_bytes(f)
        audio, fin, code = collect(ws, timeout=20)
    assert fin["event"] == "finish" and fin["reason"] == "error", fin
    assert fragment.lower() in fin["message"].lower(), fin
    assert code == close_code and audio == b""
    assert wait_until(lambda: engine_idle(service))


def test_sdk_raises_on_finish_error(main):
    from fishaudio import FishAudio, TTSConfig
    from fishaudio.exceptions import WebSocketError

    with FishAudio(api_key=KEY, base_url=main.url) as client, pytest.raises(WebSocketError):
        list(client.tts.stream_websocket(iter(["hi."]), reference_id="unknown-voice",
                                         config=TTSConfig(format="pcm")))


def test_idle_timeout_only_when_nothing_is_generating(make_server, service):
    srv = make_server(LiveConfig(idle_timeout_s=0.5))
    with live_ws(srv) as ws:
        t = time.monotonic()
        send(ws, start_event(seed=1, max_new_tokens=120))  # ~1.5 s of generation on CPU: > timeout
        send(ws, {"event": "text", "text": "A longer sentence to generate."})
        audio, fin, code = collect(ws, timeout=30)
        took = time.monotonic() - t
    assert fin["reason"] == "error" and "idle timeout" in fin["message"] and code == 1008
    assert len(audio) == 120 * FRAME * 2  # the whole segment was generated first
    assert took > 1.0
    assert wait_until(lambda: engine_idle(service))

    with live_ws(srv) as ws:  # no start at all
        audio, fin, code = collect(ws, timeout=10)
    assert fin["reason"] == "error" and "idle" in fin["message"]


# --------------------------------------------------------------------------- lifecycle
def test_stop_finish_close_1000_and_empty_input(main):
    with live_ws(main) as ws:
        send(ws, start_event(format="wav"))
        send(ws, {"event": "stop"})
        audio, fin, code = collect(ws)
    assert audio == b"" and fin == {"event": "finish", "reason": "stop"} and code == 1000

    with live_ws(main) as ws:  # text in the start request itself is spoken too
        send(ws, start_event(text="Text in the start request.", max_new_tokens=3, seed=2))
        send(ws, {"event": "stop"})
        audio, fin, code = collect(ws)
    assert len(audio) == 3 * FRAME * 2 and fin["reason"] == "stop" and code == 1000


def _long_socket(srv: LiveServer):
    """A socket generating a long segment, its first audio frame read."""
    cm = live_ws(srv)
    ws = cm.__enter__()
    send(ws, start_event(seed=9, max_new_tokens=3000, latency="low"))
    send(ws, {"event": "text", "text": "A very long story begins."})
    ev = ormsgpack.unpackb(ws.receive_bytes(timeout=30))
    assert ev["event"] == "audio"
    return cm, ws


def test_disconnect_mid_generation_frees_engine_slots(make_server, service):
    srv = make_server()  # no frame cap
    cm, _ws = _long_socket(srv)
    time.sleep(0.2)
    assert service.engine.num_running == 1
    cm.__exit__(None, None, None)  # the client goes away mid-generation
    assert wait_until(lambda: engine_idle(service), 10), "the socket's engine request was not aborted"
    assert wait_until(lambda: srv.app.state.shoal.limiter.in_flight(KEY) == 0
                      and srv.app.state.shoal.metrics.in_flight._value.get() == 0, 5)


def test_pings_are_answered_while_audio_is_generating(make_server, service):
    srv = make_server()
    cm, ws = _long_socket(srv)
    try:
        for _ in range(3):
            pong = ws.ping()
            assert pong.wait(5), "no pong while generating"
            ev = ormsgpack.unpackb(ws.receive_bytes(timeout=10))
            assert ev["event"] == "audio"  # still generating
        assert service.engine.num_running == 1
    finally:
        cm.__exit__(None, None, None)
    assert wait_until(lambda: engine_idle(service), 10)


def test_per_key_concurrency_counts_sockets(make_server, service):
    srv = make_server(api_keys=frozenset({KEY}), max_concurrency_per_key=1)
    cm, _ws = _long_socket(srv)
    try:
        with pytest.raises(WebSocketUpgradeError) as err, live_ws(srv):
            pass
        assert err.value.response.status_code == 429
    finally:
        cm.__exit__(None, None, None)
    assert wait_until(lambda: engine_idle(service), 10)
    assert wait_until(lambda: srv.app.state.shoal.limiter.in_flight(KEY) == 0, 5)


# --------------------------------------------------------------------------- the benchmark
def test_bench_live_smoke(main, tmp_path):
    from shoal.bench.live import main as bench_main

    out = tmp_path / "bench"
    ws_url = main.url.replace("http://", "ws://")
    rc = bench_main(["--url", ws_url, "--api-key", KEY, "--concurrency", "1,2", "--sentences", "2",
                     "--words-per-second", "40", "--max-new-tokens", "4", "--out", str(out), "--no-plot"])
    assert rc == 0
    data = json.loads((out / "live.json").read_text())
    levels = data["results"]
    assert [r["concurrency"] for r in levels] == [1, 2]
    for r in levels:
        assert r["errors"] == 0 and r["sockets"] == r["concurrency"]
        assert 0 < r["ttfa_p50_ms"] <= r["ttfa_p99_ms"] and r["total_p50_s"] > 0 and r["audio_s_mean"] > 0
