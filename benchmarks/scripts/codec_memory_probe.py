"""Where the codec decode path's resident memory goes, block by block, and what the graph pool's
primed margin does to it (GPU).

    python benchmarks/scripts/codec_memory_probe.py [MARGINS_MIB] [SLOTS]

For each margin (default ``0,32,64,96``; ``SHOAL_CODEC_PRIME_MARGIN_MIB``) runs
``shoal.bench.codec.serving_memory`` on the real-size codec (random weights) at SLOTS stream
slots (default 64) and prints the decode path's resident GiB and the graph pool's segments.
A last build records the allocator's history: every segment the serving path opened is
listed with its size, its live bytes, and the live blocks by the shoal source line that
allocated them, so the default pool's held-but-free bytes (rounding and fragmentation) can be
traced to their owners. Writes ``$OUT/codec-memory-probe.json``."""

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
    margins = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "0,32,64,96").split(",")]
    slots = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    res: dict = {"gpu": torch.cuda.get_device_name(), "slots": slots, "runs": []}
    codec32 = build_codec(False, dev)
    for m in margins:
        os.environ["SHOAL_CODEC_PRIME_MARGIN_MIB"] = str(m)
        r = serving_memory(codec32, dev, slots, 32, False)
        r["margin_mib"] = m
        print(f"margin {m} MiB: decode resident {r['decode_resident_gib']:.4f} GiB, pool "
              f"{r['graph_pools_reserved_gib']:.4f} GiB {r['graph_pool_segments_mib']}, default held free "
              f"{r['default_held_free_gib']:.4f}", flush=True)
        res["runs"].append(r)
    # the segment listing: the serving path built once more under the allocator's history, kept
    # alive while its segments are read
    os.environ["SHOAL_CODEC_PRIME_MARGIN_MIB"] = str(margins[0])
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
    print("segments opened by the serving path:", dict(tot))
    for s in sorted(segs, key=lambda s: -(s["total_mib"] - s["allocated_mib"]))[:25]:
        own = ", ".join(f"{k} {v:.1f}" for k, v in list(s["owners_mib"].items())[:3])
        print(f"  pool {s['pool']} {s['total_mib']:.1f} MiB, live {s['allocated_mib']:.1f}: {own}")
    d = os.environ.get("OUT", ".")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "codec-memory-probe.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
