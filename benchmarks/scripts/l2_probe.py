"""L2 probe (one-off, H200 2026-12-02; results in benchmarks/results/2026-12-02-h200-l2probe-2a99736.json):
is a decode GEMM (M = 1) faster on L2-resident weights, and can an L2 prefetch of its weights on a
forked stream, overlapping latency-bound kernels (simulated by torch.cuda._sleep), make them resident?

    OUT=DIR PYTHONPATH=. python benchmarks/scripts/l2_probe.py
"""
import json
import os
import torch
import triton
import triton.language as tl
from shoal.bench.kernels_fp8 import time_graph
from shoal.kernels import dense, fp8

@triton.jit
def _pf_lines(ptr, n_lines, LINES: tl.constexpr):
    pid = tl.program_id(0)
    offs = (pid * LINES + tl.arange(0, LINES)).to(tl.int64)
    offs = tl.minimum(offs, n_lines - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr + offs * 128],
                              dtype=tl.int32, is_pure=False, pack=1)

@triton.jit
def _pf_bulk(ptr, nbytes, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    lane = tl.arange(0, 32)
    off = (pid * 32 + lane).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - off, 0), CHUNK).to(tl.int32)
    tl.inline_asm_elementwise("{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; }\n\tmov.u32 $0, 0;",
                              "=r,l,r", [ptr + off, size], dtype=tl.int32, is_pure=False, pack=1)

def prefetch(t, nbytes, mode):
    nbytes = min(nbytes, t.numel() * t.element_size())
    if mode == "lines":
        n = nbytes // 128
        LINES = 1024
        _pf_lines[(triton.cdiv(n, LINES),)](t, n, LINES=LINES, num_warps=4)
    else:
        CH = 16384
        _pf_bulk[(triton.cdiv(nbytes, CH * 32),)](t, nbytes, CHUNK=CH, num_warps=1)

def run_graph(body, iters=20):
    """Median microseconds of one CUDA-graph replay of ``body`` (the benchmarks' timer)."""
    return time_graph([body], iters)

SHAPES = {"wqkv": (6144, 2560), "wo": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
res = {}
side = torch.cuda.Stream()
for prec in ("bf16", "fp8"):
    for name, (N, K) in SHAPES.items():
        w0 = (torch.randn(N, K, device="cuda") * K ** -0.5).bfloat16()
        ncopy = 8
        if prec == "bf16":
            ws = [w0.clone() for _ in range(ncopy)]
            x = torch.randn(1, K, device="cuda").bfloat16()
            outs = [torch.empty(1, N, device="cuda", dtype=torch.bfloat16) for _ in ws]
            gemm = lambda i, w=None: dense.dense_linear(x, ws[i] if w is None else w)
            wbuf = lambda i: ws[i]
        else:
            q = [fp8.quantize_weight_ref(w0) for _ in range(ncopy)]
            x = torch.randn(1, K, device="cuda").bfloat16()
            xq, xs = fp8.quantize_act(x)
            gemm = lambda i, w=None: fp8.fp8_gemm(xq, xs, *q[i])
            wbuf = lambda i: q[i][0]
        del w0
        nb = wbuf(0).numel() * wbuf(0).element_size()
        r = {}
        r["cold"] = run_graph(lambda: [gemm(i) for i in range(ncopy)]) / ncopy
        r["warm"] = run_graph(lambda: [gemm(0) for i in range(ncopy)]) / ncopy
        for sl in (0, 4000, 10000):
            r[f"sleep{sl}"] = run_graph(lambda: [torch.cuda._sleep(sl) if sl else None for _ in range(ncopy)]) / ncopy if sl else 0.0
            r[f"sleep{sl}+cold"] = run_graph(lambda: [(torch.cuda._sleep(sl) if sl else None, gemm(i)) for i in range(ncopy)]) / ncopy
            for mode in ("lines", "bulk"):
                for frac in (0.5, 1.0):
                    def body(mode=mode, frac=frac, sl=sl):
                        for i in range(ncopy):
                            cur = torch.cuda.current_stream()
                            side.wait_stream(cur)
                            with torch.cuda.stream(side):
                                prefetch(wbuf(i), int(nb * frac), mode)
                            if sl:
                                torch.cuda._sleep(sl)
                            cur.wait_stream(side)
                            gemm(i)
                    try:
                        r[f"sleep{sl}+pf_{mode}{frac}+cold"] = run_graph(body) / ncopy
                    except Exception as e:
                        r[f"sleep{sl}+pf_{mode}{frac}+cold"] = str(e)[:200]
        res[f"{prec}/{name}"] = r
        print(prec, name, f"{nb/1e6:.1f}MB", json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
        del gemm
        torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "l2probe.json"), "w"), indent=1)
