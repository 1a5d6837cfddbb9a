"""Which tiles give the 96-channel residual-unit kernel the two-kernel path's bits on the GPU.

    python benchmarks/scripts/unit96_probe.py [TAG]

At a 64 x 32-frame call's size (96 channels, 65,536 samples per stream), for each candidate
tile of ``shoal.kernels.codec_unit.residual_unit_triton``: bit equality with the two kernels
(k7 conv, then the k1 conv with its input Snake, residual and next-Snake epilogue), the
largest difference in each output-channel range (the first tile's channels and the second
tile's), the same against the ``k1`` mode's three kernels and the fp32 PyTorch reference, and
the CUDA-graph replay time. Writes ``$OUT/unit96-TAG.json``."""

from __future__ import annotations

import json
import os
import sys

import torch

from shoal.bench.kernels_codec_conv import bench_unit

# (BT, BN, BC, warps, stages, TMA, FLAT, BN2[, k1_trans]); without k1_trans the kernel's default
CANDIDATES = [
    (128, 64, 32, 4, 4, 1, 1, 32, 0),   # the table's tile, direct form (wrong on Hopper)
    (128, 64, 32, 4, 4, 1, 1, 64),   # second tile padded to 64 (masked)
    (64, 64, 32, 4, 4, 1, 1, 64),
    (128, 128, 32, 4, 4, 1, 1, 0),   # one padded tile of 128
    (64, 128, 32, 4, 3, 1, 1, 0),
    (128, 128, 32, 8, 4, 1, 1, 0),
    (128, 64, 32, 4, 1, 0, 0, 32, 0),   # pointer loads, one stage
    (128, 64, 16, 4, 4, 1, 1, 32, 0),   # 16-channel K slices
    (64, 64, 32, 4, 4, 0, 0, 32, 0),
    (64, 64, 32, 4, 4, 1, 1, 32, 0),
    # the k=1 conv transposed (ninth field): the Snake'd tiles as the MMAs' second operand
    (128, 64, 32, 4, 4, 1, 1, 32, 1),
    (64, 64, 32, 4, 4, 1, 1, 32, 1),
    (128, 128, 32, 4, 4, 1, 1, 0, 1),
]


# the fused mode's k1 conv (Snake on its input tiles): the table's tile, one stage (no software
# pipelining of its register-operand MMAs), pointer loads
FUSED_K1 = [(128, 128, 32, 4, 4, 1, 0), (128, 128, 32, 4, 1, 1, 0), (128, 128, 32, 4, 4, 0, 0),
            (128, 128, 32, 4, 1, 0, 0), (128, 64, 32, 4, 4, 1, 0, 32)]


def main() -> None:
    torch.set_grad_enabled(False)
    tag = sys.argv[1] if len(sys.argv) > 1 else "probe"
    B, L = 64, 32 * 2048
    out = {"gpu": torch.cuda.get_device_name(), "cells": []}
    for d in (1, 9):
        r = bench_unit(96, B, L, d, configs=CANDIDATES, fused_k1_configs=FUSED_K1)
        out["cells"].append(r)
        print(f"d={d}: two kernels (fused mode) {r['two_kernels_us']:.1f} us, k1 path {r['k1_path_us']:.1f} us; "
              f"fused == k1 path: {r['fused_equals_k1_path']} (max diff {r['fused_vs_k1_path']}); "
              f"against the fp32 reference: fused {r['fused_vs_ref']}, k1 path {r['k1_path_vs_ref']}", flush=True)
        for c in r["fused_k1"]:
            print("    fused k1", c, flush=True)
        for c in r["unit"]:
            print("   ", c, flush=True)
    path = os.path.join(os.environ.get("OUT", "."), f"unit96-{tag}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
