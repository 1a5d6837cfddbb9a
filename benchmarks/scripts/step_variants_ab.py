"""A/B of variants of the decode step, by CUDA-graph replay at S2-Pro shapes (random
weights, 64 sequences at a 700-token context), interleaved rounds in one process:

    [AB_DENSE_TABLE=DIR] python benchmarks/scripts/step_variants_ab.py [bf16|fp8] [ROUNDS] [VARIANT ...]

A variant is a set of environment variables read when kernels are configured (``SHOAL_PDL``,
``SHOAL_FP8_PARTIALS``, ``SHOAL_FP8_ATTN_QUANT``, ``SHOAL_ATTN_FP8_CONFIG``, ``SHOAL_DENSE_TUNED``; add others to ``VARIANTS``). For each one the step is re-captured for
batches 1 and 64 and timed by ``shoal.bench.tune_step.StepTimer`` (from the same saved slot
state every time; the pages the timed steps write are allocated first), so each variant does the
same work. The last step of a measurement must give the same codes in every variant of
``SAME_BITS`` (launch modes do not change the arithmetic); the script exits non-zero if it
does not. Another GEMM table may change the last bits, so its codes are not compared.
Prints ms per step and writes JSON to $OUT (or ./out).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from shoal.bench.random_model import S2_IM_END, random_dualar, random_prompt, s2_pro_config
from shoal.bench.tune_step import StepTimer, _short
from shoal.engine.engine import Engine, EngineConfig
from shoal.engine.request import EngineRequest, GridSession
from shoal.engine.sampling import SamplingParams
from shoal.kernels import dense, fp8_fused
from shoal.kernels import paged_attention as pa

VARIANTS = {
    "base": {},
    "nopdl": {"SHOAL_PDL": "0"},
    # FP8: the split-K GEMMs reduce their own partials (the consumers read bf16)
    "fp8_reduced": {"SHOAL_FP8_PARTIALS": "0"},
    # FP8: the fast positions' attention kernel writes wo's quantized input (no quantize launch)
    "fp8_attn_quant": {"SHOAL_FP8_ATTN_QUANT": "1"},
    # FP8 KV cache: twice the heuristic's context splits in the decode attention
    "fp8kv_split2": {"SHOAL_ATTN_FP8_CONFIG": "split_mult=2"},
    # FP8 KV cache: the attention's e4m3 hi / lo operands and per-tile reductions (the default
    # before 2026-12-07; benchmarks/scripts/attention_fp8_variants_probe.py)
    "kv_e4m3": {"SHOAL_ATTN_FP8_CONFIG": "f16ops=0,joint_max=0,lazy_l=0"},
    # ... fp16 operands with the joint maxima and row-kept denominators at every batch
    "kv_f16jl": {"SHOAL_ATTN_FP8_CONFIG": "joint_max=1,lazy_l=1"},
    # another bf16 GEMM table (a directory holding dense_tuned.json), e.g. a tuner's output
    "table": {"SHOAL_DENSE_TUNED": os.environ.get("AB_DENSE_TABLE", "")},
}
SAME_BITS = {"base", "nopdl", "fp8_reduced", "fp8_attn_quant"}  # (split counts change the attention's last bits)
KEYS = sorted({k for v in VARIANTS.values() for k in v})


def apply(env: dict) -> None:
    for k in KEYS:
        os.environ.pop(k, None)
    os.environ.update(env)
    pa.pdl_enabled.cache_clear()
    fp8_fused.consumer_partials.cache_clear()
    fp8_fused.attn_quant.cache_clear()
    dense.set_dense_table(None)  # re-reads $SHOAL_DENSE_TUNED; clears the config caches


def print_launches(cfg) -> None:
    """The bf16 GEMM launches the table in force gives the batch-1 step's layers."""
    d = cfg.slow
    on_table = torch.cuda.get_device_properties(0).multi_processor_count == dense.table_sms()
    for label, n, k in (("wqkv", (d.n_head + 2 * d.n_local_heads) * d.head_dim, d.dim),
                        ("wo", d.dim, d.n_head * d.head_dim), ("gate_up", 2 * d.intermediate_size, d.dim),
                        ("down", d.dim, d.intermediate_size)):
        c = dense.dense_config(1, n, k) if on_table else None
        print(f"    M=1 {label}: " + (_short(c) if c else "cuBLAS"), flush=True)


def main(argv: list[str]) -> int:
    dtype = argv[0] if argv else "bf16"
    rounds = int(argv[1]) if len(argv) > 1 else 3
    names = argv[2:] or [n for n in VARIANTS if n != "table" or os.environ.get("AB_DENSE_TABLE")]
    if "table" in names:
        table_dir = os.environ.get("AB_DENSE_TABLE", "")
        if dtype != "bf16":
            raise SystemExit("the table variant changes bf16 GEMMs only; FP8 weights never read it")
        if not (Path(table_dir) / "dense_tuned.json").is_file() and not Path(table_dir).is_file():
            raise SystemExit(f"AB_DENSE_TABLE={table_dir!r}: no dense_tuned.json there")
    dev = torch.device("cuda")
    cfg = s2_pro_config(4096)
    model = random_dualar(cfg, dev, torch.bfloat16, quantization="fp8" if dtype == "fp8" else "none")
    B = 64
    eng = Engine(model, S2_IM_END, config=EngineConfig(
        max_running=B, max_seq_len=4096, num_blocks=B * 64 + 64, prefill_graphs=False,
        kv_cache_dtype="fp8" if dtype == "fp8" else None))
    rng = np.random.default_rng(0)
    for i in range(B):
        eng.add_request(EngineRequest(session=GridSession(random_prompt(cfg, 500, 200, rng)),
                                      params=SamplingParams(temperature=0.8, top_p=0.8, top_k=30), seed=i,
                                      max_new_tokens=10_000, ignore_eos=True))
    while eng.num_running < B or any(r.status.value != "decode" for r in eng.scheduler.running):
        eng.step()
    runner = eng.runner
    reps = 40
    # pages for every position a measurement writes (the engine allocates them step by step)
    for r in eng.scheduler.running:
        eng.pool.append_slots(r.request_id, reps + 8)
        runner.set_block_table(r.slot, eng.pool.block_table(r.request_id))
    runner.slot_ids[:B].copy_(torch.tensor([r.slot for r in eng.scheduler.running], device=dev))
    torch.cuda.synchronize()
    # each measurement re-captures the step for the variant in force, from the same saved state
    timers = {b: StepTimer(eng, b, reps) for b in (1, B)}
    times: dict[str, dict[int, list[float]]] = {n: {1: [], B: []} for n in names}
    first: dict[int, torch.Tensor] = {}
    mismatch = []
    for r in range(rounds):
        for name in names:
            apply(VARIANTS[name])
            if name == "table" and not dense._table():
                raise SystemExit(f"the table variant's file has no configs: {VARIANTS[name]}")
            if r == 0 and dtype == "bf16":
                print(f"{name} ({VARIANTS[name]}):", flush=True)
                print_launches(cfg)
            for b in (1, B):
                times[name][b].append(timers[b].measure())
                cols = runner.out_cols[:b].clone()  # the same step from the same state in every variant
                if name in SAME_BITS:
                    if b not in first:
                        first[b] = cols
                    elif not torch.equal(first[b], cols):
                        mismatch.append((name, b, r))
    apply({})
    print(f"{dtype}: ms per step (median of {reps} graph replays, {rounds} rounds; median [min-max])")
    base = names[0]
    res = {}
    for name in names:
        row = {}
        for b in (1, B):
            v = times[name][b]
            med = float(np.median(v))
            row[b] = {"median_ms": med, "all_ms": v}
            ref = float(np.median(times[base][b]))
            print(f"  {name:22s} batch {b:3d}: {med:7.3f} [{min(v):.3f}-{max(v):.3f}]  "
                  f"{(ref / med - 1) * 100:+5.1f}% vs {base}", flush=True)
        res[name] = {"env": VARIANTS[name], **{str(k): v for k, v in row.items()}}
    if mismatch:
        print(f"MISMATCH: codes differ from the first same-bits variant's in {mismatch}")
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"step-variants-{dtype}.json").write_text(json.dumps({
        "dtype": dtype, "device": torch.cuda.get_device_name(), "rounds": rounds, "reps": reps,
        "variants": res, "mismatch": mismatch}, indent=1))
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
