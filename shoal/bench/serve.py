"""``shoal bench serve``: closed-loop load against a running server over HTTP, as clients see it.

For each concurrency level ``c``, ``c`` virtual clients each POST ``/v1/tts`` (msgpack, the way
the Fish SDKs do; streaming on, ``format`` pcm by default) and send the next request as soon as
the previous response has been read to the end. Every request reads a different text from the
bundled multilingual corpus (``shoal/bench/corpus``: short sentences and paragraphs; no two
requests of a run share a text, so prefix-cache hits come only from the voice). A share
``--clone-ratio`` of requests clone a voice: the inline reference ``--voice-audio`` (+
``--voice-text``), a library voice ``--reference-id``, or, when neither is given, a synthetic
6-second voice-like signal; the others use the model's default voice.

Measured per level (``wall`` = level start -> last response finished):

* requests/s: successful responses / wall;
* audio-s/s: audio seconds received per second over the middle 80 % of the level's audio (10 %
  -> 90 % of the cumulative audio received, like the engine sweep's middle 80 % of frames);
  ``*_overall``: all audio / wall; frames/s = audio-s/s x 44100 / 2048;
* per-stream frames/s: a response's frames after its first chunk / (last byte - first audio
  byte), the speed a listener's stream is produced at (real time = 21.5), mean / p10 / p50;
* time to first audio byte (ttfa): request sent -> first byte of audio samples, p50/p90/p99;
* end-to-end latency (e2e): request sent -> last byte, p50/p90/p99; RTF = e2e / audio seconds;
* playback underruns: a simulated player starts playing at the first audio byte (or once
  ``--prebuffer-ms`` of audio is in) and plays every chunk in order at its real duration; a chunk
  that arrives after the audio before it has finished playing is an underrun, the gap a stall
  (playback resumes when it arrives). Per level: underrun chunks, requests with >= 1 underrun,
  total / mean / max stall seconds;
* errors by status (HTTP status, ``timeout``, ``empty`` for a 200 without audio, or the
  transport exception's name).

Writes ``OUT/serve.json`` (+ ``serve.png`` when matplotlib is installed). Only the given URL is
contacted (default loopback); every level is bounded by ``--duration``, ``--requests`` or
``--requests-per-client``, by ``--max-level-s`` and by the per-request ``--timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .corpus import CorpusText, UniqueTexts, load_corpus, summary

FRAME_RATE = 44100 / 2048  # codec frames per second of audio (S1 / S2 codec)
PCM_BYTES = 2  # s16le mono
WAV_HEADER = 44
SUPPORTED_FORMATS = ("pcm", "wav")
MAX_CONCURRENCY = 1024
MAX_REQUESTS_PER_LEVEL = 100_000


# --------------------------------------------------------------------------- pure accounting
@dataclass(frozen=True)
class Playback:
    chunks: int  # chunks with audio
    underruns: int  # chunks that arrived after the audio before them had finished playing
    stall_s: float  # total time the player had nothing to play (after it started)
    max_stall_s: float
    start_s: float | None  # when playback started (same clock as the arrivals)


def simulate_playback(arrivals: Sequence[tuple[float, float]], prebuffer_s: float = 0.0) -> Playback:
    """Play ``(arrival_time, audio_seconds)`` chunks (in arrival order) with a player that starts
    when ``prebuffer_s`` of audio has arrived (at the first chunk for 0, or at the last chunk if
    the whole response is shorter) and resumes right away after a stall."""
    chunks = [(float(t), float(d)) for t, d in arrivals if d > 0]
    if not chunks:
        return Playback(0, 0, 0.0, 0.0, None)
    buffered, start_idx = 0.0, len(chunks) - 1
    for i, (_, d) in enumerate(chunks):
        buffered += d
        if buffered >= prebuffer_s:
            start_idx = i
            break
    start = chunks[start_idx][0]
    play_end = start + sum(d for _, d in chunks[: start_idx + 1])
    underruns, stall, max_stall = 0, 0.0, 0.0
    for t, d in chunks[start_idx + 1:]:
        if t > play_end:
            underruns += 1
            stall += t - play_end
            max_stall = max(max_stall, t - play_end)
            play_end = t
        play_end += d
    return Playback(len(chunks), underruns, stall, max_stall, start)


class AudioBytes:
    """Bytes of a pcm / wav response as they arrive -> samples of audio (odd bytes, a header
    split across reads and so on handled by counting cumulatively)."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        if fmt not in SUPPORTED_FORMATS:
            raise ValueError(f"format {fmt!r}: the serve benchmark reads {', '.join(SUPPORTED_FORMATS)}")
        self.header = WAV_HEADER if fmt == "wav" else 0
        self.sample_rate = sample_rate
        self.nbytes = 0
        self.samples = 0

    def feed(self, n: int) -> float:
        """Account ``n`` more bytes; returns the seconds of audio they completed."""
        self.nbytes += n
        samples = max(0, self.nbytes - self.header) // PCM_BYTES
        new, self.samples = samples - self.samples, samples
        return new / self.sample_rate

    @property
    def seconds(self) -> float:
        return self.samples / self.sample_rate


def _pct(values: Sequence[float], q: float, scale: float = 1.0) -> float | None:
    return float(np.percentile(values, q)) * scale if len(values) else None


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


# --------------------------------------------------------------------------- one request
@dataclass
class RequestResult:
    index: int
    lang: str
    chars: int
    cloned: bool
    status: str  # "200" or the error key
    ok: bool
    sent: float  # perf_counter at send
    e2e_s: float
    ttfa_s: float | None = None
    audio_s: float = 0.0
    sample_rate: int | None = None
    arrivals: list[tuple[float, float]] = field(default_factory=list)  # (s after send, audio s)
    error: str | None = None

    @property
    def frames(self) -> float:
        return self.audio_s * FRAME_RATE

    @property
    def per_stream_fps(self) -> float | None:
        if len(self.arrivals) < 2:
            return None
        span = self.arrivals[-1][0] - self.arrivals[0][0]
        return (self.audio_s - self.arrivals[0][1]) * FRAME_RATE / span if span > 0 else None


@dataclass(frozen=True)
class Voice:
    kind: str  # "none" | "inline" | "reference_id"
    audio: bytes = b""
    text: str = ""
    reference_id: str = ""
    source: str = ""
    seconds: float | None = None


def synthetic_voice(seconds: float = 6.0, rate: int = 22050, seed: int = 0) -> bytes:
    """A voice-like WAV (a gliding harmonic tone with a syllable-rate envelope and some noise):
    exercises the cloning path (reference encoding, a longer prompt) without a recording."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 25 * np.sin(2 * np.pi * 0.4 * t) + 10 * np.sin(2 * np.pi * 3.1 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    tone = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = np.clip(np.sin(2 * np.pi * 4.0 * t + rng.uniform(0, 2 * np.pi)), 0, None) ** 0.5
    x = 0.25 * tone * envelope + 0.01 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, (x / max(np.abs(x).max(), 1e-6) * 0.6).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def make_body(text: str, idx: int, args: argparse.Namespace, voice: Voice, cloned: bool) -> bytes:
    import ormsgpack

    body: dict = {"text": text, "format": args.format, "streaming": True, "latency": args.latency,
                  "seed": args.seed + idx, "normalize": True}
    if args.max_new_tokens is not None:
        body["max_new_tokens"] = args.max_new_tokens
    if cloned and voice.kind == "inline":
        body["references"] = [{"audio": voice.audio, "text": voice.text}]
    elif cloned and voice.kind == "reference_id":
        body["reference_id"] = voice.reference_id
    return ormsgpack.packb(body)


def _error_message(raw: bytes) -> str:
    try:
        return str(json.loads(raw).get("message", ""))[:300]
    except (ValueError, AttributeError):
        return raw[:300].decode("utf-8", "replace")


async def one_request(client, path: str, headers: dict, body: bytes, fmt: str, *, index: int,
                      text: CorpusText, cloned: bool, timeout: float) -> RequestResult:
    """POST one request and read its streamed audio; ``timeout`` bounds the whole exchange."""
    import httpx

    sent = time.perf_counter()
    arrivals: list[tuple[float, float]] = []
    got: dict = {}

    def done(status: str, ok: bool = False, **kw) -> RequestResult:
        return RequestResult(index, text.lang, len(text.text), cloned, status, ok, sent,
                             time.perf_counter() - sent, **kw)

    async def exchange() -> None:
        async with client.stream("POST", path, content=body, headers=headers) as resp:
            got["status"] = resp.status_code
            if resp.status_code != 200:
                got["error"] = _error_message(await resp.aread())
                return
            got["rate"] = int(resp.headers.get("x-shoal-sample-rate") or 44100)
            got["acc"] = acc = AudioBytes(fmt, got["rate"])
            async for chunk in resp.aiter_raw():
                now = time.perf_counter()
                seconds = acc.feed(len(chunk))
                if seconds > 0:
                    arrivals.append((now - sent, seconds))

    try:
        await asyncio.wait_for(exchange(), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException) as e:
        return done("timeout", error=f"no complete response after {time.perf_counter() - sent:.1f} s ({e!r})"[:300])
    except httpx.HTTPError as e:
        return done(type(e).__name__, error=str(e)[:300])
    if got["status"] != 200:
        return done(str(got["status"]), error=got["error"])
    if not arrivals:
        return done("empty", error="HTTP 200 without audio", sample_rate=got["rate"])
    return done("200", ok=True, ttfa_s=arrivals[0][0], audio_s=got["acc"].seconds, sample_rate=got["rate"],
                arrivals=arrivals)


# --------------------------------------------------------------------------- one level
@dataclass
class LevelPlan:
    concurrency: int
    requests: int | None
    duration_s: float | None
    max_level_s: float
    max_errors: int


async def run_level(url: str, headers: dict, plan: LevelPlan, texts: UniqueTexts, args: argparse.Namespace,
                    voice: Voice, first_index: int, progress=None) -> tuple[list[RequestResult], float]:
    """Closed loop at ``plan.concurrency``; returns the results and the level's wall time."""
    import httpx

    c = plan.concurrency
    limits = httpx.Limits(max_connections=c + 2, max_keepalive_connections=c + 2)
    timeout = httpx.Timeout(args.timeout + 5, connect=min(args.timeout, 30.0))  # the total: one_request
    results: list[RequestResult] = []
    state = {"next": 0, "errors": 0}
    cap = plan.requests if plan.requests is not None else MAX_REQUESTS_PER_LEVEL
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, trust_env=False) as client:
        t0 = time.perf_counter()
        stop_at = t0 + min(plan.duration_s if plan.duration_s is not None else plan.max_level_s, plan.max_level_s)

        async def worker() -> None:
            while (state["next"] < cap and time.perf_counter() < stop_at
                   and state["errors"] < plan.max_errors):
                k = state["next"]
                state["next"] += 1
                idx = first_index + k
                text = next(texts)
                cloned = voice.kind != "none" and int((k + 1) * args.clone_ratio) > int(k * args.clone_ratio)
                body = make_body(text.text, idx, args, voice, cloned)
                r = await one_request(client, "/v1/tts", headers, body, args.format, index=idx, text=text,
                                      cloned=cloned, timeout=args.timeout)
                results.append(r)
                if not r.ok:
                    state["errors"] += 1
                if progress is not None:
                    progress.update(1)
                    if state["errors"]:
                        progress.set_postfix(errors=state["errors"], refresh=False)
                if not r.ok:
                    await asyncio.sleep(0.05)  # an erroring server is not hammered in a hot loop

        await asyncio.gather(*(worker() for _ in range(c)))
        wall = time.perf_counter() - t0
    return results, wall


def middle_rate(results: Sequence[RequestResult], lo: float = 0.1, hi: float = 0.9) -> float | None:
    """Audio seconds per second between the times ``lo`` and ``hi`` of all audio had arrived."""
    events = sorted((r.sent + t, d) for r in results if r.ok for t, d in r.arrivals)
    if len(events) < 3:
        return None
    ts = np.array([t for t, _ in events])
    cum = np.cumsum([d for _, d in events])
    total = cum[-1]
    i, j = int(np.searchsorted(cum, lo * total)), int(np.searchsorted(cum, hi * total))
    if j <= i or ts[j] <= ts[i]:
        return None
    return float((cum[j] - cum[i]) / (ts[j] - ts[i]))


def level_metrics(c: int, results: Sequence[RequestResult], wall: float, prebuffer_s: float) -> dict:
    ok = [r for r in results if r.ok]
    errors = Counter(r.status for r in results if not r.ok)
    ttfa = [r.ttfa_s for r in ok if r.ttfa_s is not None]
    e2e = [r.e2e_s for r in ok]
    rtf = [r.e2e_s / r.audio_s for r in ok if r.audio_s > 0]
    per_stream = [v for v in (r.per_stream_fps for r in ok) if v is not None]
    plays = [simulate_playback(r.arrivals, prebuffer_s) for r in ok]
    total_audio = sum(r.audio_s for r in ok)
    mid = middle_rate(ok)
    audio_rate = mid if mid is not None else (total_audio / wall if wall > 0 else None)
    out = {
        "concurrency": c, "requests": len(results), "ok": len(ok), "errors": sum(errors.values()),
        "errors_by_status": dict(sorted(errors.items())),
        "error_examples": {s: next(r.error for r in results if r.status == s) for s in sorted(errors)},
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "audio_s_per_s": audio_rate,
        "audio_s_per_s_overall": total_audio / wall if wall > 0 else None,
        "frames_per_s": audio_rate * FRAME_RATE if audio_rate is not None else None,
        "frames_per_s_overall": total_audio * FRAME_RATE / wall if wall > 0 else None,
        "audio_s_total": total_audio,
        "audio_s_per_request_mean": _mean([r.audio_s for r in ok]),
        "per_stream_fps_mean": _mean(per_stream), "per_stream_fps_p10": _pct(per_stream, 10),
        "per_stream_fps_p50": _pct(per_stream, 50),
        "ttfa_p50_ms": _pct(ttfa, 50, 1e3), "ttfa_p90_ms": _pct(ttfa, 90, 1e3), "ttfa_p99_ms": _pct(ttfa, 99, 1e3),
        "e2e_p50_ms": _pct(e2e, 50, 1e3), "e2e_p90_ms": _pct(e2e, 90, 1e3), "e2e_p99_ms": _pct(e2e, 99, 1e3),
        "rtf_mean": _mean(rtf), "rtf_p50": _pct(rtf, 50), "rtf_p90": _pct(rtf, 90),
        "chunks_total": sum(p.chunks for p in plays),
        "underrun_chunks": sum(p.underruns for p in plays),
        "underrun_requests": sum(1 for p in plays if p.underruns),
        "underrun_request_fraction": (sum(1 for p in plays if p.underruns) / len(plays)) if plays else None,
        "stall_s_total": sum(p.stall_s for p in plays),
        "stall_s_per_request_mean": _mean([p.stall_s for p in plays]),
        "stall_s_max": max((p.max_stall_s for p in plays), default=0.0),
        "by_kind": {},
    }
    for kind, sel in (("cloned", [r for r in ok if r.cloned]), ("plain", [r for r in ok if not r.cloned])):
        if sel:
            t = [r.ttfa_s for r in sel if r.ttfa_s is not None]
            out["by_kind"][kind] = {"ok": len(sel), "ttfa_p50_ms": _pct(t, 50, 1e3), "ttfa_p90_ms": _pct(t, 90, 1e3),
                                    "e2e_p50_ms": _pct([r.e2e_s for r in sel], 50, 1e3)}
    langs = Counter(r.lang for r in ok)
    out["languages"] = dict(sorted(langs.items()))
    return out


# --------------------------------------------------------------------------- plot
def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [r["concurrency"] for r in results]

    def series(key: str) -> list[float]:
        return [np.nan if r.get(key) is None else r[key] for r in results]

    fig, ax = plt.subplots(2, 3, figsize=(16, 8.4))
    a = ax[0, 0]
    a.plot(cs, series("audio_s_per_s"), "o-", label="audio s / s")
    a.plot(cs, series("requests_per_s"), "s--", label="requests / s")
    a.set(xlabel="concurrent clients", title="throughput")
    a.legend()
    a = ax[0, 1]
    a.plot(cs, series("per_stream_fps_mean"), "o-", label="mean")
    a.plot(cs, series("per_stream_fps_p10"), "o--", label="p10 (slowest streams)")
    a.axhline(FRAME_RATE, color="red", ls=":", label="real time (21.5)")
    a.set(xlabel="concurrent clients", ylabel="frames/s", title="per stream")
    a.legend()
    for a, key, name in ((ax[0, 2], "ttfa", "time to first audio byte"), (ax[1, 0], "e2e", "end-to-end latency")):
        for q, style in (("p50", "o-"), ("p90", "o--"), ("p99", "o:")):
            a.plot(cs, series(f"{key}_{q}_ms"), style, label=q)
        a.set(xlabel="concurrent clients", ylabel="ms", title=name)
        a.legend()
    a = ax[1, 1]
    a.plot(cs, series("rtf_p50"), "o-", label="p50")
    a.plot(cs, series("rtf_p90"), "o--", label="p90")
    a.axhline(1.0, color="red", ls=":", label="real time")
    a.set(xlabel="concurrent clients", ylabel="e2e / audio duration", title="real-time factor")
    a.legend()
    a = ax[1, 2]
    a.plot(cs, [100 * (r["underrun_request_fraction"] or 0) for r in results], "o-", label="requests with an underrun")
    a.set(xlabel="concurrent clients", ylabel="% of requests", title="playback underruns",
          ylim=(-5, 105))
    b = a.twinx()
    b.plot(cs, series("stall_s_per_request_mean"), "s--", color="tab:orange", label="mean stall per request (s)")
    b.set_ylabel("stall s")
    handles = a.get_legend_handles_labels()[0] + b.get_legend_handles_labels()[0]
    a.legend(handles, [h.get_label() for h in handles], loc="center left", fontsize="small")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for a in ax.flat:
        a.set_xticks(cs)
        a.xaxis.set_major_formatter(ScalarFormatter())
        a.xaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(title)
    for a in ax.flat:  # explicit limits: a level with no successes leaves no data to autoscale
        if cs:
            a.set_xlim(min(cs) / 1.5, max(cs) * 1.5)
        a.set_xscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI
def _levels(spec: str) -> list[int]:
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency: expected comma-separated integers, got {spec!r}") from None
    if not levels or any(c < 1 or c > MAX_CONCURRENCY for c in levels):
        raise SystemExit(f"--concurrency: levels must be 1..{MAX_CONCURRENCY}")
    return levels


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shoal bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (default loopback :8080)")
    p.add_argument("--api-key", default=None, help="bearer key, if the server needs one")
    p.add_argument("--model", default="s2-pro", help="the `model` header sent (Fish API); default s2-pro")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels (default 1,4,16,64)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--duration", type=float, default=None, metavar="S",
                   help="seconds per level during which clients send new requests (default 60)")
    g.add_argument("--requests", type=int, default=None, metavar="N", help="requests per level")
    g.add_argument("--requests-per-client", type=int, default=None, metavar="N",
                   help="requests per client: c x N per level (every level the same number of waves)")
    p.add_argument("--max-level-s", type=float, default=1800.0, metavar="S",
                   help="no new request after S seconds of a level (default 1800)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S", help="limit on a whole request, send to last byte (default 300)")
    p.add_argument("--max-errors", type=int, default=200, help="stop a level after this many errors (default 200)")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="unmeasured requests first (default 2)")
    p.add_argument("--clone-ratio", type=float, default=0.5, help="share of requests cloning a voice (default 0.5)")
    v = p.add_mutually_exclusive_group()
    v.add_argument("--voice-audio", metavar="PATH", help="reference audio sent inline with cloning requests")
    v.add_argument("--reference-id", metavar="ID", help="voice id of the server's library for cloning requests")
    p.add_argument("--voice-text", default="", help="transcript of --voice-audio")
    p.add_argument("--format", default="pcm", choices=SUPPORTED_FORMATS,
                   help="response format (default pcm; audio length is counted from the bytes)")
    p.add_argument("--latency", default="balanced", choices=["low", "balanced", "normal"],
                   help="the request's latency mode = first-chunk size (default balanced)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="frames per text batch (default: the server's default)")
    p.add_argument("--languages", default=None, help="corpus languages to use, e.g. en,zh (default all)")
    p.add_argument("--prebuffer-ms", type=float, default=0.0,
                   help="simulated player starts once this much audio is buffered (default 0: at the first byte)")
    p.add_argument("--seed", type=int, default=0, help="seeds the text order and the request seeds")
    p.add_argument("--out", default="bench-out", help="output folder (serve.json, serve.png)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--ready-timeout", type=float, default=120.0, metavar="S",
                   help="wait this long for /v1/ready before starting (default 120)")
    return p


def _load_voice(args: argparse.Namespace) -> Voice:
    if args.clone_ratio <= 0:
        return Voice("none")
    if args.reference_id:
        return Voice("reference_id", reference_id=args.reference_id, source=f"reference_id {args.reference_id}")
    if args.voice_audio:
        data = Path(args.voice_audio).read_bytes()
        seconds = None
        try:
            import soundfile as sf

            info = sf.info(io.BytesIO(data))
            seconds = info.frames / info.samplerate
        except (RuntimeError, ValueError, TypeError):  # not a format libsndfile reads: the server decides
            seconds = None
        return Voice("inline", audio=data, text=args.voice_text, source=str(args.voice_audio), seconds=seconds)
    print("no --voice-audio / --reference-id: cloning requests send a synthetic 6 s voice-like reference",
          file=sys.stderr)
    return Voice("inline", audio=synthetic_voice(), text=args.voice_text, source="synthetic", seconds=6.0)


def _wait_ready(url: str, headers: dict, timeout: float) -> dict | None:
    """/v1/ready's JSON once it answers 200; None for servers without it (404)."""
    import httpx

    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            r = httpx.get(url.rstrip("/") + "/v1/ready", headers=headers, timeout=10, trust_env=False)
            if r.status_code == 200:
                try:
                    return r.json()
                except ValueError:
                    return {}
            if r.status_code in (401, 403, 404, 405):
                return None
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = repr(e)
        if time.monotonic() > deadline:
            raise SystemExit(f"server at {url} not ready after {timeout:.0f} s ({last})")
        time.sleep(0.5)


def _progress(args: argparse.Namespace, total: int | None, desc: str):
    if args.no_progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True, leave=True)


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def run(args: argparse.Namespace, on_level: Callable[[dict], None] | None = None) -> dict:
    """The sweep; ``on_level`` gets the data so far (``partial: true``) after each level."""
    levels = _levels(args.concurrency)
    if not 0.0 <= args.clone_ratio <= 1.0:
        raise SystemExit("--clone-ratio must be within 0..1")
    if args.requests is not None and not 1 <= args.requests <= MAX_REQUESTS_PER_LEVEL:
        raise SystemExit(f"--requests must be within 1..{MAX_REQUESTS_PER_LEVEL}")
    per_client = getattr(args, "requests_per_client", None)
    if per_client is not None and not 1 <= per_client * max(levels) <= MAX_REQUESTS_PER_LEVEL:
        raise SystemExit(f"--requests-per-client x concurrency must be within 1..{MAX_REQUESTS_PER_LEVEL}")
    counted = args.requests is not None or per_client is not None
    duration = args.duration if args.duration is not None else (None if counted else 60.0)
    if duration is not None and duration <= 0:
        raise SystemExit("--duration must be > 0")
    import httpx

    from .engine import git_commit  # (imports torch: kept out of the module's import)

    headers = {"content-type": "application/msgpack", "model": args.model}
    if args.api_key:
        headers["authorization"] = f"Bearer {args.api_key}"
    corpus = load_corpus(args.languages.split(",") if args.languages else None)
    texts = UniqueTexts(corpus, seed=args.seed)
    voice = _load_voice(args)
    server = _wait_ready(args.url, headers, args.ready_timeout)

    meta = {
        "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S %z"), "url": args.url,
        "client_commit": git_commit(), "server": server, "python": platform.python_version(),
        "httpx": httpx.__version__,
        "workload": {"format": args.format, "latency": args.latency, "max_new_tokens": args.max_new_tokens,
                     "clone_ratio": args.clone_ratio if voice.kind != "none" else 0.0,
                     "voice": {"kind": voice.kind, "source": voice.source, "seconds": voice.seconds,
                               "transcript_chars": len(voice.text)},
                     "duration_s": duration, "requests": args.requests, "requests_per_client": per_client,
                     "warmup": args.warmup,
                     "prebuffer_ms": args.prebuffer_ms, "corpus": summary(corpus)},
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
        "frame_rate": FRAME_RATE,
    }

    async def all_levels() -> list[dict]:
        index = 0
        if args.warmup > 0:
            plan = LevelPlan(min(args.warmup, 4), args.warmup, None, args.max_level_s, args.warmup)
            warm, _ = await run_level(args.url, headers, plan, texts, args, voice, index)
            index += len(warm)
            bad = Counter(r.status for r in warm if not r.ok)
            if bad:
                print(f"warm-up errors: {dict(bad)}: {next(r.error for r in warm if not r.ok)}", file=sys.stderr)
        out = []
        for c in levels:
            n = c * per_client if per_client is not None else args.requests
            plan = LevelPlan(c, n, duration, args.max_level_s, args.max_errors)
            bar = _progress(args, n, f"c={c}")
            try:
                res, wall = await run_level(args.url, headers, plan, texts, args, voice, index, bar)
            finally:
                if bar is not None:
                    bar.close()
            index += len(res)
            m = level_metrics(c, res, wall, args.prebuffer_ms / 1e3)
            out.append(m)
            if on_level is not None:
                on_level({"meta": meta, "results": list(out), "partial": True})
            print(f"c={c:4d}  {m['ok']:5d} ok {m['errors']:3d} err  {_fmt(m['requests_per_s'], '6.2f')} req/s  "
                  f"{_fmt(m['audio_s_per_s'], '7.1f')} audio-s/s  per-stream {_fmt(m['per_stream_fps_mean'], '6.1f')} fps  "
                  f"ttfa p50/p99 {_fmt(m['ttfa_p50_ms'], '.0f')}/{_fmt(m['ttfa_p99_ms'], '.0f')} ms  "
                  f"e2e p50 {_fmt(m['e2e_p50_ms'], '.0f')} ms  rtf p50 {_fmt(m['rtf_p50'], '.3f')}  "
                  f"underruns {m['underrun_chunks']} ({m['underrun_requests']} req, {m['stall_s_total']:.2f} s)"
                  + (f"  errors {m['errors_by_status']}" if m["errors"] else ""), file=sys.stderr, flush=True)
        return out

    results = asyncio.run(all_levels())
    return {"meta": meta, "results": results}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import httpx  # noqa: F401
    except ImportError:
        print("shoal bench serve needs httpx: pip install httpx", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write(data: dict) -> None:  # after every level too: a run cut short keeps its levels
        (out / "serve.json").write_text(json.dumps(data, indent=1, ensure_ascii=False))

    data = run(args, on_level=write)
    write(data)
    print(f"wrote {out / 'serve.json'}", file=sys.stderr)
    meta = data["meta"]
    try:
        plot(data["results"], out / "serve.png",
             f"shoal serve, {args.url}, {meta['date']}, client {meta['client_commit']}, {args.format}, "
             f"clone {meta['workload']['clone_ratio']:.0%}")
        print(f"wrote {out / 'serve.png'}", file=sys.stderr)
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
    return 1 if all(r["ok"] == 0 for r in data["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
