"""``shoal bench engine``: closed-loop concurrency sweep of the engine at real S2-Pro shapes.

Each of ``c`` virtual clients submits a request (a ~300-token cloning-shaped prompt, 400
frames, EOS ignored, sampled with top-k 30 / top-p 0.8 / temperature 0.8) and submits the next
one as soon as it finishes. By default every request clones a voice of its own (no prefix-cache
hits: the worst case); ``--voices N`` draws each request's reference (the prompt's leading text
and reference codes) from N fixed voices, as a server cloning its library voices sees it, so
the voice-prefix cache serves those columns (the level's hit rate is reported). Reported per level: aggregate frames/s (over the middle 80% of
frames), per-stream frames/s, time to first frame and first audio chunk (p50/p99), GPU memory.
Weights are random (speed does not depend on their values) unless ``--checkpoint`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..engine.audio import ChunkSchedule
from ..engine.engine import Engine, EngineConfig
from ..engine.request import AudioEvent, EngineRequest, FinishEvent, FramesEvent, GridSession
from ..engine.sampling import SamplingParams
from ..kernels import paged_attention as pa
from .random_model import S2_IM_END, random_codec, random_dualar, random_prompt, s2_pro_config, tiny_config


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def git_commit() -> str:
    import os

    if os.environ.get("SHOAL_COMMIT"):
        return os.environ["SHOAL_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def voice_prompts(config, prompt_tokens: int, ref_frames: int, voices: int, seed: int = 12345) -> list[np.ndarray]:
    """``voices`` fixed cloning prompts; a request keeps one's reference part (leading text and
    reference codes) and gets fresh target text (see :func:`prompt_for`)."""
    rng = np.random.default_rng(seed)
    return [random_prompt(config, prompt_tokens - ref_frames, ref_frames, rng) for _ in range(voices)]


def prompt_for(config, prompt_tokens: int, ref_frames: int, rng: np.random.Generator,
               voices: list[np.ndarray] | None) -> np.ndarray:
    grid = random_prompt(config, prompt_tokens - ref_frames, ref_frames, rng)
    if voices:
        ref_end = (prompt_tokens - ref_frames) // 2 + ref_frames  # random_prompt: text/2, codes, text
        grid[:, :ref_end] = voices[int(rng.integers(len(voices)))][:, :ref_end]
    return grid


def run_level(engine: Engine, model, c: int, n_requests: int, frames: int, prompt_tokens: int,
              ref_frames: int, audio: bool, seed: int, voices: list[np.ndarray] | None = None) -> dict:
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.8, top_p=0.8, top_k=30)
    submitted, inflight, finished = 0, {}, []
    first_audio: dict[str, float] = {}
    # playback from each stream's first chunk on: when its audio so far ends, and how long it
    # ran dry waiting for a later chunk (an underrun)
    play_end: dict[str, float] = {}
    dry: dict[str, float] = {}
    timeline: list[tuple[float, int]] = []
    total_frames = 0
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    hit0, queried0, copied0 = engine.pool.hit_tokens, engine.pool.queried_tokens, engine.pool.copied_tokens
    waits0, prefill0 = engine.scheduler.deferred_admissions, engine.stats.get("prefill_tokens", 0)
    if engine.audio is not None:
        engine.audio.streamer.stats.reset()  # read by this thread only once the level is over
    t0 = time.perf_counter()
    while len(finished) < n_requests:
        while len(inflight) < c and submitted < n_requests:
            grid = prompt_for(model.config, prompt_tokens, ref_frames, rng, voices)
            req = EngineRequest(session=GridSession(grid), params=params, seed=submitted,
                                max_new_tokens=frames, ignore_eos=True, stream_audio=audio,
                                request_id=f"c{c}-{submitted}")
            engine.add_request(req)
            inflight[req.request_id] = req
            submitted += 1
        for ev in engine.step():
            if isinstance(ev, FramesEvent):
                total_frames += ev.codes.shape[1]
            elif isinstance(ev, AudioEvent):
                now = time.perf_counter()
                rid = ev.request_id
                first_audio.setdefault(rid, now)
                end = play_end.get(rid, now)
                if now > end:
                    dry[rid] = dry.get(rid, 0.0) + (now - end)
                play_end[rid] = max(end, now) + len(ev.pcm) / ev.sample_rate
            elif isinstance(ev, FinishEvent):
                finished.append(inflight.pop(ev.request_id))
        timeline.append((time.perf_counter(), total_frames))
    wall = time.perf_counter() - t0
    ts = np.array([t for t, _ in timeline])
    fs = np.array([f for _, f in timeline])
    lo, hi = np.searchsorted(fs, 0.1 * total_frames), np.searchsorted(fs, 0.9 * total_frames)
    steady = (fs[hi] - fs[lo]) / max(ts[hi] - ts[lo], 1e-9) if hi > lo else total_frames / wall
    per_stream = [r.frames_total / max(r.finish_time - r.first_frame_time, 1e-9) for r in finished]
    ttff = [r.first_frame_time - r.arrival for r in finished]
    ttfa = [first_audio[r.request_id] - r.arrival for r in finished if r.request_id in first_audio]
    out = {
        "concurrency": c, "requests": n_requests, "frames_per_request": frames,
        "prompt_tokens": prompt_tokens, "wall_s": wall, "total_frames": total_frames,
        "aggregate_fps": float(steady), "aggregate_fps_overall": total_frames / wall,
        "per_stream_fps_mean": float(np.mean(per_stream)), "per_stream_fps_p50": _pct(per_stream, 50),
        "ttff_p50_ms": 1e3 * _pct(ttff, 50), "ttff_p99_ms": 1e3 * _pct(ttff, 99),
        "ttfa_p50_ms": 1e3 * _pct(ttfa, 50) if ttfa else None,
        "ttfa_p99_ms": 1e3 * _pct(ttfa, 99) if ttfa else None,
        "audio_s_per_s": float(steady) * 2048 / 44100,
        "voices": len(voices) if voices else 0,
        "prefix_hit_rate": ((engine.pool.hit_tokens - hit0) / (engine.pool.queried_tokens - queried0)
                            if engine.pool.queried_tokens > queried0 else 0.0),
        # of the hits, tokens from partial-page copies (prefix hits to the token)
        "prefix_copied_tokens": engine.pool.copied_tokens - copied0,
        # scheduling steps requests waited for pages being computed; prompt tokens prefilled
        "prefix_waits": engine.scheduler.deferred_admissions - waits0,
        "prefill_tokens": engine.stats.get("prefill_tokens", 0) - prefill0,
    }
    if audio:
        out["underrun_requests"] = sum(1 for v in dry.values() if v > 0)
        out["underrun_s"] = float(sum(dry.values()))
        out.update(engine.audio.streamer.stats.summary())
    if torch.cuda.is_available():
        out["gpu_mem_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [r["concurrency"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].plot(cs, [r["aggregate_fps"] for r in results], "o-", label="shoal")
    axes[0].axhline(8006, color="gray", ls="--", label="Fish Audio prod (FP8, c=64)")
    axes[0].set(xscale="log", xlabel="concurrent streams", ylabel="aggregate frames/s", title="throughput")
    axes[0].legend()
    axes[1].plot(cs, [r["per_stream_fps_mean"] for r in results], "o-")
    axes[1].axhline(21.53, color="red", ls=":", label="real time (21.5 frames/s)")
    axes[1].set(xscale="log", xlabel="concurrent streams", ylabel="frames/s per stream", title="per stream")
    axes[1].legend()
    axes[2].plot(cs, [r["ttff_p50_ms"] for r in results], "o-", label="first frame p50")
    axes[2].plot(cs, [r["ttff_p99_ms"] for r in results], "o--", label="first frame p99")
    if all(r.get("ttfa_p50_ms") is not None for r in results):
        axes[2].plot(cs, [r["ttfa_p50_ms"] for r in results], "s-", label="first audio p50")
    axes[2].set(xscale="log", xlabel="concurrent streams", ylabel="ms", title="latency")
    axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shoal bench engine", description=__doc__)
    p.add_argument("--concurrency", default="1,4,16,32,64,128")
    p.add_argument("--frames", type=int, default=400)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--ref-frames", type=int, default=200)
    p.add_argument("--requests-per-client", type=float, default=2.0)
    p.add_argument("--voices", type=int, default=0,
                   help="draw each request's reference from this many fixed voices (prefix-cache hits); "
                        "0 = a new voice per request")
    p.add_argument("--audio-sms", type=int, default=None,
                   help="confine the codec's stream to this many SMs (EngineConfig.audio_sms; "
                        "default: env SHOAL_AUDIO_SMS, else every SM)")
    p.add_argument("--max-running", type=int, default=128)
    p.add_argument("--audio", action="store_true", help="stream audio through the (random, real-size) codec")
    p.add_argument("--audio-first", type=int, default=4,
                   help="frames in each stream's first audio chunk (4 = the server's 'balanced' "
                        "latency, 2 = its 'low')")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--prefill-chunk", type=int, default=1024, help="prompt tokens per engine step")
    p.add_argument("--block-size", type=int, default=None, help="KV-cache page size in tokens (default: the engine's)")
    p.add_argument("--no-prefix-copy", action="store_true",
                   help="prefix hits in whole pages only (no partial-page copies)")
    p.add_argument("--no-prefix-wait", action="store_true",
                   help="admit requests at once even when their prompt's pages are being computed")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=["s2-pro", "tiny"], default="s2-pro",
                   help="model shapes (tiny: a CPU smoke run of the benchmark itself)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none",
                   help="fp8: block-scaled FP8 weights + Triton FP8 GEMMs (shoal.quant)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                   help="slow KV cache storage (EngineConfig.kv_cache_dtype; default: env "
                        "SHOAL_KV_CACHE_DTYPE, else auto = the model's dtype)")
    args = p.parse_args(argv)
    from ..quant.kv import kv_cache_dtype_arg

    dev = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.concurrency.split(",")]
    cfg = s2_pro_config() if args.shape == "s2-pro" else tiny_config()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    t = time.perf_counter()
    model = random_dualar(cfg, dev, dtype, quantization=args.quantization)
    codec = random_codec(dev, dtype) if args.audio else None
    print(f"model ready in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    engine = Engine(model, S2_IM_END, codec=codec, config=EngineConfig(
        max_running=args.max_running, num_blocks=None if dev.type == "cuda" else 2048, cuda_graphs=not args.no_graphs, max_seq_len=4096,
        prefill_chunk=args.prefill_chunk, audio_sms=args.audio_sms,
        **({"block_size": args.block_size} if args.block_size else {}),
        prefix_copy_partial=not args.no_prefix_copy, prefix_wait=not args.no_prefix_wait,
        kv_cache_dtype=kv_cache_dtype_arg(args.kv_cache_dtype),
        audio_schedule=ChunkSchedule(first=args.audio_first, growth=2.0, max_frames=32)))
    t = time.perf_counter()
    engine.warmup()
    print(f"graphs captured in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    voices = voice_prompts(cfg, args.prompt_tokens, args.ref_frames, args.voices) if args.voices else None
    run_level(engine, model, 2, 2, 8, args.prompt_tokens, args.ref_frames, args.audio, 999)  # warm-up
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
            "torch": torch.__version__, "commit": git_commit(),
            "model": f"{args.shape} shapes, random {args.dtype} weights"
                     + (" (FP8 block-scaled)" if args.quantization == "fp8" else ""),
            "kv_cache_dtype": "fp8" if engine.kv_cache_dtype is not None else args.dtype,
            "kv_cache_gib": round(engine.runner.kv.nbytes / 2**30, 2),
            # the FP8 cache's decode-attention launch config and value layout (it sets the kernel)
            "attn_fp8_config": pa.fp8_kv_config() if engine.kv_cache_dtype is not None else None,
            "kv_v_token_minor": bool(engine.runner.kv.v_token_minor),
            "env": {k: v for k, v in os.environ.items() if k.startswith("SHOAL_") and k != "SHOAL_COMMIT"},
            "kv_blocks": engine.pool.num_blocks,
            "kv_block_size": engine.pool.block_size,
            "prefix_copy_partial": engine.pool.copy_partial,
            "args": vars(args),
            "audio_sms": engine.audio.sms if engine.audio is not None else None}
    results = []

    def save() -> None:  # after every level: a run cut short keeps the levels it finished
        meta["engine_stats"] = {k: v for k, v in engine.stats.items()}
        (out / "engine.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))

    for c in levels:
        n = max(int(round(c * args.requests_per_client)), 2)
        r = run_level(engine, model, c, n, args.frames, args.prompt_tokens, args.ref_frames, args.audio, c, voices)
        results.append(r)
        print(f"c={c:4d}  agg {r['aggregate_fps']:8.0f} fps  per-stream {r['per_stream_fps_mean']:6.1f}  "
              f"ttff p50 {r['ttff_p50_ms']:7.1f} ms p99 {r['ttff_p99_ms']:7.1f}  "
              f"ttfa p50 {r['ttfa_p50_ms'] or float('nan'):7.1f} ms p99 {r['ttfa_p99_ms'] or float('nan'):7.1f}  "
              + (f"underruns {r['underrun_requests']} req {r['underrun_s']:.2f} s  "
                 f"first-chunk queue p50 {r['first_chunk_queue_p50_ms'] or float('nan'):.1f} ms  "
                 f"codec call p50 {r['codec_call_p50_ms'] or float('nan'):.1f} ms  " if "underrun_s" in r else "")
              + (f"prefix hits {100 * r['prefix_hit_rate']:.0f}%  " if voices else "")
              + f"mem {r.get('gpu_mem_peak_gib', 0):.1f} GiB",
              file=sys.stderr, flush=True)
        save()
    save()
    try:
        plot(results, out / "engine.png", f"shoal engine, {meta['gpu']}, {meta['date']}, {meta['commit']}")
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
