"""Kernel-by-kernel profile of one streaming codec call on the GPU.

    python benchmarks/scripts/codec_profile.py [BATCH [FRAMES]]

Builds the real-size codec with random weights (bf16 decode side) in the serving layout, runs
the eager serving decoder (the same kernels the CUDA graphs replay) for a few warm-up calls,
then profiles one call with ``torch.profiler`` and prints every GPU kernel in launch order
(name, grid, microseconds) and a summary by kernel name. Writes
``$OUT/codec-profile-BxT.json``."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import defaultdict

import torch

from shoal.bench.codec import build_codec, random_codes
from shoal.codec.streaming import serving_decoder


def main() -> None:
    torch.set_grad_enabled(False)
    dev = torch.device("cuda")
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    T = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    codec = build_codec(False, dev).to(torch.bfloat16)
    dec = serving_decoder(codec, graphs=False)
    state = dec.new_state(B)
    codes = random_codes(B, T, dev, seed=1)
    for _ in range(3):
        dec.decode_chunk(codes, state)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(5):
        dec.decode_chunk(codes, state)
    ev[1].record()
    torch.cuda.synchronize()
    eager_ms = ev[0].elapsed_time(ev[1]) / 5
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.decode_chunk(codes, state)
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    kernels = [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels.sort(key=lambda e: e["ts"])
    rows = []
    for e in kernels:
        a = e.get("args", {})
        rows.append({"name": e["name"][:90], "us": e["dur"], "grid": a.get("grid"), "block": a.get("block"),
                     "regs": a.get("registers per thread"), "smem": a.get("shared memory")})
    total = sum(r["us"] for r in rows)
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) if kernels else 0
    print(f"{B}x{T}: eager call {eager_ms:.2f} ms; profiled kernels {total / 1e3:.2f} ms busy, span {span / 1e3:.2f} ms")
    for i, r in enumerate(rows):
        print(f"{i:3d} {r['us']:9.1f} us  grid={r['grid']} block={r['block']} regs={r['regs']} smem={r['smem']}  {r['name']}")
    by = defaultdict(lambda: [0, 0.0])
    for r in rows:
        by[r["name"]][0] += 1
        by[r["name"]][1] += r["us"]
    print("by name:")
    for n, (c, us) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"  {us / 1e3:8.2f} ms  {c:4d} x  {n}")
    out = {"gpu": torch.cuda.get_device_name(), "batch": B, "frames": T, "eager_call_ms": eager_ms,
           "kernel_busy_ms": total / 1e3, "span_ms": span / 1e3, "kernels": rows,
           "env": {k: v for k, v in os.environ.items() if k.startswith("SHOAL_")}}
    d = os.environ.get("OUT", ".")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"codec-profile-{B}x{T}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
