"""Fused S2 sampling kernels vs the PyTorch sampler at S2-Pro sizes (H200 numbers in
docs/benchmarks.md): microseconds per call under CUDA-graph replay, main token (4,097 allowed
logits, two draws + RAS) and one residual codebook (1,024 logits), bf16.

    python -m shoal.bench.kernels_sampling --batch 1,16,64,128 --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..engine.sampling import BatchSampling, SamplingParams, residual_code, s2_main_token
from ..kernels.sampling import s2_main_sample, s2_residual_sample


def _graph_us(fn, iters: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def bench(B: int, A: int = 4097, n: int = 1024, temperature: float = 0.8, top_p: float = 0.8,
          top_k: int = 30) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(B)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    bs = BatchSampling.from_params([params] * B, list(range(B)), dev)
    slots = torch.arange(B, device=dev)
    frame = torch.zeros(B, dtype=torch.long, device=dev)
    window = torch.full((B, 16), -1, dtype=torch.long, device=dev)
    logits = (torch.randn(B, A, generator=g, device=dev) * 3).bfloat16()
    fl = (torch.randn(B, n, generator=g, device=dev) * 3).bfloat16()
    allowed = torch.arange(A, device=dev)
    emb = torch.randn(4096, 2560, device=dev).bfloat16()
    e = torch.empty(B, 2560, dtype=torch.bfloat16, device=dev)
    cols = torch.zeros(B, 11, dtype=torch.long, device=dev)
    idx = torch.zeros(B, dtype=torch.long, device=dev)
    q = torch.ones(B, n, device=dev)
    return {
        "batch": B,
        "main_fused_us": _graph_us(lambda: s2_main_sample(logits, slots, frame, bs, window, allowed, 4096, cols,
                                                          idx, emb, e)),
        "main_torch_us": _graph_us(lambda: s2_main_token(logits, bs, frame, window, 4096)),
        "residual_fused_us": _graph_us(lambda: s2_residual_sample(fl, slots, frame, bs, 2, cols, 2, emb, e)),
        "residual_torch_us": _graph_us(lambda: residual_code(fl, bs, frame, 1, "s2", None, q)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,16,64,128")
    p.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for B in [int(b) for b in args.batch.split(",")]:
        r = bench(B)
        rows.append(r)
        print(f"B={B:4d}  main fused {r['main_fused_us']:7.1f} us  torch {r['main_torch_us']:7.1f} us   "
              f"residual fused {r['residual_fused_us']:6.1f} us  torch {r['residual_torch_us']:6.1f} us", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_sampling.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                          indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
