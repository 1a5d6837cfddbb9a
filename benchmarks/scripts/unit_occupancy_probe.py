"""More programs per SM for the codec's residual-unit kernels: tiles x register caps.

    python benchmarks/scripts/unit_occupancy_probe.py

Nsight Compute (2026-12-07, H100) found the unit kernels saturating nothing at 255 registers a
thread: two 4-warp programs per SM, tensor pipes under half busy, L2 at 58-69%. A Triton
``maxnreg`` cap of 168 lets three programs share an SM (where shared memory allows: fewer
stages for the 192-channel unit) for a few spilled bytes (Triton 3.6 for sm_90a: 68 bytes at 96
channels, ~690 at 192; ``benchmarks/scripts/unit_regs.py``). Times each (tile, cap) at a 64 x
32-frame call's size through ``shoal.bench.kernels_codec_conv.bench_unit`` (CUDA-graph replay;
bits compared with the shipped path). Writes ``$OUT/unit-occupancy.json``.
"""
from __future__ import annotations

import json
import os

import torch

from shoal.bench.kernels_codec_conv import bench_unit
from shoal.kernels.codec_unit import unit_config

FRAMES, BATCH = 32, 64
POSITIONS = {96: FRAMES * 2048, 192: FRAMES * 1024}
# (tile, register cap); the tile's last fields: TMA, FLAT, BN2
VARIANTS = {
    192: [(unit_config(192), 0), ((64, 128, 64, 4, 2, 1, 1, 64), 0), ((64, 128, 64, 4, 2, 1, 1, 64), 168),
          ((64, 128, 32, 4, 4, 1, 1, 64), 168), ((64, 128, 32, 4, 3, 1, 1, 64), 168),
          ((64, 128, 64, 4, 3, 1, 1, 64), 168)],
    96: [(unit_config(96), 0), (unit_config(96), 168), ((128, 64, 32, 4, 3, 1, 1, 32), 168),
         ((128, 64, 32, 4, 3, 1, 1, 32), 0), ((64, 64, 32, 4, 4, 1, 1, 32), 0)],
}


def main() -> None:
    torch.set_grad_enabled(False)
    res = {"gpu": torch.cuda.get_device_name(), "cells": []}
    for C, variants in VARIANTS.items():
        for cfg, cap in variants:
            os.environ["SHOAL_UNIT_MAXNREG"] = str(cap)
            r = bench_unit(C, BATCH, POSITIONS[C], 1, configs=[cfg])
            u = r["unit"][0]
            cell = {"c": C, "config": cfg, "maxnreg": cap, **{k: u.get(k) for k in ("us", "bit_equal", "error")},
                    "gflop": r["gflop"]}
            if u.get("us"):
                cell["tflops"] = r["gflop"] / u["us"] * 1e-3
            res["cells"].append(cell)
            print(C, cfg, "regs", cap or "-", {k: (round(v, 1) if isinstance(v, float) else v)
                                               for k, v in cell.items() if k in ("us", "tflops", "bit_equal", "error")},
                  flush=True)
            d = os.environ.get("OUT", ".")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "unit-occupancy.json"), "w") as f:
                json.dump(res, f, indent=1, default=str)
    os.environ.pop("SHOAL_UNIT_MAXNREG", None)


if __name__ == "__main__":
    main()
