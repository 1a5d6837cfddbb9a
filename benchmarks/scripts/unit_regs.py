"""Registers and spills of the codec's residual-unit kernel, compiled here (no GPU) for sm_90a.

    pip install --no-deps --target /tmp/t36 triton==3.6.0      # the GPU machine's Triton
    PYTHONPATH=/tmp/t36:$PWD python benchmarks/scripts/unit_regs.py C CONFIG [CONFIG ...]

``triton.compile`` of ``shoal.kernels.codec_unit._unit_kernel`` for ``GPUTarget("cuda", 90, 32)``
with the serving launch's specialisations (bf16, K = 7, dilation 3, the SFU sine, 16-byte aligned
pointers, strides divisible by 16, the channel stride 1), then the ``ptxas -v`` report of the
Triton's own ptxas. A CONFIG is ``BT,BN,BC,WARPS,STAGES,TMA,FLAT,BN2`` with optional ``:trans``,
``:vtma``, ``:early``, ``:regsN`` suffixes (the k=1 conv transposed, the k=1 weight through
descriptors, the second tile's k=1 products early, Triton's ``maxnreg=N`` cap). Prints ``(registers, spill store bytes, spill load bytes,
shared memory bytes)`` per config. Use the Triton the GPU machine runs: a newer one allocates
registers differently (Triton 3.9 reported ~2-3 KB of spills per thread for the 192-channel
shipped tile where 3.6 reports 88 bytes, and none with ``:vtma``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as tcompile

from shoal.kernels import codec_unit as cu

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_unit(C: int, spec: str) -> tuple[int, int, int, int]:
    cfg, *flags = spec.split(":")
    bt, bn, bc, warps, stages, tma, flat, bn2 = (int(v) for v in cfg.split(","))
    trans, vtma, early = "trans" in flags, "vtma" in flags, "early" in flags
    maxnreg = next((int(f[4:]) for f in flags if f.startswith("regs")), None)
    fn = cu._kernel()
    desc = lambda r, c: f"tensordesc<bf16[{r}, {c}]>"  # noqa: E731
    vshape = {"va_ptr": (bn, bn), "vb_ptr": (bn2, bn), "vc_ptr": (bn, bn2), "vd_ptr": (bn2, bn2)}
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n == "x_ptr":
            sig[n] = desc(bt, bc) if tma else "*bf16"
        elif n == "w_ptr":
            sig[n] = desc(bc, bn) if tma else "*bf16"
        elif n == "w2_ptr":
            sig[n] = desc(bc, bn2) if tma else "*bf16"
        elif n in vshape:
            sig[n] = desc(*vshape[n]) if (vtma and tma) else "*bf16"
        elif n.endswith("_ptr"):
            sig[n] = "*bf16"
        elif n in ("L_out", "n_tb", "x_rows", "C"):
            sig[n] = "i32"
        elif len(n) == 3 and n[0] == "s":  # strides: the channel stride is 1, the rest % 16
            sig[n] = "constexpr" if n[2] == "c" else "i64"
        else:
            sig[n] = "constexpr"
        if sig[n] in ("*bf16", "i64") or n == "C":
            attrs[(i,)] = [["tt.divisibility", 16]]
    consts = {n: 1 for n in fn.arg_names if len(n) == 3 and n[0] == "s" and n[2] == "c"}
    consts.update(K=7, DIL=3, WRITE_O=True, SNAKE=True, ACCURATE_SIN=2, BT=bt, BN=bn, BC=bc, BN2=bn2,
                  DT=cu._DT_CODE[torch.bfloat16], IEEE=False, UPCAST=False, FLAT=bool(flat), TMA=bool(tma),
                  K1_TRANS=trans, V_TMA=vtma and bool(tma), K1_EARLY=early and not trans)
    k = tcompile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                 options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False,
                          **({"maxnreg": maxnreg} if maxnreg else {})})
    if os.environ.get("UNIT_REGS_PTX"):  # keep the PTX for reading (setmaxnreg, barriers)
        with open(os.environ["UNIT_REGS_PTX"] + f".{C}.{spec.replace(',', '_').replace(':', '-')}.ptx", "w") as f:
            f.write(k.asm["ptx"])
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    rep = r.stderr + r.stdout
    if r.returncode:
        raise RuntimeError(rep[-400:])
    regs = re.search(r"Used (\d+) registers", rep)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", rep)
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2)), int(k.metadata.shared)


def main() -> None:
    C = int(sys.argv[1])
    print("triton", triton.__version__)
    for spec in sys.argv[2:]:
        try:
            print(C, spec, compile_unit(C, spec), flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(C, spec, "failed:", type(e).__name__, str(e)[:400], flush=True)


if __name__ == "__main__":
    main()
