"""``python -m shoal.bench.live``: concurrency sweep of live TTS sockets (``WS /v1/tts/live``).

At each concurrency level ``c``, ``c`` clients each open a socket (``--sockets-per-client`` in a
row), send ``start``, then a few sentences **word by word** at ``--words-per-second`` (an LLM
streaming its answer), then ``stop``, and read every frame until ``finish``. Per socket:

* TTFA: first ``text`` sent -> first ``audio`` frame received (what a voice agent waits for;
  it includes the time the client takes to type the first sentence);
* sentence -> audio: the ``text`` that ends the first sentence sent -> first ``audio`` frame
  (the part of TTFA the server is responsible for);
* total: connect -> ``finish``;
* audio seconds received (pcm at 44.1 kHz unless ``--format``/``--sample-rate`` say otherwise);
* errors (``finish{error}``, handshake refusals, disconnects), with their messages.

Reported per level: TTFA p50/p99/mean, sentence -> audio p50/p99, total p50/p99, audio, errors; ``live.json`` (and
``live.png`` with matplotlib) in ``--out``. The server is any shoal (or Fish-compatible)
server::

    shoal serve --checkpoint /models/s2-pro --port 8080 &
    python -m shoal.bench.live --url ws://127.0.0.1:8080 --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Streaming speech lets a voice agent answer before it has finished thinking.",
    "Each word arrives a moment after the last, just like a language model writes.",
    "Latency matters most for the first sound, because that is what people notice.",
    "After that, audio only has to stay ahead of the listener to sound natural.",
    "A good server keeps every socket moving while it batches the work on the device.",
]


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def http_url(url: str) -> str:
    """``ws://`` / ``wss://`` / ``http(s)://`` base URL -> the http(s) base httpx-ws upgrades."""
    url = url.rstrip("/")
    if url.startswith("ws://"):
        url = "http://" + url[5:]
    elif url.startswith("wss://"):
        url = "https://" + url[6:]
    url = url.removesuffix("/v1/tts/live")
    return url


def server_info(args) -> dict | None:
    """The server's ``/v1/ready`` JSON (model, random weights, slots), or None when unavailable."""
    import httpx

    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(http_url(args.url) + "/v1/ready", headers=headers, timeout=10, trust_env=False)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def sentences_for(i: int, n: int) -> list[str]:
    return [SENTENCES[(i + k) % len(SENTENCES)] for k in range(n)]


async def one_socket(client, args, index: int) -> dict:
    import ormsgpack
    from httpx_ws import aconnect_ws

    request = {"text": "", "format": args.format, "sample_rate": args.sample_rate, "latency": args.latency,
               "chunk_length": args.chunk_length, "references": [], "reference_id": args.reference_id,
               "normalize": True, "prosody": None, "temperature": 0.7, "top_p": 0.7,
               "max_new_tokens": args.max_new_tokens}
    if args.seed is not None:
        request["seed"] = args.seed + index
    gap = 1.0 / args.words_per_second if args.words_per_second > 0 else 0.0
    words = [w + " " for s in sentences_for(index, args.sentences) for w in s.split()]
    out = {"ttfa_s": None, "sentence_s": None, "total_s": None, "audio_bytes": 0, "frames": 0, "error": None}
    t0 = time.perf_counter()
    first_text: float | None = None
    first_end: float | None = None  # the text completing the first sentence went out
    try:
        async with aconnect_ws("/v1/tts/live", client, keepalive_ping_interval_seconds=None) as ws:
            async def sender() -> None:
                nonlocal first_text, first_end
                await ws.send_bytes(ormsgpack.packb({"event": "start", "request": request}))
                for k, w in enumerate(words):
                    if k and gap:
                        await asyncio.sleep(gap)
                    if first_text is None:
                        first_text = time.perf_counter()
                    await ws.send_bytes(ormsgpack.packb({"event": "text", "text": w}))
                    ends = w.rstrip().endswith((".", "!", "?"))
                    if ends and args.flush:
                        await ws.send_bytes(ormsgpack.packb({"event": "flush"}))
                    if ends and first_end is None:
                        first_end = time.perf_counter()
                await ws.send_bytes(ormsgpack.packb({"event": "stop"}))

            send_task = asyncio.ensure_future(sender())
            try:
                while True:
                    ev = ormsgpack.unpackb(await ws.receive_bytes(timeout=args.timeout))
                    if not isinstance(ev, dict):
                        continue
                    if ev.get("event") == "audio":
                        if out["ttfa_s"] is None and first_text is not None:
                            now = time.perf_counter()
                            out["ttfa_s"] = now - first_text
                            if first_end is not None:
                                out["sentence_s"] = now - first_end
                        out["audio_bytes"] += len(ev.get("audio") or b"")
                        out["frames"] += 1
                    elif ev.get("event") == "finish":
                        if ev.get("reason") != "stop":
                            out["error"] = f"finish error: {ev.get('message')}"
                        break
                await send_task
            finally:
                send_task.cancel()
    except Exception as e:  # noqa: BLE001 - every failure is a data point
        out["error"] = f"{type(e).__name__}: {e}"
    out["total_s"] = time.perf_counter() - t0
    return out


def audio_seconds(n_bytes: int, args) -> float:
    if args.format not in ("pcm", "wav"):
        return float("nan")  # compressed: not measured
    rate = args.sample_rate or 44100
    return max(n_bytes - (44 if args.format == "wav" else 0), 0) / 2 / rate


async def run_level(args, c: int) -> dict:
    import httpx

    headers = {"model": args.model}
    if args.api_key:
        headers["authorization"] = f"Bearer {args.api_key}"
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(base_url=http_url(args.url), headers=headers, timeout=args.timeout,
                                 limits=limits, trust_env=False) as client:
        async def worker(w: int) -> list[dict]:
            return [await one_socket(client, args, w * args.sockets_per_client + k)
                    for k in range(args.sockets_per_client)]

        t = time.perf_counter()
        per = await asyncio.gather(*(worker(w) for w in range(c)))
        wall = time.perf_counter() - t
    runs = [r for rs in per for r in rs]
    ok = [r for r in runs if r["error"] is None]
    ttfa = [r["ttfa_s"] * 1000 for r in ok if r["ttfa_s"] is not None]
    sentence = [r["sentence_s"] * 1000 for r in ok if r["sentence_s"] is not None]
    total = [r["total_s"] for r in ok]
    secs = [audio_seconds(r["audio_bytes"], args) for r in ok]
    errors = sorted({r["error"] for r in runs if r["error"] is not None})
    return {"concurrency": c, "sockets": len(runs), "errors": len(runs) - len(ok), "error_messages": errors[:5],
            "ttfa_p50_ms": _pct(ttfa, 50), "ttfa_p99_ms": _pct(ttfa, 99),
            "ttfa_mean_ms": float(np.mean(ttfa)) if ttfa else None,
            "sentence_to_audio_p50_ms": _pct(sentence, 50), "sentence_to_audio_p99_ms": _pct(sentence, 99),
            "total_p50_s": _pct(total, 50), "total_p99_s": _pct(total, 99),
            "audio_s_mean": float(np.mean(secs)) if secs else None,
            "audio_frames_mean": float(np.mean([r["frames"] for r in ok])) if ok else None,
            "wall_s": wall}


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [r["concurrency"] for r in results]

    def series(key: str) -> list[float]:
        return [float("nan") if r.get(key) is None else r[key] for r in results]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    axes[0].plot(cs, series("ttfa_p50_ms"), "o-", label="TTFA p50")
    axes[0].plot(cs, series("ttfa_p99_ms"), "o--", label="TTFA p99")
    axes[0].plot(cs, series("sentence_to_audio_p50_ms"), "s-", label="sentence end -> audio p50")
    axes[0].plot(cs, series("sentence_to_audio_p99_ms"), "s--", label="sentence end -> audio p99")
    axes[0].set(xlabel="concurrent sockets", ylabel="ms", title="first text -> first audio")
    axes[0].legend()
    axes[1].plot(cs, series("total_p50_s"), "o-", label="p50")
    axes[1].plot(cs, series("total_p99_s"), "o--", label="p99")
    axes[1].set(xlabel="concurrent sockets", ylabel="s", title="socket total time")
    axes[1].legend()
    for a in axes:  # explicit limits: a level with no successes leaves no data to autoscale
        if cs:
            a.set_xlim(min(cs) / 1.5, max(cs) * 1.5)
        a.set_xscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shoal.bench.live", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="server base URL (ws://HOST:PORT or http://HOST:PORT)")
    p.add_argument("--api-key", default=None, help="bearer key")
    p.add_argument("--model", default="s2-pro", help="the `model` header (default s2-pro)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated socket counts")
    p.add_argument("--sockets-per-client", type=int, default=1, help="sockets each client opens in a row")
    p.add_argument("--sentences", type=int, default=3, help="sentences per socket")
    p.add_argument("--words-per-second", type=float, default=8.0,
                   help="text pace (0 = as fast as possible; default 8, a streaming LLM)")
    p.add_argument("--flush", action="store_true", help="send `flush` after each sentence")
    p.add_argument("--format", default="pcm", help="audio format (default pcm)")
    p.add_argument("--sample-rate", type=int, default=None)
    p.add_argument("--latency", default="balanced", choices=["low", "balanced", "normal"])
    p.add_argument("--chunk-length", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=1024, help="frames per segment cap")
    p.add_argument("--reference-id", default=None, help="a voice id of the server's library")
    p.add_argument("--seed", type=int, default=None, help="base seed (socket i uses seed + i)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds without a frame before giving up")
    p.add_argument("--out", default="bench-out", help="output directory (live.json, live.png)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "url": args.url, "host": platform.node(),
            "server": server_info(args), "args": {k: v for k, v in vars(args).items() if k != "api_key"}}
    results = []
    for c in levels:
        r = asyncio.run(run_level(args, c))
        results.append(r)
        # after every level: a run cut short keeps the levels it finished
        (out / "live.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))

        def ms(v):
            return float("nan") if v is None else v

        print(f"c={c:4d}  sockets {r['sockets']:4d}  errors {r['errors']:3d}  "
              f"ttfa p50 {ms(r['ttfa_p50_ms']):8.1f} ms  p99 {ms(r['ttfa_p99_ms']):8.1f} ms  "
              f"sentence->audio p50 {ms(r['sentence_to_audio_p50_ms']):7.1f} ms  "
              f"p99 {ms(r['sentence_to_audio_p99_ms']):7.1f} ms  "
              f"total p50 {ms(r['total_p50_s']):6.2f} s  p99 {ms(r['total_p99_s']):6.2f} s",
              file=sys.stderr, flush=True)
        for msg in r["error_messages"]:
            print(f"        error: {msg}", file=sys.stderr)
    if not args.no_plot:
        try:
            plot(results, out / "live.png", f"shoal live TTS, {args.url}, {meta['date']}")
        except ImportError:
            print("matplotlib not installed: no plot", file=sys.stderr)
    return 0 if all(r["errors"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
