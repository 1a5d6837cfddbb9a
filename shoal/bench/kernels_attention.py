"""GPU micro-benchmark of the paged decode-attention kernel at S2-Pro shapes.

    python -m shoal.bench.kernels_attention --out DIR [--sweep]

For every (block_size, batch, context) cell it

1. checks the Triton kernel against the PyTorch reference (ragged context lengths and
   uniform ones, random page order), recording the max abs error;
2. times, with CUDA graphs, one decode-attention call of
   * ``triton``: :func:`shoal.kernels.paged_decode_attention` (paged, uniform lengths),
   * ``gather_sdpa``: gather the pages into a contiguous cache, then masked
     ``scaled_dot_product_attention`` (the straightforward PyTorch paged path),
   * ``sdpa_dense_gqa``: SDPA on an equivalent contiguous ``[B, H_kv, L, D]`` cache
     (``enable_gqa=True``; no paging, no mask: a lower bound for PyTorch),
   * ``sdpa_dense_mha``: SDPA on a contiguous ``[B, H, L, D]`` cache (K/V expanded to all
     query heads, 4x the bytes at S2-Pro's GQA ratio),
   * ``triton_fp8kv``: the kernel on an FP8 KV cache (:mod:`shoal.quant.kv`: e4m3 values, one
     fp32 scale per token and KV head), checked against the reference on the same cache; its
     "GB/s" counts the bytes it reads (e4m3 + scales, ~52% of bf16).

Each graph holds ``n_layers`` calls, each on a different slice of the cache (like the 36
layers of a decode step), so that the K/V working set exceeds the H200's 60 MB L2 and
reads come from HBM; a replay's time (median of ``--iters`` replays, CUDA events) is
divided by ``n_layers``. "GB/s" is the K/V bytes one call must read
(``2 * sum(context) * H_kv * D * 2``) over its time, for every method (so the MHA
baseline's own traffic is 4x what its GB/s says).

``--sweep`` additionally times tile size / warps / pipeline stages / split counts of the
kernel on a few cells (to tune the heuristics). Results go to ``DIR/kernels_attention.json``.
A failing cell or method is printed and recorded, and the run continues.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from shoal.kernels import paged_attention as pa

H, H_KV, D = 32, 8, 128
DTYPE = torch.bfloat16
L2_DEFEAT_BYTES = 256 << 20  # per-graph K/V working set to aim for (> 4x L2)
MAX_LAYERS = 32


def _log(*a):
    print(*a, flush=True)


def time_graph(fn, iters: int, warmup: int = 3, warmup_s: float = 0.05) -> float:
    """Capture ``fn`` into a CUDA graph; median replay time in microseconds.

    Replays at least ``warmup`` times and for at least ``warmup_s`` seconds before
    timing (the first measurement after a pause otherwise reads up to ~15% slow)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile / autotune / allocate outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    t_end = time.perf_counter() + warmup_s
    n = 0
    while n < warmup or time.perf_counter() < t_end:
        g.replay()
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    times = []
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del g
    times.sort()
    return times[len(times) // 2]


def gather_sdpa(q, k_cache, v_cache, block_tables, context_lens, scale):
    """PyTorch paged path: gather pages to [B, H_kv, L, D], masked SDPA (GQA)."""
    B, Hq, Dh = q.shape
    nb, bs, hkv, _ = k_cache.shape
    bt = block_tables.long().clamp(0, nb - 1)
    L = bt.shape[1] * bs
    k = k_cache[bt].reshape(B, L, hkv, Dh).transpose(1, 2)
    v = v_cache[bt].reshape(B, L, hkv, Dh).transpose(1, 2)
    mask = (torch.arange(L, device=q.device)[None, :] < context_lens[:, None].long())[:, None, None, :]
    o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[:, :, 0, :]


def _n_layers(bytes_per_layer: int) -> int:
    return max(1, min(MAX_LAYERS, math.ceil(L2_DEFEAT_BYTES / max(1, bytes_per_layer))))


def make_pool(B, ctx, bs, n_layers, device):
    """One K/V page pool holding ``n_layers`` independent caches, random page order."""
    blocks_per_seq = -(-ctx // bs)
    per_layer = B * blocks_per_seq
    num_blocks = per_layer * n_layers
    k = torch.randn(num_blocks, bs, H_KV, D, device=device, dtype=DTYPE)
    v = torch.randn(num_blocks, bs, H_KV, D, device=device, dtype=DTYPE)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = [perm[i * per_layer : (i + 1) * per_layer].reshape(B, blocks_per_seq).contiguous() for i in range(n_layers)]
    return k, v, tables


def run_cell(B, ctx, bs, iters, device, methods, repeat_triton=False):
    res = {"B": B, "context": ctx, "block_size": bs, "H": H, "H_kv": H_KV, "D": D, "dtype": "bf16"}
    scale = 1.0 / math.sqrt(D)
    kv_bytes = 2 * B * ctx * H_KV * D * 2
    n_layers = _n_layers(kv_bytes)
    res["n_layers"] = n_layers
    res["kv_bytes_per_call"] = kv_bytes
    max_ctx = -(-ctx // bs) * bs
    res["num_splits"] = pa.choose_num_splits(
        B, H_KV, max_ctx, pa._default_block_n(bs, D), torch.cuda.get_device_properties(device).multi_processor_count
    )

    k, v, tables = make_pool(B, ctx, bs, n_layers, device)
    q = torch.randn(B, H, D, device=device, dtype=DTYPE)

    # ---- correctness: ragged and uniform lengths on layer 0
    try:
        g = torch.Generator(device="cpu").manual_seed(B * 7919 + ctx + bs)
        ragged = torch.randint(1, ctx + 1, (B,), generator=g)
        ragged[0] = ctx
        errs = {}
        for name, lens in (("ragged", ragged), ("uniform", torch.full((B,), ctx))):
            cl = lens.to(device=device, dtype=torch.int32)
            o = pa.paged_decode_attention(q, k, v, tables[0], cl, scale)
            r = pa.paged_decode_attention_ref(q, k, v, tables[0], cl, scale)
            errs[name] = (o.float() - r.float()).abs().max().item()
            del o, r
        res["max_abs_err"] = errs
        res["check_ok"] = all(e <= 2e-2 for e in errs.values())
    except Exception as e:  # noqa: BLE001
        res["check_error"] = f"{type(e).__name__}: {e}"
        res["check_ok"] = False
        _log(traceback.format_exc())
    torch.cuda.empty_cache()

    cl = torch.full((B,), ctx, dtype=torch.int32, device=device)
    outs = [torch.empty_like(q) for _ in range(n_layers)]
    timings = {}

    def bench(name, fn):
        try:
            t = time_graph(fn, iters) / n_layers
            timings[name] = {"us": round(t, 2), "GBps": round(kv_bytes / (t * 1e-6) / 1e9, 1)}
        except Exception as e:  # noqa: BLE001
            timings[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        torch.cuda.empty_cache()

    if "triton" in methods:

        def f_triton():
            for i in range(n_layers):
                pa.paged_decode_attention(q, k, v, tables[i], cl, scale, out=outs[i])

        bench("triton", f_triton)

    if "gather_sdpa" in methods:

        def f_gather():
            for i in range(n_layers):
                outs[i].copy_(gather_sdpa(q, k, v, tables[i], cl, scale))

        bench("gather_sdpa", f_gather)

    if repeat_triton and "triton" in methods:
        bench("triton_repeat", f_triton)  # run-to-run spread of the kernel's timing

    if "triton_fp8kv" in methods:
        from shoal.quant.kv import quantize_kv

        k8, ks = quantize_kv(k)
        v8, vs = quantize_kv(v)
        del k, v
        if pa.fp8_kv_config()["cvt"] == "mma8":  # the value layout the engine gives that kernel
            from shoal.kernels.paged_attention_fp8 import token_minor_like

            v8m = token_minor_like(v8.shape, v8.device)
            v8m.copy_(v8)
            v8 = v8m
        torch.cuda.empty_cache()
        try:
            lens = torch.randint(1, ctx + 1, (B,), generator=torch.Generator().manual_seed(B + ctx)).to(
                device=device, dtype=torch.int32)
            o = pa.paged_decode_attention(q, k8, v8, tables[0], lens, scale, k_scale=ks, v_scale=vs)
            r = pa.paged_decode_attention_ref(q, k8, v8, tables[0], lens, scale, k_scale=ks, v_scale=vs)
            excess = ((o.float() - r.float()).abs() - 2e-2 * r.float().abs()).max().item()
            res["fp8kv_check_ok"] = excess <= 2e-2
            res["check_ok"] = res.get("check_ok", True) and res["fp8kv_check_ok"]
            del o, r
        except Exception as e:  # noqa: BLE001
            res["fp8kv_check_error"] = f"{type(e).__name__}: {e}"
            res["check_ok"] = False
        fp8_bytes = 2 * B * ctx * H_KV * (D + 4)

        def f_fp8():
            for i in range(n_layers):
                pa.paged_decode_attention(q, k8, v8, tables[i], cl, scale, out=outs[i], k_scale=ks, v_scale=vs)

        bench("triton_fp8kv", f_fp8)
        if "us" in timings.get("triton_fp8kv", {}):
            timings["triton_fp8kv"]["GBps"] = round(fp8_bytes / (timings["triton_fp8kv"]["us"] * 1e-6) / 1e9, 1)
        k, v = k8, v8  # freed below

    del k, v
    torch.cuda.empty_cache()

    if "sdpa_dense_gqa" in methods or "sdpa_dense_mha" in methods:
        q4 = q[:, :, None, :]
        for name, heads in (("sdpa_dense_gqa", H_KV), ("sdpa_dense_mha", H)):
            if name not in methods:
                continue
            try:
                kd = [torch.randn(B, heads, ctx, D, device=device, dtype=DTYPE) for _ in range(n_layers)]
                vd = [torch.randn(B, heads, ctx, D, device=device, dtype=DTYPE) for _ in range(n_layers)]
            except torch.OutOfMemoryError as e:
                timings[name] = {"error": f"OOM: {str(e)[:200]}"}
                continue
            gqa = heads != H

            def f_dense(kd=kd, vd=vd, gqa=gqa):
                for i in range(n_layers):
                    o = F.scaled_dot_product_attention(q4, kd[i], vd[i], scale=scale, enable_gqa=gqa)
                    outs[i].copy_(o[:, :, 0, :])

            bench(name, f_dense)
            del kd, vd
            torch.cuda.empty_cache()

    res["timings"] = timings
    return res


def run_sweep(device, iters):
    """Tile / warps / stages / splits sweep of the kernel on a few cells (block_size 16)."""
    from shoal.kernels.paged_attention import paged_decode_attention_triton as kern

    scale = 1.0 / math.sqrt(D)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = []
    for B, ctx, bs in ((1, 4096, 16), (16, 2048, 16), (64, 1024, 16), (128, 4096, 16), (32, 1024, 32)):
        kv_bytes = 2 * B * ctx * H_KV * D * 2
        n_layers = _n_layers(kv_bytes)
        k, v, tables = make_pool(B, ctx, bs, n_layers, device)
        q = torch.randn(B, H, D, device=device, dtype=DTYPE)
        cl = torch.full((B,), ctx, dtype=torch.int32, device=device)
        o = torch.empty_like(q)
        cell = {"B": B, "context": ctx, "block_size": bs, "n_layers": n_layers, "configs": []}
        t_cell = time.time()
        for block_n in (32, 64, 128):
            base = pa.choose_num_splits(B, H_KV, ctx, block_n, sms)
            split_opts = sorted({max(1, base // 2), base, min(64, base * 2)})
            for num_warps in (2, 4, 8):
                for num_stages in (1, 2, 3):
                    for splits in split_opts:
                        if (splits != base) and (num_warps, num_stages) != (4, 2):
                            continue  # split variations only at the default warps/stages

                        def fn(block_n=block_n, num_warps=num_warps, num_stages=num_stages, splits=splits):
                            for i in range(n_layers):
                                kern(q, k, v, tables[i], cl, scale, out=o, num_splits=splits, block_n=block_n,
                                     num_warps=num_warps, num_stages=num_stages)

                        rec = {"block_n": block_n, "num_warps": num_warps, "num_stages": num_stages, "splits": splits}
                        try:
                            t = time_graph(fn, iters) / n_layers
                            rec.update(us=round(t, 2), GBps=round(kv_bytes / (t * 1e-6) / 1e9, 1))
                        except Exception as e:  # noqa: BLE001
                            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                        cell["configs"].append(rec)
        ok = [c for c in cell["configs"] if "us" in c]
        if ok:
            best = min(ok, key=lambda c: c["us"])
            cell["best"] = best
            _log(f"sweep B={B} ctx={ctx} bs={bs}: best {best}  ({time.time() - t_cell:.1f}s)")
        out.append(cell)
        del k, v, tables
        torch.cuda.empty_cache()
    return out


def run_fp8_sweep(device, iters, cells=((1, 1024), (16, 1024), (64, 512), (64, 1024), (64, 4096), (128, 1024)),
                  widening=False, std_layout=False):
    """Launch options of the kernel on an FP8 cache (``pa.FP8_KV_CONFIG``): the e4m3 widening
    dtype, tile size, warps, pipeline stages, split multiplier. Returns the cells' timings and
    the config with the lowest total time over the cells (relative to each cell's best)."""
    from shoal.quant.kv import quantize_kv

    scale = 1.0 / math.sqrt(D)
    configs = []
    if widening:
        for cvt in ("f16", "q"):
            for block_n in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3):
                        configs.append({"cvt": cvt, "block_n": block_n, "num_warps": warps, "num_stages": stages,
                                        "split_mult": 1})
            configs.append({"cvt": cvt, "block_n": 64, "num_warps": 4, "num_stages": 2, "split_mult": 2})
    else:  # the widening kernel's packaged launch only, for reference
        configs.append({"cvt": "f16", "block_n": 128, "num_warps": 4, "num_stages": 2, "split_mult": 1})
    # the e4m3-operand kernel (shoal.kernels.paged_attention_fp8) on a token-minor V (v_layout
    # "minor", the layout it loads without a transpose; on the standard layout it ran 1.5-1.9x
    # slower, 2026-12-02) and, with --fp8-sweep-std, on the standard one
    for v_layout in ("minor", "std") if std_layout else ("minor",):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    configs.append({"cvt": "mma8", "block_n": block_n, "num_warps": warps, "num_stages": stages,
                                    "split_mult": 1, "v_layout": v_layout})
        for block_n in (32, 64):
            configs.append({"cvt": "mma8", "block_n": block_n, "num_warps": 4, "num_stages": 3, "split_mult": 2,
                            "v_layout": v_layout})
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = {"cells": [], "configs": configs}
    times = [[None] * len(configs) for _ in cells]
    for ci, (B, ctx) in enumerate(cells):
        bs = 16
        kv_bytes = 2 * B * ctx * H_KV * (D + 4)
        n_layers = _n_layers(kv_bytes)
        k, v, tables = make_pool(B, ctx, bs, n_layers, device)
        k8, ks = quantize_kv(k)
        v8, vs = quantize_kv(v)
        del k, v
        from shoal.kernels.paged_attention_fp8 import token_minor_like

        v8m = token_minor_like(v8.shape, v8.device)
        v8m.copy_(v8)
        q = torch.randn(B, H, D, device=device, dtype=DTYPE)
        cl = torch.full((B,), ctx, dtype=torch.int32, device=device)
        o = torch.empty_like(q)
        ref = pa.paged_decode_attention_ref(q, k8, v8, tables[0], cl, scale, k_scale=ks, v_scale=vs)
        cell = {"B": B, "context": ctx, "n_layers": n_layers, "results": []}
        for j, c in enumerate(configs):
            base = pa.choose_num_splits(B, H_KV, ctx, c["block_n"], sms)
            splits = max(1, min(base * c["split_mult"], -(-ctx // c["block_n"]), 64))
            kw = dict(num_splits=splits, block_n=c["block_n"], num_warps=c["num_warps"],
                      num_stages=c["num_stages"], cvt=c["cvt"])
            rec = dict(c, splits=splits)
            vv = v8m if c.get("v_layout") == "minor" else v8
            try:
                chk = pa.paged_decode_attention_triton(q, k8, vv, tables[0], cl, scale, k_scale=ks, v_scale=vs, **kw)
                rec["excess"] = ((chk.float() - ref.float()).abs() - 2e-2 * ref.float().abs()).max().item()

                def fn(kw=kw, vv=vv):
                    for i in range(n_layers):
                        pa.paged_decode_attention_triton(q, k8, vv, tables[i], cl, scale, out=o, k_scale=ks,
                                                         v_scale=vs, **kw)

                t = time_graph(fn, iters) / n_layers
                rec.update(us=round(t, 2), GBps=round(kv_bytes / (t * 1e-6) / 1e9, 1))
                if rec["excess"] <= 2e-2:
                    times[ci][j] = t
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            cell["results"].append(rec)
        ok = [r for r in cell["results"] if "us" in r and r["excess"] <= 2e-2]
        if ok:
            cell["best"] = min(ok, key=lambda r: r["us"])
            _log(f"fp8 sweep B={B} ctx={ctx}: best {cell['best']}")
        out["cells"].append(cell)
        del k8, v8, v8m, ks, vs, tables
        torch.cuda.empty_cache()
    score = []
    for j in range(len(configs)):
        col = [times[ci][j] for ci in range(len(cells))]
        if any(t is None for t in col):
            score.append(float("inf"))
            continue
        score.append(sum(t / min(x for x in times[ci] if x is not None) for ci, t in enumerate(col)))
    jbest = min(range(len(configs)), key=lambda j: score[j])
    if score[jbest] == float("inf"):
        raise RuntimeError("no FP8-cache launch config was valid in every cell (see the cells' errors)")
    out["best"] = dict(configs[jbest], score=round(score[jbest], 3))
    out["env"] = ",".join(f"{k}={v}" for k, v in configs[jbest].items() if k != "v_layout")
    _log(f"fp8 sweep best overall: {out['best']}  SHOAL_ATTN_FP8_CONFIG={out['env']}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (kernels_attention.json)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--iters", type=int, default=20, help="timed graph replays per measurement")
    ap.add_argument(
        "--methods",
        nargs="+",
        default=["triton", "gather_sdpa", "sdpa_dense_gqa", "sdpa_dense_mha"],
    )
    ap.add_argument("--repeat-triton", action="store_true", help="time the kernel a second time per cell")
    ap.add_argument("--sweep", action="store_true", help="also sweep kernel launch parameters")
    ap.add_argument("--sweep-only", action="store_true")
    ap.add_argument("--fp8-sweep", action="store_true",
                    help="also sweep the FP8-cache launch options (writes the best as SHOAL_ATTN_FP8_CONFIG "
                         "to DIR/fp8_kv_config.env)")
    ap.add_argument("--fp8-sweep-widening", action="store_true",
                    help="the FP8 sweep also covers the widening kernel's launch options (cvt f16 / q)")
    ap.add_argument("--fp8-sweep-std", action="store_true",
                    help="the FP8 sweep also runs the e4m3-operand kernel on the standard V layout")
    args = ap.parse_args(argv)

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kernels_attention.json")
    if not torch.cuda.is_available():
        _log("CUDA is not available: nothing to benchmark")
        with open(path, "w") as f:
            json.dump({"error": "CUDA not available"}, f, indent=1)
        return 1
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    import triton

    report = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shapes": {"H": H, "H_kv": H_KV, "D": D, "dtype": "bf16"},
        "cells": [],
    }
    t0 = time.time()

    def dump():
        report["total_s"] = round(time.time() - t0, 1)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)

    if not args.sweep_only:
        hdr = f"{'bs':>3} {'B':>4} {'ctx':>5} {'spl':>3} {'lay':>3} {'err':>8} | " + " | ".join(
            f"{m:>22}" for m in args.methods
        )
        _log(hdr + (f" | {'triton_repeat':>22}" if args.repeat_triton else ""))
        for bs in args.block_sizes:
            for B in args.batches:
                for ctx in args.contexts:
                    try:
                        cell = run_cell(B, ctx, bs, args.iters, device, args.methods, args.repeat_triton)
                    except Exception as e:  # noqa: BLE001
                        cell = {"B": B, "context": ctx, "block_size": bs, "error": f"{type(e).__name__}: {e}"}
                        _log(traceback.format_exc())
                        torch.cuda.empty_cache()
                    report["cells"].append(cell)
                    dump()
                    tm = cell.get("timings", {})
                    cols = []
                    for m in args.methods + (["triton_repeat"] if args.repeat_triton else []):
                        r = tm.get(m, {})
                        cols.append(f"{r['us']:>9.1f}us {r['GBps']:>6.0f}GB/s" if "us" in r else f"{'ERR' if r else '-':>22}")
                    err = max(cell.get("max_abs_err", {"x": float("nan")}).values())
                    _log(
                        f"{bs:>3} {B:>4} {ctx:>5} {cell.get('num_splits', '?'):>3} {cell.get('n_layers', '?'):>3} "
                        f"{err:>8.4f} | " + " | ".join(cols)
                        + ("" if cell.get("check_ok", False) else "   <-- CHECK FAILED")
                    )
                    for m, r in tm.items():
                        if "error" in r:
                            _log(f"    {m}: {r['error']}")
    if args.sweep or args.sweep_only:
        try:
            report["sweep"] = run_sweep(device, max(5, args.iters // 2))
        except Exception as e:  # noqa: BLE001
            report["sweep_error"] = f"{type(e).__name__}: {e}"
            _log(traceback.format_exc())
    if args.fp8_sweep:
        try:
            report["fp8_sweep"] = run_fp8_sweep(device, max(5, args.iters // 2), widening=args.fp8_sweep_widening,
                                                std_layout=args.fp8_sweep_std)
            with open(os.path.join(args.out, "fp8_kv_config.env"), "w") as f:
                f.write(report["fp8_sweep"]["env"] + "\n")
        except Exception as e:  # noqa: BLE001
            report["fp8_sweep_error"] = f"{type(e).__name__}: {e}"
            _log(traceback.format_exc())
    dump()
    _log(f"wrote {path} ({report['total_s']}s)")
    bad = [c for c in report["cells"] if not c.get("check_ok", False)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
