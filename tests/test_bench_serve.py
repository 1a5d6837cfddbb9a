"""``shoal bench serve``: the corpus, the pure accounting (playback underruns, bytes -> audio),
and a short live run against the tiny S2 checkpoint served by uvicorn on loopback."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from shoal.bench import serve
from shoal.bench.corpus import REQUIRED_LANGUAGES, UniqueTexts, load_corpus, summary
from shoal.bench.serve import (
    FRAME_RATE,
    AudioBytes,
    RequestResult,
    level_metrics,
    simulate_playback,
)

if TYPE_CHECKING:
    from live_server import LiveServer

KEY = "bench-key"


# --------------------------------------------------------------------------- corpus
def test_corpus_languages_sizes_and_uniqueness():
    texts = load_corpus()
    assert len(texts) >= 200
    assert len({t.text for t in texts}) == len(texts), "duplicate corpus texts"
    stats = summary(texts)
    for lang in REQUIRED_LANGUAGES:
        assert lang in stats, lang
        assert stats[lang]["long"] >= 5, (lang, stats[lang])  # paragraphs
        assert stats[lang]["texts"] - stats[lang]["long"] >= 20, (lang, stats[lang])  # sentences
    assert all(t.text.strip() == t.text and t.text for t in texts)
    # scripts really are the languages they claim
    assert all(any("\u4e00" <= ch <= "\u9fff" for ch in t.text) for t in texts if t.lang == "zh")
    assert all(any("\u3040" <= ch <= "\u30ff" for ch in t.text) for t in texts if t.lang == "ja")
    assert not any("\u3040" <= ch <= "\u9fff" for t in texts if t.lang in ("en", "de", "es") for ch in t.text)
    only = load_corpus(["de", "ja"])
    assert {t.lang for t in only} == {"de", "ja"}
    with pytest.raises(ValueError, match="xx"):
        load_corpus(["xx"])


def test_unique_texts_never_repeat_and_are_deterministic():
    corpus = load_corpus()

    def take(seed: int, n: int) -> list:
        stream = UniqueTexts(corpus, seed=seed)
        return [next(stream) for _ in range(n)]

    got = take(3, 3 * len(corpus))
    assert len({t.text for t in got}) == len(got)
    assert {t.text for t in got[: len(corpus)]} == {t.text for t in corpus}  # every text once, first
    by_text = {c.text: c.lang for c in corpus}
    for t in got[len(corpus):]:  # then joins of texts of one language
        assert t.lang in {"zh", "ja"} or " " in t.text
    assert all(by_text[t.text] == t.lang for t in got[: len(corpus)])
    assert take(3, 300) == got[:300]  # deterministic
    assert take(4, 50) != got[:50]


# --------------------------------------------------------------------------- pure accounting
def test_playback_underruns_on_a_synthetic_schedule():
    # 0.5 s chunks; the player starts at t=0 and has audio until 0.5, then 1.0 after chunk 2
    arrivals = [(0.0, 0.5), (0.2, 0.5), (1.5, 0.5), (1.6, 0.5), (3.0, 1.0)]
    p = simulate_playback(arrivals)
    # chunk 3 arrives at 1.5 but audio ran out at 1.0 -> stall 0.5, plays until 2.0, chunk 4
    # extends to 2.5, chunk 5 at 3.0 -> stall 0.5
    assert (p.chunks, p.underruns) == (5, 2)
    assert p.stall_s == pytest.approx(1.0) and p.max_stall_s == pytest.approx(0.5) and p.start_s == 0.0
    # a 0.9 s jitter buffer: playback starts at 0.2 with 1.0 s buffered -> runs dry at 1.2
    p = simulate_playback(arrivals, prebuffer_s=0.9)
    assert p.underruns == 2 and p.stall_s == pytest.approx(0.3 + 0.5) and p.start_s == 0.2
    # a buffer longer than the whole response: starts at the last chunk, never stalls
    assert simulate_playback(arrivals, prebuffer_s=60).underruns == 0
    # chunks arriving exactly when the previous audio ends are on time; empty chunks are ignored
    on_time = [(0.0, 0.25), (0.25, 0.25), (0.3, 0.0), (0.5, 1.0), (1.4, 0.5)]
    p = simulate_playback(on_time)
    assert (p.chunks, p.underruns, p.stall_s) == (4, 0, 0.0)
    assert simulate_playback([]) == serve.Playback(0, 0, 0.0, 0.0, None)


def test_audio_bytes_pcm_and_wav():
    pcm = AudioBytes("pcm", 100)
    assert pcm.feed(3) == pytest.approx(0.01)  # one whole sample, one odd byte held back
    assert pcm.feed(1) == pytest.approx(0.01)
    assert pcm.samples == 2 and pcm.seconds == pytest.approx(0.02)
    wav = AudioBytes("wav", 100)
    assert wav.feed(40) == 0.0  # header only
    assert wav.feed(8) == pytest.approx(0.02)  # 4 header bytes + 2 samples
    with pytest.raises(ValueError):
        AudioBytes("mp3", 44100)


def _result(i: int, arrivals: list[tuple[float, float]], e2e: float, cloned: bool = False) -> RequestResult:
    return RequestResult(i, "en", 10, cloned, "200", True, sent=float(i), e2e_s=e2e, ttfa_s=arrivals[0][0],
                         audio_s=sum(d for _, d in arrivals), sample_rate=44100, arrivals=arrivals)


def test_level_metrics_from_synthetic_results():
    ok1 = _result(0, [(0.1, 0.5), (0.3, 0.5), (2.0, 1.0)], e2e=2.0, cloned=True)  # one 0.9 s stall
    ok2 = _result(1, [(0.2, 1.0), (0.7, 1.0)], e2e=0.8)
    bad = RequestResult(2, "de", 5, False, "503", False, sent=2.0, e2e_s=0.01, error="overloaded")
    m = level_metrics(2, [ok1, ok2, bad], wall=4.0, prebuffer_s=0.0)
    assert (m["requests"], m["ok"], m["errors"], m["errors_by_status"]) == (3, 2, 1, {"503": 1})
    assert m["error_examples"] == {"503": "overloaded"}
    assert m["requests_per_s"] == pytest.approx(0.5)
    assert m["audio_s_total"] == pytest.approx(4.0)
    assert m["audio_s_per_s_overall"] == pytest.approx(1.0)
    assert m["frames_per_s"] == pytest.approx(m["audio_s_per_s"] * FRAME_RATE)
    assert (m["underrun_chunks"], m["underrun_requests"]) == (1, 1)
    assert m["stall_s_total"] == pytest.approx(0.9) and m["underrun_request_fraction"] == 0.5
    # per stream: frames after the first chunk / (last - first arrival)
    assert ok1.per_stream_fps == pytest.approx(1.5 * FRAME_RATE / 1.9)
    assert m["per_stream_fps_mean"] == pytest.approx((1.5 * FRAME_RATE / 1.9 + 1.0 * FRAME_RATE / 0.5) / 2)
    assert m["rtf_mean"] == pytest.approx((2.0 / 2.0 + 0.8 / 2.0) / 2)
    assert m["ttfa_p50_ms"] == pytest.approx(150.0)
    assert set(m["by_kind"]) == {"cloned", "plain"}


# --------------------------------------------------------------------------- live
@pytest.fixture(scope="module")
def live(tiny_s2_checkpoint) -> Iterator[LiveServer]:
    from live_server import LiveServer, tiny_service

    from shoal.server.app import create_app
    from shoal.server.config import ServerConfig

    with tiny_service(tiny_s2_checkpoint, max_running=8) as svc:
        app = create_app(svc, ServerConfig(api_keys=frozenset({KEY}), max_new_tokens_cap=8))
        with LiveServer(app, timeout=60) as srv:
            yield srv


METRICS = ["requests_per_s", "audio_s_per_s", "audio_s_per_s_overall", "frames_per_s", "per_stream_fps_mean",
           "per_stream_fps_p10", "per_stream_fps_p50", "ttfa_p50_ms", "ttfa_p90_ms", "ttfa_p99_ms",
           "e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms", "rtf_mean", "rtf_p50", "rtf_p90", "underrun_chunks",
           "underrun_requests", "underrun_request_fraction", "stall_s_total", "stall_s_per_request_mean",
           "stall_s_max", "chunks_total", "wall_s"]


def test_bench_serve_live(live, tmp_path, capsys):
    out = tmp_path / "out"
    rc = serve.main(["--url", live.url, "--api-key", KEY, "--concurrency", "1,2", "--requests", "4",
                     "--max-new-tokens", "8", "--clone-ratio", "0.5", "--warmup", "1", "--languages", "en,zh,ja",
                     "--no-progress", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "serve.json").read_text())
    meta = data["meta"]
    assert meta["url"] == live.url and "api_key" not in meta["args"]
    assert meta["server"]["model_family"] == "s2"
    assert meta["workload"]["voice"]["source"] == "synthetic"
    assert [r["concurrency"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        assert (r["requests"], r["ok"], r["errors"], r["errors_by_status"]) == (4, 4, 0, {}), r
        for k in METRICS:
            assert r[k] is not None and r[k] >= 0, (k, r[k])
        assert 0 < r["ttfa_p50_ms"] <= r["e2e_p50_ms"]
        assert r["ttfa_p99_ms"] <= r["e2e_p99_ms"]
        assert r["frames_per_s"] == pytest.approx(r["audio_s_per_s"] * FRAME_RATE)
        assert r["audio_s_total"] > 0 and r["chunks_total"] >= 4
        assert r["underrun_requests"] <= r["ok"] and r["underrun_chunks"] <= r["chunks_total"] - r["ok"]
        assert r["by_kind"]["cloned"]["ok"] == 2 and r["by_kind"]["plain"]["ok"] == 2
    err = capsys.readouterr().err
    assert "c=   2" in err and "wrote" in err


def test_bench_serve_counts_errors_by_status(live, tmp_path):
    rc = serve.main(["--url", live.url, "--api-key", "wrong", "--concurrency", "1", "--requests", "2",
                     "--warmup", "0", "--clone-ratio", "0", "--no-progress", "--out", str(tmp_path)])
    assert rc == 1  # nothing succeeded
    r = json.loads((tmp_path / "serve.json").read_text())["results"][0]
    assert (r["ok"], r["errors"], r["errors_by_status"]) == (0, 2, {"401": 2})
    assert r["error_examples"]["401"]


def test_bench_serve_timeout_and_duration_bounds(live, tmp_path):
    rc = serve.main(["--url", live.url, "--api-key", KEY, "--concurrency", "1", "--requests", "2", "--warmup", "0",
                     "--timeout", "0.001", "--no-progress", "--out", str(tmp_path / "t")])
    assert rc == 1
    r = json.loads((tmp_path / "t" / "serve.json").read_text())["results"][0]
    assert r["errors_by_status"] == {"timeout": 2} and "no complete response" in r["error_examples"]["timeout"]
    # --duration: clients stop sending new requests after it; all that were sent complete
    t = time.perf_counter()
    rc = serve.main(["--url", live.url, "--api-key", KEY, "--concurrency", "2", "--duration", "0.5", "--warmup", "0",
                     "--max-new-tokens", "4", "--no-progress", "--out", str(tmp_path / "d")])
    assert rc == 0 and time.perf_counter() - t < 30
    data = json.loads((tmp_path / "d" / "serve.json").read_text())
    r = data["results"][0]
    assert data["meta"]["workload"]["duration_s"] == 0.5
    assert r["requests"] >= 2 and r["ok"] == r["requests"] and r["errors"] == 0


def test_plots_survive_levels_without_successes(tmp_path):
    """A sweep whose every request failed (e.g. 401s) still writes its plots (matplotlib refused
    to log-scale axes with no data)."""
    pytest.importorskip("matplotlib")
    from shoal.bench import live, serve

    keys = ("audio_s_per_s", "requests_per_s", "per_stream_fps_mean", "per_stream_fps_p10", "rtf_p50",
            "rtf_p90", "stall_s_per_request_mean") + tuple(f"{k}_{q}_ms" for k in ("ttfa", "e2e")
                                                          for q in ("p50", "p90", "p99"))
    rows = [{"concurrency": c, "underrun_request_fraction": None, **{k: None for k in keys}} for c in (1, 4)]
    serve.plot(rows, tmp_path / "serve.png", "all failed")
    live_rows = [{"concurrency": c, **{k: None for k in ("ttfa_p50_ms", "ttfa_p99_ms", "sentence_to_audio_p50_ms",
                                                          "sentence_to_audio_p99_ms", "total_p50_s",
                                                          "total_p99_s")}} for c in (1, 8)]
    live.plot(live_rows, tmp_path / "live.png", "all failed")
    assert (tmp_path / "serve.png").stat().st_size > 0 and (tmp_path / "live.png").stat().st_size > 0
