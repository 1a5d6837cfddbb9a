"""VoiceStore unit tests: CRUD, id and upload validation, format sniffing, codes encoded once,
the code LRU and its invalidation, atomicity on failure, threads and a second process view."""

from __future__ import annotations

import io
import os
import sqlite3
import threading
import time

import numpy as np
import pytest
import soundfile as sf

from shoal.voices import (
    InvalidVoice,
    SampleInput,
    StoreLimits,
    TooLarge,
    UnsupportedMedia,
    VoiceExists,
    VoiceNotFound,
    VoiceStore,
    VoiceStoreError,
    guess_language,
)
from shoal.voices.media import sniff_audio, sniff_image
from shoal.voices.store import SCHEMA_VERSION

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64
JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 64


def tone(seconds: float = 1.0, rate: int = 22050, freq: float = 220.0, fmt: str = "WAV",
         subtype: str | None = None) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def m4a(seconds: float = 1.0, rate: int = 22050) -> bytes:
    import av

    x = (0.3 * np.sin(2 * np.pi * 220 * np.arange(int(seconds * rate)) / rate)).astype(np.float32)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        st = c.add_stream("aac", rate=rate)
        st.layout = "mono"
        frame = av.AudioFrame.from_ndarray(x[None], format="flt", layout="mono")
        frame.sample_rate = rate
        for pkt in [*st.encode(frame), *st.encode(None)]:
            c.mux(pkt)
    return buf.getvalue()


class CountingEncoder:
    """Deterministic fake codec: 10 codebooks, one frame per 2048 samples."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.calls = 0
        self.fail_on = fail_on
        self.lock = threading.Lock()

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        with self.lock:
            self.calls += 1
            n = self.calls
        if self.fail_on is not None and n == self.fail_on:
            raise RuntimeError("codec exploded")
        frames = max(1, samples.size // 2048)
        base = (np.abs(samples[: frames * 2048:2048]) * 4000).astype(np.int64) % 4096
        return np.stack([(base + k) % 4096 for k in range(10)])


@pytest.fixture
def enc() -> CountingEncoder:
    return CountingEncoder()


@pytest.fixture
def store(tmp_path, enc) -> VoiceStore:
    s = VoiceStore(tmp_path / "voices", encoder=enc, codec_key="codec1")
    yield s
    s.close()


def two_samples() -> list[SampleInput]:
    return [SampleInput(tone(1.0), "Hello there."), SampleInput(tone(1.5, freq=330), "Second clip.")]


def blob_dirs(store: VoiceStore) -> list[str]:
    return sorted(p.name for p in store.blobs.iterdir())


# --------------------------------------------------------------------------- CRUD
def test_create_get_list_update_delete(store, enc):
    v = store.create(title="Alice", samples=two_samples(), description="warm", tags=["en", "female"],
                     cover_image=PNG, visibility="private")
    assert len(v.id) == 32 and int(v.id, 16) >= 0
    assert (v.title, v.description, v.visibility, v.tags) == ("Alice", "warm", "private", ("en", "female"))
    assert [s.text for s in v.samples] == ["Hello there.", "Second clip."]
    assert [s.format for s in v.samples] == ["wav", "wav"] and v.samples[1].duration == pytest.approx(1.5)
    assert v.languages == ("en",) and v.cover_media_type == "image/png" and v.rev == 1
    assert store.get(v.id) == v and v.id in store and len(store) == 1
    assert enc.calls == 2

    w = store.update(v.id, title="Alicia", tags=["x"], visibility="unlisted", cover_image=JPEG)
    assert (w.title, w.tags, w.visibility, w.rev) == ("Alicia", ("x",), "unlist", 2)
    assert w.cover_media_type == "image/jpeg" and w.updated_at >= v.updated_at and w.created_at == v.created_at
    files = os.listdir(store.blobs / w.storage_key)
    assert sum(f.startswith("cover-") for f in files) == 1  # the old cover is gone
    assert store.cover_path(w).read_bytes() == JPEG
    path, sample = store.sample_path(w, w.samples[0].id)
    assert path.read_bytes() == tone(1.0) and sample.media_type == "audio/wav"

    gone = store.delete(v.id)
    assert gone.id == v.id and len(store) == 0 and blob_dirs(store) == []
    for call in (lambda: store.get(v.id), lambda: store.delete(v.id), lambda: store.references(v.id),
                 lambda: store.update(v.id, title="x")):
        with pytest.raises(VoiceNotFound):
            call()


def test_given_ids_and_validation(store):
    v = store.create(title="Bob", samples=two_samples()[:1], voice_id="bob_v2-en")
    assert v.id == "bob_v2-en" and store.get("BOB_V2-EN").id == "bob_v2-en"  # ids are case-insensitive
    with pytest.raises(VoiceExists):
        store.create(title="Bob again", samples=two_samples()[:1], voice_id="Bob_V2-en")
    bad_ids = ["../etc", "..", ".", "a/b", "a\\b", "/abs", "x" * 65, "", "has space", "-lead", "dot.ted",
               "%2e%2e", "new\nline", "ünï", "alloy"]
    for bad in bad_ids:
        with pytest.raises(InvalidVoice):
            store.create(title="x", samples=two_samples()[:1], voice_id=bad)
        assert store.get_optional(bad) is None
    with pytest.raises(InvalidVoice, match="title"):
        store.create(title="  ", samples=two_samples())
    with pytest.raises(InvalidVoice, match="texts\\[1\\]"):
        store.create(title="x", samples=[SampleInput(tone(), "ok"), SampleInput(tone(), " ")])
    with pytest.raises(InvalidVoice, match="at least one"):
        store.create(title="x", samples=[])
    with pytest.raises(InvalidVoice, match="visibility"):
        store.create(title="x", samples=two_samples(), visibility="secret")
    with pytest.raises(InvalidVoice, match="at least"):
        store.create(title="x", samples=[SampleInput(tone(0.05), "too short")])
    assert len(store) == 1 and len(blob_dirs(store)) == 1


def test_size_caps(tmp_path, enc):
    limits = StoreLimits(max_samples=3, max_sample_bytes=60_000, max_total_bytes=100_000, max_cover_bytes=100,
                         max_sample_seconds=1.2)
    store = VoiceStore(tmp_path / "v", encoder=enc, codec_key="c", limits=limits)
    with pytest.raises(TooLarge, match="voices\\[0\\]"):
        store.create(title="x", samples=[SampleInput(tone(1.5), "big")])  # 66 KB > 60 KB
    with pytest.raises(TooLarge, match="upload"):
        store.create(title="x", samples=[SampleInput(tone(1.0), "a"), SampleInput(tone(1.0), "b"),
                                         SampleInput(tone(0.5), "c")])  # 44 + 44 + 22 KB > 100 KB
    with pytest.raises(TooLarge, match="cover"):
        store.create(title="x", samples=[SampleInput(tone(0.5), "a")], cover_image=PNG + b"\0" * 100)
    with pytest.raises(InvalidVoice, match="4 audio samples"):
        store.create(title="x", samples=[SampleInput(tone(0.3), "a")] * 4)
    with pytest.raises(InvalidVoice, match="limit is 1.2 s"):
        store.create(title="x", samples=[SampleInput(tone(1.3, rate=8000), "long")])
    assert enc.calls == 0 and len(store) == 0 and blob_dirs(store) == []
    store.close()


# --------------------------------------------------------------------------- formats
def test_formats_are_sniffed_from_content(store):
    ok = {"wav": tone(), "flac": tone(fmt="FLAC"), "ogg": tone(fmt="OGG", subtype="VORBIS"),
          "mp3": tone(fmt="MP3", subtype="MPEG_LAYER_III"), "m4a": m4a()}
    for fmt, data in ok.items():
        assert sniff_audio(data) == fmt
    v = store.create(title="formats", samples=[SampleInput(d, f"sample {f}") for f, d in ok.items()])
    assert [s.format for s in v.samples] == list(ok)
    assert all(abs(s.duration - 1.0) < 0.1 for s in v.samples)

    not_audio = {
        "text renamed .wav": b"just some text pretending to be a .wav file\n" * 20,
        "RIFF but garbage": b"RIFF\x24\x00\x00\x00WAVEjunkjunkjunkjunk" + b"\x00" * 100,
        "png": PNG,
        "empty": b"",
        "aiff (decodable, not accepted)": tone(fmt="AIFF"),
    }
    for what, data in not_audio.items():
        with pytest.raises(UnsupportedMedia):
            store.create(title=what, samples=[SampleInput(data, "text")])
    with pytest.raises(UnsupportedMedia, match="cover"):
        store.create(title="x", samples=[SampleInput(tone(), "t")], cover_image=b"<svg></svg>" * 10)
    assert sniff_image(PNG) == "png" and sniff_image(JPEG) == "jpeg" and sniff_image(b"GIF89a" + b"0" * 10) == "gif"
    assert len(store) == 1


def test_language_guess():
    assert guess_language("Hello there") == "en"
    assert guess_language("你好，世界") == "zh"
    assert guess_language("こんにちは世界") == "ja"
    assert guess_language("안녕하세요") == "ko"
    assert guess_language("12345 !!") == ""


# --------------------------------------------------------------------------- codes and the LRU
def test_codes_are_encoded_once_and_cached(tmp_path, enc):
    root = tmp_path / "v"
    store = VoiceStore(root, encoder=enc, codec_key="codec1")
    v = store.create(title="A", samples=two_samples())
    assert enc.calls == 2
    first = store.references(v.id)
    again = store.references(v.id)
    assert enc.calls == 2 and store.cache_hits == 1
    assert [t for t, _ in first] == ["Hello there.", "Second clip."]
    assert all(a is b for (_, a), (_, b) in zip(first, again))  # the same arrays: the same prompt
    assert not first[0][1].flags.writeable
    codes_direct = enc(np.zeros(1))  # (a call of our own, to compare shapes)
    assert first[0][1].shape[0] == codes_direct.shape[0] == 10
    store.close()

    # another process with the same codec reads the stored codes: no encoding
    enc2 = CountingEncoder()
    other = VoiceStore(root, encoder=enc2, codec_key="codec1")
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(other.references(v.id), first))
    assert enc2.calls == 0
    other.close()

    # a different codec encodes each sample once from the stored audio, then keeps the codes
    enc3 = CountingEncoder()
    third = VoiceStore(root, encoder=enc3, codec_key="codec2")
    third.references(v.id)
    third.references(v.id)
    assert enc3.calls == 2
    third.close()
    fourth = VoiceStore(root, encoder=CountingEncoder(), codec_key="codec2")
    fourth.references(v.id)
    assert fourth.encoder.calls == 0
    assert len(list((root / "blobs" / v.storage_key).glob("*.npy"))) == 4
    fourth.close()


def test_lru_invalidated_on_update_and_delete_and_bounded(store, enc):
    a = store.create(title="A", samples=two_samples())
    b = store.create(title="B", samples=two_samples()[:1])
    ra = store.references(a.id)
    assert store.references(a.id)[0][1] is ra[0][1]
    store.update(a.id, title="A2")
    misses = store.cache_misses
    ra2 = store.references(a.id)
    assert store.cache_misses == misses + 1 and ra2[0][1] is not ra[0][1]
    assert np.array_equal(ra2[0][1], ra[0][1])  # reloaded, same content
    assert store.references(a.id)[0][1] is ra2[0][1]
    store.references(b.id)
    assert store.cached_bytes == sum(c.nbytes for _, c in ra2) + sum(c.nbytes for _, c in store.references(b.id))

    # another process's update / delete invalidates this process's entry (revision check)
    other = VoiceStore(store.root)
    other.update(a.id, description="changed elsewhere")
    assert store.references(a.id)[0][1] is not ra2[0][1]
    other.delete(b.id)
    with pytest.raises(VoiceNotFound):
        store.references(b.id)
    other.close()
    store.delete(a.id)
    assert store.cached_bytes == 0
    assert enc.calls == 3

    small = VoiceStore(store.root, encoder=enc, codec_key="codec1", cache_bytes=1)
    c = small.create(title="C", samples=two_samples()[:1])
    small.references(c.id)
    small.references(c.id)
    assert small.cached_bytes == 0 and small.cache_hits == 0  # over the bound: never cached
    small.close()


def test_record_use_counts_tasks(store):
    v = store.create(title="A", samples=two_samples()[:1])
    for _ in range(3):
        store.record_use(v.id)
    assert store.get(v.id).task_count == 3 and store.get(v.id).rev == 1


# --------------------------------------------------------------------------- listing
def test_list_pagination_filters_sort(store):
    ids = {}
    for i, (title, tags, text, vis, author) in enumerate([
        ("Alpha one", ["calm", "en"], "Hello.", "public", "local"),
        ("Beta two", ["loud"], "你好世界", "public", "k1"),
        ("alpha three", ["calm"], "Bonjour.", "private", "k1"),
        ("Gamma 100%", [], "Hi_there.", "unlist", "k2"),
    ]):
        ids[title] = store.create(title=title, samples=[SampleInput(tone(0.5), text)], tags=tags,
                                  visibility=vis, author_id=author).id
        time.sleep(0.002)  # distinct created_at
    for _ in range(5):
        store.record_use(ids["Beta two"])
    store.record_use(ids["Gamma 100%"])

    total, page = store.list(page_size=3, page_number=1, sort_by="created_at")
    assert total == 4 and [v.title for v in page] == ["Gamma 100%", "alpha three", "Beta two"]
    total, page = store.list(page_size=3, page_number=2, sort_by="created_at")
    assert total == 4 and [v.title for v in page] == ["Alpha one"]
    assert store.list(page_size=3, page_number=3)[1] == []
    assert [v.title for v in store.list(sort_by="task_count")[1]][:2] == ["Beta two", "Gamma 100%"]
    assert [v.title for v in store.list(sort_by="score")[1]][:2] == ["Beta two", "Gamma 100%"]

    def titles(**kw):
        return sorted(v.title for v in store.list(**kw)[1])

    assert titles(title="ALPHA") == ["Alpha one", "alpha three"]
    assert titles(title="100%") == ["Gamma 100%"] and titles(title="_") == []  # LIKE wildcards escaped
    assert titles(tags=["calm"]) == ["Alpha one", "alpha three"]
    assert titles(tags=["loud", "en"]) == ["Alpha one", "Beta two"]  # any of the tags
    assert titles(languages=["zh"]) == ["Beta two"]
    assert titles(title_languages=["en"]) == ["Alpha one", "Beta two", "Gamma 100%", "alpha three"]
    assert titles(author_id="k1") == ["Beta two", "alpha three"]
    assert titles(title="alpha", tags=["calm"], author_id="local") == ["Alpha one"]
    # a viewer sees public voices and its own
    assert titles(viewer="k2") == ["Alpha one", "Beta two", "Gamma 100%"]
    assert titles(viewer="k1") == ["Alpha one", "Beta two", "alpha three"]
    with pytest.raises(InvalidVoice):
        store.list(sort_by="likes")


# --------------------------------------------------------------------------- failures and atomicity
def test_failures_leave_nothing_behind(tmp_path):
    enc = CountingEncoder(fail_on=2)
    store = VoiceStore(tmp_path / "v", encoder=enc, codec_key="c")
    with pytest.raises(RuntimeError, match="exploded"):
        store.create(title="A", samples=two_samples())
    assert len(store) == 0 and blob_dirs(store) == []

    keep = store.create(title="Keep", samples=two_samples()[:1], voice_id="keep")
    before = sorted(os.listdir(store.blobs / keep.storage_key))
    # the row insert fails after the blobs are written (a concurrent create of the same id)
    real_get = store.get_optional
    store.get_optional = lambda vid: None  # skip the early duplicate check
    with pytest.raises(VoiceExists):
        store.create(title="Dup", samples=two_samples()[:1], voice_id="keep")
    store.get_optional = real_get
    assert blob_dirs(store) == [keep.storage_key]
    assert sorted(os.listdir(store.blobs / keep.storage_key)) == before
    assert store.get("keep").title == "Keep"

    # a failing update (bad cover) keeps the voice and its files unchanged
    with pytest.raises(UnsupportedMedia):
        store.update("keep", title="New", cover_image=b"not an image at all")
    assert store.get("keep").title == "Keep" and store.get("keep").rev == 1
    store.close()


def test_garbage_collection_and_schema(tmp_path, enc):
    root = tmp_path / "v"
    store = VoiceStore(root, encoder=enc, codec_key="c")
    v = store.create(title="A", samples=two_samples()[:1])
    orphan = store.blobs / ("f" * 32)
    orphan.mkdir()
    (orphan / "x.wav").write_bytes(b"x")
    tmp = store.blobs / v.storage_key / ".tmp-abc-x.wav"
    tmp.write_bytes(b"partial")
    assert store.collect_garbage() == 0  # too young: may be a create in progress
    old = time.time() - 7200
    for p in (orphan, tmp):
        os.utime(p, (old, old))
    assert store.collect_garbage() == 2
    assert blob_dirs(store) == [v.storage_key] and not tmp.exists()
    assert store.schema_version == SCHEMA_VERSION
    store.close()

    conn = sqlite3.connect(root / "voices.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(VoiceStoreError, match="newer"):
        VoiceStore(root)


def test_store_without_encoder_cannot_create(tmp_path):
    store = VoiceStore(tmp_path / "v")
    with pytest.raises(VoiceStoreError, match="encoder"):
        store.create(title="A", samples=two_samples())
    with pytest.raises(ValueError):
        VoiceStore(tmp_path / "w", encoder=CountingEncoder())  # an encoder needs a codec key
    with pytest.raises(ValueError):
        VoiceStore(tmp_path / "w", encoder=CountingEncoder(), codec_key="../x")
    store.close()


# --------------------------------------------------------------------------- threads
def test_concurrent_access_from_threads(store, enc):
    base = [store.create(title=f"base {i}", samples=two_samples()[:1]) for i in range(3)]
    # Run every code path once on this thread first: lazy imports compile their modules on first
    # use, and CPython 3.11's compiler is not thread-safe (concurrent compiles can raise
    # "SystemError: AST constructor recursion depth mismatch" on a fresh checkout without .pyc).
    warm = store.create(title="warm", samples=[SampleInput(tone(0.3), "warm")])
    store.references(base[0].id)
    store.record_use(base[0].id)
    store.list(page_size=5, title="t")
    store.update(warm.id, title="warm 2")
    store.delete(warm.id)
    errors: list[BaseException] = []
    created: list[str] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        try:
            for i in range(4):
                v = store.create(title=f"t{n}-{i}", samples=[SampleInput(tone(0.3), f"text {n} {i}")])
                with lock:
                    created.append(v.id)
                for b in base:
                    assert store.references(b.id)[0][0] == "Hello there."
                    store.record_use(b.id)
                store.list(page_size=5, title="t")
                store.update(v.id, title=f"u{n}-{i}")
                if i % 2:
                    store.delete(v.id)
                    with lock:
                        created.remove(v.id)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(store) == 3 + len(created) == 3 + 12
    assert sum(store.get(b.id).task_count for b in base) == 6 * 4 * 3 + 1  # + the warm-up use
    assert enc.calls == 3 + 1 + 24  # bases, the warm-up voice, the threads
    assert len(blob_dirs(store)) == len(store)
    assert all(store.get(vid).title.startswith("u") for vid in created)
