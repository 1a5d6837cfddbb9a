"""Tune the FP8 GEMM launch configs for S2-Pro's decode shapes on the current GPU.

    python -m shoal.bench.tune_fp8 [--out DIR] [--ms 1,8,16,32,64,128,1024] [--shapes ...] [--jobs N]

For every S2-Pro GEMM shape (gate_up, wqkv, wo, down, fast head) and every M bucket, times a
grid of candidate configs of :func:`shoal.kernels.fp8.fp8_gemm_triton` (pre-quantized
activations; both kernel variants: ``KIND`` "tile" and, for M <= 32, the swap-AB decode kernel
"swap"; tile sizes, split-K up to 16 with the in-kernel reduce ``REDUCE`` "fused", warps,
stages) on cold weights (CUDA-graph replay over rotating weight copies larger than L2, median
of replays), checks every candidate against the reference, and writes ``DIR/fp8_tuned.json``
in the format ``shoal/kernels/fp8_tuned.json`` is read in: ``{"configs": {"N,K": {"M":
config}}}``, a bucket ``M`` serving every batch size up to it (plus ``DIR/tune_fp8_cells.json``
with every timing). The packaged table's entry is always among the candidates (as it is, and
with the fused reduce), so "vs old" in the final table is measured in the same run.

Use the fresh table without committing it: ``python -m shoal.bench.kernels_fp8 --table
DIR/fp8_tuned.json`` (or ``SHOAL_FP8_TUNED=DIR/fp8_tuned.json``); copy it to
``shoal/kernels/fp8_tuned.json`` to make it the default (it is only used on GPUs with the same
SM count as the one it was tuned on, see ``_gemm_config``).

Compile time dominates a cold run (every distinct config and integer specialization is one
Triton compile): ``--jobs`` worker processes compile every candidate first (into Triton's
on-disk cache, which the timing loop then hits); the space is pruned to a few hundred compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from shoal.kernels import fp8

from .kernels_fp8 import SHAPES, _log, time_graph

MS = (1, 8, 16, 32, 64, 128, 1024)
TUNE_SHAPES = ("gate_up", "wqkv", "wo", "down", "fast_head")
SWAP_MAX_M = 32
SMS = 132
DEV = "cuda"  # (a test runs the flow on CPU tensors under the Triton interpreter)


def _packaged_table() -> dict:
    path = Path(fp8.__file__).with_name("fp8_tuned.json")
    try:
        return json.loads(path.read_text()).get("configs", {})
    except (OSError, ValueError):
        return {}


def old_config(M: int, N: int, K: int) -> dict | None:
    """The packaged table's entry for this cell (the bucket lookup of ``_tuned_config``)."""
    entry = fp8.bucket_entry(_packaged_table().get(f"{N},{K}"), M)
    return dict(entry) if entry is not None else None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _splits(KB: int, tiles: int, options=(1, 2, 4, 8, 16), lo: float = 0.5, hi: float = 6.0) -> list[int]:
    """Split counts worth trying for ``tiles`` output tiles: at least 2 K blocks per split,
    between ``lo`` and ``hi`` waves of programs on SMS SMs (the smallest split reaching one
    wave is always kept); splits that collapse to the same effective split are dropped."""
    out, seen = [], set()
    for s in options:
        kbp = _cdiv(KB, s)
        eff = _cdiv(KB, kbp)
        if eff in seen or (s > 1 and kbp < 2):
            continue
        progs = tiles * eff
        if lo * SMS <= progs <= hi * SMS or (progs >= SMS and not any(tiles * e >= SMS for e in seen)):
            seen.add(eff)
            out.append(s)
    if not out:  # too few tiles for any split to fill the GPU: the largest split
        out = [max(options, key=lambda s: (tiles * _cdiv(KB, _cdiv(KB, s)), -s) if s == 1 or _cdiv(KB, s) >= 2
                   else (0, 0))]
    return out


def mma_v2_candidates(M: int, N: int, K: int) -> list[dict]:
    """Launches whose MMA is the synchronous ``mma.sync`` instead of Hopper's asynchronous
    wgmma, for 1-128 tokens: Triton takes wgmma only for 64 or more rows
    on the MMA's M axis per warp group, so the tile kernel with 16/32-token tiles and the swap
    kernel with 16/32 weight rows lower to mma.sync. Why try them: a wgmma's fp32 result must be
    waited for before the per-K-block scales apply, and Triton waits for all of it right away
    (``warp_group_dot_wait`` with 0 pending) -- the serial chain that bounds the 64-token cells;
    a synchronous MMA's result is ordinary registers, so the compiler can overlap one K block's
    scaling with the next block's MMAs. The price (compiled for sm_90 with Triton 3.8): Triton
    widens both e4m3 operands to fp16 and runs ``mma.sync.m16n8k16.f16`` -- one conversion per
    two weight values, which the FP8-weight / bf16-activation experiment (docs/benchmarks.md)
    found to be the expensive part at four times that count."""
    KB = _cdiv(K, 128)
    out: list[dict] = []
    for bm in (16, 32):  # tile kernel: tokens on the MMA's M axis
        if bm > fp8._pow2(M) and bm > 16:
            continue
        for bn, nw in ((64, 4), (128, 4), (256, 8)):
            tiles = _cdiv(M, bm) * _cdiv(N, bn)
            for sk in _splits(KB, tiles, options=(1, 2, 4, 8), lo=0.3, hi=8.0):
                for ns in (3, 4):
                    out.append({"KIND": "tile", "BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": sk, "num_warps": nw,
                                "num_stages": ns})
    for bn in (16, 32):  # swap kernel: weight rows on the MMA's M axis
        for bm in sorted({min(64, max(16, fp8._pow2(M))), 16 if M <= 16 else 32}):
            tiles = _cdiv(M, bm) * _cdiv(N, bn)
            for sk in _splits(KB, tiles, options=(1, 2, 4, 8), lo=0.3, hi=8.0):
                for ns in (3, 4):
                    for tma in (False, True):
                        out.append({"KIND": "swap", "BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": sk,
                                    "num_warps": 4, "num_stages": ns, "TMA": tma,
                                    **({"M_FAST": True} if bm < M else {})})
    return out


ODD_SPLITS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
"""Split-K counts of both tuners' ``--odd-splits`` (M <= 32): besides the powers of two, counts
that bring a shape's program count nearer a whole number of waves on 132 SMs (e.g. bf16 wo at
M = 1: 40 weight tiles x 3 splits = 120 programs, where 2 give 80 and 4 give 160)."""


def candidates(M: int, N: int, K: int, seeds: list[dict] | None = None, mma_v2: bool = False,
               odd_splits: bool = False) -> list[dict]:
    """The search space for one cell (kept small: every distinct config is one Triton compile).
    M <= 32: the swap-AB kernel, weight tiles of 64/128/256 rows, tokens 16 or 32 per program,
    split-K 1-16 (in-kernel reduce), 1/2/4 K blocks per iteration with 2-6 stages, pointer or
    TMA loads -- or, given ``seeds`` (the best M = 1 configs of the shape), only those with the
    token tile adjusted to M; M = 64/128: the tile kernel with 64/128 x 64/128/256 tiles,
    split-K 1-4, and the swap kernel with the whole token tile (64/128 x 64/128, 1 or 2 K
    blocks per iteration, pointer or TMA loads); prefill: tile kernel, no split.
    Plus the packaged table's entry (as it is and with the fused reduce). ``mma_v2``: only the
    launches of :func:`mma_v2_candidates` (and the packaged entry)."""
    KB = _cdiv(K, 128)
    out: list[dict] = []
    if mma_v2:
        out = mma_v2_candidates(M, N, K)
    elif M <= SWAP_MAX_M and seeds is not None:
        for c in seeds:
            c = _public(c)
            if c.get("KIND") == "swap":
                c["BLOCK_M"] = 16 if M <= 16 else 32
            else:
                c["BLOCK_M"] = max(16, min(64, fp8._pow2(M)))
            out.append(c)
    elif M <= SWAP_MAX_M:
        bm = 16 if M <= 16 else 32
        # (weight rows, warps, {K blocks per iteration: stages}): about 200 KB of shared memory at most
        for bn, nw, steps in ((64, 4, {1: (4, 6), 2: (3, 4), 4: (2, 3)}), (128, 4, {1: (4, 6), 2: (3,)}),
                              (256, 8, {1: (3, 4)})):
            tiles = _cdiv(N, bn) * _cdiv(M, bm)
            for sk in _splits(KB, tiles, options=ODD_SPLITS if odd_splits else (1, 2, 4, 8, 16)):
                for step, stages in steps.items():
                    for ns in stages:
                        for tma in (False, True):
                            out.append({"KIND": "swap", "BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": sk,
                                        "num_warps": nw, "num_stages": ns, "KB_STEP": step, "TMA": tma})
    elif M <= 128:
        # (narrow 32-row tiles and deeper splits: more programs per SM to overlap each one's
        # MMA -> scale chain, which bounds these cells rather than the weight stream)
        for bm, bn, nw in ((64, 32, 4), (64, 64, 4), (64, 128, 4), (64, 256, 8), (128, 128, 8), (128, 256, 8)):
            if bm > 64 and M <= 64:
                continue
            tiles = _cdiv(M, bm) * _cdiv(N, bn)
            for sk in _splits(KB, tiles, options=(1, 2, 4), lo=0.0, hi=8.0):
                for ns in (3, 4):
                    out.append({"KIND": "tile", "BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": sk, "num_warps": nw,
                                "num_stages": ns})
        # the swap kernel with a whole token tile (64 or 128 tokens on the MMA's N axis), pointer
        # or TMA loads; and with 16/32-token tiles launched token-tile-fastest (M_FAST: a weight
        # tile's programs run together and share its bytes through L2), TMA loads
        for bm, m_fast in [(b, False) for b in sorted({64, fp8._pow2(M)})] + [(16, True), (32, True)]:
            for bn in (64, 128):
                tiles = _cdiv(M, bm) * _cdiv(N, bn)
                for sk in _splits(KB, tiles, options=(1, 2, 4), lo=0.0, hi=8.0 if m_fast else 4.0):
                    for step, ns in ((1, 4), (2, 3)):
                        for tma in (True,) if m_fast else (False, True):
                            out.append({"KIND": "swap", "BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": sk,
                                        "num_warps": 4 if bm * bn <= 64 * 64 else 8, "num_stages": ns,
                                        "KB_STEP": step, "TMA": tma, **({"M_FAST": True} if m_fast else {})})
    else:  # prefill
        for bm, bn, nw in ((64, 128, 4), (128, 128, 8), (64, 256, 8), (128, 256, 8)):
            for ns in (3, 4):
                out.append({"KIND": "tile", "BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": 1, "num_warps": nw,
                            "num_stages": ns})
    for c in out:
        if min(int(c.get("SPLIT_K", 1)), KB) > 1:
            c["REDUCE"] = "fused"
    old = old_config(M, N, K)
    if old is not None:
        out.append(dict(old))
        if min(int(old.get("SPLIT_K", 1)), KB) > 1:
            out.append({**old, "REDUCE": "fused"})
    seen, uniq = set(), []
    for c in out:  # identical launches (after normalization) are timed once
        key = _key(c, M, K)
        if key not in seen:
            seen.add(key)
            uniq.append(c)
    if old is not None:
        old_key = _key(old, M, K)
        for c in uniq:
            if _key(c, M, K) == old_key:
                c["_old"] = True
    return uniq


def _key(c: dict, M: int, K: int) -> str:
    f = fp8._finish_config({k: v for k, v in c.items() if not k.startswith("_")}, M, K)
    return json.dumps(f, sort_keys=True)


def _public(c: dict) -> dict:
    return {k: v for k, v in c.items() if not k.startswith("_")}


def short(c: dict | None) -> str:
    if not c:
        return "-"
    s = f"{c.get('KIND', 'tile')} {c.get('BLOCK_M', 16)}x{c.get('BLOCK_N', 64)}"
    if int(c.get("SPLIT_K", 1)) > 1:
        s += f" sk{c['SPLIT_K']}{'f' if c.get('REDUCE') == 'fused' else 'r'}"
    if int(c.get("KB_STEP") or 1) > 1:
        s += f" x{c['KB_STEP']}"
    if c.get("TMA"):
        s += " tma"
    if c.get("M_FAST"):
        s += " mfast"
    return s + f" w{c.get('num_warps', 4)}s{c.get('num_stages', 4)}"


# --------------------------------------------------------------------------------------
# Parallel precompile (worker processes fill Triton's on-disk cache)
# --------------------------------------------------------------------------------------


def _compile_jobs(jobs: list[tuple[int, int, int, dict]]) -> int:
    """Worker: run every (N, K, M, config) once (compiles it); returns the number that failed."""
    if DEV == "cuda":
        torch.cuda.init()
    failed = 0
    ops = {}
    for N, K, M, cfg in jobs:
        try:
            if (N, K) not in ops:
                ops.clear()
                Wq = torch.zeros(N, K, device=DEV).to(fp8.FP8_DTYPE)
                Ws = torch.ones(_cdiv(N, 128), _cdiv(K, 128), device=DEV)
                ops[(N, K)] = (Wq, Ws, {})
            Wq, Ws, xs_by_m = ops[(N, K)]
            if M not in xs_by_m:
                xs_by_m[M] = fp8.quantize_act(torch.randn(M, K, device=DEV).bfloat16())
            xq, xs = xs_by_m[M]
            out = torch.empty(M, N, dtype=torch.bfloat16, device=DEV)
            fp8.fp8_gemm_triton(xq, xs, Wq, Ws, out=out, config=cfg)
        except Exception:  # noqa: BLE001 - the timing loop reports it
            failed += 1
    if DEV == "cuda":
        torch.cuda.synchronize()
    return failed


def precompile(cells: list[tuple[int, int, int, list[dict]]], n_jobs: int) -> None:
    """Compile every candidate of every cell in ``n_jobs`` processes (round-robin by distinct
    launch, one of each identical compile), so the serial timing loop finds them on disk."""
    import multiprocessing as mp

    uniq, seen = [], set()
    for N, K, M, cands in cells:
        spec = ("M1" if M == 1 else "M16" if M % 16 == 0 else "Mx")
        for c in cands:
            cfg = _public(c)
            key = (spec, _key(cfg, M, K), K % 16 == 0, N % 16 == 0)
            if key not in seen:
                seen.add(key)
                uniq.append((N, K, M, cfg))
    uniq.sort(key=lambda j: (j[0], j[1]))  # a worker keeps one weight shape at a time
    chunks = [uniq[i::n_jobs] for i in range(n_jobs)]
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(n_jobs) as pool:
        failed = sum(pool.map(_compile_jobs, [c for c in chunks if c]))
    _log(f"precompiled {len(uniq)} distinct launches in {n_jobs} processes in {time.time() - t0:.0f}s "
         f"({failed} failed)")


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------


def tune_cell(N: int, K: int, M: int, weights, iters: int, cands: list[dict] | None = None) -> dict:
    dev = DEV
    x = torch.randn(M, K, device=dev).bfloat16()
    xq, xs = fp8.quantize_act(x)
    Wq0, Ws0 = weights[0]
    y_ref = fp8.fp8_gemm_ref(xq, xs, Wq0, Ws0).float()
    outs = [torch.empty(M, N, dtype=torch.bfloat16, device=dev) for _ in weights]
    results = []
    old = None
    for c in cands if cands is not None else candidates(M, N, K):
        cfg = _public(c)
        try:
            y = fp8.fp8_gemm_triton(xq, xs, Wq0, Ws0, config=cfg).float()
            rel = ((y - y_ref).abs().max() / y_ref.abs().max()).item()
            if rel > 2.0 ** -7:
                results.append({"config": cfg, "error": f"rel {rel:.2e}"})
                continue
            us = time_graph([lambda i=i, c=cfg: fp8.fp8_gemm_triton(xq, xs, *weights[i], out=outs[i], config=c)
                             for i in range(len(weights))], iters)
            r = {"config": cfg, "us": us}
            results.append(r)
            if c.get("_old"):
                old = r
        except Exception as e:  # noqa: BLE001 - a config that does not compile / fit is skipped
            results.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:200]})
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    default = fp8._heuristic_config(M, N, K, fp8._device_sms(x))
    best = ok[0] if ok else None
    nbytes = N * K + N * _cdiv(K, 128) * 4 + M * K + M * N * 2
    return {"N": N, "K": K, "M": M, "best": best, "top5": ok[:5], "n_tried": len(results),
            "n_failed": sum(1 for r in results if "error" in r), "heuristic": default, "old": old,
            "best_tbps": nbytes / (best["us"] * 1e-6) / 1e12 if best else None,
            "failures": [r for r in results if "error" in r][:5]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=",".join(TUNE_SHAPES))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=min(8, max(1, (os.cpu_count() or 2) - 2)),
                    help="processes that precompile the candidates (0: compile inline)")
    ap.add_argument("--seeds", type=int, default=4, help="best M=1 configs tried at M = 8, 16, 32")
    ap.add_argument("--odd-splits", action="store_true",
                    help="M <= 32 (swap kernel): split-K counts 3, 5, 6 and 12 as well as the powers of two")
    ap.add_argument("--mma-v2", action="store_true",
                    help="try only the mma.sync launches (16/32-token or 16/32-weight-row tiles) against the packaged table")
    ap.add_argument("--max-candidates", type=int, default=0, help="debug: at most this many per cell")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        _log("tune_fp8: CUDA not available; nothing to tune")
        return 0
    t0 = time.time()
    ms = [int(m) for m in args.ms.split(",") if m]
    names = [n for n in args.shapes.split(",") if n]
    cells: list[dict] = []
    # the packaged entries stay for the cells not tuned in this run (a subset, or a time limit)
    table: dict[str, dict[str, dict]] = {k: dict(v) for k, v in _packaged_table().items()}
    # phase 1: M = 1 over the full decode space; phase 2: the other M, the small ones (M <= 32)
    # seeded by the shape's best M = 1 configs (two parallel precompiles, a few hundred compiles)
    phase1 = [m for m in ms if m == 1] or []
    phase2 = [m for m in ms if m != 1]
    seeds: dict[str, list[dict]] = {}
    for phase_ms in (phase1, phase2):
        if not phase_ms:
            continue
        plan = []
        for name in names:
            N, K = SHAPES[name]
            for M in phase_ms:
                cands = candidates(M, N, K, seeds.get(name) if 1 < M <= SWAP_MAX_M else None, mma_v2=args.mma_v2,
                                   odd_splits=args.odd_splits)
                if args.max_candidates:
                    cands = cands[:args.max_candidates]
                plan.append((name, N, K, M, cands))
        _log(f"tune_fp8: M in {phase_ms}: {len(plan)} cells, {sum(len(p[4]) for p in plan)} candidate timings "
             f"[{time.time() - t0:.0f}s]")
        if args.jobs > 0:
            try:
                precompile([(N, K, M, c) for _, N, K, M, c in plan], args.jobs)
            except Exception as e:  # noqa: BLE001 - compile inline instead
                _log(f"precompile failed ({type(e).__name__}: {e}); compiling inline")
        for name in names:
            _time_shape(name, [p for p in plan if p[0] == name], args, table, cells, t0)
            if 1 in phase_ms:
                c1 = next((c for c in cells if c["shape"] == name and c["M"] == 1), None)
                if c1 and c1["top5"]:
                    seeds[name] = [r["config"] for r in c1["top5"][:args.seeds]]
    cells.sort(key=lambda c: (names.index(c["shape"]), c["M"]))
    _summary(cells)
    _log(f"tuned {len(cells)} cells in {time.time() - t0:.0f}s")
    return 0


def _time_shape(name: str, plan: list, args, table: dict, cells: list, t0: float) -> None:
    if not plan:
        return
    N, K = SHAPES[name]
    torch.manual_seed(0)
    w = (torch.randn(N, K, device=DEV) * K ** -0.5).bfloat16()
    Wq, Ws = fp8.quantize_weight_ref(w)
    del w
    weights = [(Wq.clone(), Ws.clone()) for _ in range(max(2, min(32, -(-(128 << 20) // Wq.numel()))))]
    for _, _, _, M, cands in plan:
        cell = tune_cell(N, K, M, weights, args.iters, cands)
        cell["shape"] = name
        cells.append(cell)
        b = cell["best"]
        if b:
            cfg = dict(b["config"])
            table.setdefault(f"{N},{K}", {})[str(M)] = cfg
            old = cell["old"]
            vs = f" old {old['us']:.2f} us ({old['us'] / b['us']:.2f}x)" if old else ""
            _log(f"{name:>10} M={M:<4} best {b['us']:7.2f} us ({cell['best_tbps']:.2f} TB/s) {short(cfg)}{vs}  "
                 f"[{cell['n_tried']} tried, {cell['n_failed']} failed, {time.time() - t0:.0f}s]")
        else:
            _log(f"{name:>10} M={M:<4} no working config")
        if args.out:  # after every cell, so a time limit keeps what was measured
            _write(args.out, table, cells)
    del weights
    torch.cuda.empty_cache()


def _summary(cells: list) -> None:
    _log("")
    _log(f"{'shape':>10} {'M':>5} | {'best config':<30} | {'us':>7} | {'TB/s':>5} | {'old us':>7} | {'vs old':>6} | "
         f"old config")
    for c in cells:
        b, o = c["best"], c["old"]
        if not b:
            _log(f"{c['shape']:>10} {c['M']:>5} | no working config")
            continue
        _log(f"{c['shape']:>10} {c['M']:>5} | {short(b['config']):<30} | {b['us']:7.2f} | {c['best_tbps']:5.2f} | "
             + (f"{o['us']:7.2f} | {o['us'] / b['us']:5.2f}x | {short(o['config'])}" if o else f"{'-':>7} | {'-':>6} |"))


def _write(out: str, table: dict, cells: list) -> None:
    doc = {"device": torch.cuda.get_device_name() if DEV == "cuda" else DEV, "sms": fp8._device_sms(torch.empty(0, device=DEV)),
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
