"""The FP8-cache decode attention (the e4m3-operand kernel) in its launch variants.

    OUT=DIR python benchmarks/scripts/attention_fp8_variants_probe.py [ROUNDS] [VARIANT ...]

S2-Pro heads (32 query / 8 KV heads, head_dim 128), an FP8 cache in 64-token pages with
token-minor values (the engine's layout), uniform context lengths, random page order. Each
variant is a ``SHOAL_ATTN_FP8_CONFIG`` string (``NAME=config``; ``slots16`` sets
``SHOAL_ATTN_MMA8_SLOTS=16`` instead): ``f16ops`` (one fp16 product each for the scores and
the values instead of the two e4m3 terms), ``joint_max`` / ``lazy_l`` (fewer cross-warp
reductions a tile), ``num_stages``. (On 2026-12-07 a ``pair`` variant, two pages an iteration,
was also timed: slower at batch >= 16, so it was removed.) Every cell is timed as a
CUDA graph over enough layers' caches to defeat L2 (median replay / layers), the variants
interleaved over ROUNDS rounds (default 2); each output is checked against the PyTorch
reference. Writes ``$OUT/attention-fp8-variants.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from shoal.bench.kernels_attention import D, H, H_KV, _n_layers, time_graph
from shoal.kernels import paged_attention as pa
from shoal.kernels.paged_attention_fp8 import token_minor_like
from shoal.quant.kv import quantize_kv

VARIANTS = {
    "base": "",  # the default: fp16 operands; joint maxima, row-kept denominators where split
    "e4m3": "f16ops=0,joint_max=0,lazy_l=0",  # the e4m3 hi / lo operands (the default before 2026-12-07)
    "f16": "joint_max=0,lazy_l=0",
    "f16jl": "joint_max=1,lazy_l=1",
    "s3": "num_stages=3",
    "slots16": "",
}
CELLS = ((64, 700), (64, 1024), (128, 700), (32, 700), (16, 700), (1, 1024), (1, 300))


def _set(name: str) -> None:
    os.environ["SHOAL_ATTN_FP8_CONFIG"] = VARIANTS[name]
    if name == "slots16":
        os.environ["SHOAL_ATTN_MMA8_SLOTS"] = "16"
    else:
        os.environ.pop("SHOAL_ATTN_MMA8_SLOTS", None)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    names = sys.argv[2:] or list(VARIANTS)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bs = 64
    scale = 1.0 / math.sqrt(D)
    res = {"gpu": torch.cuda.get_device_name(), "cells": []}
    for B, ctx in CELLS:
        pages = -(-ctx // bs)
        kv_bytes = 2 * B * ctx * H_KV * D
        n_layers = max(_n_layers(kv_bytes), 16)
        nb = B * pages * n_layers
        k8, ks = quantize_kv(torch.randn(nb, bs, H_KV, D, device=dev) * 2)
        v8s, vs = quantize_kv(torch.randn(nb, bs, H_KV, D, device=dev))
        v8 = token_minor_like(v8s.shape, dev)
        v8.copy_(v8s)
        del v8s
        perm = torch.randperm(nb, device=dev).to(torch.int32)
        tables = [perm[i * B * pages:(i + 1) * B * pages].view(B, pages).contiguous() for i in range(n_layers)]
        q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
        cl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        ref = pa.paged_decode_attention_ref(q.float(), k8, v8, tables[0], cl, scale, k_scale=ks, v_scale=vs)
        times: dict = {n: [] for n in names}
        errs = {}
        for r in range(rounds):
            for name in names:
                _set(name)
                outs = [torch.empty_like(q) for _ in range(n_layers)]

                def fn(outs=outs):
                    for i in range(n_layers):
                        pa.paged_decode_attention_triton(q, k8, v8, tables[i], cl, scale, out=outs[i],
                                                         k_scale=ks, v_scale=vs)

                try:
                    o = pa.paged_decode_attention_triton(q, k8, v8, tables[0], cl, scale, k_scale=ks, v_scale=vs)
                    errs[name] = float(((o.float() - ref.float()).norm() / ref.float().norm()))
                    times[name].append(time_graph(fn, 40) / n_layers)
                except Exception as e:  # noqa: BLE001 - record and go on
                    errs[name] = f"{type(e).__name__}: {str(e)[:200]}"
        base = min(times.get("base") or [float("nan")])
        for name in names:
            t = times[name]
            rec = {"B": B, "context": ctx, "variant": name, "config": VARIANTS[name],
                   "us": [round(x, 2) for x in t], "best_us": round(min(t), 2) if t else None,
                   "vs_base": round(base / min(t), 3) if t else None, "rel_err": errs.get(name),
                   "tb_s": round(2 * B * ctx * H_KV * (D + 4) / (min(t) * 1e-6) / 1e12, 2) if t else None}
            res["cells"].append(rec)
            print(rec, flush=True)
        del k8, v8, ks, vs, tables
        torch.cuda.empty_cache()
    _set("base")
    with open(os.path.join(os.environ.get("OUT", "."), "attention-fp8-variants.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
