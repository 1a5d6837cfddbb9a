"""GEMV probe (one-off, H200 2026-12-03): at one token, is a CUDA-core GEMV (weights loaded
straight into registers, fp32 FMAs into a [BLOCK_N, BLOCK_K] accumulator reduced once at the
end, no tensor cores and no shared-memory staging) faster than the packaged swap-AB MMA kernel
on S2-Pro's narrow projections (wo, down, wqkv) and gate_up?

Cold weights (8 rotating copies, more than L2), CUDA-graph replay, medians, PDL launches like
the decode step's; every candidate is checked against the fp32 reference first. Split-K
candidates write fp32 partials that dense's reduce kernel sums (a second launch, timed with it).

    OUT=DIR PYTHONPATH=. python benchmarks/scripts/gemv_probe.py            # H200
    GEMV_PROBE_TINY=1 TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/scripts/gemv_probe.py  # CPU check
"""
import json
import os
import time

import torch
import triton
import triton.language as tl

from shoal.kernels import dense
from shoal.kernels.paged_attention import pdl_enter, pdl_options

TINY = bool(os.environ.get("GEMV_PROBE_TINY"))
DEV = "cpu" if TINY else "cuda"


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, N, K, k_per_split,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_lo = pid_k * k_per_split
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + (k_lo + offs_k)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        kk = k_lo + k0 + offs_k
        k_mask = kk < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        acc += w * x[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_n, y.to(tl.bfloat16), mask=n_mask)
    else:
        tl.store(part_ptr + pid_k * N + offs_n, y, mask=n_mask)


def gemv(x, w, cfg, work=None, out=None):
    N, K = w.shape
    bn, bk, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    per = triton.cdiv(triton.cdiv(K, bk), split) * bk
    split = triton.cdiv(K, per)
    out = torch.empty(1, N, dtype=torch.bfloat16, device=x.device) if out is None else out
    if split > 1 and work is None:
        work = torch.empty(split, 1, N, dtype=torch.float32, device=x.device)
    kw = {} if TINY else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], **pdl_options(x)}
    _gemv_kernel[(triton.cdiv(N, bn), split)](x, w, out, work if work is not None else out, N, K, per,
                                              BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, **kw)
    if split > 1:
        dense._launch_reduce(work, out, 1, N, split)
    return out


def candidates(N, K, sms=132):
    out = []
    for bn, bk in ((16, 256), (32, 128), (32, 256), (64, 128)):
        tiles = triton.cdiv(N, bn)
        kblocks = triton.cdiv(K, bk)
        splits = sorted({s for s in range(1, 17) if s <= kblocks},
                        key=lambda s: min(abs(tiles * s - t) for t in (sms, 2 * sms, 4 * sms)))
        picked = []
        for s in splits:  # the split counts whose program counts come nearest 1, 2 and 4 per SM
            if len(picked) == 3:
                break
            if all(abs(tiles * s - tiles * p) > 0 for p in picked):
                picked.append(s)
        for s in picked:
            for stages in ((1,) if TINY else (1, 3)):
                out.append({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": s, "num_warps": 4, "num_stages": stages})
    return out


def timed(fns, iters=30):
    from shoal.bench.kernels_fp8 import time_graph

    return time_graph(fns, iters)


def main():
    shapes = ({"tiny_narrow": (64, 320), "tiny_wide": (200, 128)} if TINY else
              {"wo": (2560, 4096), "down": (2560, 9728), "wqkv": (6144, 2560), "gate_up": (19456, 2560)})
    res = {"date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("SHOAL_COMMIT"),
           "gpu": torch.cuda.get_device_name() if not TINY else "cpu (interpreter)", "shapes": {}}
    for name, (N, K) in shapes.items():
        g = torch.Generator(device=DEV).manual_seed(N + K)
        ncopy = 1 if TINY else 8
        ws = [(torch.randn(N, K, device=DEV, generator=g) * K ** -0.5).bfloat16() for _ in range(ncopy)]
        x = torch.randn(1, K, device=DEV, generator=g).bfloat16()
        ref = dense.dense_gemm_ref(x, ws[0])
        scale = ref.float().abs().max().item()
        row = {"N": N, "K": K, "weight_mb": N * K * 2 / 1e6, "candidates": []}
        if not TINY:
            row["packaged_us"] = timed([lambda i=i: dense.dense_linear(x, ws[i]) for i in range(ncopy)])
            row["cublas_us"] = timed([lambda i=i: torch.nn.functional.linear(x, ws[i]) for i in range(ncopy)])
        for cfg in candidates(N, K):
            try:
                y = gemv(x, ws[0], cfg)
                err = (y.float() - ref.float()).abs().max().item() / scale
                ok = err <= 2.0 ** -7
                entry = {**cfg, "rel_err": err, "ok": ok}
                if ok and not TINY:
                    outs = [torch.empty(1, N, dtype=torch.bfloat16, device=DEV) for _ in range(ncopy)]
                    per = triton.cdiv(triton.cdiv(K, cfg["BLOCK_K"]), cfg["SPLIT_K"]) * cfg["BLOCK_K"]
                    split = triton.cdiv(K, per)
                    works = [torch.empty(split, 1, N, dtype=torch.float32, device=DEV) if split > 1 else None
                             for _ in range(ncopy)]
                    entry["us"] = timed([lambda i=i: gemv(x, ws[i], cfg, works[i], outs[i]) for i in range(ncopy)])
            except Exception as e:  # noqa: BLE001 -- a candidate that fails to compile is recorded, not fatal
                entry = {**cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            row["candidates"].append(entry)
        timedc = [c for c in row["candidates"] if "us" in c]
        best = min(timedc, key=lambda c: c["us"]) if timedc else None
        row["best"] = best
        res["shapes"][name] = row
        bad = [c for c in row["candidates"] if not c.get("ok")]
        line = f"{name:8s} N={N} K={K}: {len(row['candidates'])} candidates, {len(bad)} failed"
        if not TINY:
            line += (f"; packaged {row['packaged_us']:.2f} us, cuBLAS {row['cublas_us']:.2f}"
                     + (f", GEMV best {best['us']:.2f} us ({row['weight_mb'] / best['us']:.2f} TB/s) {best}"
                        if best else ""))
        print(line, flush=True)
        if bad:
            print("  failed:", bad[:3], flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gemv_probe.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
