"""``shoal bench gate``: the engine's decode-speed regression gate.

Runs the engine sweep (:func:`shoal.bench.engine.run_level`, in process, random weights at the
S2-Pro shapes by default) at c = 1, 16, 64 and compares the per-request decode speed (mean
per-stream frames/s: a request's frames / (finish - first frame)) with a frozen baseline file
(``benchmarks/baselines/<gpu>.json``, format in ``benchmarks/baselines/README.md``). A level
slower than the baseline by more than ``--tolerance`` fails the gate (exit 1). The workload
(shapes, dtype, frames, prompt, requests per client, engine slots, CUDA graphs, repeats) is
taken from the baseline, so a rerun measures exactly what was frozen; ``--update`` measures and
writes a new baseline. Exit status: 0 pass / updated, 1 regression, 2 refused (no baseline,
another GPU, another workload).

    shoal bench gate --baseline benchmarks/baselines/h200.json            # before merging
    shoal bench gate --baseline benchmarks/baselines/h200.json --update   # freeze new numbers
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

FORMAT = "shoal-bench-gate-baseline/1"
METRIC = "per_stream_fps_mean"
DEFAULT_LEVELS = (1, 16, 64)
# the workload of a gate run; defaults are the engine sweep's (docs/benchmarks.md)
DEFAULT_WORKLOAD = {"shape": "s2-pro", "dtype": "bf16", "frames": 400, "prompt_tokens": 300, "ref_frames": 200,
                    "requests_per_client": 2.0, "max_running": 128, "cuda_graphs": True, "repeats": 3}
WARMUP_SEED = 999


class Refused(Exception):
    """The gate cannot compare (exit 2)."""


def device_name(device: str) -> str:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise Refused(f"--device {device}: CUDA is not available on this machine")
        return torch.cuda.get_device_name(dev)
    return f"{dev.type}: {platform.processor() or platform.machine()}"


def load_baseline(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise Refused(f"{path}: not valid JSON ({e})") from None
    if data.get("format") != FORMAT:
        raise Refused(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
    return data


def resolve_workload(args: argparse.Namespace, baseline: dict | None) -> tuple[dict, list[int]]:
    """Baseline workload (or the defaults) overridden by the command line; without --update a
    command-line value that differs from the baseline's is refused."""
    base = dict(DEFAULT_WORKLOAD)
    if baseline is not None:
        base.update(baseline.get("workload", {}))
    cli = {"shape": args.shape, "dtype": args.dtype, "frames": args.frames, "prompt_tokens": args.prompt_tokens,
           "ref_frames": args.ref_frames, "requests_per_client": args.requests_per_client,
           "max_running": args.max_running, "cuda_graphs": False if args.no_graphs else None,
           "repeats": args.repeats}
    workload = dict(base)
    diffs = []
    for k, v in cli.items():
        if v is None:
            continue
        if baseline is not None and not args.update and v != base[k]:
            diffs.append(f"{k}: baseline {base[k]!r}, command line {v!r}")
        workload[k] = v
    if diffs:
        raise Refused("the command line asks for another workload than the baseline's:\n  " + "\n  ".join(diffs)
                      + "\nrerun without these options (the baseline's workload is used), or --update to "
                        "measure and freeze a new baseline")
    base_levels = [lv["concurrency"] for lv in baseline["levels"]] if baseline else list(DEFAULT_LEVELS)
    if args.concurrency:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    else:
        levels = base_levels if baseline is not None and not args.update else list(DEFAULT_LEVELS)
    if not levels or any(c < 1 for c in levels):
        raise Refused("--concurrency: positive integers, comma-separated")
    if baseline is not None and not args.update:
        missing = [c for c in levels if c not in base_levels]
        if missing:
            raise Refused(f"the baseline has no level c={','.join(map(str, missing))} (it has "
                          f"{','.join(map(str, base_levels))}); use --update to measure a new baseline")
    return workload, levels


def measure(workload: dict, levels: list[int], device: str) -> list[dict]:
    """The engine sweep at ``levels``; per level the best (highest) per-stream speed of
    ``repeats`` runs (best-of damps noise: slowdowns that matter show in every run)."""
    import torch

    from ..engine.audio import ChunkSchedule
    from ..engine.engine import Engine, EngineConfig
    from .engine import run_level
    from .random_model import S2_IM_END, random_dualar, s2_pro_config, tiny_config

    dev = torch.device(device)
    cfg = s2_pro_config() if workload["shape"] == "s2-pro" else tiny_config()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[workload["dtype"]]
    t = time.perf_counter()
    model = random_dualar(cfg, dev, dtype)
    engine = Engine(model, S2_IM_END, config=EngineConfig(
        max_running=workload["max_running"], num_blocks=None if dev.type == "cuda" else 2048,
        cuda_graphs=workload["cuda_graphs"], max_seq_len=4096,
        audio_schedule=ChunkSchedule(first=4, growth=2.0, max_frames=32)))
    engine.warmup(show_progress=sys.stderr.isatty())
    run_level(engine, model, 2, 2, 8, workload["prompt_tokens"], workload["ref_frames"], False, WARMUP_SEED)
    print(f"engine ready in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    out = []
    for c in levels:
        n = max(round(c * workload["requests_per_client"]), 2)
        runs = [run_level(engine, model, c, n, workload["frames"], workload["prompt_tokens"], workload["ref_frames"],
                          False, c + 1000 * i) for i in range(workload["repeats"])]
        best = max(runs, key=lambda r: r[METRIC])
        level = {"concurrency": c, "per_stream_fps": best[METRIC],
                 "per_stream_fps_runs": [r[METRIC] for r in runs],
                 "aggregate_fps": best["aggregate_fps"], "ttff_p50_ms": best["ttff_p50_ms"],
                 "ttff_p99_ms": best["ttff_p99_ms"], "requests": n, "wall_s": best["wall_s"]}
        if "gpu_mem_peak_gib" in best:
            level["gpu_mem_peak_gib"] = best["gpu_mem_peak_gib"]
        out.append(level)
        print(f"c={c:4d}  per-stream {level['per_stream_fps']:8.1f} frames/s  aggregate "
              f"{level['aggregate_fps']:8.0f} frames/s  first frame p50 {level['ttff_p50_ms']:7.1f} ms",
              file=sys.stderr, flush=True)
    return out


def compare(baseline: dict, now: list[dict], tolerance: float) -> tuple[list[dict], str]:
    """Per level: baseline vs now; ``regression`` when now < baseline x (1 - tolerance)."""
    base = {lv["concurrency"]: lv for lv in baseline["levels"]}
    rows = []
    for lv in now:
        b = base.get(lv["concurrency"])
        if b is None:
            continue
        delta = lv["per_stream_fps"] / b["per_stream_fps"] - 1.0 if b["per_stream_fps"] > 0 else 0.0
        status = "REGRESSION" if delta < -tolerance else ("faster" if delta > tolerance else "ok")
        rows.append({"concurrency": lv["concurrency"], "baseline": b["per_stream_fps"], "now": lv["per_stream_fps"],
                     "delta": delta, "status": status,
                     "aggregate_baseline": b.get("aggregate_fps"), "aggregate_now": lv.get("aggregate_fps")})
    lines = [f"per-stream decode speed (frames/s), tolerance {tolerance:.1%}:",
             f"{'c':>5}  {'baseline':>10}  {'now':>10}  {'delta':>8}  {'status':<10}  {'aggregate base -> now':>24}"]
    for r in rows:
        agg = (f"{r['aggregate_baseline']:.0f} -> {r['aggregate_now']:.0f}"
               if r["aggregate_baseline"] is not None and r["aggregate_now"] is not None else "-")
        lines.append(f"{r['concurrency']:>5}  {r['baseline']:>10.1f}  {r['now']:>10.1f}  {r['delta']:>+8.1%}  "
                     f"{r['status']:<10}  {agg:>24}")
    return rows, "\n".join(lines)


def environment(device: str, gpu: str) -> dict:
    import torch

    from .engine import git_commit

    return {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "device": device, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "commit": git_commit()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shoal bench gate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="baseline JSON (benchmarks/baselines/<gpu>.json)")
    p.add_argument("--update", action="store_true", help="measure and write a new baseline (exit 0)")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="allowed drop of per-stream frames/s per level (default 0.05 = 5%%)")
    p.add_argument("--concurrency", default=None,
                   help="levels (default: the baseline's; 1,16,64 for a new baseline)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu with --shape tiny")
    p.add_argument("--allow-device-mismatch", action="store_true",
                   help="compare even though the baseline was measured on another GPU")
    p.add_argument("--json", default=None, metavar="PATH", help="also write this run's numbers and comparison")
    w = p.add_argument_group("workload (default: the baseline's; changing it needs --update)")
    w.add_argument("--shape", choices=["s2-pro", "tiny"], default=None)
    w.add_argument("--dtype", choices=["bf16", "fp32"], default=None)
    w.add_argument("--frames", type=int, default=None, help="frames per request (400)")
    w.add_argument("--prompt-tokens", type=int, default=None, help="prompt tokens per request (300)")
    w.add_argument("--ref-frames", type=int, default=None, help="reference frames in the prompt (200)")
    w.add_argument("--requests-per-client", type=float, default=None, help="requests per client per level (2)")
    w.add_argument("--max-running", type=int, default=None, help="engine slots (128)")
    w.add_argument("--no-graphs", action="store_true", default=None, help="no CUDA graphs")
    w.add_argument("--repeats", type=int, default=None, help="runs per level, the best counts (3)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    path = Path(args.baseline)
    try:
        if not 0 <= args.tolerance < 1:
            raise Refused("--tolerance must be within [0, 1)")
        baseline = load_baseline(path)
        if baseline is None and not args.update:
            raise Refused(f"no baseline at {path}; measure one with --update (on the GPU it is named after)")
        workload, levels = resolve_workload(args, baseline)
        if workload["shape"] == "s2-pro" and not args.device.startswith("cuda"):
            raise Refused("S2-Pro shapes need --device cuda; use --shape tiny for a CPU smoke run")
        if workload["repeats"] < 1:
            raise Refused("--repeats must be >= 1")
        gpu = device_name(args.device)
        if baseline is not None and baseline.get("gpu") != gpu:
            msg = (f"the baseline {path} was measured on {baseline.get('gpu')!r}, this device is {gpu!r}: "
                   f"speeds are not comparable across GPUs")
            if not args.allow_device_mismatch:
                raise Refused(msg + ". Use (or create with --update) the baseline of this GPU, or pass "
                                    "--allow-device-mismatch to compare anyway")
            print(f"warning: {msg} (--allow-device-mismatch)", file=sys.stderr)
    except Refused as e:
        print(f"shoal bench gate: refused: {e}", file=sys.stderr)
        return 2
    env = environment(args.device, gpu)
    if baseline is not None:
        print(f"baseline: {path} ({baseline.get('gpu')}, {baseline.get('date')}, commit {baseline.get('commit')}, "
              f"torch {baseline.get('torch')})", file=sys.stderr)
    print(f"now: {gpu}, commit {env['commit']}, torch {env['torch']}; workload {json.dumps(workload)}; "
          f"levels {levels}", file=sys.stderr, flush=True)
    now = measure(workload, levels, args.device)
    rows: list[dict] = []
    if baseline is not None and baseline.get("workload", workload) != workload:
        print("the workload changed: no comparison with the old baseline", file=sys.stderr)
    elif baseline is not None:
        rows, table = compare(baseline, now, args.tolerance)
        print(table)
    regressions = [r for r in rows if r["status"] == "REGRESSION"]
    command = "shoal bench gate " + shlex.join(argv)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"format": FORMAT.replace("baseline", "run"), **env,
                                               "command": command, "workload": workload, "metric": METRIC,
                                               "levels": now, "baseline": str(path), "tolerance": args.tolerance,
                                               "comparison": rows}, indent=1))
    if args.update:
        new = {"format": FORMAT, **env, "command": command, "metric": METRIC, "workload": workload, "levels": now}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(new, indent=1) + "\n")
        if regressions:
            print("note: the new baseline is slower than the old one at "
                  + ", ".join(f"c={r['concurrency']} ({r['delta']:+.1%})" for r in regressions), file=sys.stderr)
        print(f"wrote baseline {path}")
        return 0
    if regressions:
        print("gate FAILED: per-stream decode speed dropped more than "
              f"{args.tolerance:.1%} at " + ", ".join(f"c={r['concurrency']} ({r['delta']:+.1%})" for r in regressions))
        return 1
    faster = [r for r in rows if r["status"] == "faster"]
    if faster:
        print("faster than the baseline at " + ", ".join(f"c={r['concurrency']} ({r['delta']:+.1%})" for r in faster)
              + ": after merging, consider --update to raise the bar")
    print("gate passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
