"""Do split-K counts that are not powers of two help the decode GEMMs at M = 1?

    python benchmarks/scripts/odd_splits_probe.py [dense|fp8 ...] [--shapes wo,down,...]

The packaged tables' M = 1 configs come from tuners that tried split counts of 1, 2, 4, 8 and
16 only. With 132 SMs that leaves, for example, bf16 wo at 40 weight tiles x 2 splits = 80
programs and FP8 down at 20 x 8 = 160 (28 SMs run two). This times, in one process, every
launch that the tuners' M = 1 space gains with ``--odd-splits`` (split counts 3, 5, 6 and 12)
against the packaged table's config, with cold weights and CUDA-graph replay (the tuners'
``tune_cell``). It prints the table's time, the best new candidate's time and their ratio per
shape, and writes JSON to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from shoal.bench import tune_dense as td
from shoal.bench import tune_fp8 as tf
from shoal.bench.tune_step import odd_split_launches
from shoal.kernels import dense, fp8

def probe_dense(shapes: list[str], jobs: int, iters: int) -> list[dict]:
    plan = []
    for name in shapes:
        N, K = td.SHAPES[name]
        cands = odd_split_launches(1, N, K)
        old = dense.dense_config(1, N, K)
        if old:
            cands.append({**{k: v for k, v in old.items() if k != "k_per_split"}, "_old": True})
        plan.append((name, N, K, 1, cands))
    td.precompile(plan, jobs)
    rows = []
    for name, N, K, M, cands in plan:
        weights = td._cold_weights(N, K)
        cell = td.tune_cell(N, K, M, weights, iters, cands)
        del weights
        torch.cuda.empty_cache()
        best = next((r for r in cell["top5"] if not r["config"].get("_old")), None)
        rows.append(_row("dense", name, cell.get("table_us"), best, cell["cublas_us"]))
    return rows


def probe_fp8(shapes: list[str], jobs: int, iters: int) -> list[dict]:
    plan = []
    for name in shapes:
        N, K = tf.SHAPES[name]
        plain = {tf._key(c, 1, K) for c in tf.candidates(1, N, K)}  # (the packaged entry is marked _old)
        cands = [c for c in tf.candidates(1, N, K, odd_splits=True) if c.get("_old") or tf._key(c, 1, K) not in plain]
        plan.append((name, N, K, 1, cands))
    tf.precompile([(N, K, M, c) for _, N, K, M, c in plan], jobs)
    rows = []
    for name, N, K, M, cands in plan:
        torch.manual_seed(0)
        w = (torch.randn(N, K, device="cuda") * K ** -0.5).bfloat16()
        Wq, Ws = fp8.quantize_weight_ref(w)
        del w
        weights = [(Wq.clone(), Ws.clone()) for _ in range(max(2, min(32, -(-(128 << 20) // Wq.numel()))))]
        cell = tf.tune_cell(N, K, M, weights, iters, cands)
        del weights
        torch.cuda.empty_cache()
        best = next((r for r in cell["top5"] if r is not cell["old"]), None)
        rows.append(_row("fp8", name, cell["old"]["us"] if cell["old"] else None, best, None))
    return rows


def _row(kind: str, name: str, table_us, best, cublas_us) -> dict:
    row = {"kind": kind, "shape": name, "table_us": table_us, "best_us": best["us"] if best else None,
           "best_config": best["config"] if best else None, "cublas_us": cublas_us}
    gain = f"{table_us / best['us']:.3f}x" if (best and table_us) else "-"
    print(f"{kind:5s} {name:10s} M=1 table {table_us or float('nan'):7.2f} us | best odd split "
          f"{best['us'] if best else float('nan'):7.2f} us ({gain}) {(td if kind == 'dense' else tf).short(best['config']) if best else '-'}",
          flush=True)
    return row


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kinds", nargs="*", default=["dense", "fp8"])
    ap.add_argument("--shapes", default="wo,down,wqkv,gate_up")
    ap.add_argument("--jobs", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    t0 = time.time()
    rows = []
    for kind in args.kinds:
        rows += (probe_dense if kind == "dense" else probe_fp8)(shapes, args.jobs, args.iters)
        print(f"[{kind} done at {time.time() - t0:.0f} s]", flush=True)
        out = Path(os.environ.get("OUT", "out"))
        out.mkdir(parents=True, exist_ok=True)
        # one file for the run, rewritten after each kind with the rows so far
        (out / f"odd-splits-{'-'.join(args.kinds)}.json").write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
