"""Prefill step micro-benchmark: per-segment SDPA (old) vs the paged varlen kernel, eager and
graph-captured, at S2-Pro shapes (random weights).

    python -m shoal.bench.kernels_prefill --out prefill.json [--quantization fp8] [--sweep]

One engine prefill step of 1,024 tokens made of 4 segments (default ``0:256,0:256,512:256,
1024:256``: two first chunks and two continuation chunks over cached prefixes of 512 and 1,024
positions; ``--segments START:LEN,...`` changes it) is run through the engine's
:class:`~shoal.engine.runner.ModelRunner` as

* ``eager_old``: the previous backend (:class:`~shoal.engine.attention.SegmentedPrefillBackend`,
  per-segment gathers, masks and SDPA in Python),
* ``eager_new``: :class:`~shoal.engine.attention.PagedPrefillBackend`, one Triton kernel per
  layer, run eagerly,
* ``graph``: the same forward replayed from the CUDA graph captured for the 1,024 bucket
  (one pinned host-to-device copy + one replay).

For each it reports, over ``--iters`` steps: ``host_ms`` (wall time of the ``prefill`` call,
i.e. the host's cost to issue the step, with an idle GPU at the start), ``host_cpu_ms`` (process
CPU time in that call), ``latency_ms`` (call to completion, synchronised every step),
``gpu_span_ms`` (CUDA events around the step), ``ms_per_step`` (``--iters`` steps back to back,
then one sync: the steady-state cost when the host only issues prefill steps) and the number of
kernels one eager step launches (profiler). It checks the K/V the three write (every layer, every
token of the step) against each other, times one layer's attention alone (old per-segment path vs
the kernel), and with ``--sweep`` times kernel tile configs (graph-captured, 36 layers' calls).

CUDA only for real numbers; ``--device cpu --shape tiny`` runs the same code on a tiny model as a
smoke test (no graphs; CPU timings mean nothing for the GPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from ..engine.engine import Engine, EngineConfig
from ..kernels import prefill_attention as pf
from .random_model import (
    S2_IM_END,
    random_dualar,
    random_prompt,
    s2_pro_config,
    tiny_config,
)

DEFAULT_SEGMENTS = "0:256,0:256,512:256,1024:256"


def _log(*a) -> None:
    print(*a, flush=True)


def _parse_segments(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        a, b = part.split(":")
        out.append((int(a), int(b)))
    return out


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4) if xs else float("nan")


class Setup:
    """An engine at the requested shape with one prefill step's chunks ready (prefixes cached)."""

    def __init__(self, shape: str, device: str, quantization: str, segments: list[tuple[int, int]],
                 seed: int = 0) -> None:
        self.dev = torch.device(device)
        cuda = self.dev.type == "cuda"
        self.cfg = s2_pro_config(4096) if shape == "s2-pro" else tiny_config(4096)
        dtype = torch.bfloat16 if cuda else torch.float32
        self.model = random_dualar(self.cfg, self.dev, dtype, quantization=None if quantization == "none" else quantization)
        bs = 16
        need = [-(-(s + n) // bs) for s, n in segments]
        self.tokens = sum(n for _, n in segments)
        self.engine = Engine(self.model, S2_IM_END, config=EngineConfig(
            max_running=max(8, len(segments)), max_seq_len=4096, num_blocks=sum(need) + 64,
            prefill_chunk=max(1024, self.tokens), block_size=bs))
        self.runner = r = self.engine.runner
        rng = np.random.default_rng(seed)
        perm = rng.permutation(sum(need) + 64)
        self.chunks, prefixes, p = [], [], 0
        for i, ((start, n), k) in enumerate(zip(segments, need)):
            blocks = [int(b) for b in perm[p: p + k]]
            p += k
            grid = random_prompt(self.cfg, (start + n) - (start + n) // 3, (start + n) // 3, rng)
            r.set_block_table(i, blocks)
            self.chunks.append((grid, start, start + n, blocks, i))
            if start:
                prefixes.append((grid, 0, start, blocks, i))
        slots = [blocks[t // bs] * bs + t % bs for _, a, e, blocks, _ in self.chunks for t in range(a, e)]
        self.slots = torch.tensor(slots, device=self.dev)
        with torch.inference_mode():
            for pre in prefixes:  # the continuation chunks' prefixes: real K/V in the cache
                r.prefill([pre])
        self.sync()

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def written_kv(self) -> torch.Tensor:
        flat = self.runner.kv.data.flatten(2, 3)
        return flat[:, :, self.slots].float()


def _use(setup: Setup, method: str):
    r = setup.runner
    if method == "eager_old":
        r.prefill_impl = "segmented"
        return {}
    r.prefill_impl = "paged"
    if method == "eager_new":
        saved = r.prefill_graphs
        r.prefill_graphs = {}
        return saved
    return r.prefill_graphs


def _count_kernels(setup: Setup, step) -> int | None:
    if setup.dev.type != "cuda":
        return None
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            setup.sync()
        return int(sum(e.count for e in prof.key_averages()
                       if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA))
    except Exception:  # noqa: BLE001 - the count is informative only
        return None


def time_method(setup: Setup, method: str, iters: int, warmup: int = 3) -> dict:
    r = setup.runner
    cuda = setup.dev.type == "cuda"
    saved = _use(setup, method)
    if method == "graph" and not r.prefill_graphs:
        raise RuntimeError("no prefill graphs captured (CUDA, Triton and a supported head size needed)")
    chunks = setup.chunks

    def step():
        with torch.inference_mode():
            r.prefill(chunks)

    try:
        for _ in range(warmup):
            step()
        setup.sync()
        host, cpu, lat, span = [], [], [], []
        for _ in range(iters):
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            c0, t0 = time.process_time(), time.perf_counter()
            step()
            t1, c1 = time.perf_counter(), time.process_time()
            if cuda:
                e1.record()
            setup.sync()
            t2 = time.perf_counter()
            host.append((t1 - t0) * 1e3)
            cpu.append((c1 - c0) * 1e3)
            lat.append((t2 - t0) * 1e3)
            if cuda:
                span.append(e0.elapsed_time(e1))
        setup.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        setup.sync()
        per_step = (time.perf_counter() - t0) / iters * 1e3
        res = {"ms_per_step": round(per_step, 3), "host_ms": _median(host), "host_cpu_ms": _median(cpu),
               "latency_ms": _median(lat), "gpu_span_ms": _median(span) if span else None,
               "host_us_per_token": round(_median(host) * 1e3 / setup.tokens, 2),
               "kernels_per_step": _count_kernels(setup, step) if method != "graph" else None}
        return res
    finally:
        if method == "eager_new":
            r.prefill_graphs = saved


def attention_only(setup: Setup, iters: int) -> dict:
    """One layer's attention for the step's queries: the old per-segment path vs the kernel
    (eager calls, CUDA events; the kernel also from a CUDA graph of 36 calls)."""
    from ..engine.attention import PagedPrefillBackend, SegmentedPrefillBackend

    r, s = setup.runner, setup.cfg.slow
    dev = setup.dev
    bs = r.cfg.block_size
    N = setup.tokens
    q = torch.randn(1, N, s.n_head, s.head_dim, device=dev, dtype=setup.model.dtype)
    lay_n, S = N, len(setup.chunks)
    cu = torch.tensor([0] + np.cumsum([e - a for _, a, e, _, _ in setup.chunks]).tolist(), device=dev)
    st = torch.tensor([a for _, a, _, _, _ in setup.chunks], device=dev)
    rows = torch.tensor([slot for *_, slot in setup.chunks], device=dev)
    new = PagedPrefillBackend(r.kv, s.n_head, s.n_local_heads, s.head_dim)
    new.set(setup.slots, cu, st, r.block_tables, rows, max_context=max(e for _, _, e, _, _ in setup.chunks),
            max_query=max(e - a for _, a, e, _, _ in setup.chunks))
    old = SegmentedPrefillBackend(r.kv, s.n_head, s.n_local_heads)
    segs, off = [], 0
    for _, a, e, blocks, _ in setup.chunks:
        segs.append((off, e - a, torch.tensor(blocks[: -(-e // bs)], device=dev), a, e))
        off += e - a
    old.set(setup.slots, segs)
    res = {"tokens": lay_n, "segments": S}
    with torch.inference_mode():
        err = (new.attend_only(0, q).float() - old.attend_only(0, q).float()).abs().max().item()
        res["max_abs_diff_new_vs_old"] = err
        for name, be in (("old_per_segment", old), ("new_kernel", new)):
            for _ in range(3):
                be.attend_only(0, q)
            setup.sync()
            t0 = time.perf_counter()
            if dev.type == "cuda":
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            for _ in range(iters):
                be.attend_only(0, q)
            host = (time.perf_counter() - t0) / iters * 1e3
            if dev.type == "cuda":
                e1.record()
            setup.sync()
            wall = (time.perf_counter() - t0) / iters * 1e3
            res[name] = {"eager_ms_per_call": round(wall, 4), "host_ms_per_call": round(host, 4)}
            if dev.type == "cuda":
                res[name]["gpu_ms_per_call"] = round(e0.elapsed_time(e1) / iters, 4)
        if dev.type == "cuda":
            from .kernels_attention import time_graph

            n_layers = s.n_layer
            out = torch.empty_like(q[0])

            def f():
                for i in range(n_layers):
                    pf.paged_prefill_attention(q[0], r.kv.k(i), r.kv.v(i), r.block_tables, cu, st, s.head_dim ** -0.5,
                                               block_table_rows=rows, out=out)

            res["new_kernel"]["graph_us_per_layer"] = round(time_graph(f, iters) / n_layers, 2)
    return res


def sweep(setup: Setup, iters: int) -> list[dict]:
    """Tile configs of the kernel (graph of one call per layer, the step's metadata)."""
    from .kernels_attention import time_graph

    r, s = setup.runner, setup.cfg.slow
    dev = setup.dev
    q = torch.randn(setup.tokens, s.n_head, s.head_dim, device=dev, dtype=setup.model.dtype)
    cu = torch.tensor([0] + np.cumsum([e - a for _, a, e, _, _ in setup.chunks]).tolist(), device=dev)
    st = torch.tensor([a for _, a, _, _, _ in setup.chunks], device=dev)
    rows = torch.tensor([slot for *_, slot in setup.chunks], device=dev)
    out = torch.empty_like(q)
    ref = pf.paged_prefill_attention_ref(q, r.kv.k(0), r.kv.v(0), r.block_tables, cu, st, s.head_dim ** -0.5,
                                         block_table_rows=rows, max_context=max(e for _, _, e, _, _ in setup.chunks),
                                         max_query=max(e - a for _, a, e, _, _ in setup.chunks))
    results = []
    for block_m in (8, 16, 32):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    rec = {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages}

                    def f(block_m=block_m, block_n=block_n, warps=warps, stages=stages):
                        for i in range(s.n_layer):
                            pf.paged_prefill_attention_triton(q, r.kv.k(i), r.kv.v(i), r.block_tables, cu, st,
                                                              s.head_dim ** -0.5, block_table_rows=rows, out=out,
                                                              block_m=block_m, block_n=block_n, num_warps=warps,
                                                              num_stages=stages)
                    try:
                        rec["us_per_layer"] = round(time_graph(f, iters) / s.n_layer, 2)
                        pf.paged_prefill_attention_triton(q, r.kv.k(0), r.kv.v(0), r.block_tables, cu, st,
                                                          s.head_dim ** -0.5, block_table_rows=rows, out=out,
                                                          block_m=block_m, block_n=block_n, num_warps=warps,
                                                          num_stages=stages)
                        rec["max_abs_err"] = (out.float() - ref.float()).abs().max().item()
                    except Exception as e:  # noqa: BLE001
                        rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    results.append(rec)
    ok = [c for c in results if "us_per_layer" in c]
    if ok:
        best = min(ok, key=lambda c: c["us_per_layer"])
        _log(f"sweep best: {best}")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON output path (a directory: DIR/kernels_prefill.json)")
    ap.add_argument("--segments", default=DEFAULT_SEGMENTS, help="START:LEN,... of the step's chunks")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quantization", choices=["none", "fp8"], default="none")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=["s2-pro", "tiny"], default="s2-pro")
    ap.add_argument("--methods", default="eager_old,eager_new,graph")
    ap.add_argument("--sweep", action="store_true", help="also time kernel tile configs")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.is_dir() or not out.suffix:
        out.mkdir(parents=True, exist_ok=True)
        out = out / "kernels_prefill.json"
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        _log("CUDA is not available: nothing to benchmark (--device cpu --shape tiny runs a smoke test)")
        out.write_text(json.dumps({"error": "CUDA not available"}, indent=1))
        return 1
    segments = _parse_segments(args.segments)
    report: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                    "torch": torch.__version__, "python": platform.python_version(), "shape": args.shape,
                    "quantization": args.quantization, "segments": segments, "iters": args.iters,
                    "timings": {}, "errors": {}}
    try:
        import triton

        report["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        report["triton"] = None

    def dump() -> None:
        out.write_text(json.dumps(report, indent=1))

    t0 = time.time()
    setup = Setup(args.shape, args.device, args.quantization, segments)
    report["tokens"] = setup.tokens
    methods = [m for m in args.methods.split(",") if m]
    r = setup.runner
    if "graph" in methods:
        if r.prefill_graphs_enabled:
            t = time.perf_counter()
            r.capture_prefill_graphs(show_progress=False)
            report["capture_s"] = round(time.perf_counter() - t, 2)
            report["graph_buckets"] = sorted(r.prefill_graphs)
            report["graph_bucket_used"] = r.prefill_bucket_for(setup.tokens, len(setup.chunks))
        else:
            methods.remove("graph")
            report["errors"]["graph"] = "prefill graphs unavailable here (CUDA + Triton needed)"
    kv = {}
    for m in methods:
        try:
            report["timings"][m] = res = time_method(setup, m, args.iters)
            kv[m] = setup.written_kv()
            _log(f"{m:>10}: {res['ms_per_step']:8.2f} ms/step back-to-back | host {res['host_ms']:7.2f} ms "
                 f"(cpu {res['host_cpu_ms']:7.2f}, {res['host_us_per_token']:6.1f} us/token) | latency "
                 f"{res['latency_ms']:7.2f} ms | kernels {res['kernels_per_step']}")
        except Exception as e:  # noqa: BLE001
            report["errors"][m] = f"{type(e).__name__}: {e}"
            _log(traceback.format_exc())
        dump()
    base = kv.get("eager_new")
    if base is not None:
        report["kv_check"] = {m: {"max_abs_diff_vs_eager_new": (t - base).abs().max().item(),
                                  "bit_identical": bool(torch.equal(t, base)), "finite": bool(torch.isfinite(t).all())}
                              for m, t in kv.items()}
        _log(f"K/V vs eager_new: {report['kv_check']}")
    try:
        report["attention_only"] = attention_only(setup, args.iters)
        _log(f"one layer's attention: {report['attention_only']}")
    except Exception as e:  # noqa: BLE001
        report["errors"]["attention_only"] = f"{type(e).__name__}: {e}"
        _log(traceback.format_exc())
    if args.sweep and setup.dev.type == "cuda":
        try:
            report["sweep"] = sweep(setup, max(5, args.iters // 2))
        except Exception as e:  # noqa: BLE001
            report["errors"]["sweep"] = f"{type(e).__name__}: {e}"
            _log(traceback.format_exc())
    report["total_s"] = round(time.time() - t0, 1)
    dump()
    _log(f"wrote {out}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
