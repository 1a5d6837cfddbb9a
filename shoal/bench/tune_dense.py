"""Tune the bf16 decode GEMM (:mod:`shoal.kernels.dense`) for S2-Pro's shapes on this GPU.

    python -m shoal.bench.tune_dense [--out DIR] [--ms 1,4,16,32,64,128] [--shapes ...] [--jobs N]
    shoal bench dense --out DIR          # the same

For every S2-Pro GEMM (wqkv, wo, gate_up = w1|w3, down, the constrained semantic head, the
fast head) and every M bucket: times bf16 cuBLAS (``F.linear``) and a grid of kernel configs
(weight tile 64-256 rows x K tile 64-256, split-K 1-16 with the in-kernel reduce, warps,
stages) on cold weights (CUDA-graph replay over rotating weight copies larger than L2, median
of replays), checks every candidate against the fp32 reference, and writes ``DIR/dense_tuned.json``
(``{"configs": {"N,K": {"M": config or null}}}``; null = cuBLAS was as fast: a config is kept
only when it beats cuBLAS by ``--min-gain``) and ``DIR/tune_dense_cells.json`` (every timing).
The table holds every entry of the active one (``SHOAL_DENSE_TUNED`` or the packaged table)
that this run did not re-tune. Copy it to ``shoal/kernels/dense_tuned.json`` to make it the
default, or point ``SHOAL_DENSE_TUNED`` at it. Kernels are timed as they are launched when
serving (with programmatic dependent launch where enabled, so back-to-back calls overlap a
little, which cuBLAS calls do not: ``SHOAL_PDL=0`` times them without). ``--swiglu`` also
tunes the fused gate_up + SwiGLU kernel against the unfused path (the gate_up choice, then
``silu_mul``) per M bucket, into the table's ``"swiglu:19456,2560"`` entry (null: unfused was
faster); every fused candidate must give the bits of its tiles run unfused.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from shoal.kernels import dense
from shoal.kernels.paged_attention import pdl_enabled

from .kernels_fp8 import SHAPES, _log, time_graph
from .tune_fp8 import ODD_SPLITS, SMS, _cdiv, _splits

TUNE_SHAPES = ("gate_up", "wqkv", "wo", "down", "semantic_head", "fast_head")
MS = (1, 4, 16, 32, 64, 128)
SMEM = 200 * 1024  # H200: 227 KB of shared memory per block; leave room for the epilogue
DEV = "cuda"


SMEM_SM = 227 * 1024  # shared memory per SM: how many stream-K programs can be resident at once


def _token_tile(M: int) -> int:
    """The token tile of an M bucket: M rounded up to a power of two, 16 to MAX_M."""
    return max(16, min(dense.MAX_M, 1 << max(0, M - 1).bit_length()))


def launch_key(c: dict, K: int) -> str:
    """One string per distinct kernel launch of a config (after ``finish_config``)."""
    return json.dumps(dense.finish_config(c, K), sort_keys=True)


def _unique(cands: list[dict], K: int) -> list[dict]:
    """``cands`` without the ones that launch the same kernel as an earlier one."""
    seen, uniq = set(), []
    for c in cands:
        key = launch_key(c, K)
        if key not in seen:
            seen.add(key)
            uniq.append(c)
    return uniq


def candidates(M: int, N: int, K: int, prefetch: bool = False, tile: bool = False,
               streamk: bool = False, odd_splits: bool = False) -> list[dict]:
    """The search space of one cell: the token tile is M rounded up to a power of two (16 to
    128); weight x K tiles (64 x 128, 64 x 256, 128 x 64, 128 x 128, 256 x 64; for M >= 64 4 or 8
    warps and 3-5 stages), the stage counts that fit shared memory, and the split-K counts that
    give 0.5-6 waves (0.3-6 for M >= 64); each with pointer loads and with TMA loads. Opt-in
    (measured on the H200 on 2026-12-02 to win 1 of the 20 cells at M <= 32 and none of the 8 at
    M >= 64, for about half again the compiles): ``prefetch`` (with PDL, M <= 32) pointer loads whose first 1,024 weight
    columns are prefetched into L2 before the kernel waits for its predecessor; ``tile`` (M >=
    64) TMA launches with the tokens on the MMA's M axis (``KIND`` "tile"); ``streamk``: the
    same tiles as stream-K launches (``KIND`` "streamk") of 1, 2 or 3 programs per SM (as many
    as fit its shared memory at once), at least 2 K blocks each (measured on the H200 on
    2026-12-02 at M = 1 and 64: the best of them within 5% of the best config in one cell of
    12, never ahead). ``odd_splits`` (M <= 32): split counts from :data:`ODD_SPLITS`."""
    bm = _token_tile(M)
    split_options = ODD_SPLITS if odd_splits and bm < 64 else (1, 2, 4, 8, 16)
    out = []
    # M >= 64: every program re-reads its token tile (from L2) once per weight tile, so wider
    # weight tiles (128-256 rows) keep that traffic below the weight stream's
    tiles_nk = ((64, 128), (64, 256), (128, 64), (128, 128), (256, 64))
    if bm >= 64:
        tiles_nk = ((64, 128), (128, 64), (128, 128), (256, 64))
    for bn, bk in tiles_nk:
        if bn == 256 and bm > 64:
            continue
        per_stage = (bn + bm) * bk * 2
        for nw in ((4, 8) if bm >= 64 and bn >= 128 else (8,) if bn * bm >= 128 * 64 or bn == 256 else (4,)):
            tiles = _cdiv(N, bn) * _cdiv(M, bm)
            for sk in _splits(_cdiv(K, bk), tiles, options=split_options, lo=0.3 if bm >= 64 else 0.5):
                for ns in (3, 4, 6) if bm < 64 else (3, 4, 5):
                    if ns * per_stage <= SMEM:
                        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": nw,
                                    "num_stages": ns})
            if not streamk:
                continue
            iters = tiles * _cdiv(K, bk)
            for ns in (3, 4, 5):
                for occ in (1, 2, 3):
                    progs = occ * SMS
                    if (ns * per_stage <= SMEM and occ * (ns * per_stage + 8 * 1024) <= SMEM_SM
                            and iters >= 2 * progs):
                        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "KIND": "streamk",
                                    "PROGRAMS": progs, "num_warps": nw, "num_stages": ns})
    with_pf = []
    if prefetch and pdl_enabled() and bm <= 32:  # pointer loads with the weights' first columns prefetched before the PDL wait
        with_pf = [{**c, "PREFETCH": 1024} for c in out]
    tiled = []  # M >= 64: TMA loads with the tokens on the MMA's M axis (wide wgmma: 128-256 weight rows)
    if tile and bm >= 64:
        tiled = [{**c, "TMA": True, "KIND": "tile"} for c in out if c["BLOCK_N"] >= 128]
    out += [{**c, "TMA": True} for c in out] + with_pf + tiled  # the same launches with TMA operand loads
    return _unique(out, K)


def mma_v2_candidates(M: int, N: int, K: int) -> list[dict]:
    """Swap-AB launches with 16 or 32 weight rows per tile, which Triton lowers to the
    synchronous ``mma.sync`` (wgmma needs 64 rows per warp group): 2-4x the tiles of the
    64-row launches, so the narrow GEMMs (wo, down: 2,560 rows, 40 tiles of 64) fill every SM
    with fewer or no K splits. 128/256-wide K tiles, the split counts of 0.5-6 waves, 3-6
    stages, pointer and TMA loads."""
    bm = _token_tile(M)
    out = []
    for bn in (16, 32):
        for bk in (128, 256):
            per_stage = (bn + bm) * bk * 2
            tiles = _cdiv(N, bn) * _cdiv(M, bm)
            for sk in _splits(_cdiv(K, bk), tiles, options=(1, 2, 4, 8), lo=0.5):
                for ns in (3, 4, 6):
                    if ns * per_stage <= SMEM:
                        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": 4,
                                    "num_stages": ns})
    return _unique(out + [{**c, "TMA": True} for c in out], K)


def swiglu_candidates(M: int, N2: int, K: int) -> list[dict]:
    """The search space of the fused gate_up + SwiGLU kernel (``dense.dense_swiglu_triton``):
    swap-AB tiles of 16-128 gate rows (as many up rows beside them) x 64-256 K, the split-K
    counts of ``candidates``, the stage counts that fit, pointer and TMA loads."""
    bm = _token_tile(M)
    out = []
    for bn, bk in ((16, 128), (32, 128), (32, 256), (64, 64), (64, 128), (128, 64)):
        per_stage = (2 * bn + bm) * bk * 2
        nw = 8 if 2 * bn * bm >= 128 * 64 or bn >= 128 else 4
        tiles = _cdiv(N2 // 2, bn) * _cdiv(M, bm)
        for sk in _splits(_cdiv(K, bk), tiles, options=(1, 2, 4, 8), lo=0.3 if bm >= 64 else 0.5):
            for ns in (3, 4, 5, 6) if bm < 64 else (3, 4, 5):
                if ns * per_stage <= SMEM:
                    out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": nw,
                                "num_stages": ns})
    out += [{**c, "TMA": True} for c in out]
    return _unique(out, K)


def short(c: dict | None) -> str:
    if not c:
        return "cuBLAS"
    s = f"{c['BLOCK_N']}x{c['BLOCK_M']}x{c['BLOCK_K']}"
    if int(c.get("SPLIT_K", 1)) > 1:
        s += f" sk{c['SPLIT_K']}"
    if c.get("TMA"):
        s += " tma"
    if c.get("PREFETCH"):
        s += f" pf{c['PREFETCH']}"
    if c.get("KIND") == "tile":
        s += " tile"
    if c.get("KIND") == "streamk":
        s += f" sk-p{c.get('PROGRAMS')}"
    return s + f" w{c.get('num_warps', 4)}s{c.get('num_stages', 4)}"


def _compile_jobs(jobs: list) -> int:
    """Worker: run every (N, K, M, config, kind) once (fills Triton's on-disk cache)."""
    torch.cuda.init()
    failed = 0
    for N, K, M, cfg, kind in jobs:
        fn = dense.dense_swiglu_triton if kind == "swiglu" else dense.dense_gemm_triton
        try:
            fn(torch.zeros(M, K, device=DEV, dtype=torch.bfloat16),
               torch.zeros(N, K, device=DEV, dtype=torch.bfloat16), config=cfg)
        except Exception:  # noqa: BLE001 - the timing loop reports it
            failed += 1
    torch.cuda.synchronize()
    return failed


def precompile(plan: list, n_jobs: int) -> None:
    import multiprocessing as mp

    jobs, seen = [], set()
    for name, N, K, M, cands in plan:
        kind = "swiglu" if name == "swiglu" else "gemm"
        spec = (kind, "M1" if M == 1 else "M16" if M % 16 == 0 else "Mx", N % 16 == 0, K % 16 == 0)
        for c in cands:
            f = dense.finish_config(c, K)
            f.pop("PROGRAMS", None)  # a runtime argument: one compile serves every program count
            rows = N // 2 if kind == "swiglu" else N  # the fused kernel's tiles cover I = N / 2 rows
            key = (spec, json.dumps(f, sort_keys=True, default=str), K % f["k_per_split"] == 0,
                   rows % f["BLOCK_N"] == 0)
            if key not in seen:
                seen.add(key)
                jobs.append((N, K, M, c, kind))
    t0 = time.time()
    with mp.get_context("spawn").Pool(n_jobs) as pool:
        failed = sum(pool.map(_compile_jobs, [jobs[i::n_jobs] for i in range(n_jobs) if jobs[i::n_jobs]]))
    _log(f"precompiled {len(jobs)} distinct launches in {n_jobs} processes in {time.time() - t0:.0f}s "
         f"({failed} failed)")


def _keep(table: dict, key: str, M: int, cell: dict, ref_us: float, min_gain: float) -> dict | None:
    """Enter the cell's best config in ``table[key][M]`` when it beats ``ref_us`` by ``min_gain``
    (else null: the reference path); returns the best result."""
    b = cell["best"]
    win = b is not None and b["us"] < (1 - min_gain) * ref_us
    table.setdefault(key, {})[str(M)] = {k: v for k, v in b["config"].items() if not k.startswith("_")} if win else None
    return b


def _tried(cell: dict, t0: float) -> str:
    return f" [{cell['n_tried']} tried, {cell['n_failed']} failed, {time.time() - t0:.0f}s]"


def _cold_weights(N: int, K: int) -> list:
    """A random bf16 weight [N, K] and enough copies that a pass over them exceeds L2 (cold reads)."""
    torch.manual_seed(0)
    w = (torch.randn(N, K, device=DEV) * K ** -0.5).bfloat16()
    return [w] + [w.clone() for _ in range(max(1, min(31, _cdiv(256 << 20, w.numel() * 2)) - 1))]


def _time_candidates(cands: list[dict], check, run, copies: int, iters: int) -> list[dict]:
    """Every candidate: ``check(cfg)`` (an error string or None), then the CUDA-graph time of
    ``run(i, cfg)`` over the ``copies`` weight copies; a config that fails to compile or fit is
    recorded with its error."""
    results = []
    for cfg in cands:
        try:
            err = check(cfg)
            if err:
                results.append({"config": cfg, "error": err})
                continue
            us = time_graph([lambda i=i, c=cfg: run(i, c) for i in range(copies)], iters)
            results.append({"config": cfg, "us": us})
        except Exception as e:  # noqa: BLE001 - a config that does not compile / fit is skipped
            results.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:200]})
    return results


def tune_cell(N: int, K: int, M: int, weights: list, iters: int, cands: list[dict]) -> dict:
    x = torch.randn(M, K, device=DEV).bfloat16()
    ref = dense.dense_gemm_ref(x, weights[0]).float()
    outs = [torch.empty(M, N, dtype=torch.bfloat16, device=DEV) for _ in weights]
    cublas = time_graph([lambda i=i: torch.mm(x, weights[i].t(), out=outs[i]) for i in range(len(weights))], iters)
    def check(cfg):
        y = dense.dense_gemm_triton(x, weights[0], config=cfg).float()
        rel = ((y - ref).abs().max() / ref.abs().max()).item()
        return f"rel {rel:.2e}" if rel > 2.0 ** -7 else None

    results = _time_candidates(cands, check, lambda i, c: dense.dense_gemm_triton(x, weights[i], out=outs[i], config=c),
                               len(weights), iters)
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    best = ok[0] if ok else None
    table = next((r for r in ok if r["config"].get("_old")), None)
    nbytes = 2 * (N * K + M * K + M * N)
    return {"N": N, "K": K, "M": M, "cublas_us": cublas, "best": best, "top5": ok[:5], "n_tried": len(results),
            "table_us": table["us"] if table else None,
            "n_failed": sum(1 for r in results if "error" in r),
            "best_tbps": nbytes / (best["us"] * 1e-6) / 1e12 if best else None,
            "cublas_tbps": nbytes / (cublas * 1e-6) / 1e12,
            "failures": [r for r in results if "error" in r][:5]}


def tune_swiglu_cell(N2: int, K: int, M: int, weights: list, iters: int, cands: list[dict],
                     base: dict | None) -> dict:
    """The fused kernel's candidates against the unfused path (``base``: the gate_up GEMM's
    tuned config, None = cuBLAS, then ``silu_mul``), cold weights; a candidate must give the bits
    of its own tiles run unfused."""
    from shoal.kernels.fused import silu_mul

    x = torch.randn(M, K, device=DEV).bfloat16()
    inter = N2 // 2
    outs = [torch.empty(M, inter, dtype=torch.bfloat16, device=DEV) for _ in weights]
    gu = torch.empty(M, N2, dtype=torch.bfloat16, device=DEV)

    def unfused(i):
        if base is None:
            torch.mm(x, weights[i].t(), out=gu)
        else:
            dense.dense_gemm_triton(x, weights[i], out=gu, config=base)
        silu_mul(gu, out=outs[i])

    base_us = time_graph([lambda i=i: unfused(i) for i in range(len(weights))], iters)
    def check(cfg):
        y = dense.dense_swiglu_triton(x, weights[0], config=cfg)
        same = torch.equal(y, silu_mul(dense.dense_gemm_triton(x, weights[0], config=cfg)))
        return None if same else "bits differ from the unfused kernels"

    results = _time_candidates(cands, check,
                               lambda i, c: dense.dense_swiglu_triton(x, weights[i], out=outs[i], config=c),
                               len(weights), iters)
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    return {"N": N2, "K": K, "M": M, "shape": "gate_up+swiglu", "unfused_us": base_us, "unfused_config": base,
            "best": ok[0] if ok else None, "top5": ok[:5], "n_tried": len(results),
            "n_failed": sum(1 for r in results if "error" in r),
            "failures": [r for r in results if "error" in r][:5]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=",".join(TUNE_SHAPES))
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--jobs", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                    help="processes that precompile the candidates (0: compile inline)")
    ap.add_argument("--min-gain", type=float, default=0.03,
                    help="keep a config only when it is this fraction faster than cuBLAS")
    ap.add_argument("--max-candidates", type=int, default=0, help="debug: at most this many per cell")
    ap.add_argument("--prefetch", action="store_true", help="also try the L2-prefetch-before-PDL-wait variants (M <= 32)")
    ap.add_argument("--tile", action="store_true", help="also try KIND tile (tokens on the MMA's M axis, M >= 64)")
    ap.add_argument("--streamk", action="store_true", help="also try stream-K launches (KIND streamk)")
    ap.add_argument("--odd-splits", action="store_true",
                    help="M <= 32: split-K counts 3, 5, 6 and 12 as well as the powers of two")
    ap.add_argument("--mma-v2", action="store_true",
                    help="only the 16/32-weight-row launches (mma.sync), against cuBLAS and the active table's config")
    ap.add_argument("--swiglu", action="store_true",
                    help="also tune the fused gate_up + SwiGLU kernel against the unfused path (table key swiglu:N,K)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        _log("tune_dense: CUDA not available; nothing to tune")
        return 0
    t0 = time.time()
    ms = [int(m) for m in args.ms.split(",") if m]
    if any(not 1 <= m <= dense.MAX_M for m in ms):
        ap.error(f"--ms: M buckets must be within 1..{dense.MAX_M} (larger M always runs on cuBLAS)")
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    plan = []
    for name in names:
        N, K = SHAPES[name]
        for M in ms:
            if args.mma_v2:
                cands = mma_v2_candidates(M, N, K)
            else:
                cands = candidates(M, N, K, prefetch=args.prefetch, tile=args.tile, streamk=args.streamk,
                                   odd_splits=args.odd_splits)
            old = dense.dense_config(M, N, K)  # the active table's choice competes, and is reported
            if old:
                cands.append({**{k: v for k, v in old.items() if k != "k_per_split"}, "_old": True})
            plan.append((name, N, K, M, cands[:args.max_candidates] if args.max_candidates else cands))
    if args.swiglu:
        N2, K2 = SHAPES["gate_up"]
        for M in ms:
            plan.append(("swiglu", N2, K2, M, swiglu_candidates(M, N2, K2)))
    _log(f"tune_dense: {len(plan)} cells, {sum(len(p[4]) for p in plan)} candidates")
    if args.jobs > 0:
        try:
            precompile(plan, args.jobs)
        except Exception as e:  # noqa: BLE001 - compile inline instead
            _log(f"precompile failed ({type(e).__name__}: {e}); compiling inline")
    # the packaged entries stay for the shapes and buckets this run does not tune
    table: dict[str, dict] = {k: dict(v) for k, v in dense._table().items()}
    cells: list[dict] = []
    for name in names:
        N, K = SHAPES[name]
        weights = _cold_weights(N, K)
        for _, _, _, M, cands in (p for p in plan if p[0] == name):
            cell = tune_cell(N, K, M, weights, args.iters, cands)
            cell["shape"] = name
            cells.append(cell)
            b = _keep(table, f"{N},{K}", M, cell, cell["cublas_us"], args.min_gain)
            _log(f"{name:>13} M={M:<4} cuBLAS {cell['cublas_us']:7.2f} us ({cell['cublas_tbps']:.2f} TB/s) | "
                 + (f"best {b['us']:7.2f} us ({cell['best_tbps']:.2f} TB/s, {cell['cublas_us'] / b['us']:.2f}x) "
                    f"{short(b['config'])}" if b else "no working config")
                 + (f" | table {cell['table_us']:.2f} us" if cell.get("table_us") else "")
                 + _tried(cell, t0))
            if args.out:
                _write(args.out, table, cells)
        del weights
        torch.cuda.empty_cache()
    if args.swiglu:
        N2, K2 = SHAPES["gate_up"]
        weights = _cold_weights(N2, K2)
        for _, _, _, M, cands in (p for p in plan if p[0] == "swiglu"):
            entry = table.get(f"{N2},{K2}", {}).get(str(M))  # this run's (or the packaged) gate_up choice
            base = dense.finish_config(entry, K2) if entry else None
            cell = tune_swiglu_cell(N2, K2, M, weights, args.iters, cands, base)
            cells.append(cell)
            b = _keep(table, f"swiglu:{N2},{K2}", M, cell, cell["unfused_us"], args.min_gain)
            _log(f"gate_up+swiglu M={M:<4} unfused {cell['unfused_us']:7.2f} us ({short(base)} + silu_mul) | "
                 + (f"fused {b['us']:7.2f} us ({cell['unfused_us'] / b['us']:.2f}x) {short(b['config'])}"
                    if b else "no working config")
                 + _tried(cell, t0))
            if args.out:
                _write(args.out, table, cells)
        del weights
    _log(f"tuned {len(cells)} cells in {time.time() - t0:.0f}s")
    return 0


def _write(out: str, table: dict, cells: list) -> None:
    doc = {"device": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "torch": torch.__version__, "triton": getattr(dense.triton, "__version__", None),
           "commit": os.environ.get("SHOAL_COMMIT"), "date": time.strftime("%Y-%m-%d"), "configs": table}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "dense_tuned.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(os.path.join(out, "tune_dense_cells.json"), "w") as fh:
        json.dump(cells, fh, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
