"""One codec serving configuration on the GPU: streaming call times and serving memory.

    SHOAL_CODEC_CONV_EPILOGUE=fused python benchmarks/scripts/codec_modes.py TAG [SLOTS,...]

Builds the real-size codec with random weights (bf16 decode side), the graphed serving
decoder for up to 64 streams, and times calls of 64 x 32, 64 x 8, 32 x 32 and 1 x 8 frames
(``shoal.bench.codec.time_stream``); with SLOTS, also the engine streamer's resident memory
at each slot count (``serving_memory``, calls of up to 32 streams). Whatever ``SHOAL_*``
variables are set pick the configuration and are recorded. Writes ``$OUT/codec-TAG.json``
(or ./codec-TAG.json)."""

from __future__ import annotations

import json
import os
import sys

import torch

from shoal.bench.codec import build_codec, serving_memory, time_stream
from shoal.codec.streaming import serving_decoder


def main() -> None:
    torch.set_grad_enabled(False)
    dev = torch.device("cuda")
    tag = sys.argv[1]
    out = {"tag": tag, "gpu": torch.cuda.get_device_name(),
           "env": {k: v for k, v in os.environ.items() if k.startswith("SHOAL_")}}
    codec = build_codec(False, dev).to(torch.bfloat16)
    dec = serving_decoder(codec, max_batch=64)
    for b, t in [(64, 32), (64, 8), (32, 32), (1, 8)]:
        r = time_stream(dec, codec, b, t, 10, 3, dev)
        out[f"{b}x{t}"] = r
        print(tag, b, t, f"{r['call_ms']:.2f} ms {r['audio_s_per_s']:.0f} audio s/s", flush=True)
    if len(sys.argv) > 2:
        del dec, codec
        torch.cuda.empty_cache()
        codec32 = build_codec(False, dev)
        for s in [int(x) for x in sys.argv[2].split(",")]:
            m = serving_memory(codec32, dev, s, 32, False)
            out[f"mem{s}"] = m
            print(tag, "mem", s, f"{m['decode_resident_gib']:.3f} GiB", flush=True)
    d = os.environ.get("OUT", ".")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"codec-{tag}.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
