"""The decode step's elementwise kernels at prefill sizes: add+RMSNorm, qk-norm + RoPE + KV
write, SiLU*mul (S2-Pro widths, bf16) at 64 to 2,048 tokens, each timed alone (CUDA-graph replay of
back-to-back launches, medians) beside the bytes it moves, so a kernel far from memory speed
stands out. ``SHOAL_PDL=0`` and ``=1`` give the launch modes' times.

    python benchmarks/scripts/prefill_elementwise_probe.py [M,M,...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from shoal.bench.kernels_fp8 import time_graph
from shoal.kernels import fused
from shoal.model.layers import rope_table


def timed(fn, reps: int = 20, launches: int = 20) -> float:
    """Median microseconds per launch of ``launches`` back-to-back calls in one CUDA graph."""
    return time_graph([fn] * launches, reps)


def main(argv):
    ms = [int(v) for v in argv[0].split(",")] if argv else [64, 256, 1024, 2048]
    dev = "cuda"
    dim, inter, H, Hkv, D = 2560, 9728, 32, 8, 128
    bf = torch.bfloat16
    rows = []
    cs = rope_table(4096, D, 1_000_000.0).to(dev)
    for M in ms:
        x = torch.randn(M, dim, device=dev, dtype=bf)
        r = torch.randn(M, dim, device=dev, dtype=bf)
        w = torch.randn(dim, device=dev, dtype=bf)
        out = torch.empty_like(x)
        h = torch.empty_like(x)
        t = {}
        t["add_rmsnorm"] = timed(lambda: fused.add_rmsnorm(x, r, w, 1e-6, out=out, h_out=h))
        t["add_rmsnorm_torch"] = timed(lambda: torch.nn.functional.rms_norm((x + r).float(), (dim,), w.float(), 1e-6))
        gu = torch.randn(M, 2 * inter, device=dev, dtype=bf)
        so = torch.empty(M, inter, device=dev, dtype=bf)
        t["silu_mul"] = timed(lambda: fused.silu_mul(gu, out=so))
        t["silu_mul_torch"] = timed(lambda: torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:])
        qkv = torch.randn(M, (H + 2 * Hkv) * D, device=dev, dtype=bf)
        kc = torch.zeros(M + 64, Hkv, D, device=dev, dtype=bf)
        vc = torch.zeros_like(kc)
        pos = torch.arange(M, device=dev)
        slots = torch.arange(M, device=dev)
        qw = torch.randn(D, device=dev, dtype=bf)
        kw = torch.randn(D, device=dev, dtype=bf)
        q = torch.empty(M, H, D, device=dev, dtype=bf)
        t["qk_norm_rope_write"] = timed(lambda: fused.qk_norm_rope_write(
            qkv, pos, cs, qw, kw, 1e-6, kc, vc, slots, H, Hkv, D, q_out=q))
        # in context: each kernel after the cuBLAS GEMM that feeds it (as in a prefill layer);
        # its cost there = (GEMM + kernel) - GEMM alone
        w13 = torch.randn(2 * inter, dim, device=dev, dtype=bf) * dim ** -0.5
        wo = torch.randn(dim, H * D, device=dev, dtype=bf) * (H * D) ** -0.5
        xa = torch.randn(M, H * D, device=dev, dtype=bf)
        gu2 = torch.empty(M, 2 * inter, device=dev, dtype=bf)
        a2 = torch.empty(M, dim, device=dev, dtype=bf)
        t["gemm_w13"] = timed(lambda: torch.matmul(x, w13.t(), out=gu2))
        t["gemm_w13+silu_mul"] = timed(lambda: (torch.matmul(x, w13.t(), out=gu2), fused.silu_mul(gu2, out=so)))
        t["gemm_wo"] = timed(lambda: torch.matmul(xa, wo.t(), out=a2))
        t["gemm_wo+add_rmsnorm"] = timed(lambda: (torch.matmul(xa, wo.t(), out=a2),
                                                  fused.add_rmsnorm(a2, r, w, 1e-6, out=out, h_out=h)))
        nbytes = {"add_rmsnorm": 4 * M * dim * 2, "silu_mul": 3 * M * inter * 2,
                  "qk_norm_rope_write": 2 * M * (H + 2 * Hkv) * D * 2}
        cell = {"M": M, "us": t, "tbps": {k: nbytes[k] / (t[k] * 1e-6) / 1e12 for k in nbytes}}
        rows.append(cell)
        print(f"M={M:5d}  " + "  ".join(f"{k} {v:7.1f} us" for k, v in t.items()) + "   TB/s "
              + " ".join(f"{k} {v:.2f}" for k, v in cell["tbps"].items()), flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"prefill-elementwise-pdl{os.environ.get('SHOAL_PDL', 'default')}.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
