"""cuBLAS's block-scaled FP8 GEMM (``torch._scaled_mm`` with 1x128 activation scales and
128x128 weight scales: sm_90, cuBLASLt >= 12.9) against our Triton FP8 GEMM and bf16 cuBLAS, at
the S2-Pro projections and prefill-sized M (a prefill chunk is up to 1,024 tokens):

    python benchmarks/scripts/scaled_mm_block_probe.py [M,M,...]

The layouts cuBLAS takes are ``shoal.kernels.fp8_cublas``'s (see its docstring). Each cell checks the result against
``fp8.fp8_gemm_ref`` and times CUDA-graph replays (medians; weight copies rotated). Writes JSON
to $OUT (or ./out).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from shoal.bench.kernels_fp8 import time_graph
from shoal.kernels import fp8, fp8_cublas

SHAPES = {"wqkv": (6144, 2560), "wo": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}


def main(argv):
    ms = [int(v) for v in argv[0].split(",")] if argv else [64, 128, 256, 512, 1024, 2048]
    dev = "cuda"
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} cuBLASLt "
          f"{torch._C._cuda_getCompiledVersion() if hasattr(torch._C, '_cuda_getCompiledVersion') else '?'}",
          flush=True)
    rows = []
    for name, (N, K) in SHAPES.items():
        torch.manual_seed(0)
        w = (torch.randn(N, K, device=dev) * K ** -0.5).bfloat16()
        Wq, Ws = fp8.quantize_weight_ref(w)
        copies = [(Wq.clone(), Ws.clone(), w.clone()) for _ in range(4)]
        for M in ms:
            x = torch.randn(M, K, device=dev).bfloat16()
            xq, xs = fp8.quantize_act(x)
            ref = fp8.fp8_gemm_ref(xq, xs, Wq, Ws).float()
            cell = {"shape": name, "N": N, "K": K, "M": M}
            scale = ref.abs().max().item()
            # "ours": the Triton kernel with the launch config the dispatcher picks for this M,
            # passed explicitly (without it, M >= 256 would go to cuBLAS)
            cfg = fp8._gemm_config(M, N, K, fp8._device_sms(xq))
            ours = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config=cfg).float()
            cell["ours_rel"] = (ours - ref).abs().max().item() / scale
            t = {}
            try:
                y = fp8_cublas.gemm(xq, xs, Wq, Ws).float()
                cell["cublas_rel"] = (y - ref).abs().max().item() / scale
                xs_col = xs.t().contiguous().t()  # the GEMM alone: scales already in cuBLAS's layout
                t["cublas_block"] = time_graph(
                    [lambda c=c: fp8_cublas.gemm_col_scales(xq, xs_col, c[0], c[1]) for c in copies], 20)
                # what an FP8 Linear costs this way: quantize, transpose the scales, GEMM
                t["cublas_block_linear"] = time_graph(
                    [lambda c=c: fp8_cublas.gemm(*fp8.quantize_act(x), c[0], c[1]) for c in copies], 20)
            except Exception as e:  # noqa: BLE001
                cell["cublas_error"] = f"{type(e).__name__}: {e}"[:400]
            t["ours"] = time_graph([lambda c=c: fp8.fp8_gemm_triton(xq, xs, c[0], c[1], config=cfg) for c in copies], 20)
            t["ours_linear"] = time_graph(
                [lambda c=c: fp8.fp8_linear_triton(x, c[0], c[1], config=cfg) for c in copies], 20)
            t["bf16"] = time_graph([lambda c=c: F.linear(x, c[2]) for c in copies], 20)
            cell["us"] = t
            cell["tflops"] = {k: 2 * M * N * K / (v * 1e-6) / 1e12 for k, v in t.items()}
            rows.append(cell)
            f = lambda k: f"{t[k]:8.1f}" if k in t else "       -"  # noqa: E731
            print(f"{name:8s} M={M:5d}  bf16 {f('bf16')}  ours {f('ours')} / lin {f('ours_linear')}  "
                  f"cublas-block {f('cublas_block')} / lin {f('cublas_block_linear')} us   "
                  f"rel ours {cell['ours_rel']:.2e} cublas {cell.get('cublas_rel', float('nan')):.2e}"
                  + (f"  ERR {cell['cublas_error'][:160]}" if "cublas_error" in cell else ""), flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaled-mm-block-probe.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
