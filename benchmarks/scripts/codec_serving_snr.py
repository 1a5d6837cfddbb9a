"""The bf16 serving decoder's error against the fp32 one-shot decode, per configuration.

    python benchmarks/scripts/codec_serving_snr.py

Builds the real-size codec with random weights, decodes 4 streams x 96 frames in fp32 in one
shot (TF32 off) as the reference, then streams the same codes through the graphed bf16
serving decoder (chunks of 8, 8, 16, 32, 32 frames) under each configuration of the codec
transformer's window state, its fused kernels and the blocks' entry Snakes, and reports the
error (max abs, rms, SNR in dB). The bf16 path's error is a property of the precision; a
configuration that adds error of its own shows up as a lower SNR than ``kv``'s.
Writes ``$OUT/codec-serving-snr.json``.
"""
from __future__ import annotations

import copy
import json
import os

import torch

from shoal.bench.codec import build_codec, error_stats, random_codes
from shoal.codec.streaming import serving_decoder

CONFIGS = [("kv", False, False), ("ring", False, False), ("ring", True, False), ("ring", True, True)]
SCHEDULE = [8, 8, 16, 32, 32]


def main() -> None:
    torch.set_grad_enabled(False)
    dev = torch.device("cuda")
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    codec32 = build_codec(False, dev)
    codes = random_codes(4, sum(SCHEDULE), dev, seed=5)
    ref = codec32.decode(codes).float()
    res = {"gpu": torch.cuda.get_device_name(), "schedule": SCHEDULE, "streams": 4, "configs": {}}
    for ws, kern, tsn in CONFIGS:
        tag = f"{ws}{'+kernels' if kern else ''}{'+tconv' if tsn else ''}"
        codec16 = copy.deepcopy(codec32).to(torch.bfloat16)
        codec16.configure_serving(window_state=ws, transformer_kernels=kern, tconv_snake=tsn)
        dec = serving_decoder(codec16, max_batch=4)
        st = dec.new_state(4)
        chunks, i = [], 0
        for t in SCHEDULE:
            chunks.append(dec.decode_chunk(codes[:, :, i:i + t], st).float())
            i += t
        got = torch.cat(chunks, -1)[..., :ref.shape[-1]]
        res["configs"][tag] = error_stats(got, ref)
        print(tag, {k: round(v, 5) for k, v in res["configs"][tag].items()}, flush=True)
        del dec, st, codec16
        torch.cuda.empty_cache()
    d = os.environ.get("OUT", ".")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "codec-serving-snr.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
