"""The decode attention at one or a few sequences: how many context splits, and which reduce.

    OUT=DIR python benchmarks/scripts/attention_splits_probe.py

S2-Pro heads, bf16 cache in 64-token pages, block tables as wide as the engine's at S2-Pro's
32,768-token context (512 pages; the split heuristic sizes splits by that width, so at a short
context most splits are empty). For batch 1 and 4 at contexts 300, 700 and 1,500: the heuristic's
split count and fixed counts, with the reduce kernel and with the splits merged by their last
program (``fused_reduce``), each timed as a CUDA graph over enough layers to defeat L2.
Writes ``$OUT/attention-splits.json``.
"""

from __future__ import annotations

import json
import math
import os

import torch

from shoal.bench.kernels_attention import D, H, H_KV, _n_layers, time_graph
from shoal.kernels import paged_attention as pa


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bs, width = 64, 512
    scale = 1.0 / math.sqrt(D)
    res = {"gpu": torch.cuda.get_device_name(), "cells": []}
    for B in (1, 4):
        for ctx in (300, 700, 1500):
            pages = -(-ctx // bs)
            kv_bytes = 2 * B * ctx * H_KV * D * 2
            n_layers = max(_n_layers(kv_bytes), 16)
            nb = B * pages * n_layers
            k = torch.randn(nb, bs, H_KV, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            perm = torch.randperm(nb, device=dev).to(torch.int32)
            tables = []
            for i in range(n_layers):
                t = torch.full((B, width), -1, dtype=torch.int32, device=dev)
                t[:, :pages] = perm[i * B * pages:(i + 1) * B * pages].view(B, pages)
                tables.append(t)
            q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
            cl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
            default = pa.choose_num_splits(B, H_KV, width * bs, 64, torch.cuda.get_device_properties(dev).multi_processor_count)
            ref = pa.paged_decode_attention_ref(q, k, v, tables[0], cl, scale)
            for splits in sorted({default, 32, 16, 8, 4, 2, 1}, reverse=True):
                for fused in ((False, True) if splits > 1 else (False,)):
                    outs = [torch.empty_like(q) for _ in range(n_layers)]
                    kw = dict(num_splits=splits, fused_reduce=fused)

                    def fn(kw=kw, outs=outs):
                        for i in range(n_layers):
                            pa.paged_decode_attention_triton(q, k, v, tables[i], cl, scale, out=outs[i], **kw)

                    o = pa.paged_decode_attention_triton(q, k, v, tables[0], cl, scale, **kw)
                    rec = {"B": B, "context": ctx, "splits": splits, "default": splits == default, "fused_reduce": fused,
                           "us": round(time_graph(fn, 50) / n_layers, 2),
                           "err": float((o.float() - ref.float()).abs().max())}
                    res["cells"].append(rec)
                    print(rec, flush=True)
            del k, v, tables
            torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "attention-splits.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
