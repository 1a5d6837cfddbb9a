"""What bounds the codec's 96- and 192-channel kernels: one launch of each at a 64 x 32-frame
call's size, for Nsight Compute.

The residual-unit kernels reach ~270-350 TFLOP/s and the 96-channel k=7 conv ~470 (H100), far
under the tensor cores' peak. A count of the bytes they pull through L2 suggests why: the
192-channel unit's programs cover 64 positions each and each reads the unit's whole packed
weight (7 x 192 x 192 + 192 x 192 values, ~590 KB), about 19 GB of L2 reads per unit call against
~6 GB of activations. This script lets the profiler say whether L2, the tensor pipes, latency
or occupancy bound them before any kernel is rewritten.

    ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
        --metrics lts__t_bytes.sum,dram__bytes.sum --csv --page details --log-file ncu.csv \
        python benchmarks/scripts/ncu_codec_units.py
    python benchmarks/scripts/ncu_codec_units.py --summarize ncu.csv

Without ``--summarize`` it warms every kernel up (compiles, autotunes nothing: the shipped
tiles), then launches each once between cudaProfilerStart / Stop, in the order printed.
"""
from __future__ import annotations

import csv
import sys
from collections import defaultdict

# frames -> positions per stream at each decoder level (hop 2048 = 4 (quantizer upsample) x
# 8 x 8 x 4 x 2): 96 channels run at the full rate, 192 at half, 384 at an eighth
FRAMES, BATCH = 32, 64
POSITIONS = {96: FRAMES * 2048, 192: FRAMES * 1024, 384: FRAMES * 256}

KEEP = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "L1/TEX Cache Throughput",
        "L2 Cache Throughput", "DRAM Throughput", "L1/TEX Hit Rate", "L2 Hit Rate", "Registers Per Thread",
        "Achieved Occupancy", "Theoretical Occupancy", "Dynamic Shared Memory Per Block", "Grid Size",
        "Executed Ipc Active", "Issue Slots Busy", "lts__t_bytes.sum", "dram__bytes.sum")


def summarize(path: str) -> int:
    rows = defaultdict(dict)
    order: list[str] = []
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # drop ncu's "==PROF==" notes
    for r in csv.DictReader(lines):
        key = f"{r['ID']} {r['Kernel Name'][:60]}"
        if key not in rows:
            order.append(key)
        name = r["Metric Name"]
        if name in KEEP or "Tensor" in name or "Pipe" in name:
            rows[key][name] = f"{r['Metric Value']} {r['Metric Unit']}".strip()
    for key in order:
        print(key)
        for name, val in rows[key].items():
            print(f"    {name}: {val}")
    return 0 if order else 1


def main() -> int:
    import torch

    from shoal.kernels.codec_conv import conv1d_cl_triton, pack_conv_weight
    from shoal.bench.kernels_codec_conv import unit_inputs
    from shoal.kernels.codec_unit import residual_unit_triton

    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    launches = []

    def unit(C: int, d: int = 1):
        x, w7, b7, a2, w1, b1, h, h_new, an, body = unit_inputs(C, BATCH, POSITIONS[C], d, dt, dev)
        return f"unit {C} ch d={d}", lambda: residual_unit_triton(x, w7, b7, d, a2, w1, b1, h, out=h_new,
                                                                  snake_alpha=an, snake_out=body)

    def conv(C: int, d: int = 1):
        k, pad, L = 7, 6 * d, POSITIONS[C]
        x = torch.randn(BATCH, L + pad, C, device=dev, dtype=dt).transpose(1, 2)
        w = pack_conv_weight(torch.randn(C, C, k, device=dev, dtype=dt) / (C * k) ** 0.5)
        b = torch.randn(C, device=dev, dtype=dt)
        out = torch.empty(BATCH, L, C, device=dev, dtype=dt).transpose(1, 2)
        return f"k7 conv {C} ch d={d}", lambda: conv1d_cl_triton(x, w, b, d, out=out)

    for make, args in ((unit, (96,)), (unit, (192,)), (unit, (192, 9)), (conv, (96,)), (conv, (192,)),
                       (conv, (384,))):
        launches.append(make(*args))
    for _, fn in launches:
        fn()
        fn()
    torch.cuda.synchronize()
    for name, _ in launches:
        print("launch:", name, flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    for _, fn in launches:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--summarize":
        sys.exit(summarize(sys.argv[2]))
    sys.exit(main())
