"""GPU check + micro-benchmark of the block-scaled FP8 GEMM (shoal.kernels.fp8) at S2-Pro shapes.

    python -m shoal.bench.kernels_fp8 [--out DIR] [--ms 1,2,4,...] [--shapes wqkv,...] [--iters 20]
                                      [--mlp] [--table DIR/fp8_tuned.json]

For every S2-Pro GEMM (wqkv 6144x2560, wo 2560x4096, gate_up 19456x2560, down 2560x9728,
semantic head 4097x2560, fast head 1024x2560) and every M in --ms:

* **check**: ours (``fp8_gemm``) vs ``fp8_gemm_ref`` (max |diff| / max |ref|; expected
  <= 1 bf16 ulp-ish, i.e. < 2^-7) and the cosine vs the bf16 product.
* **timing** (microseconds per call, median of ``--iters`` CUDA-graph replays, each replay
  running one call per weight copy, the copies totalling >= 256 MB (H200 L2: 50 MB), so
  weights are read cold from HBM):
  - ``fp8``: our GEMM alone (activation pre-quantized); from M = 256 (``SHOAL_FP8_CUBLAS_MIN_M``)
    the dispatcher sends it to cuBLAS's block-scaled GEMM, and the cell's ``fp8_backend``
    and printed config say so;
  - ``fp8+q``: ``fp8_linear``, the GEMM with the activation quantize fused in (what a
    linear layer costs);
  - ``bf16``: ``F.linear`` (cuBLAS) on bf16 weights;
  - ``scaled_mm``: ``torch._scaled_mm`` rowwise (per-token x per-channel fp32 scales), if
    this torch/GPU supports it (M padded to a multiple of 16 when required);
  - ``scaled_mm_block``: ``torch._scaled_mm`` with our 1x128 / 128x128 block scales in the
    layouts cuBLAS takes (``shoal.kernels.fp8_cublas.gemm``; sm_90, cuBLASLt >= 12.9).
  Effective TB/s = (weight + activation + output bytes) / time.

``--mlp`` also times the whole MLP block (``fp8``: the GEMMs reduce their own split-K;
``fp8_partials``: gate_up's split-K partials summed by the SwiGLU+quantize kernel, as the fused
layers run it). ``--table`` uses another tuned-config table (a fresh ``tune_fp8 --out``).
A failing cell is printed and recorded, and the run continues. Prints a table; with --out
writes ``DIR/kernels_fp8.json``. Aims at < 3 minutes.

    python -m shoal.bench.kernels_fp8 --layer [--layer-ms 1,16,64] [--layer-stacks slow,fast]

instead times one full FP8 decoder layer at S2-Pro shapes (dim 2560, heads 32/8, head_dim
128, intermediate 9728; a stack of ``--layer-count`` layers with distinct weights, so weights
stream cold) through ``DualAR._layers_fused``, unfused (``fp8_fusion = False``) vs fused
(kernels/fp8_fused.py), under CUDA-graph replay: microseconds and kernel launches per layer,
and whether the two give bit-identical hidden states and KV caches. ``slow``: paged decode
attention over ``--layer-context`` positions (qk-norm); ``fast``: the 10-slot fast cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from shoal.kernels import fp8, fp8_cublas

SHAPES = {  # name -> (N, K)
    "wqkv": (6144, 2560),
    "wo": (2560, 4096),
    "gate_up": (19456, 2560),
    "down": (2560, 9728),
    "semantic_head": (4097, 2560),
    "fast_head": (1024, 2560),
}
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
COLD_BYTES = 256 << 20  # rotate weight copies totalling >= this (H200 L2 is 50 MB)


def _log(*a):
    print(*a, flush=True)


def _copies(nbytes: int, cap: int = 128) -> int:
    return max(2, min(cap, -(-COLD_BYTES // max(1, nbytes))))


def time_graph(fns, iters: int) -> float:
    """fns: list of zero-arg callables (one per weight copy). Captures one pass over all of
    them in a CUDA graph; returns the median microseconds per call over ``iters`` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:  # warm-up / compile outside the capture
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    del g
    return statistics.median(times)


def _scaled_mm_available() -> bool:
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability() >= (8, 9)


def bench_shape(name, N, K, ms, iters, results, do_scaled_mm):
    dev = "cuda"
    torch.manual_seed(0)
    w = (torch.randn(N, K, device=dev) * K ** -0.5).bfloat16()
    Wq, Ws = fp8.quantize_weight_ref(w)
    n8 = _copies(Wq.numel())
    n16 = _copies(w.numel() * 2)
    wq_copies = [(Wq.clone(), Ws.clone()) for _ in range(n8)]
    w_copies = [w.clone() for _ in range(n16)]
    sm_copies = None
    if do_scaled_mm:
        try:
            wf = w.float()
            ch = (wf.abs().amax(1, keepdim=True).clamp_min(1e-10) / 448.0)  # [N, 1] per channel
            wq_ch = (wf / ch).clamp(-448, 448).to(torch.float8_e4m3fn)
            sm_copies = [(wq_ch.clone(), ch.t().contiguous().clone()) for _ in range(n8)]
            del wf, wq_ch
        except Exception as e:  # noqa: BLE001
            _log(f"  {name}: scaled_mm weight prep failed: {e}")
    for M in ms:
        cell = {"shape": name, "N": N, "K": K, "M": M}
        key = f"{name}/M{M}"
        try:
            x = torch.randn(M, K, device=dev).bfloat16()
            xq, xs = fp8.quantize_act(x)
            y = fp8.fp8_gemm(xq, xs, Wq, Ws)
            y_ref = fp8.fp8_gemm_ref(xq, xs, Wq, Ws)
            yb = F.linear(x, w).float()
            cell["rel_vs_ref"] = ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()
            cell["cos_vs_bf16"] = F.cosine_similarity(y.float().flatten(), yb.flatten(), dim=0).item()
            cell["ok"] = bool(cell["rel_vs_ref"] <= 2.0 ** -7 and cell["cos_vs_bf16"] > 0.995)
            # prefill-sized products go to cuBLAS's block-scaled GEMM (shoal.kernels.fp8_cublas)
            cell["fp8_backend"] = "cublas-block" if fp8_cublas.usable(xq, xs, Wq, Ws) else "triton"
            if cell["fp8_backend"] == "triton":
                cell["config"] = {k: v for k, v in fp8._gemm_config(M, N, K, fp8._device_sms(xq)).items()}
            outs = [torch.empty(M, N, dtype=torch.bfloat16, device=dev) for _ in range(max(n8, n16))]
            fp8_bytes = N * K + N * -(-K // 128) * 4 + M * K + M * N * 2
            bf16_bytes = 2 * N * K + 2 * M * K + M * N * 2
            t = {}
            t["fp8"] = time_graph([lambda i=i: fp8.fp8_gemm(xq, xs, *wq_copies[i], out=outs[i]) for i in range(n8)],  # noqa: B023 (captured at once)
                                  iters)

            def lin(i):  # a Linear layer: quantize fused into the GEMM (fp8_linear)
                fp8.fp8_linear(x, *wq_copies[i], out=outs[i])  # noqa: B023 (captured at once)

            t["fp8+q"] = time_graph([lambda i=i: lin(i) for i in range(n8)], iters)
            t["bf16"] = time_graph([lambda i=i: F.linear(x, w_copies[i]) for i in range(n16)], iters)  # noqa: B023 (captured at once)
            if sm_copies is not None:
                try:
                    Mp = -(-M // 16) * 16
                    xp = torch.zeros(Mp, K, device=dev, dtype=torch.bfloat16)
                    xp[:M] = x
                    xsc = (xp.float().abs().amax(1, keepdim=True).clamp_min(1e-10) / 448.0)
                    xpq = (xp.float() / xsc).clamp(-448, 448).to(torch.float8_e4m3fn)
                    t["scaled_mm"] = time_graph(
                        [lambda i=i: torch._scaled_mm(xpq, sm_copies[i][0].t(), scale_a=xsc, scale_b=sm_copies[i][1],  # noqa: B023 (captured at once)
                                                      out_dtype=torch.bfloat16) for i in range(n8)], iters)
                except Exception as e:  # noqa: BLE001
                    cell["scaled_mm_error"] = f"{type(e).__name__}: {e}"[:300]
            if do_scaled_mm:
                try:  # blockwise 1x128 x 128x128 scales (torch + cuBLASLt >= 12.9 on sm_90), in its layouts
                    fp8_cublas.gemm(xq, xs, *wq_copies[0])
                    t["scaled_mm_block"] = time_graph(
                        [lambda i=i: fp8_cublas.gemm(xq, xs, *wq_copies[i]) for i in range(n8)], iters)  # noqa: B023
                except Exception as e:  # noqa: BLE001
                    cell["scaled_mm_block_error"] = f"{type(e).__name__}: {e}"[:300]
            cell["us"] = t
            cell["tbps"] = {k: (fp8_bytes if k.startswith(("fp8", "scaled_mm")) else bf16_bytes) / (v * 1e-6) / 1e12
                            for k, v in t.items()}
            cell["speedup_vs_bf16"] = t["bf16"] / t["fp8"]
        except Exception as e:  # noqa: BLE001 - print and continue
            cell["error"] = f"{type(e).__name__}: {e}"[:500]
            _log(f"  {key}: FAILED {cell['error']}")
            traceback.print_exc(limit=3)
        results[key] = cell
        _print_row(cell)


def bench_mlp(ms, iters, results):
    """The whole S2-Pro MLP: x -> quantize -> gate_up (19456x2560) -> SwiGLU + quantize -> down
    (2560x9728), ours vs bf16 cuBLAS (w13 GEMM, fused SiLU*mul, w2 GEMM)."""
    from shoal.kernels.fused import silu_mul

    dev = "cuda"
    torch.manual_seed(1)
    w13 = (torch.randn(19456, 2560, device=dev) * 2560 ** -0.5).bfloat16()
    w2 = (torch.randn(2560, 9728, device=dev) * 9728 ** -0.5).bfloat16()
    q13, s13 = fp8.quantize_weight_ref(w13)
    q2, s2 = fp8.quantize_weight_ref(w2)
    n8 = _copies(q13.numel() + q2.numel())
    n16 = _copies(2 * (w13.numel() + w2.numel()))
    f8 = [(q13.clone(), s13.clone(), q2.clone(), s2.clone()) for _ in range(n8)]
    b16 = [(w13.clone(), w2.clone()) for _ in range(n16)]
    for M in ms:
        cell = {"shape": "mlp", "M": M}
        try:
            x = torch.randn(M, 2560, device=dev).bfloat16()

            def ours(i, x=x):
                a, b, c, d = f8[i]
                gu = fp8.fp8_linear(x, a, b)
                return fp8.fp8_gemm(*fp8.silu_mul_quant(gu), c, d)

            def ours_partials(i, x=x):  # as the fused layers run it: gate_up's split-K partials summed by the SwiGLU
                a, b, c, d = f8[i]
                gu = fp8.fp8_linear_triton(x, a, b, partials=True)
                return fp8.fp8_gemm(*fp8.silu_mul_quant(gu), c, d)

            def ref(i, x=x):
                a, c = b16[i]
                return F.linear(silu_mul(F.linear(x, a)), c)

            y, yb = ours(0).float(), ref(0).float()
            cell["cos_vs_bf16"] = F.cosine_similarity(y.flatten(), yb.flatten(), dim=0).item()
            cell["partials_exact"] = bool(torch.equal(ours_partials(0), ours(0)))
            cell["ok"] = bool(cell["cos_vs_bf16"] > 0.99 and cell["partials_exact"])
            cell["configs"] = {k: "cuBLAS block-scaled" if fp8_cublas.routes(M, n, kk, x.device)
                               else fp8._gemm_config(M, n, kk, fp8._device_sms(x))
                               for k, (n, kk) in (("gate_up", (19456, 2560)), ("down", (2560, 9728)))}
            t = {"fp8": time_graph([lambda i=i: ours(i) for i in range(n8)], iters),
                 "fp8_partials": time_graph([lambda i=i: ours_partials(i) for i in range(n8)], iters),
                 "bf16": time_graph([lambda i=i: ref(i) for i in range(n16)], iters)}
            cell["us"] = t
            cell["speedup_vs_bf16"] = t["bf16"] / min(t["fp8"], t["fp8_partials"])
            _log(f"{'mlp':>14} {M:>5} | fp8 {t['fp8']:8.2f} us | fp8 (gate_up partials -> SwiGLU) "
                 f"{t['fp8_partials']:8.2f} us | bf16 {t['bf16']:8.2f} us | {cell['speedup_vs_bf16']:5.2f}x | "
                 f"cos {cell['cos_vs_bf16']:.5f} {'ok' if cell['ok'] else 'BAD'}"
                 + (" (GEMMs: cuBLAS block-scaled)" if isinstance(cell["configs"]["gate_up"], str) else ""))
        except Exception as e:  # noqa: BLE001
            cell["error"] = f"{type(e).__name__}: {e}"[:500]
            _log(f"  mlp/M{M}: FAILED {cell['error']}")
        results[f"mlp/M{M}"] = cell


def _layer_model(n_layers: int):
    """S2-Pro-shaped DualAR with ``n_layers`` slow and fast layers, FP8 weights, fused kernels
    (a small vocabulary: the heads are not timed)."""
    from dataclasses import replace

    from .random_model import random_dualar, s2_pro_config

    cfg = s2_pro_config(4096)
    cfg = replace(cfg, vocab_size=8192, semantic_begin_id=4096, semantic_end_id=8191,
                  slow=replace(cfg.slow, n_layer=n_layers), fast=replace(cfg.fast, n_layer=n_layers))
    model = random_dualar(cfg, "cuda", torch.bfloat16, quantization="fp8")
    model.enable_fused_kernels()
    return model


def _layer_inputs(model, stack: str, M: int, context: int, dev: str = "cuda"):
    """(x, positions, rope table, layers, backend) of one decode step of ``stack`` at batch M."""
    from shoal.engine.attention import (
        FastCacheBackend,
        PagedDecodeBackend,
        PagedKVCache,
    )

    layers = model.layers if stack == "slow" else model.fast_layers
    sh = layers[0].attention.shape
    g = torch.Generator(device=dev).manual_seed(M)
    x = (torch.randn(M, 1, sh.dim, device=dev, generator=g)).bfloat16()
    if stack == "fast":
        be = FastCacheBackend(len(layers), M, 10, sh.n_head, sh.n_local_heads, sh.head_dim, torch.bfloat16, dev)
        be.k.normal_(generator=g)
        be.v.normal_(generator=g)
        be.position, be._rows = 5, M
        return x, torch.full((M, 1), 5, device=dev), model.fast_rope, layers, be
    bs = 16
    nb = -(-context // bs)
    cache = PagedKVCache(len(layers), M * nb + 1, bs, sh.n_local_heads, sh.head_dim, torch.bfloat16,
                         torch.device(dev))
    cache.data.normal_(generator=g)
    be = PagedDecodeBackend(cache, sh.n_head, sh.head_dim)
    bt = torch.arange(M * nb, device=dev, dtype=torch.int32).view(M, nb)
    pos = torch.full((M,), context - 1, device=dev)
    be.set(bt[:, -1].long() * bs + (context - 1) % bs, bt, (pos + 1).to(torch.int32))
    return x, pos[:, None], model.slow_rope, layers, be


def _count_kernels(fn) -> tuple[int, dict]:
    """Kernels one eager call of ``fn`` launches (profiler), and their names."""
    from collections import Counter

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(names.values()), dict(names)


def bench_layer(ms, stacks, n_layers, context, iters, results, verbose=False):
    """One full FP8 decoder layer, unfused vs fused, under CUDA-graph replay (see the module doc)."""
    model = _layer_model(n_layers)
    _log(f"FP8 decoder layer at S2-Pro shapes ({n_layers} layers per replay, distinct weights); "
         "us and kernel launches per layer, CUDA-graph replay, median")
    _log(f"{'stack':>6} {'M':>4} | {'unfused us':>10} {'launches':>8} | {'fused us':>10} {'launches':>8} | "
         f"{'saved us':>8} {'speedup':>7} | exact")
    for stack in stacks:
        for M in ms:
            key = f"layer/{stack}/M{M}"
            cell = {"shape": "layer", "stack": stack, "M": M, "layers": n_layers}
            try:
                x, pos, rope, layers, be = _layer_inputs(model, stack, M, context)
                outs, t, launches, names = {}, {}, {}, {}
                for mode in ("unfused", "fused"):
                    model.fp8_fusion = mode == "fused"

                    def step(model=model, x=x, layers=layers, pos=pos, rope=rope, be=be):
                        return model._layers_fused(x, layers, pos, rope, be)

                    h = step()
                    cache = (be.k, be.v) if stack == "fast" else (be.cache.data,)
                    outs[mode] = [h.clone()] + [c.clone() for c in cache]
                    n, names[mode] = _count_kernels(step)
                    launches[mode] = n / n_layers
                    t[mode] = time_graph([step], iters) / n_layers  # (every step rewrites the same K/V slot)
                model.fp8_fusion = True
                exact = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                            for a, b in zip(outs["unfused"], outs["fused"]))
                cell.update({"us": t, "launches_per_layer": launches, "exact": exact, "ok": exact,
                             "saved_us_per_layer": t["unfused"] - t["fused"],
                             "speedup": t["unfused"] / t["fused"]})
                if verbose:
                    cell["kernels"] = names
                _log(f"{stack:>6} {M:>4} | {t['unfused']:10.2f} {launches['unfused']:8.1f} | {t['fused']:10.2f} "
                     f"{launches['fused']:8.1f} | {cell['saved_us_per_layer']:8.2f} {cell['speedup']:6.3f}x | "
                     f"{'yes' if exact else 'NO'}")
                if verbose:
                    for mode in ("unfused", "fused"):
                        _log(f"    {mode}: " + ", ".join(f"{k[:60]} x{v}" for k, v in sorted(names[mode].items())))
            except Exception as e:  # noqa: BLE001 - print and continue
                cell["error"] = f"{type(e).__name__}: {e}"[:500]
                _log(f"  {key}: FAILED {cell['error']}")
                traceback.print_exc(limit=5)
            results[key] = cell
            torch.cuda.empty_cache()


def _print_row(c):
    if "error" in c:
        return
    us = c.get("us", {})
    tb = c.get("tbps", {})

    def f(k):
        return f"{us[k]:8.2f} ({tb[k]:4.2f})" if k in us else f"{'-':>15}"

    _log(f"{c['shape']:>14} {c['M']:>5} | {f('fp8')} | {f('fp8+q')} | {f('bf16')} | {f('scaled_mm')} | {f('scaled_mm_block')} | "
         f"{c.get('speedup_vs_bf16', 0):5.2f}x | rel {c['rel_vs_ref']:.1e} cos {c['cos_vs_bf16']:.5f} "
         f"{'ok' if c['ok'] else 'BAD'} | "
         f"{'cuBLAS block-scaled' if c.get('fp8_backend') == 'cublas-block' else _short_config(c.get('config'))}")


def _short_config(c) -> str:
    if not c:
        return "-"
    s = f"{c.get('KIND', 'tile')} {c.get('BLOCK_M')}x{c.get('BLOCK_N')}"
    if c.get("SPLIT_K", 1) > 1:
        s += f" sk{c['SPLIT_K']}{'f' if c.get('REDUCE') == 'fused' else 'r'}"
    return s + f" w{c.get('num_warps')}s{c.get('num_stages')}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--mlp", action="store_true", help="also time the whole MLP block")
    ap.add_argument("--table", default=None,
                    help="tuned-config table to use (e.g. the fp8_tuned.json a fresh tune_fp8 --out wrote; "
                         "a directory means DIR/fp8_tuned.json); default: $SHOAL_FP8_TUNED or the packaged one")
    ap.add_argument("--layer", action="store_true",
                    help="instead: one full FP8 decoder layer, unfused vs fused (kernels/fp8_fused.py)")
    ap.add_argument("--layer-ms", default="1,16,64")
    ap.add_argument("--layer-stacks", default="slow,fast")
    ap.add_argument("--layer-count", type=int, default=4, help="layers per graph replay (distinct weights)")
    ap.add_argument("--layer-context", type=int, default=512, help="slow stack: attended positions")
    ap.add_argument("--verbose", action="store_true", help="--layer: list the kernels of each path")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        _log("kernels_fp8: CUDA not available; nothing to benchmark")
        return 0
    if args.table:
        fp8.set_tuned_table(args.table)
        _log(f"tuned table: {args.table} ({len(fp8._tuned_table())} shapes)")
    ms = [int(m) for m in args.ms.split(",") if m]
    do_sm = _scaled_mm_available()
    t0 = time.time()
    results = {}
    _log(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  scaled_mm {do_sm}")
    if args.layer:
        bench_layer([int(m) for m in args.layer_ms.split(",") if m], [s for s in args.layer_stacks.split(",") if s],
                    args.layer_count, args.layer_context, args.iters, results, args.verbose)
        return _finish(args, results, t0)
    _log("us per call (effective TB/s); cold weights, CUDA-graph replay, median")
    _log(f"{'shape':>14} {'M':>5} | {'fp8':>15} | {'fp8+quant':>15} | {'bf16 cuBLAS':>15} | {'scaled_mm row':>15} | {'scaled_mm block':>15} |"
         f" fp8/bf16 | check")
    for name in [n for n in args.shapes.split(",") if n in SHAPES]:
        N, K = SHAPES[name]
        try:
            bench_shape(name, N, K, ms, args.iters, results, do_sm)
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            results[f"{name}/setup"] = {"error": f"{type(e).__name__}: {e}"[:500]}
            _log(f"  {name}: setup FAILED {e}")
    if "mlp" in args.shapes.split(",") or args.mlp:
        try:
            bench_mlp([m for m in ms if m <= 256], args.iters, results)
        except Exception as e:  # noqa: BLE001
            results["mlp/setup"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return _finish(args, results, t0)


def _finish(args, results, t0) -> int:
    n_bad = sum(1 for c in results.values() if "error" in c or not c.get("ok", False))
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": getattr(fp8.triton, "__version__", None), "python": platform.python_version(),
               "wall_s": time.time() - t0, "n_cells": len(results), "n_bad": n_bad, "cells": results}
    _log(f"done in {summary['wall_s']:.1f}s; {n_bad} bad/failed cells of {len(results)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kernels_fp8.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
