"""Weight-layout probe (one-off, H200): do decode GEMMs stream weights faster when every
(BLOCK_N x BLOCK_K) weight tile is one contiguous block of memory instead of BLOCK_N rows of a
row-major matrix?

1. Pure reads: a kernel that only loads (TMA) and sums the weight tiles in the GEMM's order,
   row-major vs tile-blocked, bf16 (BLOCK_K = 128 elements = 256 B per row) and 1-byte (fp8-sized,
   128 B per row), cold copies (rotated, larger than L2), CUDA-graph replay.
2. The bf16 decode GEMM (``shoal.kernels.dense._dense_tma_kernel``) with ``W_KBT`` (blocked) vs
   the row-major weight, same launch config, M = 1 and 64.

    OUT=DIR PYTHONPATH=. python benchmarks/scripts/layout_probe.py
"""
import json
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from shoal.bench.kernels_fp8 import time_graph
from shoal.kernels import dense, fp8


@triton.jit
def _read_tiles(w_desc, out_ptr, kb_per_prog, BN: tl.constexpr, BK: tl.constexpr, KBT: tl.constexpr,
                BLOCKED: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for kb in range(pid_k * kb_per_prog, tl.minimum((pid_k + 1) * kb_per_prog, KBT)):
        if BLOCKED:
            t = w_desc.load([(pid_n * KBT + kb) * BN, 0])
        else:
            t = w_desc.load([pid_n * BN, kb * BK])
        acc += t.to(tl.float32)
    tl.store(out_ptr + pid_n * tl.num_programs(1) + pid_k, tl.sum(tl.sum(acc, 1), 0))


def blocked(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """[N, K] -> [N/bn * K/bk * bn, bk]: tile (n, k) is rows ((n * K/bk + k) * bn ...) ."""
    N, K = w.shape
    return w.view(N // bn, bn, K // bk, bk).permute(0, 2, 1, 3).contiguous().view(-1, bk)


SHAPES = {"wqkv": (6144, 2560), "wo": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
COPIES = 8


def read_probe(res):
    for dt, esize in ((torch.bfloat16, 2), (torch.uint8, 1)):
        for name, (N, K) in SHAPES.items():
            base = torch.randint(0, 100, (N, K), device="cuda").to(dt)
            for bn in (64, 128):
                bk = 128
                kbt = K // bk
                tiles = N // bn
                for split in sorted({1, max(1, 132 // tiles), max(1, 264 // tiles)}):
                    per = triton.cdiv(kbt, split)
                    for lay in ("rowmajor", "blocked"):
                        ws = [base.clone() if lay == "rowmajor" else blocked(base, bn, bk) for _ in range(COPIES)]
                        descs = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws]
                        out = torch.empty(tiles * split, device="cuda")
                        fns = [lambda d=d: _read_tiles[(tiles, split)](d, out, per, BN=bn, BK=bk, KBT=kbt,
                                                                      BLOCKED=lay == "blocked", num_warps=4,
                                                                      num_stages=4) for d in descs]
                        us = time_graph(fns, 20)
                        key = f"read {'bf16' if esize == 2 else 'u8'} {name} {bn}x{bk} split{split} {lay}"
                        res[key] = {"us": us, "tbps": N * K * esize / us / 1e6}
                        print(f"{key:52s} {us:7.2f} us {res[key]['tbps']:.2f} TB/s", flush=True)
                        del ws, descs


def gemm(x, w, cfg, w_kbt, out, counters):
    M, K = x.shape
    N = out.shape[1]
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w, [bn, bk])
    work = torch.empty(split, M, N, dtype=torch.float32, device="cuda") if split > 1 else x
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), split)
    dense._dense_tma_kernel[grid](xd, wd, out, work, counters if split > 1 else out, M, N, out.stride(0),
                                  cfg["k_per_split"], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                                  FUSED_REDUCE=split > 1, UPCAST_DOT=False, W_KBT=w_kbt,
                                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def gemm_probe(res):
    counters = fp8._tile_counters(torch.device("cuda"), 4096)
    for name, (N, K) in SHAPES.items():
        base = (torch.randn(N, K, device="cuda") * K ** -0.5).bfloat16()
        for M in (1, 64):
            x = torch.randn(M, K, device="cuda").bfloat16()
            ref = dense.dense_gemm_ref(x, base).float()
            bm = 16 if M == 1 else 64
            table = dense.dense_config(M, N, K)
            cfgs = [] if table is None else [dict(table, TMA=True)]
            for bn, bk, sk, ns in ((64, 128, 1, 4), (64, 128, 2, 4), (128, 128, 1, 4), (128, 128, 2, 3),
                                   (64, 128, 4, 4), (128, 64, 4, 5)):
                cfgs.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": 4,
                             "num_stages": ns})
            for c in cfgs:
                c = dense.finish_config(c, K)
                if N % c["BLOCK_N"] or K % c["k_per_split"]:
                    continue
                row = {}
                for lay in ("rowmajor", "blocked"):
                    ws = [base.clone() if lay == "rowmajor" else blocked(base, c["BLOCK_N"], c["BLOCK_K"])
                          for _ in range(COPIES)]
                    outs = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in ws]
                    kbt = K // c["BLOCK_K"] if lay == "blocked" else 0
                    gemm(x, ws[0], c, kbt, outs[0], counters)
                    err = ((outs[0].float() - ref).abs().max() / ref.abs().max()).item()
                    us = time_graph([lambda i=i, ws=ws, outs=outs: gemm(x, ws[i], c, kbt, outs[i], counters)
                                     for i in range(COPIES)], 20)
                    row[lay] = {"us": us, "tbps": N * K * 2 / us / 1e6, "rel_err": err}
                    del ws, outs
                key = (f"gemm {name} M={M} {c['BLOCK_N']}x{c['BLOCK_M']}x{c['BLOCK_K']} sk{c['SPLIT_K']} "
                       f"s{c['num_stages']}")
                res[key] = row
                print(f"{key:44s} rowmajor {row['rowmajor']['us']:6.2f} us  blocked {row['blocked']['us']:6.2f} us "
                      f"({row['rowmajor']['us'] / row['blocked']['us']:.3f}x; err {row['blocked']['rel_err']:.1e})",
                      flush=True)


if __name__ == "__main__":
    res = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("SHOAL_COMMIT")}
    read_probe(res)
    gemm_probe(res)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "layout_probe.json"), "w") as fh:
        json.dump(res, fh, indent=1)
