"""Tune the dense GEMM's launch configs inside the decode step, not GEMM after GEMM.

``shoal bench dense`` (:mod:`shoal.bench.tune_dense`) times each candidate in a CUDA graph of
the same GEMM over rotating weight copies. In the decode step each GEMM instead follows a small
PDL-launched kernel (a norm, RoPE, attention, SiLU*mul), and on the H200 that context changed
the ranking: a one-token GEMV 9-17% faster than the packaged kernel back to back left the
engine's speed unchanged (docs/benchmarks.md, 2026-12-03). Here every candidate config of one
projection replaces that projection's entry in a copy of the table, the decode step of a real
engine (S2-Pro shapes, random weights, ``--batch`` requests decoding at ``--context`` tokens)
is captured again as a CUDA graph, and the step's replay time is what is compared. The
baseline (the active table) is re-measured after each projection, so drift between machines
states shows. The best config per projection (if it beats the baseline step by at least
``--min-gain``) goes into the table written to ``DIR/dense_tuned.json``, whose combined step
time is measured last.

    python -m shoal.bench.tune_step --batch 1 --out DIR [--shapes wo,down] [--kinds swap,gemv]
    SHOAL_DENSE_TUNED=DIR/dense_tuned.json shoal serve ...    # to use what it found

On CPU (``--device cpu --shape tiny``) the step is timed eagerly and the dense kernel is not
used (it needs CUDA): a smoke run of the tuner itself, no measurement.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..engine.engine import Engine, EngineConfig
from ..engine.request import EngineRequest, GridSession
from ..engine.sampling import SamplingParams
from ..kernels import dense
from .random_model import S2_IM_END, random_dualar, random_prompt, s2_pro_config, tiny_config

# the runner's per-slot decode state that one step advances (restored before every measurement)
_STATE = ("last_col", "position", "frame", "window", "code_hist", "first", "out_cols")


def projections(model) -> dict[str, tuple[int, int]]:
    """(N, K) of each decode GEMM the dense kernel can take: the four layer projections (slow and
    fast share them at S2-Pro shapes) and both heads."""
    att, ff = model.layers[0].attention, model.layers[0].feed_forward
    shapes = {"wqkv": tuple(att.wqkv.weight.shape), "wo": tuple(att.wo.weight.shape),
              "gate_up": (2 * ff.w1.weight.shape[0], ff.w1.weight.shape[1]), "down": tuple(ff.w2.weight.shape),
              # the fast head runs on its first residual_codebook_size rows (the codes 1..9 can take)
              "fast_head": (model.config.residual_codebook_size, model.fast_output.weight.shape[1])}
    if hasattr(model, "allowed_head"):
        shapes["semantic_head"] = tuple(model.allowed_head.shape)
    return shapes


def odd_split_launches(M: int, N: int, K: int) -> list[dict]:
    """The swap-space launches that ``tune_dense --odd-splits`` adds for this cell (none where
    K is too short for a new effective split count)."""
    from . import tune_dense

    plain = {tune_dense.launch_key(c, K) for c in tune_dense.candidates(M, N, K)}
    return [c for c in tune_dense.candidates(M, N, K, odd_splits=True) if tune_dense.launch_key(c, K) not in plain]


def gemv_candidates(N: int, K: int, sms: int = 132) -> list[dict]:
    """KIND "gemv" launches (one token): 8-32 weight rows x 256-512 columns per program, the
    split counts nearest 1, 2 and 4 programs per SM, pointer loads unpipelined or 3 stages."""
    out = []
    for bn in (8, 16, 32):
        for bk in (256, 512):
            tiles, kblocks = -(-N // bn), -(-K // bk)
            picked = []
            for target in (sms, 2 * sms, 4 * sms):
                s = min(range(1, min(16, kblocks) + 1), key=lambda s: abs(tiles * s - target))
                if s not in picked:
                    picked.append(s)
            for s in picked:
                for stages in (1, 3):
                    out.append({"KIND": "gemv", "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": s, "num_warps": 4,
                                "num_stages": stages})
    return out


def bucket_key(entry: dict | None, M: int) -> str:
    """The table bucket that serves batch ``M`` (the smallest >= M; ``str(M)`` when the entry
    has none, which adds that bucket)."""
    for b in sorted(int(m) for m in (entry or {})):
        if M <= b:
            return str(b)
    return str(M)


class StepTimer:
    """Replay time of the engine's decode step for ``B`` running requests, re-captured for the
    table in force; the decode state is restored before each measurement so every candidate
    runs the same positions."""

    def __init__(self, engine: Engine, B: int, replays: int) -> None:
        self.runner, self.B, self.replays = engine.runner, B, replays
        self.cuda = self.runner.device.type == "cuda"
        self.saved = {k: getattr(self.runner, k).clone() for k in _STATE}

    def _restore(self) -> None:
        with torch.inference_mode():
            for k, v in self.saved.items():
                getattr(self.runner, k).copy_(v)

    def measure(self) -> float:
        """Median milliseconds per decode step."""
        r, B = self.runner, self.B
        self._restore()
        if not self.cuda:
            times = []
            with torch.inference_mode():
                for _ in range(self.replays):
                    t = time.perf_counter()
                    r._decode_body(B)
                    times.append((time.perf_counter() - t) * 1e3)
            return statistics.median(times)
        r.graphs.pop(B, None)
        graph = r._capture([B], r._decode_body, [B], "", False)[B]  # warm-up compiles outside it
        self._restore()
        for _ in range(3):
            graph.replay()
        times = []
        for _ in range(self.replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        del graph
        return statistics.median(times)


def _checked(cfg: dict, M: int, N: int, K: int, device) -> str | None:
    """None when ``cfg`` computes this GEMM right at ``M`` tokens (random data against the fp32
    reference), else why not."""
    if device.type != "cuda":
        return None
    try:
        x = torch.randn(M, K, device=device).bfloat16()
        w = (torch.randn(N, K, device=device) * K ** -0.5).bfloat16()
        ref = dense.dense_gemm_ref(x, w)
        err = (dense.dense_gemm_triton(x, w, config=cfg).float() - ref.float()).abs().max().item()
        return None if err <= 2.0 ** -7 * ref.float().abs().max().item() else f"error {err:.3g}"
    except Exception as e:  # noqa: BLE001 -- recorded, the candidate is skipped
        return f"{type(e).__name__}: {str(e)[:160]}"


def _short(c: dict) -> str:
    tile = f"{c.get('BLOCK_M', 1)}x{c['BLOCK_N']}x{c['BLOCK_K']}"
    return (f"{c.get('KIND', 'swap')} {tile} split {c.get('SPLIT_K', 1)} warps {c.get('num_warps', 4)} "
            f"stages {c.get('num_stages', 4)}" + (" TMA" if c.get("TMA") else ""))


def _with(doc: dict, key: str, bucket: str, cfg: dict | None) -> dict:
    new = copy.deepcopy(doc)
    new.setdefault("configs", {}).setdefault(key, {})[bucket] = cfg
    return new


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shoal bench dense-step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1, help="requests decoding together (the table bucket tuned)")
    p.add_argument("--context", type=int, default=500, help="tokens of context per request")
    p.add_argument("--shapes", default="", help="projections to tune (default: all of them)")
    p.add_argument("--kinds", default="swap,gemv", help="candidate kernels: swap (tune_dense's space), gemv")
    p.add_argument("--limit", type=int, default=40, help="at most this many candidates per projection and kind")
    p.add_argument("--odd-splits", action="store_true",
                   help="swap: only the launches tune_dense --odd-splits adds (split-K 3, 5, 6, 12; M <= 32)")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--min-gain", type=float, default=0.005, help="fraction of the step a config must save")
    p.add_argument("--out", default="tune-step-out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=["s2-pro", "tiny"], default="s2-pro")
    args = p.parse_args(argv)
    from . import tune_dense

    dev = torch.device(args.device)
    B = args.batch
    if not 1 <= B <= dense.MAX_M:
        p.error(f"--batch must be 1..{dense.MAX_M} (the dense kernel's largest bucket)")
    if args.context + args.replays + 8 > 4096:
        p.error("--context + --replays must stay inside the 4,096-token test sequence")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = s2_pro_config(4096) if args.shape == "s2-pro" else tiny_config()
    model = random_dualar(cfg, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    eng = Engine(model, S2_IM_END, config=EngineConfig(max_running=B, max_seq_len=4096, num_blocks=B * 64 + 64,
                                                       cuda_graphs=False))
    rng = np.random.default_rng(0)
    for i in range(B):
        eng.add_request(EngineRequest(session=GridSession(random_prompt(cfg, args.context - args.context // 3,
                                                                        args.context // 3, rng)),
                                      params=SamplingParams(temperature=0.8, top_p=0.8, top_k=30), seed=i,
                                      max_new_tokens=100_000, ignore_eos=True))
    while eng.num_running < B or any(r.status.value != "decode" for r in eng.scheduler.running):
        eng.step()
    runner = eng.runner
    if dev.type == "cuda" and B not in runner.buckets:
        p.error(f"--batch {B} is not a decode graph bucket ({runner.buckets}): serving would pad it")
    runner.slot_ids[:B].copy_(torch.tensor([r.slot for r in eng.scheduler.running], dtype=torch.long, device=dev))
    timer = StepTimer(eng, B, args.replays)

    base_doc = copy.deepcopy(dense._table_doc())
    shapes = projections(model)
    wanted = [s for s in args.shapes.split(",") if s] or list(shapes)
    unknown = [s for s in wanted if s not in shapes]
    if unknown:
        p.error(f"unknown projections {unknown}; this model has {sorted(shapes)}")
    kinds = {k for k in args.kinds.split(",") if k}
    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "batch": B, "context": args.context, "shape": args.shape, "args": vars(args), "projections": {}}
    previous = list(dense._table_override)  # an override in force before (restored at the end)
    tmpdir = tempfile.TemporaryDirectory(prefix="shoal-tune-step-")
    tmp = Path(tmpdir.name)
    best_doc = copy.deepcopy(base_doc)

    def use(path) -> None:
        dense.set_dense_table(path if path is not None else (previous[0] if previous else None))

    try:
        report["baseline_ms"] = [timer.measure()]
        print(f"baseline step {report['baseline_ms'][0]:.3f} ms (batch {B})", flush=True)
        for name in wanted:
            N, K = shapes[name]
            key = f"{N},{K}"
            bucket = bucket_key(base_doc.get("configs", {}).get(key), B)
            cands = []
            if "swap" in kinds:
                space = odd_split_launches(B, N, K) if args.odd_splits else tune_dense.candidates(B, N, K)
                random.Random(N * 7 + K).shuffle(space)
                cands += [(bucket, c) for c in space[: args.limit]]
            if "gemv" in kinds and B == 1:  # one token only: its own bucket, never M > 1
                cands += [("1", c) for c in gemv_candidates(N, K)[: args.limit]]
            rows = []
            for bkey, c in cands:
                why = _checked(c, B, N, K, dev)
                if why is None:
                    path = tmp / "t.json"
                    path.write_text(json.dumps(_with(base_doc, key, bkey, c)))
                    use(path)
                    try:
                        rows.append({"config": c, "bucket": bkey, "step_ms": timer.measure()})
                        continue
                    except Exception as e:  # noqa: BLE001 -- a launch that fails in the step is skipped
                        why = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append({"config": c, "bucket": bkey, "skipped": why})
            use(None)
            base = timer.measure()  # the baseline again, right after this projection's sweep
            report["baseline_ms"].append(base)
            timed = [r for r in rows if "step_ms" in r]
            best = min(timed, key=lambda r: r["step_ms"]) if timed else None
            gain = (base - best["step_ms"]) / base if best else 0.0
            taken = best is not None and gain >= args.min_gain and dev.type == "cuda"  # CPU: no kernel, no table
            if taken:
                best_doc = _with(best_doc, key, best["bucket"], best["config"])
            report["projections"][name] = {"N": N, "K": K, "bucket": bucket,
                                           "packaged": base_doc.get("configs", {}).get(key, {}).get(bucket),
                                           "baseline_ms": base, "best": best, "gain": gain, "taken": taken,
                                           "candidates": rows}
            print(f"{name:14s} {N}x{K} bucket {bucket}: {len(timed)} timed, baseline {base:.3f} ms, best "
                  + (f"{best['step_ms']:.3f} ms ({100 * gain:+.2f}%) {_short(best['config'])}" if best else "-")
                  + ("  -> table" if taken else ""), flush=True)
        best_doc["note"] = (f"decode-step tuned (shoal.bench.tune_step, batch {B}, {report['date']}) over "
                            + str(base_doc.get("note", "the packaged table")))
        (out / "dense_tuned.json").write_text(json.dumps(best_doc, indent=1))
        use(out / "dense_tuned.json")
        report["tuned_ms"] = timer.measure()
        use(None)
        report["final_baseline_ms"] = timer.measure()
        print(f"tuned table: {report['tuned_ms']:.3f} ms per step against {report['final_baseline_ms']:.3f} "
              f"(written to {out / 'dense_tuned.json'})", flush=True)
    finally:
        use(None)
        tmpdir.cleanup()
        (out / "tune_step.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
