"""Tune the FP8-weight / bf16-activation decode GEMM (:mod:`shoal.kernels.fp8w`) on this GPU.

    python -m shoal.bench.tune_fp8w [--out DIR] [--ms 1,4,16,32,64,128] [--shapes ...] [--jobs N]

For every S2-Pro GEMM and M bucket it times, on cold weights (CUDA-graph replay over rotating
weight copies larger than L2, medians), what an FP8 linear costs today -- the W8A8 path
(:func:`shoal.kernels.fp8.fp8_linear_triton`: the 1x128 activation quantize + the tuned GEMM;
and the GEMM alone on a pre-quantized activation) and the bf16 weight
(:func:`shoal.kernels.dense.dense_linear`: our tuned kernel or cuBLAS) -- and a grid of fp8w
launch configs (64/128 weight rows x 64/128 K, the token tile, split-K counts, stages, pointer
or TMA loads). Every candidate is checked against the reference (``fp8w_gemm_ref``, relative
error <= 2^-7 of the output's max). Writes ``DIR/fp8w_tuned.json`` (``{"configs": {"N,K":
{"M": config}}}``, the best config of every cell) and ``DIR/tune_fp8w_cells.json`` (every
timing, with the W8A8 and bf16 references beside it), after every cell.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from shoal.kernels import dense, fp8, fp8w

from .kernels_fp8 import SHAPES, _log, time_graph
from .tune_fp8 import SMS, _cdiv, _splits

TUNE_SHAPES = ("gate_up", "wqkv", "wo", "down", "fast_head")
MS = (1, 4, 16, 32, 64, 128)
SMEM = 200 * 1024
DEV = "cuda"


def _token_tile(M: int) -> int:
    return max(16, min(128, 1 << max(0, M - 1).bit_length()))


def candidates(M: int, N: int, K: int) -> list[dict]:
    """Weight x K tiles 64 x 128, 128 x 128, 128 x 64; the token tile (M rounded up to a power
    of two, 16..64; M > 64 also 128); the split counts of 0.5-6 waves; 4 or 6 stages (3 or 4 for
    64-128 tokens) where they fit; pointer and TMA loads."""
    bms = [_token_tile(M)] if M <= 64 else [64, 128]
    out = []
    for bm in bms:
        for bn, bk in ((64, 128), (128, 128), (128, 64)):
            per_stage = bn * bk + 2 * bm * bk
            nw = 8 if bn * bm >= 128 * 64 else 4
            tiles = _cdiv(N, bn) * _cdiv(M, bm)
            for sk in _splits(_cdiv(K, bk), tiles, options=(1, 2, 4, 8, 16), lo=0.3 if bm >= 64 else 0.5):
                for ns in ((4, 6) if bm <= 32 else (3, 4)):
                    if ns * per_stage <= SMEM:
                        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": nw,
                                    "num_stages": ns})
    return out + [{**c, "TMA": True} for c in out]


def short(c: dict | None) -> str:
    if not c:
        return "-"
    s = f"{c['BLOCK_N']}x{c['BLOCK_M']}x{c['BLOCK_K']}"
    if int(c.get("SPLIT_K", 1)) > 1:
        s += f" sk{c['SPLIT_K']}"
    if c.get("TMA"):
        s += " tma"
    if c.get("BITS") is False:
        s += " cvt"
    return s + f" w{c.get('num_warps', 4)}s{c.get('num_stages', 4)}"


def _weights(N: int, K: int) -> tuple[list, list]:
    """Cold copies of one random weight: (e4m3, scales) pairs and bf16 copies."""
    torch.manual_seed(0)
    w = (torch.randn(N, K, device=DEV) * K ** -0.5).bfloat16()
    Wq, Ws = fp8.quantize_weight_ref(w)
    n8 = max(2, min(32, _cdiv(256 << 20, Wq.numel())))
    n16 = max(2, min(32, _cdiv(256 << 20, 2 * w.numel())))
    return [(Wq.clone(), Ws.clone()) for _ in range(n8)], [w.clone() for _ in range(n16)]


def _compile_jobs(jobs: list) -> int:
    torch.cuda.init()
    failed = 0
    for N, K, M, cfg in jobs:
        try:
            Wq = torch.zeros(N, K, device=DEV).to(fp8.FP8_DTYPE)
            Ws = torch.ones(_cdiv(N, 128), _cdiv(K, 128), device=DEV)
            fp8w.fp8w_gemm_triton(torch.zeros(M, K, device=DEV, dtype=torch.bfloat16), Wq, Ws, config=cfg)
        except Exception:  # noqa: BLE001 - the timing loop reports it
            failed += 1
    torch.cuda.synchronize()
    return failed


def precompile(plan: list, n_jobs: int) -> None:
    import multiprocessing as mp

    jobs, seen = [], set()
    for _, N, K, M, cands in plan:
        spec = ("M1" if M == 1 else "M16" if M % 16 == 0 else "Mx", N % 16 == 0, K % 16 == 0)
        for c in cands:
            f = fp8w.finish_config(c, K)
            key = (spec, json.dumps(f, sort_keys=True), K % f["k_per_split"] == 0)
            if key not in seen:
                seen.add(key)
                jobs.append((N, K, M, c))
    t0 = time.time()
    with mp.get_context("spawn").Pool(n_jobs) as pool:
        failed = sum(pool.map(_compile_jobs, [jobs[i::n_jobs] for i in range(n_jobs) if jobs[i::n_jobs]]))
    _log(f"precompiled {len(jobs)} distinct launches in {n_jobs} processes in {time.time() - t0:.0f}s ({failed} failed)")


def tune_cell(N: int, K: int, M: int, w8: list, w16: list, iters: int, cands: list[dict]) -> dict:
    x = torch.randn(M, K, device=DEV).bfloat16()
    Wq0, Ws0 = w8[0]
    ref = fp8w.fp8w_gemm_ref(x, Wq0, Ws0).float()
    outs = [torch.empty(M, N, dtype=torch.bfloat16, device=DEV) for _ in range(max(len(w8), len(w16)))]
    xq, xs = fp8.quantize_act(x)
    w8a8 = time_graph([lambda i=i: fp8.fp8_linear_triton(x, *w8[i], out=outs[i]) for i in range(len(w8))], iters)
    w8a8_gemm = time_graph([lambda i=i: fp8.fp8_gemm_triton(xq, xs, *w8[i], out=outs[i]) for i in range(len(w8))],
                           iters)
    bf16 = time_graph([lambda i=i: outs[i].copy_(dense.dense_linear(x, w16[i])) for i in range(len(w16))], iters)
    results = []
    for cfg in cands:
        try:
            y = fp8w.fp8w_gemm_triton(x, Wq0, Ws0, config=cfg).float()
            rel = ((y - ref).abs().max() / ref.abs().max()).item()
            if rel > 2.0 ** -7:
                results.append({"config": cfg, "error": f"rel {rel:.2e}"})
                continue
            us = time_graph([lambda i=i, c=cfg: fp8w.fp8w_gemm_triton(x, *w8[i], out=outs[i], config=c)
                             for i in range(len(w8))], iters)
            results.append({"config": cfg, "us": us})
        except Exception as e:  # noqa: BLE001 - a config that does not compile / fit is skipped
            results.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:200]})
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    best = ok[0] if ok else None
    cvt = None
    if best:  # the same launch with Triton's own e4m3 -> fp32 conversion instead of the bit moves
        c2 = {**best["config"], "BITS": False}
        cvt = {"config": c2, "us": time_graph([lambda i=i: fp8w.fp8w_gemm_triton(x, *w8[i], out=outs[i], config=c2)
                                               for i in range(len(w8))], iters)}
    nbytes = N * K + M * K * 2 + M * N * 2
    return {"N": N, "K": K, "M": M, "w8a8_linear_us": w8a8, "w8a8_gemm_us": w8a8_gemm, "bf16_us": bf16,
            "best": best, "best_cvt": cvt, "top5": ok[:5], "n_tried": len(results),
            "n_failed": sum(1 for r in results if "error" in r),
            "best_tbps": nbytes / (best["us"] * 1e-6) / 1e12 if best else None,
            "failures": [r for r in results if "error" in r][:5]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=",".join(TUNE_SHAPES))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--max-candidates", type=int, default=0, help="debug: at most this many per cell")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        _log("tune_fp8w: CUDA not available; nothing to tune")
        return 0
    t0 = time.time()
    ms = [int(m) for m in args.ms.split(",") if m]
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    plan = []
    for name in names:
        N, K = SHAPES[name]
        for M in ms:
            c = candidates(M, N, K)
            plan.append((name, N, K, M, c[:args.max_candidates] if args.max_candidates else c))
    _log(f"tune_fp8w: {len(plan)} cells, {sum(len(p[4]) for p in plan)} candidates")
    if args.jobs > 0:
        try:
            precompile(plan, args.jobs)
        except Exception as e:  # noqa: BLE001 - compile inline instead
            _log(f"precompile failed ({type(e).__name__}: {e}); compiling inline")
    table: dict[str, dict] = {}
    cells: list[dict] = []
    for name in names:
        N, K = SHAPES[name]
        w8, w16 = _weights(N, K)
        for _, _, _, M, cands in (p for p in plan if p[0] == name):
            cell = tune_cell(N, K, M, w8, w16, args.iters, cands)
            cell["shape"] = name
            cells.append(cell)
            b = cell["best"]
            if b:
                table.setdefault(f"{N},{K}", {})[str(M)] = dict(b["config"])
            cv = cell["best_cvt"]
            _log(f"{name:>10} M={M:<4} W8A8 linear {cell['w8a8_linear_us']:7.2f} (GEMM {cell['w8a8_gemm_us']:6.2f}) "
                 f"bf16 {cell['bf16_us']:7.2f} | "
                 + (f"fp8w {b['us']:7.2f} us ({cell['best_tbps']:.2f} TB/s, {cell['w8a8_linear_us'] / b['us']:.2f}x "
                    f"W8A8) {short(b['config'])}; cvt {cv['us']:.2f}" if b else "no working config")
                 + f" [{cell['n_tried']} tried, {cell['n_failed']} failed, {time.time() - t0:.0f}s]")
            if args.out:
                _write(args.out, table, cells)
        del w8, w16
        torch.cuda.empty_cache()
    _log(f"tuned {len(cells)} cells in {time.time() - t0:.0f}s")
    return 0


def _write(out: str, table: dict, cells: list) -> None:
    doc = {"device": torch.cuda.get_device_name(), "sms": SMS, "torch": torch.__version__,
           "triton": getattr(fp8.triton, "__version__", None), "commit": os.environ.get("SHOAL_COMMIT"),
           "date": time.strftime("%Y-%m-%d"), "configs": table}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fp8w_tuned.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(os.path.join(out, "tune_fp8w_cells.json"), "w") as fh:
        json.dump(cells, fh, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
