"""The codec transformer's window state and fused kernels (and the decoder blocks' entry
Snake in the transposed convs' epilogues), A/B on the GPU.

    OUT=DIR python benchmarks/scripts/codec_transformer_ab.py [ROUNDS]

Builds the real-size codec once (random weights, bf16 decode side) and, for each configuration
(window state ``kv`` / ``ring`` x transformer kernels off / on, and ``tconv_snake`` on with
``kv`` and with ``ring`` + kernels), in ``ROUNDS`` interleaved rounds:

* the post-quantizer transformer alone: one streaming call of 64 streams x 32 frames captured
  in a CUDA graph, replay time (median of 30), and its output against the ``kv`` modules' on
  the same input (max abs difference; bf16);
* the graphed serving decoder (``serving_decoder``): 64 x 32, 64 x 8 and 1 x 8 frame calls
  (``shoal.bench.codec.time_stream``).

Writes ``$OUT/codec-transformer-ab.json``."""

from __future__ import annotations

import json
import os
import sys

import torch

from shoal.bench.codec import build_codec, time_stream
from shoal.bench.kernels_attention import time_graph
from shoal.codec.layers import StreamState, rope_table
from shoal.codec.streaming import serving_decoder

# (window state, transformer kernels, tconv_snake)
CONFIGS = [("kv", False, False), ("ring", False, False), ("kv", True, False), ("ring", True, False),
           ("kv", False, True), ("ring", True, True)]


def transformer_call(codec, ws: str, kernels: bool, x: torch.Tensor, rope: torch.Tensor) -> dict:
    """Graph replay time and output of one 64 x 32 streaming call of the post_module."""
    codec.configure_serving(window_state=ws, transformer_kernels=kernels)
    tr = codec.quantizer.post_module
    B = x.shape[0]
    # streams 96 frames old, so the timed calls wrap the ring, as in serving
    state = StreamState(tr.init_stream_state(B, x.device, x.dtype))
    warm = torch.randn(B, x.shape[1], 96, device=x.device, dtype=x.dtype, generator=torch.Generator(x.device).manual_seed(3))
    tr(warm, state, rope)
    out = tr(x, state, rope).clone()
    us = time_graph(lambda: tr(x, state, rope), 30)
    return {"replay_ms": us / 1e3, "out": out}


def main() -> None:
    torch.set_grad_enabled(False)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    dev = torch.device("cuda")
    codec = build_codec(False, dev).to(torch.bfloat16)
    res: dict = {"gpu": torch.cuda.get_device_name(), "rounds": []}
    dim = codec.quantizer.post_module.cfg.dim
    x = torch.randn(64, dim, 32, device=dev, dtype=torch.bfloat16, generator=torch.Generator(dev).manual_seed(1))
    tr = codec.quantizer.post_module
    rope = rope_table(4096, tr.cfg.head_dim, tr.cfg.rope_base, dev)
    for r in range(rounds):
        row = {}
        base = None
        for ws, kern, tsn in CONFIGS:
            tag = f"{ws}{'+kernels' if kern else ''}{'+tconv' if tsn else ''}"
            t = transformer_call(codec, ws, kern, x, rope)
            if base is None:
                base = t["out"]
            cell = {"transformer_64x32_ms": t["replay_ms"],
                    "max_abs_diff_vs_kv": (t["out"].float() - base.float()).abs().max().item(),
                    "out_max_abs": base.float().abs().max().item()}
            codec.configure_serving(window_state=ws, transformer_kernels=kern, tconv_snake=tsn)
            dec = serving_decoder(codec, max_batch=64)
            for b, f in [(64, 32), (64, 8), (1, 8)]:
                cell[f"{b}x{f}"] = time_stream(dec, codec, b, f, 10, 3, dev)
            del dec
            torch.cuda.empty_cache()
            row[tag] = cell
            print(r, tag, f"transformer {cell['transformer_64x32_ms']:.3f} ms (diff {cell['max_abs_diff_vs_kv']:.3g})",
                  f"64x32 {cell['64x32']['call_ms']:.2f} ms {cell['64x32']['audio_s_per_s']:.0f} audio s/s",
                  f"64x8 {cell['64x8']['call_ms']:.2f} ms 1x8 {cell['1x8']['call_ms']:.2f} ms", flush=True)
            save(res, row)  # after every cell: a run cut short keeps what it measured


def save(res: dict, row: dict) -> None:
    if not res["rounds"] or res["rounds"][-1] is not row:
        res["rounds"].append(row)
    d = os.environ.get("OUT", ".")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "codec-transformer-ab.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
