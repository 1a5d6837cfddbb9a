"""Where does a decode step's GPU time go? Profiles the decode step (eager, same kernels as the
captured graph) at S2-Pro shapes and prints the top kernels by CUDA time, plus the graph-replay
time of the same step.

    python -m shoal.bench.profile_step --batch 1,64 --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..engine.engine import Engine, EngineConfig
from ..engine.request import EngineRequest, GridSession
from ..engine.sampling import SamplingParams
from .random_model import S2_IM_END, random_dualar, random_prompt, s2_pro_config


def profile_prefill(model, cfg, dev, tokens: int, kv_cache_dtype: str | None = None,
                    prefill_graphs: bool | None = None) -> dict:
    """Wall time and top CPU / GPU ops of the engine steps that prefill one prompt (after a
    warm-up request of the same length, so compilation is excluded; with the CUDA graphs of a
    serving engine: prefill chunks up to the largest prefill bucket replay a graph, unless
    ``prefill_graphs`` is False (None: the engine's default): then they run eagerly, as with ``--no-prefill-graphs``)."""
    eng = Engine(model, S2_IM_END, config=EngineConfig(max_running=4, max_seq_len=4096, num_blocks=1024,
                                                       kv_cache_dtype=kv_cache_dtype,
                                                       prefill_graphs=prefill_graphs))
    eng.runner.capture_graphs(show_progress=False)  # decode + prefill graphs, as when serving
    rng = np.random.default_rng(0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def one(i):
        eng.add_request(EngineRequest(session=GridSession(random_prompt(cfg, tokens - tokens // 2, tokens // 2, rng)),
                                      params=SamplingParams(temperature=0.8, top_p=0.8, top_k=30), seed=i,
                                      max_new_tokens=1, ignore_eos=True))
        eng.run_until_done()
        sync()

    one(0)
    t = time.perf_counter()
    one(1)
    wall = time.perf_counter() - t
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        one(2)
    ka = prof.key_averages()
    print(f"=== prefill {tokens} tokens + 1 frame ({'eager' if prefill_graphs is False else 'graph'} prefill): "
          f"{wall * 1e3:.1f} ms wall", flush=True)
    print(ka.table(sort_by="cpu_time_total", row_limit=20), flush=True)
    if dev.type == "cuda":
        print(ka.table(sort_by="self_device_time_total", row_limit=15), flush=True)
    return {"tokens": tokens, "wall_ms": wall * 1e3, "prefill_graphs": prefill_graphs,
            "top_cpu": [{"name": e.key[:120], "cpu_ms": e.cpu_time_total / 1e3, "count": e.count}
                        for e in sorted(ka, key=lambda e: -e.cpu_time_total)[:30]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", default="1,64")
    p.add_argument("--context", type=int, default=700)
    p.add_argument("--out", default="profile-out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=["s2-pro", "tiny"], default="s2-pro")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                   help="the KV cache's dtype (default: $SHOAL_KV_CACHE_DTYPE, else auto)")
    p.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                   help="instead: profile the engine steps that prefill one TOKENS-token prompt")
    p.add_argument("--no-prefill-graphs", action="store_true",
                   help="with --prefill: run the prefill chunk eagerly instead of replaying its graph")
    args = p.parse_args(argv)
    from ..quant.kv import kv_cache_dtype_arg

    args.kv_cache_dtype = kv_cache_dtype_arg(args.kv_cache_dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from .random_model import tiny_config

    cfg = s2_pro_config(4096) if args.shape == "s2-pro" else tiny_config()
    dev = torch.device(args.device)
    model = random_dualar(cfg, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32,
                          quantization=args.quantization)
    report = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    if args.prefill:
        report["prefill"] = profile_prefill(model, cfg, dev, args.prefill, args.kv_cache_dtype,
                                            prefill_graphs=False if args.no_prefill_graphs else None)
        (out / "profile_step.json").write_text(json.dumps(report, indent=1))
        return 0
    for B in [int(b) for b in args.batch.split(",")]:
        eng = Engine(model, S2_IM_END, config=EngineConfig(max_running=max(B, 1), max_seq_len=4096,
                                                           num_blocks=B * 64 + 64,
                                                           kv_cache_dtype=args.kv_cache_dtype))
        rng = np.random.default_rng(0)
        for i in range(B):
            eng.add_request(EngineRequest(session=GridSession(random_prompt(cfg, args.context - 200, 200, rng)),
                                          params=SamplingParams(temperature=0.8, top_p=0.8, top_k=30), seed=i,
                                          max_new_tokens=10_000, ignore_eos=True))
        while eng.num_running < B or any(r.status.value != "decode" for r in eng.scheduler.running):
            eng.step()
        slots = [r.slot for r in eng.scheduler.running]
        runner = eng.runner
        ids = torch.tensor(slots, dtype=torch.long, device=dev)
        runner.slot_ids[:B].copy_(ids)
        with torch.inference_mode():
            for _ in range(3):
                runner._decode_body(B)
            sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
            sync()
            acts = [torch.profiler.ProfilerActivity.CUDA if dev.type == "cuda" else torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(5):
                    runner._decode_body(B)
                sync()
        table = prof.key_averages().table(sort_by="self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total",
                                          row_limit=25)
        def dev_time(e) -> float:
            if dev.type != "cuda":
                return e.self_cpu_time_total
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

        events = [(e.key, dev_time(e) / 5, e.count / 5) for e in prof.key_averages()]
        events.sort(key=lambda e: -e[1])
        total = sum(e[1] for e in events)
        if dev.type != "cuda":
            report[B] = {"kernel_ms": total / 1e3, "kernels": sum(e[2] for e in events)}
            continue
        # graph replay time of the same step
        runner.capture_graphs(show_progress=False)
        g = runner.graphs[runner.bucket_for(B)]
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - t) / 20 * 1e3
        n_kernels = sum(e[2] for e in events)
        print(f"=== batch {B}: kernel time {total / 1e3:.2f} ms/step over {n_kernels:.0f} kernels; "
              f"graph replay {replay_ms:.2f} ms/step", flush=True)
        print(table, flush=True)
        report[B] = {"kernel_ms": total / 1e3, "kernels": n_kernels, "replay_ms": replay_ms,
                     "top": [{"name": k[:120], "us": us, "count": c} for k, us, c in events[:40]]}
        del eng
        torch.cuda.empty_cache()
    (out / "profile_step.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
