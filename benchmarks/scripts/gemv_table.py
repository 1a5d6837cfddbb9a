"""Tune the dense GEMM's KIND "gemv" at one token and write a table override (one-off, H200
2026-12-03): for each S2-Pro projection and head, time the packaged M = 1 config and a grid of
GEMV configs through ``dense.dense_gemm_triton`` (cold weights: 8 rotating copies; CUDA-graph
replay with PDL launches; medians; each candidate checked against the fp32 reference first),
and write the packaged table with the M = 1 bucket replaced wherever a GEMV config is >= 3%
faster to ``$OUT/dense_tuned.json`` (and ``$TABLE`` if set), for ``SHOAL_DENSE_TUNED``.

    OUT=DIR TABLE=/tmp/t.json PYTHONPATH=. python benchmarks/scripts/gemv_table.py
"""
import copy
import json
import os
import time
from pathlib import Path

import torch
from shoal.bench.kernels_fp8 import time_graph
from shoal.bench.tune_step import gemv_candidates as candidates
from shoal.kernels import dense

SHAPES = {"wqkv": (6144, 2560), "wo": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728),
          "semantic_head": (4097, 2560), "fast_head": (1024, 2560)}


def main():
    doc = json.loads(Path(dense.__file__).with_name("dense_tuned.json").read_text())
    new = copy.deepcopy(doc)
    res = {"date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("SHOAL_COMMIT"),
           "gpu": torch.cuda.get_device_name(), "shapes": {}}
    for name, (N, K) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(N + K)
        ws = [(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16() for _ in range(8)]
        x = torch.randn(1, K, device="cuda", generator=g).bfloat16()
        outs = [torch.empty(1, N, dtype=torch.bfloat16, device="cuda") for _ in ws]
        ref = dense.dense_gemm_ref(x, ws[0])
        scale = ref.float().abs().max().item()
        packaged = time_graph([lambda i=i: dense.dense_linear(x, ws[i]) for i in range(8)], 30)
        row = {"N": N, "K": K, "packaged_us": packaged, "packaged_config": dense.dense_config(1, N, K), "candidates": []}
        for cfg in candidates(N, K):
            entry = dict(cfg)
            try:
                err = (dense.dense_gemm_triton(x, ws[0], config=cfg).float() - ref.float()).abs().max().item() / scale
                entry["rel_err"] = err
                if err <= 2.0 ** -7:
                    entry["us"] = time_graph([lambda i=i: dense.dense_gemm_triton(x, ws[i], out=outs[i], config=cfg)
                                              for i in range(8)], 30)
            except Exception as e:  # noqa: BLE001 -- recorded, not fatal
                entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row["candidates"].append(entry)
        timed = [c for c in row["candidates"] if "us" in c]
        best = min(timed, key=lambda c: c["us"]) if timed else None
        row["best"] = best
        res["shapes"][name] = row
        key = f"{N},{K}"
        took = best is not None and best["us"] < 0.97 * packaged and key in new["configs"]
        if took:
            new["configs"][key]["1"] = {k: best[k] for k in ("KIND", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps",
                                                            "num_stages")}
        print(f"{name:14s} packaged {packaged:6.2f} us  gemv best "
              + (f"{best['us']:6.2f} us ({N * K * 2 / best['us'] / 1e6:.2f} TB/s) bn{best['BLOCK_N']} bk{best['BLOCK_K']} "
                 f"s{best['SPLIT_K']} st{best['num_stages']}" if best else "-")
              + ("  -> table" if took else ""), flush=True)
    new["note"] = (doc.get("note", "") + " | M = 1 GEMV entries from benchmarks/scripts/gemv_table.py "
                   + time.strftime("%Y-%m-%d")).strip(" |")
    new["commit"] = os.environ.get("SHOAL_COMMIT", new.get("commit"))
    for path in filter(None, (os.environ.get("OUT") and os.path.join(os.environ["OUT"], "dense_tuned.json"),
                              os.environ.get("TABLE"))):
        Path(path).write_text(json.dumps(new, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gemv_table.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
