"""Where the codec decode path's resident memory goes, block by block (GPU).

    SHOAL_CODEC_PRIME_MARGIN_MIB=64 python benchmarks/scripts/codec_memory_probe.py TAG [SLOTS] [--segments]

Runs ``shoal.bench.codec.serving_memory`` once on the real-size codec (random weights) at
SLOTS stream slots (default 64) and prints the decode path's resident GiB, the graph pool's
segments and the default pool's held-but-free bytes. One configuration per process: a second
build in the same process reuses the first one's freed segments (and allocations that live
on, like per-stream workspaces), so its figures are not a fresh server's. With
``--segments``, the serving path is then built once more under the allocator's history and
every segment it opened is listed with its live bytes by the shoal source line that
allocated them (the second build: for finding owners, not for the totals). Writes
``$OUT/codec-memory-TAG.json``."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import torch

from shoal.bench.codec import build_codec, serving_memory


def _owner(block: dict) -> str:
    for fr in block.get("frames", []) or []:
        fn = fr.get("filename", "")
        if "/shoal/" in fn and "/bench/" not in fn:
            return f"{fn.split('/shoal/')[-1]}:{fr.get('line')} {fr.get('name')}"
    return "?"


def segments(before: set[int]) -> list[dict]:
    snap = torch.cuda.memory._snapshot()
    out = []
    for seg in snap["segments"]:
        if seg["address"] in before:
            continue
        owners: dict[str, int] = defaultdict(int)
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                owners[_owner(blk)] += blk["size"]
        out.append({"pool": list(seg.get("segment_pool_id", (0, 0))), "total_mib": seg["total_size"] / 2 ** 20,
                    "allocated_mib": seg["allocated_size"] / 2 ** 20,
                    "owners_mib": {k: v / 2 ** 20 for k, v in sorted(owners.items(), key=lambda kv: -kv[1])}})
    return out


def main() -> None:
    torch.set_grad_enabled(False)
    dev = torch.device("cuda")
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tag = args[0]
    slots = int(args[1]) if len(args) > 1 else 64
    res: dict = {"tag": tag, "gpu": torch.cuda.get_device_name(), "slots": slots,
                 "env": {k: v for k, v in os.environ.items() if k.startswith("SHOAL_")}}
    codec32 = build_codec(False, dev)
    r = serving_memory(codec32, dev, slots, 32, False)
    print(f"{tag}: decode resident {r['decode_resident_gib']:.4f} GiB, pool {r['graph_pools_reserved_gib']:.4f} GiB "
          f"{r['graph_pool_segments_mib']}, default held free {r['default_held_free_gib']:.4f}, "
          f"warm-up peak live {r['warmup_peak_live_gib']:.4f}", flush=True)
    res["memory"] = r
    if "--segments" in sys.argv:
        torch.cuda.empty_cache()
        before = {s["address"] for s in torch.cuda.memory._snapshot()["segments"]}
        torch.cuda.memory._record_memory_history(max_entries=200000)
        from shoal.codec.model import Codec
        from shoal.engine.audio import AudioStreamer, ChunkSchedule

        host = {k: v.detach().to("cpu") for k, v in codec32.state_dict().items()}
        with torch.device("meta"):
            codec = Codec(codec32.config)
        codec.load_state_dict(host, strict=True, assign=True)
        codec = codec.place(dev, torch.float32, torch.bfloat16).eval().requires_grad_(False)
        del host
        st = AudioStreamer(codec, slots, ChunkSchedule(), 32, first_lane=False)
        st.warmup()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        segs = segments(before)
        torch.cuda.memory._record_memory_history(enabled=None)
        res["segments"] = segs
        tot = defaultdict(float)
        for s in segs:
            kind = "default" if s["pool"] == [0, 0] else "graph"
            tot[f"{kind}_total_mib"] += s["total_mib"]
            tot[f"{kind}_allocated_mib"] += s["allocated_mib"]
        res["segment_totals"] = dict(tot)
        print("segments opened by a second build:", {k: round(v, 1) for k, v in tot.items()})
        for s in sorted(segs, key=lambda s: -(s["total_mib"] - s["allocated_mib"]))[:12]:
            own = ", ".join(f"{k} {v:.1f}" for k, v in list(s["owners_mib"].items())[:3])
            print(f"  pool {s['pool']} {s['total_mib']:.1f} MiB, live {s['allocated_mib']:.1f}: {own}")
        del st, codec
    d = os.environ.get("OUT", ".")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"codec-memory-{tag}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
