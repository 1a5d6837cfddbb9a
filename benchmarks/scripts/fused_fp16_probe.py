"""Where the opt-in ``fused`` Snake mode departs from ``k1`` in fp16 (GPU).

    python benchmarks/scripts/fused_fp16_probe.py [dtype ...]

Replays ``tests/test_codec_conv.py::test_gpu_graphed_fused_decoder_equals_eager_k1`` (tiny
random codec, 3 streams, chunks of 4, 4 and 8 frames, row groups of 16 positions) and prints,
for the eager ``fused`` decoder and the graphed one against the eager ``k1`` decoder: the
non-finite samples of each output, how many finite samples differ and by how much, and the
first differing chunk. Writes ``$OUT/fused-fp16-probe.json`` when ``OUT`` is set."""

from __future__ import annotations

import json
import os
import sys

import torch

from shoal.bench.codec import build_codec, random_codes
from shoal.codec import StreamingDecoder
from shoal.codec.streaming import GraphedStreamingDecoder, pack_conv_weights

CHUNKS = ((0, 4), (4, 4), (8, 8))


def decode(dec, codes) -> list[torch.Tensor]:
    st = dec.new_state(codes.shape[0])
    return [dec.decode_chunk(codes[:, :, i:i + t], st) for i, t in CHUNKS]


def compare(name: str, got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    rows = []
    for (i, t), a, b in zip(CHUNKS, got, ref):
        fin = torch.isfinite(a) & torch.isfinite(b)
        d = (a.float() - b.float()).abs()[fin]
        rows.append({"frames": [i, t], "nonfinite_got": int((~torch.isfinite(a)).sum()),
                     "nonfinite_ref": int((~torch.isfinite(b)).sum()),
                     "finite_differ": int((d > 0).sum()), "max_abs": float(d.max()) if d.numel() else 0.0,
                     "ref_absmax": float(b.float()[torch.isfinite(b)].abs().max()),
                     "equal_nan_equal": bool(torch.equal(torch.nan_to_num(a, 7.0, 8.0, -8.0),
                                                         torch.nan_to_num(b, 7.0, 8.0, -8.0)))})
    print(name, json.dumps(rows), flush=True)
    return {"name": name, "chunks": rows}


def main() -> None:
    torch.set_grad_enabled(False)
    names = sys.argv[1:] or ["float16", "bfloat16"]
    out = []
    for dn in names:
        dtype = getattr(torch, dn)
        codec = build_codec(True, torch.device("cuda")).to(dtype)
        codes = random_codes(3, 16, "cuda", seed=6)
        try:
            codec.configure_serving(channels_last=True, triton_conv=True, snake_epilogue="k1", group_positions=16)
            ref = decode(StreamingDecoder(codec), codes)
            codec.configure_serving(snake_epilogue="fused")
            pack_conv_weights(codec)
            eager = decode(StreamingDecoder(codec), codes)
            graphed = decode(GraphedStreamingDecoder(codec, chunk_frames=(4, 8), max_batch=4), codes)
            codec.configure_serving(group_positions=None)
            nogroup = decode(StreamingDecoder(codec), codes)
            codec.configure_serving(snake_epilogue="k1")
            ref_nogroup = decode(StreamingDecoder(codec), codes)
        finally:
            codec.configure_serving(channels_last=False, triton_conv=False, snake_epilogue=False, group_positions=None)
        out.append({"dtype": dn, "cases": [compare(f"{dn} eager fused vs k1", eager, ref),
                                           compare(f"{dn} graphed fused vs k1", graphed, ref),
                                           compare(f"{dn} graphed vs eager fused", graphed, eager),
                                           compare(f"{dn} no groups: fused vs k1", nogroup, ref_nogroup),
                                           compare(f"{dn} k1: groups vs none", ref, ref_nogroup)]})
    d = os.environ.get("OUT")
    if d:
        with open(os.path.join(d, "fused-fp16-probe.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
