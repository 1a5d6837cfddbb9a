"""``shoal bench codec``: the codec decode path at serving scale (real-size codec, random weights).

Measures, for the streaming decoder with carried per-stream state (what the engine runs):

* throughput in seconds of audio per second for batch x chunk frames, CUDA graphs on and off,
  per dtype (bf16 by default, fp32 optionally);
* first-chunk latency (a fresh stream's first 4 / 8 frames) at batch 1 and 64;
* memory: weights after load (whole codec and decode path), state per stream, peak per run;
* the eager one-shot decode of 1024 frames (the reference's serving call), fused and
  module-by-module decoder paths;
* layout / autotuning variants (channels-last, cudnn.benchmark) at a few points;
* exactness on the device: graphed streaming vs one-shot in fp32 (TF32 off), bf16 vs fp32;
* the batched encoder vs one clip at a time.

The issue's reference numbers (fish-speech codec on an H200) are printed and stored beside
ours. Every configuration is isolated: an error (e.g. out of memory) is recorded and the run
goes on. ``--tiny --device cpu`` is a smoke run of the benchmark itself.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

import numpy as np
import torch

REFERENCE = {
    "source": "issue #5: fish-speech reference codec, H200, real size, random weights",
    "decode_audio_s_per_s_bf16_max": 500,
    "decode_call_ms_batch1": [20, 26],
    "resident_gib": 4.6,
    "causal_mask_gib": 3.0,
    "targets": {"decode_audio_s_per_s_64_streams": 3000, "first_8_frame_chunk_ms_batch1": 10,
                "resident_gib": 1.0},
}

SR, HOP = 44100, 2048


def log(msg: str) -> None:
    print(f"[bench codec {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_codec(tiny: bool, device: torch.device, seed: int = 0):
    """Random-weight codec in fp32: the real size, or the tiny golden-sized config."""
    from ..codec.config import CodecConfig
    from ..codec.loader import convert_state_dict
    from ..codec.model import Codec
    from ..codec.random_init import random_codec_state_dict

    if tiny:
        from ..demo import TINY_CODEC_CONFIG

        cfg = CodecConfig.from_dict(TINY_CODEC_CONFIG)
    else:
        cfg = CodecConfig.real()
    with torch.device("meta"):
        codec = Codec(cfg)
    expected = {k: v.shape for k, v in codec.state_dict().items()}
    weights = convert_state_dict(random_codec_state_dict(cfg, seed), expected, source="random")
    codec.load_state_dict(weights, strict=True, assign=True)
    return codec.to(device=device).eval().requires_grad_(False)


def random_codes(batch: int, frames: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(0, 4096, (batch, 1, frames), generator=g),
                      torch.randint(0, 1024, (batch, 9, frames), generator=g)], 1).to(device)


def decode_path_bytes(codec) -> int:
    q = codec.quantizer
    mods = [q.post_module, q.upsample, codec.decoder]
    mods += [vq.codebook for vq in q.semantic_quantizer.quantizers] + [vq.out_proj for vq in q.semantic_quantizer.quantizers]
    mods += [vq.codebook for vq in q.quantizer.quantizers] + [vq.out_proj for vq in q.quantizer.quantizers]
    return sum(p.numel() * p.element_size() for m in mods for p in m.parameters())


def mem_gib(dev) -> dict:
    if dev.type != "cuda":
        return {}
    return {"allocated_gib": torch.cuda.memory_allocated(dev) / 2**30,
            "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30}


def reset_peak(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def guarded(results: list, record: dict, fn) -> dict:
    """Run fn(record) -> fields; on error record it (OOM etc.) and go on."""
    try:
        record.update(fn())
    except Exception as e:  # noqa: BLE001 - one failing configuration must not end the run
        record["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"  ERROR {record}: {record['error']}")
        if "out of memory" not in str(e).lower():
            traceback.print_exc(file=sys.stderr)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    results.append(record)
    return record


def use_layout(codec, layout: str) -> str:
    """Configure the decoder's conv path: "serving" (what ``serving_decoder`` picks; returns the
    layout it chose), "cudnn" or "cudnn-cl"."""
    from ..codec.streaming import configure_serving_layout

    if layout == "serving":
        return configure_serving_layout(codec)
    codec.configure_serving(channels_last=layout == "cudnn-cl", triton_conv=False)
    return layout


def make_decoder(codec, graphs: bool, batches, chunks):
    from ..codec.streaming import GraphedStreamingDecoder, StreamingDecoder

    if graphs:
        return GraphedStreamingDecoder(codec, batch_buckets=tuple(batches), chunk_frames=tuple(chunks))
    return StreamingDecoder(codec)


def time_stream(dec, codec, batch: int, t: int, iters: int, warmup: int, dev) -> dict:
    codes = random_codes(batch, t, dev, seed=batch * 100 + t)
    state = dec.new_state(batch)
    reset_peak(dev)
    t0 = time.perf_counter()
    for _ in range(warmup):
        dec.decode_chunk(codes, state)
    sync(dev)
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(iters):
        out = dec.decode_chunk(codes, state)
    sync(dev)
    dt = (time.perf_counter() - t0) / iters
    audio_s = batch * t * HOP / SR
    res = {"call_ms": dt * 1e3, "audio_s_per_s": audio_s / dt, "warmup_s": warm_s,
           "finite": bool(torch.isfinite(out).all()), **mem_gib(dev)}
    stats = getattr(dec, "stats", None)
    if stats is not None:
        res["graph_replays"] = stats.replays
        res["graph_eager_calls"] = stats.eager
        if getattr(dec, "_failed", None):
            res["graph_failed"] = dict((f"{k[0]}x{k[1]}", v) for k, v in dec._failed.items())
    return res


def eager_call_peak(codec, batch: int, t: int, dev) -> float:
    """GiB one eager streaming call of ``batch`` x ``t`` frames allocates at its peak."""
    from ..codec.streaming import StreamingDecoder

    dec = StreamingDecoder(codec)
    state = dec.new_state(batch)
    codes = random_codes(batch, t, dev, seed=5)
    sync(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    dec.decode_chunk(codes, state)
    sync(dev)
    return (torch.cuda.max_memory_allocated(dev) - base) / 2**30


def time_first_chunk(dec, batch: int, t: int, reps: int, dev) -> dict:
    codes = random_codes(batch, t, dev, seed=7)
    state = dec.new_state(batch)
    dec.decode_chunk(codes, state)  # capture / autotune outside the timing
    times = []
    for _ in range(reps):
        state.reset_()  # fresh streams: position 0, zero context
        sync(dev)
        t0 = time.perf_counter()
        out = dec.decode_chunk(codes, state)
        if dev.type == "cuda":
            out = out.float().cpu()  # the engine ships PCM to the host
        times.append(time.perf_counter() - t0)
    return {"p50_ms": float(np.median(times) * 1e3), "min_ms": float(np.min(times) * 1e3),
            "max_ms": float(np.max(times) * 1e3)}


def time_oneshot(codec, frames: int, batch: int, reps: int, dev) -> dict:
    codes = random_codes(batch, frames, dev, seed=3)
    reset_peak(dev)
    codec.decode(codes)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        codec.decode(codes)
    sync(dev)
    dt = (time.perf_counter() - t0) / reps
    return {"call_ms": dt * 1e3, "audio_s_per_s": batch * frames * HOP / SR / dt, **mem_gib(dev)}


def error_stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.double().cpu(), b.double().cpu()
    d = a - b
    rms = float(d.pow(2).mean().sqrt())
    sig = float(b.pow(2).mean().sqrt())
    return {"max_abs": float(d.abs().max()), "rms": rms, "peak": float(b.abs().max()),
            "snr_db": float(20 * np.log10(sig / rms)) if rms > 0 else float("inf")}


def exactness(codec32, codec16, dev, frames: int = 64) -> dict:
    """fp32 (TF32 off): graphed / eager streaming vs one-shot; bf16 vs fp32."""
    from ..codec.streaming import GraphedStreamingDecoder, StreamingDecoder

    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        codes = random_codes(2, frames, dev, seed=11)
        ref = codec32.decode(codes)
        sched = [4, 8, 16, 32, 4]
        sched = [t for t in sched if t <= frames]
        while sum(sched) < frames:
            sched.append(min(4, frames - sum(sched)))
        out = {"schedule": sched, "frames": frames}
        for name, dec in (("eager", StreamingDecoder(codec32)),
                          ("graph", GraphedStreamingDecoder(codec32, batch_buckets=(2,), chunk_frames=(4, 8, 16, 32)))):
            st = dec.new_state(2)
            chunks, i = [], 0
            for t in sched:
                chunks.append(dec.decode_chunk(codes[:, :, i:i + t], st))
                i += t
            out[f"stream_{name}_vs_oneshot_fp32"] = error_stats(torch.cat(chunks, -1)[..., :ref.shape[-1]], ref)
        out["bf16_vs_fp32_oneshot"] = error_stats(codec16.decode(codes).float(), ref)
        out["tolerance_fp32_stream"] = 1e-4
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def encoder_bench(codec, dev, n_clips: int, seconds: float) -> dict:
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(int(SR * seconds * (0.6 + 0.4 * i / max(1, n_clips - 1))), generator=g) * 0.2
             for i in range(n_clips)]
    total = sum(c.numel() for c in clips) / SR
    codec.encode_batch(clips[:1])
    sync(dev)
    t0 = time.perf_counter()
    single = [codec.encode(c.to(dev)[None, None])[0][0] for c in clips]
    sync(dev)
    t_single = time.perf_counter() - t0
    codec.encode_batch(clips)
    sync(dev)
    t0 = time.perf_counter()
    batched = codec.encode_batch(clips)
    sync(dev)
    t_batch = time.perf_counter() - t0
    same = sum(int(torch.equal(a, b)) for a, b in zip(single, batched))
    return {"clips": n_clips, "audio_s": total, "one_by_one_audio_s_per_s": total / t_single,
            "batched_audio_s_per_s": total / t_batch, "codes_identical": f"{same}/{n_clips}"}


def pool_breakdown(dev) -> dict:
    """The process's reserved GPU memory by allocator pool, from a memory snapshot: the
    default pool (reserved, allocated, and free but held -- blocks ``empty_cache`` cannot return
    because a live block shares their segment) and the private pools of CUDA graphs."""
    gib = 2 ** 30
    out = {"default_reserved_gib": 0.0, "default_allocated_gib": 0.0, "graph_pools_reserved_gib": 0.0,
           "graph_pools_allocated_gib": 0.0, "graph_pools": 0}
    pools = set()
    segs: list[float] = []
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", 0) != index:
            continue
        pid = tuple(seg.get("segment_pool_id", (0, 0)))
        kind = "default" if pid == (0, 0) else "graph_pools"
        if kind == "graph_pools":
            pools.add(pid)
        out[f"{kind}_reserved_gib"] += seg["total_size"] / gib
        out[f"{kind}_allocated_gib"] += seg["allocated_size"] / gib
        if kind == "graph_pools":
            segs.append(seg["total_size"] / 2 ** 20)
    out["graph_pools"] = len(pools)
    out["graph_pool_segments_mib"] = sorted(segs, reverse=True)  # how the pool is cut up
    out["default_held_free_gib"] = out["default_reserved_gib"] - out["default_allocated_gib"]
    return out


def serving_memory(codec32, dev, streams: int, max_call_streams: int, first_lane: bool) -> dict:
    """What the engine's audio streamer keeps on the GPU for ``streams`` stream slots after its
    warm-up (every CUDA graph captured), on a copy of the codec as ``shoal serve`` places it
    (encode side fp32, decode side bf16, both placed from host copies of the weights like
    :func:`shoal.codec.loader.load_codec`; the serving decoder layout): the decode side's
    weights, the streamer's state slots, each lane's static graph state and graph pool, and
    the total the decode path holds (the encoder's weights listed apart)."""
    from ..codec.model import Codec
    from ..codec.streaming import StreamingDecoder
    from ..engine.audio import AudioStreamer, ChunkSchedule

    sync(dev)
    torch.cuda.empty_cache()
    # the weights go through the host as load_codec places them (each side cast once on its
    # way to the GPU): a GPU copy converted in place would leave the fp32 decode weights'
    # blocks reserved, interleaved with live ones, and count them as the codec's
    host = {k: v.detach().to("cpu") for k, v in codec32.state_dict().items()}
    a0, r0 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    with torch.device("meta"):
        codec = Codec(codec32.config)
    codec.load_state_dict(host, strict=True, assign=True)
    codec = codec.place(dev, torch.float32, torch.bfloat16).eval().requires_grad_(False)
    del host
    sync(dev)
    a1 = torch.cuda.memory_allocated(dev)
    enc_b = sum(p.numel() * p.element_size() for m in codec.encode_modules() for p in m.parameters())
    dec_b = sum(p.numel() * p.element_size() for m in codec.decode_modules() for p in m.parameters())
    st = AudioStreamer(codec, streams, ChunkSchedule(), max_call_streams, first_lane=first_lane)
    sync(dev)
    a2, r2 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    st.warmup()
    sync(dev)
    warm_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(dev)
    torch.cuda.empty_cache()  # the eager warm-up calls' cached blocks (the engine returns them too)
    a3, r3 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    gib = 2 ** 30
    lanes = {}
    for lane in st.lanes:
        d = lane.decoder
        ss = getattr(d, "_static_state", None)
        lanes[lane.name] = {"buckets": list(getattr(d, "batch_buckets", ())),
                            "chunks": list(getattr(d, "chunk_frames", ())),
                            "graphs": len(getattr(d, "graphs", {})),
                            "static_state_gib": (ss.nbytes() if ss is not None else 0) / gib,
                            "primed_pool_gib": getattr(getattr(d, "stats", None), "primed_bytes", 0) / gib,
                            # graphs whose output stayed in the pool (0: all in the shared buffer)
                            "own_outputs": getattr(getattr(d, "stats", None), "own_outputs", 0),
                            "group_positions": codec.decoder.group_positions}
    out = {"streams": streams, "max_call_streams": max_call_streams, "first_lane": first_lane,
           "encode_weights_gib": enc_b / gib, "decode_weights_gib": dec_b / gib,
           "weights_allocated_gib": (a1 - a0) / gib,
           "state_slots_gib": st.state.nbytes() / gib,
           "state_per_stream_mib": StreamingDecoder(codec).state_nbytes_per_stream() / 2 ** 20,
           "streamer_allocated_gib": (a2 - a1) / gib, "lanes": lanes,
           "warmup_reserved_gib": (r3 - r2) / gib,  # graph pools (and the allocator's slack)
           "warmup_allocated_gib": (a3 - a2) / gib, "warmup_s": warm_s,
           # the most the warm-up's calls had live at once (eager ones and captures alike)
           "warmup_peak_live_gib": (peak - a2) / gib,
           "reserved_total_gib": (r3 - r0) / gib}
    # the decode path's resident memory: everything the codec holds on the GPU but the
    # encoder's weights (reserved, so graph pools and the allocator's slack count)
    out["decode_resident_gib"] = out["reserved_total_gib"] - enc_b / gib
    out.update(pool_breakdown(dev))
    del st, codec
    sync(dev)
    torch.cuda.empty_cache()
    return out


def plot(res: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    rows = [r for r in res["throughput"] if "error" not in r]
    keys = sorted({(r["dtype"], r["graphs"], r["chunk"]) for r in rows})
    for dt, gr, ch in keys:
        pts = sorted((r["batch"], r["audio_s_per_s"]) for r in rows if (r["dtype"], r["graphs"], r["chunk"]) == (dt, gr, ch))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if gr else "x--", label=f"{dt} {'graph' if gr else 'eager'} t={ch}")
    ax.axhline(REFERENCE["decode_audio_s_per_s_bf16_max"], color="gray", ls=":", label="reference max (bf16)")
    ax.axhline(REFERENCE["targets"]["decode_audio_s_per_s_64_streams"], color="red", ls=":", label="target @64")
    ax.set(xscale="log", yscale="log", xlabel="streams per call", ylabel="audio s / s", title="streaming decode throughput")
    ax.legend(fontsize=6)
    ax = axes[1]
    lat = [r for r in res["latency"] if "error" not in r]
    labels = [f"{r['dtype']} {'g' if r['graphs'] else 'e'} b{r['batch']} t{r['chunk']}" for r in lat]
    ax.barh(range(len(lat)), [r["p50_ms"] for r in lat])
    ax.set_yticks(range(len(lat)), labels, fontsize=6)
    ax.axvline(REFERENCE["targets"]["first_8_frame_chunk_ms_batch1"], color="red", ls=":", label="target (8 frames, b=1)")
    ax.set(xlabel="ms (p50)", title="first-chunk latency")
    ax.legend(fontsize=7)
    ax = axes[2]
    m = res["memory"]
    names = [k for k in ("weights_gib", "allocated_after_load_gib", "decode_path_weights_gib", "bf16_weights_gib",
                         "bf16_decode_path_weights_gib") if k in m]
    ax.bar(range(len(names) + 1), [m[k] for k in names] + [REFERENCE["resident_gib"]])
    ax.set_xticks(range(len(names) + 1), names + ["reference resident"], rotation=30, fontsize=7)
    ax.axhline(REFERENCE["targets"]["resident_gib"], color="red", ls=":")
    ax.set(ylabel="GiB", title="codec memory")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shoal bench codec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny codec (CPU smoke run of the benchmark)")
    p.add_argument("--quick", action="store_true", help="a reduced grid (~2-3 min on an H200)")
    p.add_argument("--dtypes", default="bf16", help="comma list of bf16,fp32")
    p.add_argument("--batches", default="1,8,16,32,64,128")
    p.add_argument("--chunks", default="4,8,16,32")
    p.add_argument("--modes", default="graph,eager", help="graph,eager")
    p.add_argument("--layout", choices=["serving", "cudnn", "cudnn-cl"], default="serving",
                   help="decoder conv path of the throughput grid and latency runs: serving (what "
                        "the engine runs: Triton implicit-GEMM convs, channels-last, for bf16 on CUDA), "
                        "cudnn (channels-first cuDNN), cudnn-cl (channels-last cuDNN)")
    p.add_argument("--channels-last", action="store_true", help="same as --layout cudnn-cl")
    p.add_argument("--no-cudnn-benchmark", action="store_true", help="main grid without cudnn.benchmark")
    p.add_argument("--variants", default="auto", help="'none' or 'auto': layout x autotune variants at a few points")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--latency-reps", type=int, default=20)
    p.add_argument("--oneshot-frames", type=int, default=1024)
    p.add_argument("--skip", default="", help="comma list of sections to skip: throughput,latency,oneshot,"
                                               "variants,exactness,encoder,serving")
    p.add_argument("--group-positions", default="",
                   help="comma list of the decoder's row-group sizes for the throughput grid (input "
                        "positions = streams x 4 x frames; 0 = no groups); default: the serving value")
    p.add_argument("--serving-streams", default="64,128",
                   help="stream slots of the serving-memory section (the engine's audio streamer)")
    p.add_argument("--max-call-streams", type=int, default=32, help="streams per codec call (serving section)")
    p.add_argument("--window-states", default="kv",
                   help="comma list of kv,hidden,ring: what a stream carries of the codec transformer's window "
                        "(serving section; SHOAL_CODEC_WINDOW_STATE)")
    args = p.parse_args(argv)
    from ..codec.layers import WindowLimitedTransformer

    for ws in args.window_states.split(","):
        if ws.strip() not in WindowLimitedTransformer.WINDOW_STATES:
            p.error(f"--window-states: {ws!r} is not one of {', '.join(WindowLimitedTransformer.WINDOW_STATES)}")
    if args.quick:
        args.batches, args.chunks = "1,8,64,128", "4,8,32"
        args.iters, args.latency_reps = 3, 10
    dev = torch.device(args.device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    batches, chunks = ints(args.batches), ints(args.chunks)
    dtypes = [d for d in args.dtypes.split(",") if d]
    modes = [m for m in args.modes.split(",") if m]
    skip = set(args.skip.split(","))
    layout_arg = "cudnn-cl" if args.channels_last else args.layout
    torch.backends.cudnn.benchmark = not args.no_cudnn_benchmark
    torch.set_grad_enabled(False)

    res: dict = {"reference": REFERENCE, "throughput": [], "latency": [], "oneshot": [], "variants": [],
                 "memory": {}, "exactness": {}, "encoder": {}}
    t_start = time.perf_counter()
    log(f"building the {'tiny' if args.tiny else 'real-size'} codec on {dev} ...")
    reset_peak(dev)
    base = mem_gib(dev).get("allocated_gib", 0.0)
    codec32 = build_codec(args.tiny, dev)
    n_params = sum(p.numel() for p in codec32.parameters())
    mem = res["memory"]
    mem["params"] = n_params
    mem["weights_gib"] = sum(p.numel() * p.element_size() for p in codec32.parameters()) / 2**30
    mem["decode_path_weights_gib"] = decode_path_bytes(codec32) / 2**30
    if dev.type == "cuda":
        mem["allocated_after_load_gib"] = mem_gib(dev)["allocated_gib"] - base
    log(f"codec ready ({n_params / 1e6:.1f}M params, {mem['weights_gib']:.2f} GiB fp32) in "
        f"{time.perf_counter() - t_start:.1f} s")
    codecs = {"fp32": codec32}
    if "bf16" in dtypes or "exactness" not in skip:
        codecs["bf16"] = copy.deepcopy(codec32).to(torch.bfloat16)
        mem["bf16_weights_gib"] = mem["weights_gib"] / 2
        mem["bf16_decode_path_weights_gib"] = mem["decode_path_weights_gib"] / 2
    from ..codec.streaming import StreamingDecoder

    mem["state_bytes_per_stream_fp32"] = StreamingDecoder(codec32).state_nbytes_per_stream()
    mem["state_bytes_per_stream_bf16"] = mem["state_bytes_per_stream_fp32"] // 2
    log(f"memory: {json.dumps(mem)}")
    log(f"reference (issue #5): {json.dumps(REFERENCE)}")

    # ---------------------------------------------------------------- throughput grid
    if "throughput" not in skip:
        for dt in dtypes:
            codec = codecs[dt]
            layout = use_layout(codec, layout_arg)
            log(f"{dt} decoder layout: {layout}")
            gps = [None] if not args.group_positions else [int(g) or None for g in args.group_positions.split(",") if g]
            for gp_arg in gps:
                if gp_arg is not None or args.group_positions:
                    codec.configure_serving(group_positions=gp_arg)
                gp = codec.decoder.group_positions
                for mode in modes:
                    for b in batches:
                        for t in chunks:
                            # one graph per decoder: its pool is what this call shape keeps
                            if dev.type == "cuda":
                                torch.cuda.empty_cache()
                                r_before = torch.cuda.memory_reserved(dev)
                            dec = make_decoder(codec, mode == "graph", [b], [t])
                            rec = {"dtype": dt, "graphs": mode == "graph", "batch": b, "chunk": t,
                                   "layout": layout, "channels_last": layout != "cudnn", "group_positions": gp}
                            r = guarded(res["throughput"], rec,
                                        lambda: time_stream(dec, codec, b, t, args.iters, args.warmup, dev))
                            if dev.type == "cuda" and "error" not in r:
                                torch.cuda.empty_cache()  # what stays: the graph's pool and buffers
                                r["reserved_gib"] = (torch.cuda.memory_reserved(dev) - r_before) / 2**30
                                r["eager_call_peak_gib"] = eager_call_peak(codec, b, t, dev)
                            if "error" not in r:
                                log(f"{dt} {mode:5s} g={gp} b={b:4d} t={t:3d}: {r['call_ms']:8.2f} ms/call "
                                    f"{r['audio_s_per_s']:9.1f} audio s/s  graph keeps {r.get('reserved_gib', 0):.3f} GiB, "
                                    f"eager call peak {r.get('eager_call_peak_gib', 0):.3f} GiB")
                            del dec
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            use_layout(codec, "cudnn")

    # ---------------------------------------------------------------- first-chunk latency
    if "latency" not in skip:
        for dt in dtypes:
            codec = codecs[dt]
            layout = use_layout(codec, layout_arg)
            for mode in modes:
                lat_b = [b for b in (1, 64) if b <= max(batches)] or [1]
                dec = make_decoder(codec, mode == "graph", lat_b, (4, 8))
                for b in lat_b:
                    for t in (4, 8):
                        rec = {"dtype": dt, "graphs": mode == "graph", "batch": b, "chunk": t, "layout": layout}
                        r = guarded(res["latency"], rec, lambda: time_first_chunk(dec, b, t, args.latency_reps, dev))
                        if "error" not in r:
                            log(f"first chunk {dt} {mode:5s} b={b:3d} t={t}: p50 {r['p50_ms']:.2f} ms "
                                f"(min {r['min_ms']:.2f})")
                del dec
            use_layout(codec, "cudnn")

    # ---------------------------------------------------------------- one-shot (reference call shape)
    if "oneshot" not in skip:
        for dt in dtypes:
            codec = codecs[dt]
            for fused in (True, False):
                codec.configure_serving(fused=fused)
                rec = {"dtype": dt, "frames": args.oneshot_frames, "batch": 1, "fused": fused}
                r = guarded(res["oneshot"], rec, lambda: time_oneshot(codec, args.oneshot_frames, 1, 2, dev))
                if "error" not in r:
                    log(f"one-shot {dt} fused={fused} {args.oneshot_frames} frames: {r['call_ms']:.1f} ms, "
                        f"{r['audio_s_per_s']:.0f} audio s/s, peak {r.get('peak_gib', 0):.2f} GiB")
            codec.configure_serving(fused=True)

    # ---------------------------------------------------------------- layout / autotuning variants
    if "variants" not in skip and args.variants != "none":
        dt = dtypes[0]
        codec = codecs[dt]
        points = [(1, 8), (64, 8)] if not args.tiny else [(1, 4)]
        for cl in (False, True):
            for bench_on in (True, False):
                torch.backends.cudnn.benchmark = bench_on
                codec.configure_serving(channels_last=cl)
                dec = make_decoder(codec, "graph" in modes, [b for b, _ in points], sorted({t for _, t in points}))
                for b, t in points:
                    rec = {"dtype": dt, "graphs": "graph" in modes, "batch": b, "chunk": t,
                           "channels_last": cl, "cudnn_benchmark": bench_on}
                    r = guarded(res["variants"], rec, lambda: time_stream(dec, codec, b, t, args.iters, args.warmup, dev))
                    if "error" not in r:
                        log(f"variant channels_last={cl} cudnn.benchmark={bench_on} b={b} t={t}: "
                            f"{r['call_ms']:.2f} ms, {r['audio_s_per_s']:.0f} audio s/s")
                del dec
        codec.configure_serving(channels_last=False)
        torch.backends.cudnn.benchmark = not args.no_cudnn_benchmark

    # ---------------------------------------------------------------- serving memory
    if "serving" not in skip and dev.type == "cuda":
        res["serving_memory"] = []
        for ws in [w.strip() for w in args.window_states.split(",") if w.strip()]:
            for n in ints(args.serving_streams):
                for fl in (False, True):
                    with mock.patch.dict(os.environ, {"SHOAL_CODEC_WINDOW_STATE": ws}):
                        r = guarded(res["serving_memory"], {"window_state": ws},
                                    lambda: serving_memory(codec32, dev, n, args.max_call_streams, fl))
                    if "error" not in r:
                        r["window_state"] = ws
                        log(f"serving memory, {n} streams, first lane {fl}, window {ws}: decode resident "
                            f"{r['decode_resident_gib']:.3f} GiB (decode weights {r['decode_weights_gib']:.3f}, "
                            f"state slots {r['state_slots_gib']:.3f}, streamer {r['streamer_allocated_gib']:.3f}, "
                            f"graph pools {r['graph_pools_reserved_gib']:.3f}, held free "
                            f"{r['default_held_free_gib']:.3f}; encoder weights {r['encode_weights_gib']:.3f} "
                            f"apart) {json.dumps(r['lanes'])}")

    # ---------------------------------------------------------------- exactness
    if "exactness" not in skip:
        rec: list = []
        guarded(rec, {}, lambda: exactness(codecs["fp32"], codecs["bf16"], dev, 64 if not args.tiny else 24))
        res["exactness"] = rec[0]
        log(f"exactness: {json.dumps(rec[0])}")

    # ---------------------------------------------------------------- encoder
    if "encoder" not in skip:
        rec = []
        enc_codec = codecs["fp32"]
        guarded(rec, {"dtype": "fp32"}, lambda: encoder_bench(enc_codec, dev, 8 if not args.tiny else 3,
                                                              10.0 if not args.tiny else 0.5))
        res["encoder"] = rec[0]
        log(f"encoder: {json.dumps(rec[0])}")

    from .engine import git_commit

    res["meta"] = {"date": time.strftime("%Y-%m-%d"),
                   "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
                   "torch": torch.__version__, "commit": git_commit(), "args": vars(args),
                   "codec": "tiny" if args.tiny else "real size (random weights)",
                   "wall_s": time.perf_counter() - t_start}
    (out_dir / "codec.json").write_text(json.dumps(res, indent=1))
    try:
        plot(res, out_dir / "codec.png", f"shoal codec, {res['meta']['device']}, {res['meta']['date']}, "
                                         f"{res['meta']['commit']}")
    except ImportError:
        log("matplotlib not installed: no plot")
    log(f"done in {res['meta']['wall_s']:.1f} s -> {out_dir / 'codec.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
