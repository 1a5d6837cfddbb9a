"""Tune the FP8 GEMM launch configs for S2-Pro's decode shapes on the current GPU.

    python -m shoal.bench.tune_fp8 [--out DIR] [--ms 1,2,4,8,16,32,64,128] [--shapes ...]

For every S2-Pro GEMM shape and every M bucket, times a grid of candidate configs of
:func:`shoal.kernels.fp8.fp8_gemm_triton` (:func:`~shoal.kernels.fp8.fp8_gemm_triton` on
pre-quantized activations; tile sizes, split-K, warps, stages) on cold weights
(CUDA-graph replay over rotating weight copies larger than L2, median of replays), checks the
winner against the reference, and writes ``DIR/fp8_tuned.json`` in the format
``shoal/kernels/fp8_tuned.json`` is read in: ``{"configs": {"N,K": {"M": config}}}``, a bucket
``M`` serving every batch size up to it. Copy the file there to make it the default (it is
only used on GPUs with the same SM count as the one it was tuned on, see ``_gemm_config``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch

from shoal.kernels import fp8

from .kernels_fp8 import SHAPES, _log, time_graph

MS = (1, 8, 16, 32, 64, 128, 1024)


def candidates(M: int, K: int) -> list[dict]:
    """The search space (kept small: every distinct config is one Triton compile)."""
    KB = -(-K // 128)
    out = []
    if M <= 16:
        for bn, sk, ns in itertools.product((32, 64, 128), (1, 2, 4), (3, 4)):
            out.append({"BLOCK_M": 16, "BLOCK_N": bn, "SPLIT_K": sk, "num_warps": 4, "num_stages": ns})
    elif M <= 64:
        for bn, sk, ns in itertools.product((64, 128), (1, 2, 4), (3, 4)):
            out.append({"BLOCK_M": M, "BLOCK_N": bn, "SPLIT_K": sk, "num_warps": 4, "num_stages": ns})
    elif M <= 128:
        for bm, bn, sk, nw in itertools.product((64, 128), (64, 128), (1, 2, 4), (4, 8)):
            out.append({"BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": sk, "num_warps": nw, "num_stages": 3})
    else:  # prefill
        for bm, bn, nw, ns in itertools.product((64, 128), (64, 128), (4, 8), (3, 4)):
            out.append({"BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": 1, "num_warps": nw, "num_stages": ns})
    seen, uniq = set(), []
    for c in out:  # splits beyond KB collapse to the same launch
        key = json.dumps({**c, "SPLIT_K": min(c["SPLIT_K"], KB)}, sort_keys=True)
        if key not in seen:
            seen.add(key)
            uniq.append(c)
    return uniq


def tune_cell(N: int, K: int, M: int, weights, iters: int) -> dict:
    dev = "cuda"
    x = torch.randn(M, K, device=dev).bfloat16()
    xq, xs = fp8.quantize_act(x)
    Wq0, Ws0 = weights[0]
    y_ref = fp8.fp8_gemm_ref(xq, xs, Wq0, Ws0).float()
    outs = [torch.empty(M, N, dtype=torch.bfloat16, device=dev) for _ in weights]
    results = []
    for cfg in candidates(M, K):
        try:
            y = fp8.fp8_gemm_triton(xq, xs, Wq0, Ws0, config=cfg).float()
            rel = ((y - y_ref).abs().max() / y_ref.abs().max()).item()
            if rel > 2.0 ** -7:
                results.append({"config": cfg, "error": f"rel {rel:.2e}"})
                continue
            us = time_graph([lambda i=i, c=cfg: fp8.fp8_gemm_triton(xq, xs, *weights[i], out=outs[i], config=c)
                             for i in range(len(weights))], iters)
            results.append({"config": cfg, "us": us})
        except Exception as e:  # noqa: BLE001 - a config that does not compile / fit is skipped
            results.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:200]})
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    default = fp8._heuristic_config(M, N, K, fp8._device_sms(x))
    best = ok[0] if ok else None
    nbytes = N * K + N * -(-K // 128) * 4 + M * K + M * N * 2
    return {"N": N, "K": K, "M": M, "best": best, "top5": ok[:5], "n_tried": len(results),
            "n_failed": sum(1 for r in results if "error" in r), "heuristic": default,
            "best_tbps": nbytes / (best["us"] * 1e-6) / 1e12 if best else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        _log("tune_fp8: CUDA not available; nothing to tune")
        return 0
    t0 = time.time()
    ms = [int(m) for m in args.ms.split(",") if m]
    table: dict[str, dict[str, dict]] = {}
    cells = []
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        torch.manual_seed(0)
        w = (torch.randn(N, K, device="cuda") * K ** -0.5).bfloat16()
        Wq, Ws = fp8.quantize_weight_ref(w)
        del w
        weights = [(Wq.clone(), Ws.clone()) for _ in range(max(2, min(32, -(-(128 << 20) // Wq.numel()))))]
        for M in ms:
            cell = tune_cell(N, K, M, weights, args.iters)
            cell["shape"] = name
            cells.append(cell)
            b = cell["best"]
            if b:
                cfg = {k: v for k, v in b["config"].items()}
                table.setdefault(f"{N},{K}", {})[str(M)] = cfg
                _log(f"{name:>14} M={M:<4} best {b['us']:7.2f} us ({cell['best_tbps']:.2f} TB/s) {cfg}  "
                     f"[{cell['n_tried']} tried, {cell['n_failed']} failed, {time.time() - t0:.0f}s]")
            else:
                _log(f"{name:>14} M={M:<4} no working config")
            if args.out:  # after every cell, so a time limit keeps what was measured
                _write(args.out, table, cells)
        del weights
        torch.cuda.empty_cache()
    _log(f"tuned {len(cells)} cells in {time.time() - t0:.0f}s")
    return 0


def _write(out: str, table: dict, cells: list) -> None:
    doc = {"device": torch.cuda.get_device_name(), "sms": fp8._device_sms(torch.empty(0, device="cuda")),
           "torch": torch.__version__, "triton": getattr(fp8.triton, "__version__", None),
           "commit": os.environ.get("SHOAL_COMMIT"), "date": time.strftime("%Y-%m-%d"),
           "configs": table}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fp8_tuned.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(os.path.join(out, "tune_fp8_cells.json"), "w") as fh:
        json.dump(cells, fh, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
