"""The bf16 decode attention's tiles read by pointer gather against tensor-descriptor boxes.

    OUT=DIR python benchmarks/scripts/attention_tma_probe.py [PAGE_SIZE]

S2-Pro heads (32 query / 8 KV heads, head_dim 128), bf16 cache in pages of PAGE_SIZE tokens
(default 64, the engine's), uniform context lengths, random page order. For each batch x
context cell: the gather kernel (``tma=False``, ``block_n`` = the page size, the engine's
launch) and the descriptor kernel (``tma=True``) at a few warps / stages, each timed as a CUDA
graph of calls over enough layers to defeat L2 (``shoal.bench.kernels_attention``'s helpers),
and whether each descriptor launch's output equals the gather's bit for bit at the same warps
and stages (with NaN in every slot past the contexts). Writes ``$OUT/attention-tma.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from shoal.bench.kernels_attention import D, H, H_KV, _n_layers, make_pool, time_graph
from shoal.kernels import paged_attention as pa


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bs = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    scale = 1.0 / math.sqrt(D)
    res = {"gpu": torch.cuda.get_device_name(), "page_size": bs, "cells": []}
    variants = [("gather", False, 4, 2), ("tma", True, 4, 2), ("tma", True, 4, 3), ("tma", True, 4, 4),
                ("tma", True, 8, 2), ("tma", True, 8, 3), ("gather", False, 4, 3)]
    for B, ctx in ((1, 700), (16, 700), (64, 512), (64, 700), (64, 1024), (128, 700), (64, 4096)):
        kv_bytes = 2 * B * ctx * H_KV * D * 2
        n_layers = _n_layers(kv_bytes)
        k, v, tables = make_pool(B, ctx, bs, n_layers, dev)
        q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
        # ragged lengths (the last page part-filled) with NaN past each context: bit checks
        lens = torch.randint(max(1, ctx // 2), ctx + 1, (B,), device=dev, dtype=torch.int32)
        kp, vp = k.clone(), v.clone()
        pos = torch.arange(tables[0].shape[1] * bs, device=dev)
        past = pos[None, :] >= lens[:, None]
        pages = tables[0].long()[:, pos // bs][past]
        slots = (pos % bs).expand(B, -1)[past]
        kp[pages, slots] = float("nan")
        vp[pages, slots] = float("nan")
        cl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        cell = {"B": B, "context": ctx, "n_layers": n_layers, "variants": []}
        ref = pa.paged_decode_attention_ref(q, kp, vp, tables[0], lens, scale)
        for name, tma, warps, stages in variants:
            kw = dict(block_n=bs, num_warps=warps, num_stages=stages, tma=tma)
            rec = {"name": name, "num_warps": warps, "num_stages": stages}
            try:
                o = pa.paged_decode_attention_triton(q, kp, vp, tables[0], lens, scale, **kw)
                g = pa.paged_decode_attention_triton(q, kp, vp, tables[0], lens, scale, block_n=bs, num_warps=warps,
                                                     num_stages=stages, tma=False)
                rec["bits_equal_gather"] = bool(torch.equal(o, g))
                rec["err_ref"] = float((o.float() - ref.float()).abs().max())
                outs = [torch.empty_like(q) for _ in range(n_layers)]

                def fn(kw=kw, outs=outs):
                    for i in range(n_layers):
                        pa.paged_decode_attention_triton(q, k, v, tables[i], cl, scale, out=outs[i], **kw)

                t = time_graph(fn, 50) / n_layers
                rec.update(us=round(t, 2), TBps=round(kv_bytes / (t * 1e-6) / 1e12, 3))
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            cell["variants"].append(rec)
            print(B, ctx, rec, flush=True)
        res["cells"].append(cell)
        del k, v, kp, vp, tables
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "attention-tma.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
