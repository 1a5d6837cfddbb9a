"""``python -m shoal.bench.kernels_codec_conv``: the codec decoder's convolutions, kernel by kernel.

For every stride-1 convolution the real-size decoder runs in a streaming call of
``batch x chunk`` frames (shapes recorded from an actual call), times cuDNN (channels-first
conv1d, channels-last conv2d) against the Triton implicit-GEMM conv
(:mod:`shoal.kernels.codec_conv`) over a grid of tile configurations, in CUDA-graph replay;
then times whole streaming decode calls (graphs) with each conv backend, and breaks the
baseline call down by kernel family with the PyTorch profiler. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from .codec import HOP, SR, build_codec, random_codes
from .kernels_sampling import _graph_us as graph_time_us

BACKENDS = {"cudnn_ncl": {"channels_last": False, "triton_conv": False},
            "cudnn_nlc": {"channels_last": True, "triton_conv": False},
            "triton": {"channels_last": True, "triton_conv": True, "snake_epilogue": False},
            "triton_epilogue": {"channels_last": True, "triton_conv": True, "snake_epilogue": True},
            "triton_epilogue_k1": {"channels_last": True, "triton_conv": True, "snake_epilogue": "k1"},
            "triton_fused": {"channels_last": True, "triton_conv": True, "snake_epilogue": "fused"},
            "triton_unit": {"channels_last": True, "triton_conv": True, "snake_epilogue": "unit"},
            "triton_tiled_snake": {"channels_last": True, "triton_conv": True, "snake_epilogue": False},
            "triton_accurate_sin": {"channels_last": True, "triton_conv": True, "snake_epilogue": False}}
# environment a backend runs under (restored after it)
BACKEND_ENV = {"triton_tiled_snake": {"SHOAL_SNAKE_FLAT": "0"},
               "triton_accurate_sin": {"SHOAL_SNAKE_ACCURATE_SIN": "1"}}

# the decoder's Snake sites: (channels, samples per frame) at its four rates (44.1 kHz / 2048-sample frames)
SNAKE_SITES = ((1536, 4), (768, 32), (384, 256), (192, 1024), (96, 2048))
SAMPLES_PER_FRAME_AT = {c: n for c, n in SNAKE_SITES}

_TILES = [  # (BT, BN, BC, warps, stages)
    (128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3),
    (128, 128, 32, 4, 4), (256, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 64, 64, 4, 4),
    (128, 128, 128, 8, 2), (64, 256, 64, 8, 3), (256, 64, 64, 8, 3),
    (256, 128, 32, 8, 4), (256, 128, 32, 8, 6), (128, 256, 32, 8, 5), (128, 64, 32, 4, 4),
    (128, 256, 64, 8, 4),
]
# each tile with pointer loads, and with descriptor (TMA) loads unrolled and flat:
# (BT, BN, BC, warps, stages, TMA, FLAT), see shoal.kernels.codec_conv
CONFIGS = [t + v for t in _TILES for v in ((0, 0), (1, 0), (1, 1))]
# two output-channel tiles per program (BN + BN2 = 96 or 192 channels, no padded MMA work;
# descriptor loads): (BT, BN, BC, warps, stages, TMA, FLAT, BN2)
SPLIT_CONFIGS = [
    (256, 64, 32, 8, 6, 1, 1, 32), (256, 64, 32, 8, 5, 1, 1, 32), (256, 64, 32, 8, 4, 1, 0, 32),
    (128, 64, 32, 4, 6, 1, 1, 32), (128, 64, 32, 8, 6, 1, 1, 32), (256, 64, 32, 4, 5, 1, 1, 32),
    (128, 128, 32, 8, 5, 1, 1, 64), (128, 128, 32, 8, 6, 1, 1, 64), (128, 128, 64, 8, 4, 1, 1, 64),
    (256, 128, 32, 8, 4, 1, 1, 64), (128, 128, 32, 4, 5, 1, 1, 64), (64, 128, 64, 4, 4, 1, 1, 64),
    (128, 128, 32, 8, 4, 1, 0, 64), (128, 64, 32, 4, 4, 1, 0, 32),
]


def split_fits(cfg: tuple, c_out: int) -> bool:
    """A two-tile config is worth timing where its tiles cover ``c_out`` exactly (a whole
    number of programs) and one power-of-two tile would not."""
    bn2 = cfg[7] if len(cfg) > 7 else 0
    return not bn2 or (c_out % (cfg[1] + bn2) == 0 and c_out & (c_out - 1) != 0 and cfg[1] + bn2 <= c_out)


def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def log(msg: str) -> None:
    print(f"[codec-conv {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def record_shapes(codec, batch: int, frames: int, dev) -> list[dict]:
    """Every stride-1 conv call (C_in, C_out, K, dilation, L_in) of one streaming decode call."""
    from ..codec.layers import CausalConv1d
    from ..codec.streaming import StreamingDecoder

    seen: list[dict] = []
    orig = CausalConv1d._conv

    def spy(self, x):
        if self.stride == 1 and self.groups == 1:
            seen.append({"c_in": x.shape[1], "c_out": self.conv.out_channels, "k": self.conv.kernel_size[0],
                         "dilation": self.dilation, "l_in": x.shape[-1], "batch": x.shape[0]})
        return orig(self, x)

    CausalConv1d._conv = spy
    try:
        dec = StreamingDecoder(codec)
        st = dec.new_state(batch)
        with torch.no_grad():
            dec.decode_chunk(random_codes(batch, frames, dev), st)
    finally:
        CausalConv1d._conv = orig
    return seen


def bench_conv(shape: dict, dtype, configs) -> dict:
    from ..kernels.codec_conv import conv1d_cl_triton, pack_conv_weight

    B, ci, co, k, d, L = shape["batch"], shape["c_in"], shape["c_out"], shape["k"], shape["dilation"], shape["l_in"]
    dev = torch.device("cuda")
    w = torch.randn(co, ci, k, device=dev, dtype=dtype) / (ci * k) ** 0.5
    b = torch.randn(co, device=dev, dtype=dtype)
    x_cf = torch.randn(B, ci, L, device=dev, dtype=dtype)
    x_cl = x_cf.transpose(1, 2).contiguous().transpose(1, 2)
    w_cl = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    packed = pack_conv_weight(w)
    L_out = L - (k - 1) * d
    flops = 2.0 * B * L_out * ci * co * k
    res = dict(shape, l_out=L_out, gflop=flops / 1e9)
    ref = F.conv1d(x_cf.float(), w.float(), b.float(), 1, 0, d)
    res["cudnn_ncl_us"] = graph_time_us(lambda: F.conv1d(x_cf, w, b, 1, 0, d))
    res["cudnn_nlc_us"] = graph_time_us(lambda: F.conv2d(x_cl.unsqueeze(2), w_cl, b, 1, 0, (1, d)))
    best = None
    cells = []
    for cfg in configs:
        if len(configs) > 1 and cfg[1] > max(16, 1 << (co - 1).bit_length()) * 2:
            continue
        if not split_fits(cfg, co):
            continue
        try:
            out = conv1d_cl_triton(x_cl, packed, b, d, config=cfg)
            err = (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
            us = graph_time_us(lambda: conv1d_cl_triton(x_cl, packed, b, d, config=cfg))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a tile
            cells.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        cells.append({"config": cfg, "us": us, "rel_err": err})
        if best is None or us < best["us"]:
            best = {"config": cfg, "us": us, "rel_err": err}
    res["triton"] = cells
    res["triton_best"] = best
    for key in ("cudnn_ncl_us", "cudnn_nlc_us"):
        res[key.replace("_us", "_tflops")] = flops / res[key] / 1e6
    if best:
        res["triton_best_tflops"] = flops / best["us"] / 1e6
    return res


# residual-unit kernel tiles: (BT, BN, BC, warps, stages, TMA, FLAT, BN2) with BN + BN2 = C
UNIT_CONFIGS = {
    96: [(128, 64, 32, 8, 4, 1, 1, 32), (128, 64, 32, 4, 4, 1, 1, 32), (256, 64, 32, 8, 4, 1, 1, 32),
         (256, 64, 32, 8, 3, 1, 1, 32), (128, 64, 32, 8, 6, 1, 1, 32), (64, 64, 32, 4, 4, 1, 1, 32),
         (128, 64, 32, 8, 4, 1, 0, 32)],
    192: [(128, 128, 32, 8, 3, 1, 1, 64), (128, 128, 64, 8, 2, 1, 1, 64), (64, 128, 32, 4, 4, 1, 1, 64),
          (64, 128, 64, 4, 3, 1, 1, 64), (128, 128, 32, 8, 4, 1, 1, 64), (64, 128, 32, 8, 4, 1, 1, 64),
          (128, 128, 32, 8, 3, 1, 0, 64)],
}


def unit_inputs(C: int, B: int, L: int, dilation: int, dtype, dev: torch.device) -> tuple:
    """Random operands of one k=7 residual unit over ``B`` streams of ``L`` output positions,
    in the argument order of ``residual_unit_triton``: ``(x, w7, b7, alpha2, w1, b1, residual,
    out, snake_alpha, snake_out)`` (channels-last activations, packed weights; ``snake_out`` a
    view after the next conv's left context, as in the decoder)."""
    from ..kernels.codec_conv import pack_conv_weight

    k, pad = 7, 6 * dilation
    x = torch.randn(B, L + pad, C, device=dev, dtype=dtype).transpose(1, 2)
    w7 = pack_conv_weight(torch.randn(C, C, k, device=dev, dtype=dtype) / (C * k) ** 0.5)
    w1 = pack_conv_weight(torch.randn(C, C, 1, device=dev, dtype=dtype) / C ** 0.5)
    b7, b1 = (torch.randn(C, device=dev, dtype=dtype) for _ in range(2))
    a2, an = (torch.rand(C, device=dev, dtype=dtype) + 0.5 for _ in range(2))
    h = torch.randn(B, L, C, device=dev, dtype=dtype).transpose(1, 2)
    body = torch.empty(B, L + pad, C, device=dev, dtype=dtype).transpose(1, 2)[..., pad:]
    return x, w7, b7, a2, w1, b1, h, torch.empty_like(h), an, body


def bench_unit(C: int, B: int, L: int, dilation: int, dtype=torch.bfloat16, configs=None,
               fused_k1_configs=(), device: str = "cuda") -> dict:
    """One residual unit at a real call's size: the ``fused`` mode's two kernels (k7 conv; k1
    conv with the Snake on its input tiles, residual and next-Snake epilogue) against the
    one-kernel unit over ``configs`` (CUDA-graph replay; bit equality checked), both also
    against the ``k1`` mode's three kernels (k7 conv, Snake kernel, k1 conv) and the fp32
    PyTorch reference (largest differences). ``fused_k1_configs``: tiles for the ``fused``
    path's k1 conv (the Snake on its input tiles) checked the same way."""
    from ..kernels.codec_conv import conv1d_cl_triton
    from ..kernels.codec_unit import residual_unit_ref, residual_unit_triton
    from ..kernels.snake import snake as snake_op

    x, w7, b7, a2, w1, b1, h, h_new, an, body = unit_inputs(C, B, L, dilation, dtype, torch.device(device))
    k = w7.shape[0]

    def two():
        a = conv1d_cl_triton(x, w7, b7, dilation)
        conv1d_cl_triton(a, w1, b1, 1, residual=h, out=h_new, snake_alpha=an, snake_out=body, pre_snake_alpha=a2)

    def three():  # the ``k1`` mode's path: k7 conv, the Snake kernel, k1 conv with its epilogue
        a = conv1d_cl_triton(x, w7, b7, dilation)
        s2 = torch.empty_like(h)
        snake_op(a, a2, out=s2)
        conv1d_cl_triton(s2, w1, b1, 1, residual=h, out=h_new, snake_alpha=an, snake_out=body)

    # fp32 PyTorch reference, each step rounded as the kernels round it (no TF32)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        ref_h, ref_s = residual_unit_ref(x, w7.permute(2, 1, 0), b7, dilation, a2, w1.permute(2, 1, 0), b1, h,
                                         snake_alpha=an)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    three()
    k1_h, k1_s = h_new.clone(), body.clone()
    two()
    want_h, want_s = h_new.clone(), body.clone()

    def maxdiff(a, b):
        return (a.float() - b.float()).abs().max().item()

    res = {"c": C, "batch": B, "l": L, "dilation": dilation,
           "gflop": 2.0 * B * L * C * C * (k + 1) / 1e9, "two_kernels_us": graph_time_us(two),
           "k1_path_us": graph_time_us(three),
           "fused_equals_k1_path": bool(torch.equal(want_h, k1_h) and torch.equal(want_s, k1_s)),
           "fused_vs_ref": maxdiff(want_h, ref_h), "k1_path_vs_ref": maxdiff(k1_h, ref_h),
           "fused_vs_k1_path": maxdiff(want_h, k1_h), "unit": []}
    res["fused_k1"] = []
    for cfg in fused_k1_configs:
        try:
            a = conv1d_cl_triton(x, w7, b7, dilation)
            h_new.fill_(float("nan"))
            body.fill_(float("nan"))
            conv1d_cl_triton(a, w1, b1, 1, residual=h, out=h_new, snake_alpha=an, snake_out=body,
                             pre_snake_alpha=a2, config=cfg)
            res["fused_k1"].append({"config": cfg, "vs_k1_path": maxdiff(h_new, k1_h), "vs_ref": maxdiff(h_new, ref_h),
                                    "bit_equal_k1_path": bool(torch.equal(h_new, k1_h) and torch.equal(body, k1_s))})
            del a
        except Exception as e:  # noqa: BLE001
            res["fused_k1"].append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:160]}"})
    best = None
    for cfg in configs or UNIT_CONFIGS.get(C, []):
        # a ninth field: the k=1 conv transposed or not (``residual_unit_triton(k1_trans=...)``);
        # without it the kernel's default for the tiles (``default_k1_trans``)
        cfg, k1_trans = tuple(cfg[:8]), bool(cfg[8]) if len(cfg) > 8 else None
        try:
            h_new.fill_(float("nan"))
            body.fill_(float("nan"))
            residual_unit_triton(x, w7, b7, dilation, a2, w1, b1, h, out=h_new, snake_alpha=an,
                                 snake_out=body, config=cfg, k1_trans=k1_trans)
            same = bool(torch.equal(h_new, want_h) and torch.equal(body, want_s))
            got_h, got_s = h_new.clone(), body.clone()
            diff = (h_new.float() - want_h.float()).abs()
            mdiff = diff.max().item()
            # per output-channel tile (the first BN channels, then the rest) and the Snake'd copy
            split = {"first_tile": diff[:, :cfg[1]].max().item(),
                     "second_tile": diff[:, cfg[1]:].max().item() if C > cfg[1] else 0.0,
                     "snake_out": (body.float() - want_s.float()).abs().max().item()}
            us = graph_time_us(lambda: residual_unit_triton(x, w7, b7, dilation, a2, w1, b1, h, out=h_new,
                                                            snake_alpha=an, snake_out=body, config=cfg,
                                                            k1_trans=k1_trans))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory or registers for a tile
            res["unit"].append({"config": cfg, "k1_trans": k1_trans, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            continue
        cell = {"config": cfg, "k1_trans": k1_trans, "us": us, "bit_equal": same, "max_diff": mdiff, "max_diff_by": split,
                "bit_equal_k1_path": bool(torch.equal(got_h, k1_h) and torch.equal(got_s, k1_s)),
                "vs_k1_path": maxdiff(got_h, k1_h), "vs_ref": maxdiff(got_h, ref_h)}
        res["unit"].append(cell)
        if best is None or us < best["us"]:
            best = cell
    res["unit_best"] = best
    return res


def decode_call(codec, batch: int, frames: int, dev, iters: int = 10) -> dict:
    from ..codec.streaming import GraphedStreamingDecoder

    dec = GraphedStreamingDecoder(codec, batch_buckets=(batch,), chunk_frames=(frames,))
    codes = random_codes(batch, frames, dev, seed=5)
    st = dec.new_state(batch)
    t0 = time.perf_counter()
    dec.decode_chunk(codes, st)  # compiles (Triton), warms up and captures the graph
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    log(f"  B={batch} T={frames}: first call (compile + capture) {first_call_s:.1f} s")
    for _ in range(2):
        dec.decode_chunk(codes, st)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        out = dec.decode_chunk(codes, st)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    return {"batch": batch, "frames": frames, "call_ms": dt * 1e3, "first_call_s": first_call_s,
            "audio_s_per_s": batch * frames * HOP / SR / dt, "graph_replays": dec.stats.replays,
            "eager_calls": dec.stats.eager, "finite": bool(torch.isfinite(out).all())}


def profile_call(codec, batch: int, frames: int, dev) -> dict:
    from ..codec.streaming import StreamingDecoder

    dec = StreamingDecoder(codec)
    codes = random_codes(batch, frames, dev, seed=5)
    st = dec.new_state(batch)
    with torch.no_grad():
        dec.decode_chunk(codes, st)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            dec.decode_chunk(codes, st)
            torch.cuda.synchronize()
    fam: dict[str, float] = {}
    for e in prof.key_averages():
        t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if t <= 0:
            continue
        n = e.key.lower()
        if "conv_kernel" in n:
            k = "triton_conv"
        elif "unit_kernel" in n:
            k = "triton_unit"
        elif "snake" in n:
            k = "snake"
        elif "conv" in n or "cudnn" in n or "xmma" in n or "implicit" in n or "sm90" in n or "gemm" in n:
            k = "cudnn/cublas"
        else:
            k = "other"
        fam[k] = fam.get(k, 0.0) + t / 1e3
    top = sorted(((e.key[:90], (e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total) / 1e3)
                  for e in prof.key_averages()), key=lambda kv: -kv[1])[:25]
    return {"batch": batch, "frames": frames, "families_ms": fam, "top_kernels_ms": top}


def trace_call(codec, batch: int, frames: int, dev) -> dict:
    """Every GPU kernel of one eager streaming call, in launch order, with its duration."""
    from ..codec.streaming import StreamingDecoder

    dec = StreamingDecoder(codec)
    codes = random_codes(batch, frames, dev, seed=5)
    st = dec.new_state(batch)
    with torch.no_grad():
        for _ in range(2):
            dec.decode_chunk(codes, st)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            dec.decode_chunk(codes, st)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: e.time_range.start)
    seq = [(e.name[:70], round(e.time_range.elapsed_us(), 1)) for e in kernels]
    return {"batch": batch, "frames": frames, "kernels": seq, "total_us": sum(d for _, d in seq)}


def epilogue_call(codec, batch: int, frames: int, dev, dtype, channels=(96, 192)) -> list[dict]:
    """Each stride-1 conv shape of a call timed as a plain conv, with the Snake epilogue only,
    and with residual + output + Snake; beside it the separate Snake kernel on its output."""
    from ..kernels.codec_conv import conv1d_cl_triton
    from ..kernels.snake import snake

    rows = []
    seen = set()
    for s in record_shapes(codec, batch, frames, dev):
        key = (s["c_in"], s["c_out"], s["k"], s["dilation"], s["l_in"])
        if key in seen or s["c_out"] < 8 or s["dilation"] != 1 or s["c_in"] not in channels:
            continue
        seen.add(key)
        B, Ci, Co, K, d, L = s["batch"], s["c_in"], s["c_out"], s["k"], s["dilation"], s["l_in"]
        Lo = L - (K - 1) * d
        x = torch.randn(B, L, Ci, device=dev, dtype=dtype).transpose(1, 2)
        w = (torch.randn(K, Ci, Co, device=dev, dtype=dtype) / (K * Ci) ** 0.5).contiguous()
        bias = torch.randn(Co, device=dev, dtype=dtype)
        alpha = torch.rand(Co, device=dev, dtype=dtype) + 0.5
        res = torch.randn(B, Lo, Co, device=dev, dtype=dtype).transpose(1, 2)
        out = torch.empty_like(res)
        sn = torch.empty_like(res)
        r = {"shape": key, "batch": B}
        r["plain_us"] = graph_time_us(lambda: conv1d_cl_triton(x, w, bias, d, out=out))
        r["snake_only_us"] = graph_time_us(lambda: conv1d_cl_triton(x, w, bias, d, snake_alpha=alpha,
                                                                  snake_out=sn, write_out=False))
        r["res_out_snake_us"] = graph_time_us(lambda: conv1d_cl_triton(x, w, bias, d, residual=res, out=out,
                                                                     snake_alpha=alpha, snake_out=sn))
        with mock.patch.dict(os.environ, {"SHOAL_SNAKE_FLAT": "0"}):  # the tiled Snake kernel
            r["separate_snake_us"] = graph_time_us(lambda: snake(out, alpha, out=sn))
            r["separate_snake_residual_us"] = graph_time_us(lambda: snake(out, alpha, res, out=sn, h_out=out))
        with mock.patch.dict(os.environ, {"SHOAL_SNAKE_FLAT": "1"}):  # the flat 1-D Snake kernel on the same tensors
            r["separate_snake_flat_us"] = graph_time_us(lambda: snake(out, alpha, out=sn))
            r["separate_snake_flat_residual_us"] = graph_time_us(lambda: snake(out, alpha, res, out=sn, h_out=out))
        log(f"epilogue {key} B={B}: plain {r['plain_us']:.1f} snake-only {r['snake_only_us']:.1f} "
            f"res+out+snake {r['res_out_snake_us']:.1f} separate snake {r['separate_snake_us']:.1f} "
            f"(flat {r['separate_snake_flat_us']:.1f}), with residual {r['separate_snake_residual_us']:.1f} "
            f"(flat {r['separate_snake_flat_residual_us']:.1f}) us")
        rows.append(r)
    return rows


def snake_sweep(batch: int, frames: int, dev, dtype) -> list[dict]:
    """The standalone Snake kernel at every decoder rate (batch x frames, channels-last):
    tiled vs flat kernel, accurate vs SFU sine, plain vs residual add + ``h`` write; time and
    achieved bandwidth (bytes read + written)."""
    from ..kernels.snake import snake

    rows = []
    for C, spf in SNAKE_SITES:
        L = frames * spf
        x = torch.randn(batch, L, C, device=dev, dtype=dtype).transpose(1, 2)
        y = torch.randn(batch, L, C, device=dev, dtype=dtype).transpose(1, 2)
        alpha = torch.rand(C, device=dev, dtype=dtype) + 0.5
        sn = torch.empty_like(x)
        h = torch.empty_like(x)
        el = x.numel()
        for kernel in ("tiled", "flat"):
            for sin in ("fast", "accurate"):
                env = {"SHOAL_SNAKE_FLAT": "1" if kernel == "flat" else "0",
                       "SHOAL_SNAKE_ACCURATE_SIN": "1" if sin == "accurate" else "0"}
                with mock.patch.dict(os.environ, env):
                    plain = graph_time_us(lambda: snake(x, alpha, out=sn))
                    resid = graph_time_us(lambda: snake(x, alpha, y, out=sn, h_out=h))
                bpe = x.element_size()
                r = {"channels": C, "length": L, "batch": batch, "kernel": kernel, "sin": sin,
                     "plain_us": plain, "residual_us": resid,
                     "plain_gbs": 2 * el * bpe / plain / 1e3, "residual_gbs": 4 * el * bpe / resid / 1e3}
                rows.append(r)
                log(f"snake C={C} L={L} B={batch} {kernel:5s} {sin:8s}: plain {plain:8.1f} us "
                    f"({r['plain_gbs']:.0f} GB/s), residual+h {resid:8.1f} us ({r['residual_gbs']:.0f} GB/s)")
        del x, y, sn, h
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="codec-conv.json")
    p.add_argument("--points", default="64x32,64x8,1x8", help="batch x chunk frames")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--skip", default="", help="comma list: snake,convs,decode,epilogue,trace,profile")
    p.add_argument("--backends", default="cudnn_ncl,cudnn_nlc,triton")
    p.add_argument("--configs", default="sweep", help="sweep (16 tiles x pointer / descriptor / flat-descriptor "
                                                      "loads), table (the shipped config) or split (the shipped "
                                                      "config and two-tile BN + BN2 configs)")
    p.add_argument("--channels", default="", help="only convs with these output channel counts (comma list)")
    p.add_argument("--units", default="", help="time the one-kernel residual unit against the two convs at "
                                                "these channel counts (comma list, e.g. 96,192) for the "
                                                "first point's call, then exit")
    p.add_argument("--min-k", type=int, default=1, help="only convs with at least this many taps")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.backends.cudnn.benchmark = True
    skip = set(args.skip.split(","))
    points = [tuple(int(v) for v in s.split("x")) for s in args.points.split(",")]
    codec = build_codec(False, dev).to(dtype)
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype,
                 "convs": [], "decode": [], "profile": []}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    path = Path(args.out)

    def save():
        path.write_text(json.dumps(out, indent=1, default=str))

    if args.units:
        B, T = points[0]
        out["units"] = []
        for C in ints(args.units):
            for d in (1, 3, 9):
                r = bench_unit(C, B, T * SAMPLES_PER_FRAME_AT[C], d, dtype)
                out["units"].append(r)
                bst = r.get("unit_best") or {}
                log(f"unit C={C} d={d} B={B} T={T}: two kernels {r['two_kernels_us']:.1f} us, unit "
                    f"{bst.get('us', float('nan')):.1f} us {bst.get('config')} bit_equal={bst.get('bit_equal')}")
                for c in r["unit"]:
                    log(f"    {c}")
                save()
        return 0
    if "snake" not in skip:
        B, T = points[0]
        out["snake"] = snake_sweep(B, T, dev, dtype)
        save()
    if "convs" not in skip:
        for B, T in points:
            shapes = record_shapes(codec, B, T, dev)
            uniq = {}
            for s in shapes:
                uniq.setdefault(tuple(sorted(s.items())), [s, 0])[1] += 1
            for s, count in uniq.values():
                if s["k"] < args.min_k:
                    continue
                if args.channels and s["c_out"] not in ints(args.channels):
                    continue
                from ..kernels.codec_conv import conv_config

                cfgs = CONFIGS if args.configs == "sweep" else [conv_config(s["c_in"], s["c_out"], s["l_in"], s["k"])]
                if args.configs == "split":
                    cfgs = cfgs + SPLIT_CONFIGS
                r = bench_conv(s, dtype, cfgs)
                r["count_per_call"] = count
                out["convs"].append(r)
                best = r.get("triton_best") or {}
                log(f"B={B} T={T} {s['c_in']}->{s['c_out']} k{s['k']} d{s['dilation']} L={s['l_in']} x{count}: "
                    f"cudnn ncl {r['cudnn_ncl_us']:.1f} nlc {r['cudnn_nlc_us']:.1f} triton {best.get('us', float('nan')):.1f} us "
                    f"{best.get('config')} ({r.get('triton_best_tflops', 0):.0f} TFLOP/s, err {best.get('rel_err', 0):.1e})")
                save()
    if "decode" not in skip:
        for B, T in points:
            for name, kw in BACKENDS.items():
                if name not in args.backends.split(","):
                    continue
                codec.configure_serving(**kw)
                try:
                    with mock.patch.dict(os.environ, BACKEND_ENV.get(name, {})):
                        r = decode_call(codec, B, T, dev)
                except Exception as e:  # noqa: BLE001
                    r = {"batch": B, "frames": T, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                r["backend"] = name
                out["decode"].append(r)
                log(f"decode {name} B={B} T={T}: {r.get('call_ms', float('nan')):.2f} ms "
                    f"{r.get('audio_s_per_s', 0):.0f} audio s/s")
                save()
                torch.cuda.empty_cache()
    if "epilogue" not in skip:
        B, T = points[-1]
        codec.configure_serving(**BACKENDS["cudnn_nlc"])  # shapes are recorded on the cuDNN path
        out["epilogue"] = epilogue_call(codec, B, T, dev, dtype)
        save()
    if "trace" not in skip:
        B, T = points[-1]
        out["trace"] = []
        for name in args.backends.split(","):
            codec.configure_serving(**BACKENDS[name])
            r = trace_call(codec, B, T, dev)
            r["backend"] = name
            out["trace"].append(r)
            log(f"trace {name} B={B} T={T}: {len(r['kernels'])} kernels, {r['total_us'] / 1e3:.2f} ms")
            for k, us in r["kernels"]:
                log(f"   {us:9.1f} us  {k}")
            save()
    if "profile" not in skip:
        for name in args.backends.split(","):
            codec.configure_serving(**BACKENDS[name])
            B, T = points[0]
            r = profile_call(codec, B, T, dev)
            r["backend"] = name
            out["profile"].append(r)
            log(f"profile {name} B={B} T={T}: {r['families_ms']}")
            save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
