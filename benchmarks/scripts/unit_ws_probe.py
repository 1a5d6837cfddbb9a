"""The codec's residual-unit kernels warp-specialized against the shipped launches (GPU).

    python benchmarks/scripts/unit_ws_probe.py

``residual_unit_triton(ws=True)`` (``SHOAL_UNIT_WS=1``) runs the k=7 loop with Triton's Hopper
warp specialization: a producer warpgroup issues the descriptor loads and two consumer
warpgroups split a 128-row tile's MMAs (``codec_unit.ws_supported``). Times each tile at a
64 x 32-frame call's size through ``shoal.bench.kernels_codec_conv.bench_unit`` (CUDA-graph
replay; bits compared with the shipped path), recording whether the launch ran specialized.
Writes ``$OUT/unit-ws.json``."""
from __future__ import annotations

import json
import os

import torch

from shoal.bench.kernels_codec_conv import bench_unit
from shoal.kernels import codec_unit as cu

FRAMES, BATCH = 32, 64
POSITIONS = {96: FRAMES * 2048, 192: FRAMES * 1024}
# (tile with an optional ninth field k1_trans, warp-specialized)
VARIANTS = {
    192: [(cu.unit_config(192), False), ((128, 128, 64, 4, 2, 1, 1, 64), True), ((128, 128, 32, 4, 4, 1, 1, 64), True),
          ((128, 128, 32, 4, 3, 1, 1, 64), True), ((128, 128, 64, 4, 2, 1, 1, 64), False)],
    96: [(cu.unit_config(96), False), ((128, 64, 32, 4, 4, 1, 1, 32, 0), True), ((128, 64, 32, 4, 3, 1, 1, 32, 0), True),
         ((256, 64, 32, 4, 3, 1, 1, 32, 0), True)],
}


def main() -> None:
    torch.set_grad_enabled(False)
    res = {"gpu": torch.cuda.get_device_name(), "cells": []}
    for C, variants in VARIANTS.items():
        for cfg, ws in variants:
            os.environ["SHOAL_UNIT_WS"] = "1" if ws else "0"
            cu.LAST_LAUNCH.clear()
            r = bench_unit(C, BATCH, POSITIONS[C], 1, configs=[cfg])
            u = r["unit"][0]
            cell = {"c": C, "config": cfg, "ws": ws, "ran_ws": cu.LAST_LAUNCH.get("WS"),
                    "ran_tma": cu.LAST_LAUNCH.get("TMA"),
                    **{k: u.get(k) for k in ("us", "bit_equal", "bit_equal_k1_path", "max_diff", "error")},
                    "gflop": r["gflop"]}
            if u.get("us"):
                cell["tflops"] = r["gflop"] / u["us"] * 1e-3
            res["cells"].append(cell)
            print(C, cfg, "ws" if ws else "-", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in cell.items()
                                                if k in ("us", "tflops", "bit_equal", "ran_ws", "error")}, flush=True)
            d = os.environ.get("OUT", ".")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "unit-ws.json"), "w") as f:
                json.dump(res, f, indent=1, default=str)
    os.environ.pop("SHOAL_UNIT_WS", None)


if __name__ == "__main__":
    main()
