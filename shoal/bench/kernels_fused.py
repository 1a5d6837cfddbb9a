"""GPU check + micro-benchmark of the fused decode-step kernels at S2-Pro shapes.

    python -m shoal.bench.kernels_fused [--out DIR] [--iters 50] [--reps 20]

1. **Checks** (bf16 and fp32, N = 1, 16, 64, 128 tokens/rows): every kernel of
   :mod:`shoal.kernels.fused` against its PyTorch reference (the model's own code path).
   bf16 is reported as the number of differing elements and the largest difference in
   ulps; fp32 as ``max|a-b| / max|b|``. Expected: h, SiLU-mul, RoPE without qk-norm, the
   V copy bit-exact; the norms within 1-2 ulp on a small fraction of elements (the sum of
   squares is added in another order); fast attention within one bf16 rounding.
   Also reports whether ``F.rms_norm`` (nn.RMSNorm, the qk-norm) rounds once or twice on
   this device (the kernel mirrors single rounding, what torch does on CPU).
2. **Timing** (bf16): each op as the unfused PyTorch sequence (the reference == the model
   code) and as the fused kernel, ``--reps`` calls captured in one CUDA graph, median of
   ``--iters`` replays divided by ``--reps`` (microseconds per call), plus the elementwise
   work of a whole slow layer (attention_norm ... silu*mul, no GEMMs / attention) and of a
   fast-layer attention (rope + cache write + attention). The number of kernels per call
   is counted with the profiler.

Prints tables; with ``--out`` also writes ``DIR/kernels_fused.json``. Runs in < 1 min.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from shoal.kernels import fused as fz
from shoal.model.layers import rope_table

DIM, H, H_KV, D, INTER, C = 2560, 32, 8, 128, 9728, 10
EPS = 1e-6
BLOCK_SIZE, NUM_BLOCKS = 16, 1024
NS = (1, 16, 64, 128)


def _log(*a):
    print(*a, flush=True)


def ulp_diff(a, b):
    ai = a.contiguous().view(torch.int16).to(torch.int32)
    bi = b.contiguous().view(torch.int16).to(torch.int32)
    ai = torch.where(ai < 0, -32768 - ai, ai)
    bi = torch.where(bi < 0, -32768 - bi, bi)
    return (ai - bi).abs()


def metric(a, b):
    """bf16: 'mism/numel maxU ulp'; fp32: relative error."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return {"error": f"dtype/shape {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"}
    if a.dtype == torch.float32:
        return {"rel_err": (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)}
    u = ulp_diff(a, b)
    return {"mismatches": int((u > 0).sum().item()), "numel": a.numel(), "max_ulp": int(u.max().item())}


def fmt(m):
    if "error" in m:
        return m["error"]
    if "rel_err" in m:
        return f"rel {m['rel_err']:.1e}"
    if "max_abs" in m:
        return f"abs {m['max_abs']:.1e}" + (f", {m['max_ulp_vs_rounded']} ulp vs rounded" if m.get("max_ulp_vs_rounded") else "")
    return f"{m['mismatches']}/{m['numel']} diff, max {m['max_ulp']} ulp"


# --------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------


class Inputs:
    def __init__(self, N, dtype, dev, seed=0):
        g = torch.Generator(device=dev).manual_seed(seed)

        def rn(*shape, s=1.0):
            return (torch.randn(*shape, generator=g, device=dev) * s).to(dtype)

        self.N, self.dtype = N, dtype
        self.x, self.r = rn(N, DIM, s=2.0), rn(N, DIM, s=2.0)
        self.w = rn(DIM, s=0.2) + 1
        self.w2 = rn(DIM, s=0.2) + 1
        self.qkv = rn(N, (H + 2 * H_KV) * D, s=2.0)
        self.qw, self.kw = rn(D, s=0.3) + 1, rn(D, s=0.3) + 1
        self.table = rope_table(32768, D, 1e6).to(dev)
        self.pos = torch.randint(0, 32768, (N,), generator=g, device=dev)
        self.k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, H_KV, D, dtype=dtype, device=dev)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g, device=dev)[:N]
        self.gu = rn(N, 2 * INTER, s=3.0)
        self.q = rn(N, H, D, s=2.0)
        self.fk, self.fv = rn(N, C, H_KV, D), rn(N, C, H_KV, D)
        self.fslots = torch.arange(N, device=dev) * C + 3  # fast cache, position 3
        self.fpos = torch.full((N,), 3, dtype=torch.long, device=dev)


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------


def rms_norm_rounding(dev):
    """'single' / 'double': how F.rms_norm (nn.RMSNorm) rounds bf16 on this device."""
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(512, 128, generator=g, device=dev) * 3).bfloat16()
    w = (torch.randn(128, generator=g, device=dev) * 0.3 + 1).bfloat16()
    r = F.rms_norm(x, (128,), w, EPS)
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    single = int((r != (n * w.float()).bfloat16()).sum().item())
    double = int((r != n.bfloat16() * w).sum().item())
    return {"mismatch_vs_single": single, "mismatch_vs_double": double,
            "verdict": "single" if single < double else "double", "numel": x.numel()}


def run_checks(dev):
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        dn = "bf16" if dtype == torch.bfloat16 else "fp32"
        for N in NS:
            t = Inputs(N, dtype, dev, seed=N)
            res = {"dtype": dn, "N": N}
            try:
                o, h = fz.add_rmsnorm(t.x, t.r, t.w, EPS)
                ro, rh = fz.add_rmsnorm_ref(t.x, t.r, t.w, EPS)
                res["add_rmsnorm.h"] = metric(h, rh)
                res["add_rmsnorm.normed"] = metric(o, ro)
                o, _ = fz.add_rmsnorm(t.x, None, t.w, EPS)
                res["rmsnorm(no res)"] = metric(o, fz.add_rmsnorm_ref(t.x, None, t.w, EPS)[0])
                for norm in (True, False):
                    kc, vc = t.k_cache.clone(), t.v_cache.clone()
                    kr, vr = t.k_cache.clone(), t.v_cache.clone()
                    qw, kw = (t.qw, t.kw) if norm else (None, None)
                    q = fz.qk_norm_rope_write(t.qkv, t.pos, t.table, qw, kw, EPS, kc, vc, t.slots, H, H_KV, D)
                    qr = fz.qk_norm_rope_write_ref(t.qkv, t.pos, t.table, qw, kw, EPS, kr, vr, t.slots, H, H_KV, D)
                    tag = "qk_norm_rope" if norm else "rope(no norm)"
                    res[f"{tag}.q"] = metric(q, qr)
                    res[f"{tag}.k"] = metric(kc, kr)
                    if not norm:
                        res["cache.v"] = metric(vc, vr)
                res["silu_mul"] = metric(fz.silu_mul(t.gu), fz.silu_mul_ref(t.gu))
                worst, worst_ulp = 0.0, 0
                for length in (1, 5, 10):
                    o = fz.fast_decode_attention(t.q, t.fk, t.fv, length)
                    # fp32 math on the CPU (no TF32 / SDPA backend choice involved)
                    r = fz.fast_decode_attention_ref(t.q.float().cpu(), t.fk.float().cpu(), t.fv.float().cpu(),
                                                     length)
                    worst = max(worst, (o.float().cpu() - r).abs().max().item())
                    if dtype == torch.bfloat16:
                        worst_ulp = max(worst_ulp, int(ulp_diff(o.cpu(), r.to(dtype)).max().item()))
                res["fast_attn(vs fp32 math)"] = {"max_abs": worst, "max_ulp_vs_rounded": worst_ulp}
            except Exception as e:  # noqa: BLE001
                res["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            rows.append(res)
    return rows


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------


def time_graph(fn, reps, iters):
    """Median microseconds per call of fn, ``reps`` calls per captured graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        st.record()
        g.replay()
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en) * 1e3 / reps)
    del g
    times.sort()
    return times[len(times) // 2]


def count_kernels(fn):
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name
                   and "Memset" not in e.name)
    except Exception:  # noqa: BLE001
        return None


def ops(t: Inputs):
    """name -> (unfused, fused) callables on the inputs ``t``."""
    out = torch.empty_like(t.x)
    hbuf = torch.empty_like(t.x)
    qbuf = torch.empty(t.N, H, D, dtype=t.dtype, device=t.x.device)
    act = torch.empty(t.N, INTER, dtype=t.dtype, device=t.x.device)
    fo = torch.empty(t.N, H, D, dtype=t.dtype, device=t.x.device)
    fkc = t.fk.clone()
    fvc = t.fv.clone()

    def un_norm():
        fz.add_rmsnorm_ref(t.x, t.r, t.w, EPS)

    def fu_norm():
        fz.add_rmsnorm(t.x, t.r, t.w, EPS, out=out, h_out=hbuf)

    def un_qk():
        fz.qk_norm_rope_write_ref(t.qkv, t.pos, t.table, t.qw, t.kw, EPS, t.k_cache, t.v_cache, t.slots, H, H_KV, D)

    def fu_qk():
        fz.qk_norm_rope_write(t.qkv, t.pos, t.table, t.qw, t.kw, EPS, t.k_cache, t.v_cache, t.slots, H, H_KV, D,
                              q_out=qbuf)

    def un_silu():
        fz.silu_mul_ref(t.gu)

    def fu_silu():
        fz.silu_mul(t.gu, out=act)

    def un_fa():
        fz.fast_decode_attention_ref(t.q, t.fk, t.fv, C)

    def fu_fa():
        fz.fast_decode_attention(t.q, t.fk, t.fv, C, out=fo)

    def un_layer():  # everything of a slow layer but the GEMMs and the attention
        n1, h0 = fz.add_rmsnorm_ref(t.x, t.r, t.w, EPS)
        fz.qk_norm_rope_write_ref(t.qkv, t.pos, t.table, t.qw, t.kw, EPS, t.k_cache, t.v_cache, t.slots, H, H_KV, D)
        fz.add_rmsnorm_ref(n1, h0, t.w2, EPS)
        fz.silu_mul_ref(t.gu)

    def fu_layer():
        fz.add_rmsnorm(t.x, t.r, t.w, EPS, out=out, h_out=hbuf)
        fz.qk_norm_rope_write(t.qkv, t.pos, t.table, t.qw, t.kw, EPS, t.k_cache, t.v_cache, t.slots, H, H_KV, D,
                              q_out=qbuf)
        fz.add_rmsnorm(out, hbuf, t.w2, EPS, out=out, h_out=hbuf)
        fz.silu_mul(t.gu, out=act)

    def un_fast_attn_layer():  # FastCacheBackend: rope, write at position 3, attend over 4
        q = fz.qk_norm_rope_write_ref(t.qkv, t.fpos, t.table, None, None, EPS, fkc, fvc, t.fslots, H, H_KV, D)
        fz.fast_decode_attention_ref(q, fkc, fvc, 4)

    def fu_fast_attn_layer():
        fz.qk_norm_rope_write(t.qkv, t.fpos, t.table, None, None, EPS, fkc, fvc, t.fslots, H, H_KV, D, q_out=qbuf)
        fz.fast_decode_attention(qbuf, fkc, fvc, 4, out=fo)

    return {
        "add_rmsnorm": (un_norm, fu_norm),
        "qk_norm_rope_write": (un_qk, fu_qk),
        "silu_mul": (un_silu, fu_silu),
        "fast_decode_attention(len 10)": (un_fa, fu_fa),
        "slow layer elementwise": (un_layer, fu_layer),
        "fast layer rope+write+attn": (un_fast_attn_layer, fu_fast_attn_layer),
    }


def run_timing(dev, reps, iters):
    rows = []
    for N in NS:
        t = Inputs(N, torch.bfloat16, dev, seed=N)
        for name, (un, fu) in ops(t).items():
            row = {"op": name, "N": N}
            try:
                row["unfused_us"] = time_graph(un, reps, iters)
                row["fused_us"] = time_graph(fu, reps, iters)
                row["speedup"] = row["unfused_us"] / row["fused_us"]
                if N == NS[0]:
                    row["unfused_kernels"] = count_kernels(un)
                    row["fused_kernels"] = count_kernels(fu)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            rows.append(row)
    return rows


# --------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for kernels_fused.json")
    ap.add_argument("--iters", type=int, default=50, help="timed graph replays per measurement")
    ap.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args(argv)

    report = {"host": platform.node(), "torch": torch.__version__}
    if not torch.cuda.is_available() or not fz.HAS_TRITON or fz.triton_interpreting():
        _log("needs CUDA and Triton in compiled mode (TRITON_INTERPRET unset)")
        report["error"] = "no CUDA / Triton"
        _write(args.out, report)
        return 1
    import triton

    dev = torch.device("cuda")
    report.update(triton=triton.__version__, gpu=torch.cuda.get_device_name(dev))
    _log(f"torch {torch.__version__}, triton {triton.__version__}, {report['gpu']}")
    t0 = time.time()

    rr = rms_norm_rounding(dev)
    report["rms_norm_rounding"] = rr
    _log(f"F.rms_norm (qk-norm) bf16 rounding on this device: {rr['verdict']} "
         f"(mismatches vs single {rr['mismatch_vs_single']}, vs double {rr['mismatch_vs_double']} of {rr['numel']})"
         + ("" if rr["verdict"] == "single" else "  <-- the kernel rounds once: expect qk-norm ulp diffs"))

    checks = run_checks(dev)
    report["checks"] = checks
    _log(f"\n== checks vs reference ({time.time() - t0:.1f}s) ==")
    for row in checks:
        _log(f"-- {row['dtype']} N={row['N']}")
        if "error" in row:
            _log(f"   ERROR {row['error']}")
        for k, v in row.items():
            if isinstance(v, dict):
                _log(f"   {k:28s} {fmt(v)}")

    if not args.skip_timing:
        timing = run_timing(dev, args.reps, args.iters)
        report["timing"] = timing
        _log(f"\n== timing, bf16, CUDA graph replay, us per call (median of {args.iters}, {args.reps} calls/graph) "
             f"({time.time() - t0:.1f}s) ==")
        _log(f"{'op':32s} {'N':>4s} {'unfused':>9s} {'fused':>8s} {'speedup':>8s} {'kernels':>10s}")
        for r in timing:
            if "error" in r:
                _log(f"{r['op']:32s} {r['N']:4d} ERROR {r['error']}")
                continue
            kern = f"{r['unfused_kernels']}->{r['fused_kernels']}" if "unfused_kernels" in r else ""
            _log(f"{r['op']:32s} {r['N']:4d} {r['unfused_us']:9.2f} {r['fused_us']:8.2f} {r['speedup']:7.2f}x {kern:>10s}")
    report["wall_s"] = time.time() - t0
    _log(f"\ndone in {report['wall_s']:.1f}s")
    _write(args.out, report)
    return 0


def _write(out, report):
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "kernels_fused.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
