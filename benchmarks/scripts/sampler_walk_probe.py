"""Time the fused S2 samplers with the nucleus walk at one rank and at eight ranks per reduction.

    OUT=DIR python benchmarks/scripts/sampler_walk_probe.py

S2-Pro sizes (4,097 allowed main logits, 1,024 residual entries), bf16, top_k 30 / top_p 0.8 /
temperature 0.8, rows near-flat (``scale`` 0.05: every draw keeps 30 ranks, as random weights
give) or peaked (``scale`` 3). Each sampler call is timed as a CUDA graph of 20 calls (median of
50 replays), at batch 1 and 64, for ``SHOAL_SAMPLER_WALK8`` off and on (patched per run), and
with walk8 at several ``SHOAL_SAMPLER_WARPS`` (warps per row program).
Writes ``$OUT/sampler-walk.json``.
"""

from __future__ import annotations

import json
import os

import torch

from shoal.bench.kernels_attention import time_graph
from shoal.engine.sampling import BatchSampling, SamplingParams
from shoal.kernels import sampling as ks


def main() -> None:
    dev = torch.device("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "cells": []}
    for B in (1, 64):
        S = B
        bs = BatchSampling.from_params([SamplingParams(temperature=0.8, top_p=0.8, top_k=30)] * S,
                                       list(range(S)), dev)
        slots = torch.arange(S, device=dev)
        frame = torch.zeros(S, dtype=torch.long, device=dev)
        window = torch.full((S, 16), -1, dtype=torch.long, device=dev)
        allowed = torch.arange(4097, device=dev)
        cols = torch.zeros(B, 11, dtype=torch.long, device=dev)
        idx = torch.zeros(B, dtype=torch.long, device=dev)
        for scale in (0.05, 3.0):
            main_l = (torch.randn(B, 4097, device=dev) * scale).to(torch.bfloat16)
            res_l = (torch.randn(B, 1024, device=dev) * scale).to(torch.bfloat16)
            for on, warps in ((False, ""), (True, ""), (True, "main=16,residual=8"), (True, "main=16,residual=16"),
                              (True, "main=32,residual=32")):
                ks.walk8 = lambda on=on: on
                os.environ["SHOAL_SAMPLER_WARPS"] = warps

                def f_main():
                    for _ in range(20):
                        ks.s2_main_sample(main_l, slots, frame, bs, window, allowed, 4096, cols, idx)

                def f_res():
                    for _ in range(20):
                        ks.s2_residual_sample(res_l, slots, frame, bs, 2, cols, 2)

                rec = {"B": B, "scale": scale, "walk8": on, "warps": warps,
                       "main_us": round(time_graph(f_main, 50) / 20, 2), "residual_us": round(time_graph(f_res, 50) / 20, 2)}
                res["cells"].append(rec)
                print(rec, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "sampler-walk.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
