"""The voice library over HTTP, tested live: uvicorn on 127.0.0.1, the tiny S2 checkpoint on
CPU, the official clients (``fishaudio`` voices.*, legacy ``fish_audio_sdk`` Session model
calls, ``openai``), raw httpx for the wire, and ``shoal voices`` on the same folder."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import ormsgpack
import pytest
import soundfile as sf
from live_server import LiveServer, assert_error, service_fixture, sine_wav

from shoal.server.app import create_app
from shoal.server.config import ServerConfig
from shoal.voices import StoreLimits

KEY, KEY2 = "voice-key", "other-key"
CAP = 8
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32
JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 32
VOICE_KEYS = {"_id", "type", "title", "description", "cover_image", "train_mode", "state", "tags", "samples",
              "created_at", "updated_at", "languages", "visibility", "lock_visibility", "like_count",
              "mark_count", "shared_count", "task_count", "liked", "marked", "author"}


service = service_fixture(max_running=4)


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def srv(service, voices_dir) -> Iterator[LiveServer]:
    config = ServerConfig(api_keys=frozenset({KEY, KEY2}), max_new_tokens_cap=CAP, voices_dir=str(voices_dir))
    with LiveServer(create_app(service, config)) as server:
        yield server


def tone(seconds: float = 1.0, freq: float = 220.0, rate: int = 22050) -> bytes:
    return sine_wav(freq, seconds, rate)


def auth(key: str = KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def post_tts(srv: LiveServer, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(srv.url + "/v1/tts", content=ormsgpack.packb(body), timeout=60,
                      headers={**auth(key), "content-type": "application/msgpack", "model": "s2-pro"})


def create_raw(srv: LiveServer, title: str = "Raw", n: int = 1, key: str = KEY, **fields) -> httpx.Response:
    data = {"title": title, "type": "tts", "train_mode": "fast", "texts": [f"Sample number {i}." for i in range(n)],
            **fields}
    files = [("voices", ("upload", tone(0.6 + 0.2 * i, 200 + 40 * i), "application/octet-stream"))
             for i in range(n)]
    return httpx.post(srv.url + "/model", data=data, files=files, headers=auth(key), timeout=60)


# --------------------------------------------------------------------------- official SDKs
def test_new_sdk_voice_lifecycle(srv):
    from fishaudio import FishAudio, TTSConfig
    from fishaudio.exceptions import NotFoundError

    with FishAudio(api_key=KEY, base_url=srv.url) as client:
        voice = client.voices.create(title="Lifecycle", voices=[tone(1.0), tone(1.2, 330)],
                                     texts=["Hello there.", "A second sample."], tags=["sdk", "new"],
                                     description="made by fishaudio", cover_image=PNG)
        assert len(voice.id) == 32 and voice.train_mode == "fast" and voice.state == "trained"
        assert voice.visibility == "private" and voice.type == "tts" and voice.languages == ["en"]
        assert [s.text for s in voice.samples] == ["Hello there.", "A second sample."]
        assert voice.cover_image.startswith(srv.url) and voice.tags == ["sdk", "new"]
        assert httpx.get(voice.cover_image, headers=auth()).content == PNG
        sample = httpx.get(voice.samples[0].audio, headers=auth())
        assert sample.status_code == 200 and sample.content == tone(1.0)
        assert sample.headers["content-type"] == "audio/wav"

        got = client.voices.get(voice.id)
        assert got.id == voice.id and got.description == "made by fishaudio"

        for i in range(2):
            client.voices.create(title=f"Lifecycle extra {i}", voices=[tone(0.5)], texts=["Extra."],
                                 tags=["extra"])
        page1 = client.voices.list(page_size=2, page_number=1, title="lifecycle", sort_by="created_at")
        page2 = client.voices.list(page_size=2, page_number=2, title="lifecycle", sort_by="created_at")
        assert page1.total == page2.total == 3 and len(page1.items) == 2 and len(page2.items) == 1
        assert page2.items[0].id == voice.id  # the oldest comes last
        assert {v.id for v in client.voices.list(tags=["sdk"], self_only=True).items} == {voice.id}
        assert client.voices.list(tags="new", language="en").total == 1
        assert client.voices.list(tags=["nope"]).total == 0

        client.voices.update(voice.id, title="Lifecycle renamed", tags=["renamed"], visibility="unlist")
        client.voices.update(voice.id, cover_image=JPEG)  # multipart
        updated = client.voices.get(voice.id)
        assert (updated.title, updated.tags, updated.visibility) == ("Lifecycle renamed", ["renamed"], "unlist")
        assert updated.updated_at > voice.updated_at
        assert httpx.get(updated.cover_image, headers=auth()).content == JPEG

        wav = client.tts.convert(text="Speak with the stored voice.", reference_id=voice.id,
                                 config=TTSConfig(format="wav", max_new_tokens=6))
        assert wav[:4] == b"RIFF" and len(wav) > 44
        assert client.voices.get(voice.id).task_count == 1

        client.voices.delete(voice.id)
        with pytest.raises(NotFoundError):
            client.voices.get(voice.id)
        with pytest.raises(NotFoundError):
            client.tts.convert(text="Gone.", reference_id=voice.id)
        with pytest.raises(NotFoundError):
            client.voices.delete(voice.id)


def test_legacy_sdk_model_calls(srv):
    from fish_audio_sdk import HttpCodeErr, Session, TTSRequest

    session = Session(KEY, base_url=srv.url)
    model = session.create_model(title="Legacy voice", voices=[tone(0.8)], texts=["Legacy words."],
                                 tags=["legacy"], visibility="public", cover_image=PNG)
    assert model.train_mode == "fast" and model.visibility == "public" and model.cover_image
    listed = session.list_models(self_only=True, tag="legacy")
    assert listed.total == 1 and listed.items[0].id == model.id
    assert session.get_model(model.id).title == "Legacy voice"

    session.update_model(model.id, title="Legacy renamed", description="now described")  # form-urlencoded
    session.update_model(model.id, cover_image=JPEG, tags=["legacy", "cover"])  # multipart
    got = session.get_model(model.id)
    assert (got.title, got.description, got.tags) == ("Legacy renamed", "now described", ["legacy", "cover"])

    audio = b"".join(session.tts(TTSRequest(text="Legacy cloning.", reference_id=model.id, format="wav"),
                                 backend="s2-pro"))
    assert audio[:4] == b"RIFF"

    session.delete_model(model.id)
    with pytest.raises(HttpCodeErr) as err:
        session.get_model(model.id)
    assert err.value.status == 404


def test_ownership_and_visibility(srv):
    from fishaudio import FishAudio
    from fishaudio.exceptions import PermissionError as FishPermissionError

    with FishAudio(api_key=KEY, base_url=srv.url) as mine, FishAudio(api_key=KEY2, base_url=srv.url) as other:
        private = mine.voices.create(title="Owner private", voices=[tone(0.5)], texts=["Mine."], tags=["owner"])
        public = mine.voices.create(title="Owner public", voices=[tone(0.5)], texts=["Ours."], tags=["owner"],
                                    visibility="public")
        assert private.author.id == public.author.id != "local"
        assert {v.id for v in other.voices.list(tags="owner").items} == {public.id}
        assert {v.id for v in mine.voices.list(tags="owner").items} == {private.id, public.id}
        assert other.voices.list(tags="owner", self_only=True).total == 0
        assert other.voices.list(author_id=private.author.id, tags="owner").total == 1
        assert other.voices.get(private.id).id == private.id  # the id is enough to use a voice
        with pytest.raises(FishPermissionError):
            other.voices.update(private.id, title="stolen")
        with pytest.raises(FishPermissionError):
            other.voices.delete(public.id)
        assert mine.voices.get(private.id).title == "Owner private"
        mine.voices.delete(private.id)
        mine.voices.delete(public.id)


# --------------------------------------------------------------------------- wire-level errors
def test_create_and_query_errors(srv):
    url = srv.url + "/model"
    resp = httpx.post(url, data={"title": "No texts", "type": "tts"},
                      files=[("voices", ("a.wav", tone(), "audio/wav"))], headers=auth())
    assert_error(resp, 400, "texts are required: this server has no ASR")
    assert_error(create_raw(srv, title=""), 400, "title")
    assert_error(create_raw(srv, type="svc"), 400, "tts")
    assert_error(create_raw(srv, train_mode="slow"), 400, "train_mode")
    resp = httpx.post(url, data={"title": "Count", "texts": ["one", "two"]},
                      files=[("voices", ("a.wav", tone(), "audio/wav"))], headers=auth())
    assert_error(resp, 400, "one transcript per file")
    assert_error(httpx.post(url, data={"title": "None", "texts": ["x"]}, headers=auth()), 400, "voices")
    text_as_wav = b"This is a text file renamed voice.wav, not audio at all.\n" * 10
    resp = httpx.post(url, data={"title": "Text", "texts": ["x"]},
                      files=[("voices", ("voice.wav", text_as_wav, "audio/wav"))], headers=auth())
    assert_error(resp, 415, "voices[0]")
    assert_error(create_raw(srv, visibility="secret"), 400, "visibility")
    assert_error(httpx.post(url, content=b"<xml/>", headers={**auth(), "content-type": "text/xml"}), 415)
    resp = httpx.post(url, data={"title": "Bad cover", "texts": ["x"]}, headers=auth(),
                      files=[("voices", ("a", tone(), "x/y")), ("cover_image", ("c", b"not an image", "x/y"))])
    assert_error(resp, 415, "cover_image")
    assert_error(httpx.post(url, data={"title": "x", "texts": ["x"]}, files=[("voices", ("a", tone(), "x"))]), 401)

    store = srv.store
    saved = store.limits
    store.limits = StoreLimits(max_sample_bytes=30_000, max_total_bytes=60_000)
    try:
        one = [("voices", ("a", tone(0.8), "x"))]  # 35 KB > 30 KB
        resp = httpx.post(url, data={"title": "Big", "texts": ["a"]}, files=one, headers=auth())
        assert_error(resp, 413, "voices[0]")
        three = [("voices", (n, tone(0.6), "x")) for n in "abc"]  # 3 x 26 KB > 60 KB
        resp = httpx.post(url, data={"title": "Big", "texts": ["a", "b", "c"]}, files=three, headers=auth())
        assert_error(resp, 413, "limit")
        store.limits = StoreLimits(max_total_bytes=1000)  # the HTTP layer stops a body past cap + 1 MiB
        resp = httpx.post(url, data={"title": "Huge", "texts": ["a"]}, headers=auth(),
                          files=[("voices", ("a", b"RIFF" + b"\0" * (1 << 21), "x"))])
        assert_error(resp, 413, "limit")
    finally:
        store.limits = saved

    for method in ("GET", "PATCH", "DELETE"):
        assert_error(httpx.request(method, url + "/0123456789abcdef0123456789abcdef", headers=auth()), 404,
                     "unknown voice")
    assert_error(httpx.get(url + "/..%2F..%2Fetc", headers=auth()), 404)
    assert_error(httpx.get(url, params={"page_size": 0}, headers=auth()), 422, "page_size")
    assert_error(httpx.get(url, params={"page_size": 101}, headers=auth()), 422, "page_size")
    assert_error(httpx.get(url, params={"page_number": "x"}, headers=auth()), 422, "page_number")
    assert_error(httpx.get(url, params={"sort_by": "likes"}, headers=auth()), 422, "sort_by")
    assert len(store) == 0 or all(v.title not in ("Text", "Big", "Bad cover") for v in store.list(page_size=100)[1])


def test_create_accepts_json_and_patch_accepts_json(srv):
    import base64

    body = {"title": "JSON voice", "texts": ["From JSON."], "tags": ["json"],
            "voices": [base64.b64encode(tone(0.5)).decode()]}
    resp = httpx.post(srv.url + "/model", json=body, headers=auth())
    assert resp.status_code == 201, resp.text
    voice = resp.json()
    assert VOICE_KEYS <= set(voice) and voice["tags"] == ["json"] and voice["visibility"] == "public"
    resp = httpx.patch(srv.url + f"/model/{voice['_id']}", json={"title": "JSON renamed", "tags": []},
                       headers=auth())
    assert resp.status_code == 200 and resp.json()["title"] == "JSON renamed" and resp.json()["tags"] == []
    resp = httpx.patch(srv.url + f"/model/{voice['_id']}", content=ormsgpack.packb({"cover_image": PNG}),
                       headers={**auth(), "content-type": "application/msgpack"})
    assert resp.status_code == 200 and resp.json()["cover_image"]
    assert httpx.delete(srv.url + f"/model/{voice['_id']}", headers=auth()).json() == {
        "_id": voice["_id"], "deleted": True}


# --------------------------------------------------------------------------- synthesis
def test_same_voice_twice_hits_the_prefix_cache(srv, service):
    resp = create_raw(srv, title="Cache voice", n=2)
    assert resp.status_code == 201, resp.text
    vid = resp.json()["_id"]
    pool = service.engine.engine.pool
    body = {"text": "The prefix cache should hit.", "reference_id": vid, "format": "pcm", "seed": 7,
            "max_new_tokens": 4, "temperature": 0.7}
    h0 = pool.hit_tokens
    first = post_tts(srv, body)
    assert first.status_code == 200
    h1 = pool.hit_tokens
    second = post_tts(srv, body)
    assert second.status_code == 200
    h2 = pool.hit_tokens
    # 2 samples = ~1.6 s of reference = ~34 codec frames in the prompt, besides the text tokens
    assert h2 - h1 >= 32 and h2 - h1 > h1 - h0, (h0, h1, h2)
    assert first.content == second.content  # same seed, same prompt: same audio

    # the resolver hands out the cached codes: the identical prompt, no re-encoding
    async def resolve():
        return await service.resolve_voices([vid]), await service.resolve_voices([vid])

    (a,), (b,) = asyncio.run(resolve())
    assert len(a) == len(b) == 1  # one voice = one reference (its samples merged)
    assert a[0].text == b[0].text == "Sample number 0. Sample number 1."
    assert np.array_equal(a[0].codes, b[0].codes)
    store = srv.store
    hits = store.cache_hits
    store.references(vid)
    assert store.cache_hits == hits + 1


def test_openai_voice_and_multi_speaker(srv, service):
    from openai import NotFoundError, OpenAI

    ids = []
    for title in ("Speaker A", "Speaker B"):
        resp = create_raw(srv, title=title, n=1)
        assert resp.status_code == 201
        ids.append(resp.json()["_id"])

    client = OpenAI(api_key=KEY, base_url=srv.url + "/v1")
    wav = client.audio.speech.create(model="tts-1", voice=ids[0], input="OpenAI with a stored voice.",
                                     response_format="wav", extra_body={"max_new_tokens": 4}).read()
    assert wav[:4] == b"RIFF"
    with pytest.raises(NotFoundError):
        client.audio.speech.create(model="tts-1", voice="0" * 32, input="x")

    dialogue = {"text": "<|speaker:0|>Hello there.<|speaker:1|>Hi, how are you?", "reference_id": ids,
                "format": "wav", "max_new_tokens": 4}
    assert post_tts(srv, dialogue).status_code == 200

    async def groups():
        return service.speaker_references(await service.resolve_voices(ids))

    refs = asyncio.run(groups())
    assert [r.text for r in refs] == ["<|speaker:0|>Sample number 0.", "<|speaker:1|>Sample number 0."]
    assert_error(post_tts(srv, {**dialogue, "reference_id": [ids[0], "f" * 32]}), 404, "reference_id")


def test_unknown_reference_id_is_404_json(srv):
    assert_error(post_tts(srv, {"text": "hi", "reference_id": "802e3bc2b27e49c2995d23ef70e6ac89"}), 404,
                 "reference_id")
    assert_error(post_tts(srv, {"text": "hi", "reference_id": "../../etc/passwd"}), 404, "reference_id")


# --------------------------------------------------------------------------- CLI on the same folder
def test_cli_voice_is_usable_by_the_server(srv, voices_dir, tiny_s2_checkpoint, tmp_path, capsys):
    from fishaudio import FishAudio

    from shoal.voices.cli import main as voices_main

    clip = tmp_path / "carol.flac"
    sf.write(clip, (0.3 * np.sin(np.arange(30000) / 7)).astype(np.float32), 24000, format="FLAC")
    common = ["--voices-dir", str(voices_dir)]
    assert voices_main(["add", "Carol", "--audio", str(clip), "--text", "Carol speaks here.", "--id", "carol",
                        "--tag", "cli", "--checkpoint", str(tiny_s2_checkpoint), *common]) == 0
    assert capsys.readouterr().out.strip() == "carol"
    assert voices_main(["add", "Bad", "--audio", str(clip), "--id", "../x", *common]) == 2  # no --text
    assert voices_main(["add", "Bad", "--audio", str(clip), "--text", "t", "--id", "../x", *common]) == 2
    capsys.readouterr()

    with FishAudio(api_key=KEY, base_url=srv.url) as client:
        voice = client.voices.get("carol")
        assert voice.title == "Carol" and voice.author.id == "local" and voice.tags == ["cli"]
        wav = client.tts.convert(text="Carol, from the command line.", reference_id="carol", format="wav")
        assert wav[:4] == b"RIFF"
    store = srv.store
    folder = store.blobs / store.get("carol").storage_key
    assert len(list(folder.glob("*.npy"))) == 1  # the CLI's codec = the server's: nothing re-encoded

    assert voices_main(["list", *common]) == 0
    assert "carol" in capsys.readouterr().out
    assert voices_main(["list", "--json", *common]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert any(v["id"] == "carol" and v["task_count"] == 1 for v in listed)
    assert voices_main(["show", "carol", *common]) == 0
    assert "Carol speaks here." in capsys.readouterr().out
    assert voices_main(["rm", "carol", *common]) == 0
    assert voices_main(["show", "carol", *common]) == 2
    assert_error(post_tts(srv, {"text": "hi", "reference_id": "carol"}), 404, "reference_id")
    assert not folder.exists()


def test_server_without_a_voice_library(service):
    server = LiveServer(create_app(service, ServerConfig()))
    try:
        resp = httpx.get(server.url + "/model")
        assert resp.status_code == 200 and resp.json()["total"] == 0 and resp.json()["items"] == []
        assert_error(create_raw(server), 501, "voice library")
        assert_error(httpx.get(server.url + "/model/abc"), 404, "--voices-dir")
    finally:
        server.stop()


def test_serve_flag():
    import argparse

    from shoal.server.cli import _voices_dir, add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--voices-dir", "/tmp/v"])
    assert _voices_dir(args.voices_dir) == "/tmp/v"
    assert _voices_dir("none") is None
    assert _voices_dir(parser.parse_args(["serve"]).voices_dir).endswith("voices")


# --------------------------------------------------------------------------- hostile bodies
def _wav(samples: np.ndarray, rate: int, subtype: str = "PCM_16") -> bytes:
    import io

    buf = io.BytesIO()
    sf.write(buf, samples.astype(np.float32), rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def test_tiny_low_rate_or_overlong_references_are_refused_from_the_header(srv):
    """A few KB of 1 Hz audio declares hours of sound and resampled to gigabytes (the server was
    OOM-killed); it, and audio over the 120 s limit, are now refused before decoding, quickly,
    inline and in the voice library, and nothing is stored."""
    import time

    noise = np.random.default_rng(0).uniform(-0.3, 0.3, 5000)
    low = _wav(noise, 1)  # ~10 KB, "5000 s" at 1 Hz
    long = _wav(np.zeros(4000 * 121), 4000, "PCM_U8")  # 121 s at 4 kHz, 484 KB
    t = time.perf_counter()
    assert_error(post_tts(srv, {"text": "hi", "references": [{"audio": low, "text": "t"}]}), 400, "4000 Hz")
    assert_error(post_tts(srv, {"text": "hi", "references": [{"audio": long, "text": "t"}]}), 400,
                 "the limit is 120 s")
    before = len(srv.store)
    for audio, why in ((low, "4000 Hz"), (long, "the limit is 120 s")):
        resp = httpx.post(srv.url + "/model", data={"title": "Hostile", "texts": ["t"]}, headers=auth(),
                          files=[("voices", ("a.wav", audio, "audio/wav"))], timeout=60)
        assert_error(resp, 400, why)
    assert time.perf_counter() - t < 20  # the 1 Hz file alone took 30 s to 60 s and GBs before
    assert len(srv.store) == before


def test_json_bodies_with_lone_surrogates_or_deep_nesting_are_400(srv):
    """JSON can spell strings that are not Unicode text ("\\ud800") and nest past the parser's
    recursion limit: both were 500s (a surrogate tag was even stored, breaking every later read
    of the voice); now 400 before anything runs, and the voice stays as it was."""
    headers = {**auth(), "content-type": "application/json"}
    deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/v1/tts", "/v1/audio/speech"):
        field = "text" if path == "/v1/tts" else "input"
        resp = httpx.post(srv.url + path, content=b'{"%s": "\\ud800 hi", "voice": "alloy"}' % field.encode(),
                          headers=headers, timeout=60)
        assert_error(resp, 400, "unicode")
        assert_error(httpx.post(srv.url + path, content=deep, headers=headers, timeout=60), 400, "nested")
    voice = create_raw(srv, title="Surrogate target").json()
    url = srv.url + f"/model/{voice['_id']}"
    assert_error(httpx.patch(url, content=b'{"tags": ["\\udfff"]}', headers=headers), 400, "unicode")
    assert_error(httpx.post(srv.url + "/model", content=b'{"title": "x", "tags": ["\\udfff"], "texts": ["a"]}',
                            headers=headers), 400, "unicode")
    assert_error(httpx.patch(url, content=deep.replace(b'"text"', b'"tags"'), headers=headers), 400, "nested")
    for bad, why in (({"title": {"a": 1}}, "not an object"), ({"tags": [["x"]]}, "nested list"),
                     ({"tags": [[[[["x"]]]]] * 2}, "nested list")):
        assert_error(httpx.patch(url, json=bad, headers=auth()), 400, why)
    got = httpx.get(url, headers=auth())
    assert got.status_code == 200 and got.json()["tags"] == voice["tags"]
    assert httpx.delete(url, headers=auth()).status_code == 200
