"""Does the FP8-weight / fp16-activation GEMM (shoal.kernels.fp8h) beat the W8A8 linear? (GPU)

    python benchmarks/scripts/fp8h_probe.py [--ms 1,16,64] [--shapes gate_up,down,wqkv,wo] [--jobs 14]

For every S2-Pro decode GEMM and token count it times, on cold weights (CUDA-graph replay over
rotating weight copies larger than L2, medians, as ``shoal bench kernels``): the packaged W8A8
linear (the 1x128 activation quantize + the tuned GEMM), the W8A8 GEMM alone on a quantized
activation, and a grid of fp8h launch configs on an fp16 activation (64/128 weight rows, 64/128
K, split-K, stages, pointer / TMA loads). Every candidate is checked against
``fp8h_gemm_ref`` (max error <= 2^-7 of the output's max) before it is timed. Prints one line per
cell and writes ``$OUT/fp8h-probe.json`` (every timing) after each cell.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from shoal.bench.kernels_fp8 import SHAPES, time_graph
from shoal.bench.tune_fp8 import SMS, _cdiv, _splits
from shoal.kernels import fp8, fp8h

SMEM = 200 * 1024
DEV = "cuda"


def log(*a) -> None:
    print(*a, flush=True)


def candidates(M: int, N: int, K: int) -> list[dict]:
    bm = max(16, min(64, 1 << max(0, M - 1).bit_length()))
    out = []
    for bn, bk in ((64, 128), (128, 128), (128, 64)):
        per_stage = bn * bk + 2 * bm * bk
        nw = 8 if bn * bm >= 128 * 64 else 4
        tiles = _cdiv(N, bn) * _cdiv(M, bm)
        for sk in _splits(_cdiv(K, bk), tiles, options=(1, 2, 4, 8, 16), lo=0.4, hi=4.0):
            for ns in ((3, 4) if bm >= 64 else (4, 6)):
                if ns * per_stage <= SMEM:
                    for tma in (False, True):
                        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": nw,
                                    "num_stages": ns, "TMA": tma})
    return out


def short(c: dict | None) -> str:
    if not c:
        return "-"
    s = f"{c['BLOCK_N']}x{c['BLOCK_M']}x{c['BLOCK_K']} sk{c.get('SPLIT_K', 1)}"
    return s + (" tma" if c.get("TMA") else "") + f" w{c.get('num_warps', 4)}s{c.get('num_stages', 4)}"


def _compile(jobs: list) -> int:
    torch.cuda.init()
    failed = 0
    for N, K, M, cfg in jobs:
        try:
            Wq = torch.zeros(N, K, device=DEV).to(fp8.FP8_DTYPE)
            Wh = torch.ones(_cdiv(N, 128), _cdiv(K, 128), device=DEV, dtype=torch.float16)
            fp8h.fp8h_gemm_triton(torch.zeros(M, K, device=DEV, dtype=torch.float16), Wq, Wh, 1.0, config=cfg)
        except Exception:  # noqa: BLE001 - the timing loop reports it
            failed += 1
    torch.cuda.synchronize()
    return failed


def precompile(plan: list, n_jobs: int) -> None:
    import multiprocessing as mp

    jobs, seen = [], set()
    for _, N, K, M, cands in plan:
        for c in cands:
            f = fp8h.fp8h_finish_config(c, K)
            key = (M == 1, M % 16 == 0, json.dumps(f, sort_keys=True), K % f["k_per_split"] == 0)
            if key not in seen:
                seen.add(key)
                jobs.append((N, K, M, c))
    t0 = time.time()
    with mp.get_context("spawn").Pool(n_jobs) as pool:
        failed = sum(pool.map(_compile, [jobs[i::n_jobs] for i in range(n_jobs) if jobs[i::n_jobs]]))
    log(f"precompiled {len(jobs)} launches in {time.time() - t0:.0f} s ({failed} failed)")


def cell(N: int, K: int, M: int, w8: list, iters: int, cands: list[dict]) -> dict:
    x = torch.randn(M, K, device=DEV).bfloat16()
    x16 = x.half()
    Wq0, Ws0 = w8[0]
    hs = [fp8h.fp16_weight_scales(Ws) for _, Ws in w8]
    Wh0, osc0, min_ratio = hs[0]
    ref = fp8h.fp8h_gemm_ref(x16, Wq0, Wh0, osc0).float()
    exact = x.float() @ fp8.dequant_weight(Wq0, Ws0).t()
    outs = [torch.empty(M, N, dtype=torch.bfloat16, device=DEV) for _ in w8]
    xq, xs = fp8.quantize_act(x)
    w8a8 = time_graph([lambda i=i: fp8.fp8_linear_triton(x, *w8[i], out=outs[i]) for i in range(len(w8))], iters)
    w8a8_gemm = time_graph([lambda i=i: fp8.fp8_gemm_triton(xq, xs, *w8[i], out=outs[i]) for i in range(len(w8))],
                           iters)
    err_w8a8 = ((fp8.fp8_linear_triton(x, Wq0, Ws0).float() - exact).abs().max() / exact.abs().max()).item()
    results = []
    for cfg in cands:
        try:
            y = fp8h.fp8h_gemm_triton(x16, Wq0, Wh0, osc0, config=cfg).float()
            rel = ((y - ref).abs().max() / ref.abs().max()).item()
            if rel > 2.0 ** -7:
                results.append({"config": cfg, "error": f"rel {rel:.2e}"})
                continue
            us = time_graph([lambda i=i, c=cfg: fp8h.fp8h_gemm_triton(x16, w8[i][0], hs[i][0], hs[i][1], out=outs[i],
                                                                      config=c) for i in range(len(w8))], iters)
            results.append({"config": cfg, "us": us, "rel_vs_ref": rel,
                            "rel_vs_exact": ((y - exact).abs().max() / exact.abs().max()).item()})
        except Exception as e:  # noqa: BLE001 - a config that does not compile / fit is skipped
            results.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:200]})
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    best = ok[0] if ok else None
    plain = None
    if best:  # the same launch with the compiler's scalar fp16 multiply instead of mul.rn.f16x2
        c2 = {**best["config"], "PACKED_MUL": False}
        plain = time_graph([lambda i=i: fp8h.fp8h_gemm_triton(x16, w8[i][0], hs[i][0], hs[i][1], out=outs[i], config=c2)
                            for i in range(len(w8))], iters)
    return {"plain_mul_us": plain, "N": N, "K": K, "M": M, "w8a8_linear_us": w8a8, "w8a8_gemm_us": w8a8_gemm, "w8a8_rel_vs_exact": err_w8a8,
            "min_scale_ratio": min_ratio, "best": best, "top5": ok[:5], "n_tried": len(results),
            "failures": [r for r in results if "error" in r][:5],
            "n_failed": sum(1 for r in results if "error" in r),
            "best_tbps": (N * K + M * K * 2 + M * N * 2) / (best["us"] * 1e-6) / 1e12 if best else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--shapes", default="gate_up,down,wqkv,wo")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=14)
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting new cells after this")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        log("fp8h_probe: CUDA not available")
        return 0
    t0 = time.time()
    ms = [int(m) for m in args.ms.split(",") if m]
    names = [n for n in args.shapes.split(",") if n]
    plan = [(n, *SHAPES[n], M, candidates(M, *SHAPES[n])) for n in names for M in ms]
    log(f"fp8h_probe: {len(plan)} cells, {sum(len(p[4]) for p in plan)} candidates on "
        f"{torch.cuda.get_device_name()} ({SMS} SMs assumed by the split grid)")
    if args.jobs > 0:
        precompile(plan, args.jobs)
    cells = []
    for name in names:
        N, K = SHAPES[name]
        torch.manual_seed(0)
        w = (torch.randn(N, K, device=DEV) * K ** -0.5).bfloat16()
        Wq, Ws = fp8.quantize_weight_ref(w)
        copies = max(2, min(32, _cdiv(256 << 20, Wq.numel())))
        w8 = [(Wq.clone(), Ws.clone()) for _ in range(copies)]
        for _, _, _, M, cands in (p for p in plan if p[0] == name):
            if time.time() - t0 > args.budget_s:
                log(f"budget spent: {name} M={M} not run")
                continue
            c = cell(N, K, M, w8, args.iters, cands)
            c["shape"] = name
            cells.append(c)
            b = c["best"]
            log(f"{name:>8} M={M:<3} W8A8 linear {c['w8a8_linear_us']:6.2f} (GEMM {c['w8a8_gemm_us']:6.2f}, err "
                f"{c['w8a8_rel_vs_exact']:.1e}) | fp8h "
                + (f"{b['us']:6.2f} us ({c['best_tbps']:.2f} TB/s, {c['w8a8_linear_us'] / b['us']:.2f}x, err "
                   f"{b['rel_vs_exact']:.1e}) {short(b['config'])}; scalar mul {c['plain_mul_us']:.2f}" if b else "none")
                + f" [{c['n_tried']} tried, {c['n_failed']} failed, {time.time() - t0:.0f} s]")
            if os.environ.get("OUT"):
                with open(os.path.join(os.environ["OUT"], "fp8h-probe.json"), "w") as fh:
                    json.dump({"device": torch.cuda.get_device_name(), "cells": cells}, fh, indent=1)
        del w8
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
