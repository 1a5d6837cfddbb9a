"""The residual-unit kernel's register-pressure switches, timed at a real call's size.

    python benchmarks/scripts/unit_switch_probe.py [TAG]

``SHOAL_UNIT_V_TMA`` (the k=1 weight's tiles through tensor descriptors, straight into shared
memory) and ``SHOAL_UNIT_K1_EARLY`` (the second output tile's k=1 products before the first
tile's epilogue, so the Snake'd k=7 result dies earlier) cut the kernel's register spills in
half in a local sm_90 compile (ptxas -v). This times each combination on the shipped tile and
on a 128-row tile at a 64 x 32-frame call (96 channels: 65,536 samples per stream; 192:
16,384; dilation 3), CUDA-graph replay, bit equality with the two-kernel path checked by
``bench_unit``. Writes ``$OUT/unit-switches-TAG.json``."""

from __future__ import annotations

import json
import os
import sys

import torch

from shoal.bench.kernels_codec_conv import SAMPLES_PER_FRAME_AT, bench_unit
from shoal.kernels.codec_unit import unit_config

EXTRA = {96: (128, 64, 32, 8, 4, 1, 1, 32), 192: (128, 128, 32, 8, 3, 1, 1, 64)}


def main() -> None:
    torch.set_grad_enabled(False)
    tag = sys.argv[1] if len(sys.argv) > 1 else "probe"
    B = 64
    out = {"gpu": torch.cuda.get_device_name(), "cells": []}
    for C in (96, 192):
        L = 32 * SAMPLES_PER_FRAME_AT[C]
        for vt, ke in ((0, 0), (1, 0), (0, 1), (1, 1)):
            os.environ["SHOAL_UNIT_V_TMA"], os.environ["SHOAL_UNIT_K1_EARLY"] = str(vt), str(ke)
            r = bench_unit(C, B, L, 3, configs=[unit_config(C), EXTRA[C]])
            r.update(v_tma=vt, k1_early=ke)
            out["cells"].append(r)
            for c in r["unit"]:
                print(f"C={C} v_tma={vt} k1_early={ke} {c.get('config')}: "
                      f"{c.get('us', c.get('error'))} us, bit-equal two kernels {c.get('bit_equal')}, "
                      f"k1 path {c.get('bit_equal_k1_path')}"
                      f" (two kernels {r['two_kernels_us']:.1f} us)", flush=True)
    path = os.path.join(os.environ.get("OUT", "."), f"unit-switches-{tag}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
