"""The codec decoder's Triton implicit-GEMM convolution (shoal/kernels/codec_conv.py).

Interpreter cases run in a subprocess (this file as a script with ``TRITON_INTERPRET=1``, see
tests/interpreter_worker.py): the kernel against ``F.conv1d`` over kernel sizes, dilations,
channel counts that are not multiples of the tiles, strided input views, the residual
epilogue, fp32 and bf16; and the tiny golden codec decoded with the kernel (one-shot equals
the golden waveform, streaming equals one-shot). GPU tests skip without CUDA.
"""

import os

if __name__ == "__main__":  # interpreter worker: must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from interpreter_worker import assert_case, report_cases, run_worker

from shoal.kernels import codec_conv as cc

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"
TINY = GOLDEN / "codec_tiny"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (B, C_in, C_out, K, dilation, L_out, residual, strided input view)
SHAPES = {
    "k7_d1": (2, 24, 40, 7, 1, 50, False, False),
    "k7_d3_res": (2, 40, 24, 7, 3, 37, True, False),
    "k7_d9_view": (1, 16, 16, 7, 9, 130, False, True),
    "k1_res": (3, 33, 33, 1, 1, 70, True, False),
    "k1_short": (2, 8, 70, 1, 1, 5, False, True),
    # whole channel slices (C_in a multiple of the tile's BC): what the TMA variant reads
    "k7_d3_res_whole": (3, 32, 48, 7, 3, 37, True, True),
    "k1_res_whole": (2, 64, 32, 1, 1, 70, True, True),
}
INTERP_CASES = ([f"{dt}_{s}" for dt in ("fp32", "bf16") for s in SHAPES]
                + ["flat_fp32_k7_d9_view", "flat_bf16_k7_d3_res",
                   "tma_fp32_k7_d9_view", "tma_bf16_k7_d3_res_whole", "tma_fp32_k1_res_whole",
                   "tma_flat_fp32_k7_d3_res_whole", "tma_fp32_k7_d3_res", "tma_golden_decode_fp32",
                   "golden_decode_fp32", "golden_decode_fp32_separate_snakes",
                   "golden_decode_fp32_k1_epilogues", "golden_decode_fp32_fused",
                   "golden_decode_fp32_row_groups", "pre_snake_bf16", "pre_snake_fp32",
                   "tma_pre_snake_bf16", "fused_entry_bf16", "tma_fused_entry_bf16", "fused_vs_k1_fp16",
                   "tma_failure_falls_back", "split_fp32", "split_bf16"])


def conv_inputs(name: str, dt: torch.dtype):
    B, ci, co, k, d, L_out, res, view = SHAPES[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    L_in = L_out + (k - 1) * d
    pad = 5 if view else 0  # a view inside a longer channels-last buffer (a carried context)
    buf = torch.randn(B, L_in + pad, ci, generator=g).to(dt).transpose(1, 2)
    x = buf[..., pad:]
    w = (torch.randn(co, ci, k, generator=g) / (ci * k) ** 0.5).to(dt)
    b = torch.randn(co, generator=g).to(dt)
    r = torch.randn(B, co, L_out, generator=g).to(dt) if res else None
    return x, w, b, d, r


def _conv_case(dt_name: str, shape: str) -> dict:
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt_name]
    x, w, b, d, r = conv_inputs(shape, dt)
    import triton.tools.tensor_descriptor as td

    made = []
    real_desc = td.TensorDescriptor
    td.TensorDescriptor = lambda *a, **k: (made.append(a[0].shape), real_desc(*a, **k))[1]
    try:
        out = cc.conv1d_cl_triton(x, cc.pack_conv_weight(w), b, d, residual=r)
    finally:
        td.TensorDescriptor = real_desc
    ref = F.conv1d(x.float(), w.float(), b.float(), 1, 0, d)
    checks, flags = {}, {}
    if dt == torch.float32:
        if r is not None:
            ref = r + ref
        checks["rel_err"] = ((out - ref).abs().max().item() / ref.abs().max().item(), 1e-5)
    else:
        # one rounding of the fp32 result (two with the residual: conv, then the sum)
        conv16 = ref.to(dt)
        expect = conv16 if r is None else (r.float() + conv16.float()).to(dt)
        tol = 2 * torch.finfo(dt).eps * expect.float().abs().max().item()
        checks["abs_err"] = ((out.float() - expect.float()).abs().max().item(), tol)
    if os.environ.get("SHOAL_CODEC_CONV_TMA") == "1":
        # the descriptor path runs only on whole channel slices; others fall back to pointers
        bc = cc.conv_config(x.shape[1], w.shape[0], 0)[2]
        flags["tma_path_as_expected"] = cc._tma_ok(x, cc.pack_conv_weight(w), bc) == (x.shape[1] % 16 == 0)
        # the launch took the path the predicate chose (two descriptors: input and weight)
        flags["descriptors_made"] = len(made) == (2 if x.shape[1] % 16 == 0 else 0)
    else:
        flags["no_descriptors"] = not made
    flags["channels_last_out"] = out.stride(1) == 1 or out.shape[1] == 1
    flags["shape"] = tuple(out.shape) == tuple(ref.shape)
    return {"checks": checks, "flags": flags}


def _golden_decode_case(snake_epilogue: bool = True, pack: bool = False, frames: int = 4,
                        chunks: tuple[int, ...] = (3, 1)) -> dict:
    """``pack``: the weights packed ahead of the first call as serving packs them (each conv's
    weight held once: the transposed convs' packed over their own storage). The default mode
    decodes 4 golden frames (streamed 3 + 1); the other modes 2 (1 + 1), since every
    interpreted frame costs seconds (the module path's tests decode all of them)."""
    from safetensors.torch import load_file

    from shoal.codec import CodecConfig, StreamingDecoder, load_codec

    golden = load_file(str(TINY / "outputs" / "codec_golden_fp32.safetensors"))
    codec = load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json"))
    codes = golden["decode_encoded.input_codes"][None][..., :frames]  # causal: a prefix decodes to a prefix
    wave = golden["decode_encoded.waveform"].flatten()
    ref = codec.decode(codes)  # the module path: F.conv1d channels-first
    codec.configure_serving(channels_last=True, triton_conv=True, snake_epilogue=snake_epilogue)
    if pack:
        from shoal.codec.streaming import pack_conv_weights

        pack_conv_weights(codec)
    used = []
    dec_mod = codec.decoder
    for name in ("_forward_triton", "_forward_fused"):
        real = getattr(dec_mod, name)
        setattr(dec_mod, name, (lambda real, name: lambda *a: (used.append(name), real(*a))[1])(real, name))
    from shoal.codec import layers as codec_layers
    from shoal.codec import model as codec_model

    entries, prologues = [], []
    real_entry, real_conv = codec_layers.CausalConvTranspose1d.gemm_forward_snake, codec_model.conv1d_cl_triton
    codec_layers.CausalConvTranspose1d.gemm_forward_snake = lambda self, *a: (entries.append(1), real_entry(self, *a))[1]
    codec_model.conv1d_cl_triton = lambda *a, **k: (prologues.append(k.get("pre_snake_alpha") is not None),
                                                    real_conv(*a, **k))[1]
    try:
        out = codec.decode(codes)
        dec = StreamingDecoder(codec)
        st = dec.new_state(1)
        outs, i = [], 0
        for t in chunks:
            outs.append(dec.decode_chunk(codes[:, :, i:i + t], st))
            i += t
    finally:
        codec_layers.CausalConvTranspose1d.gemm_forward_snake = real_entry
        codec_model.conv1d_cl_triton = real_conv
    streamed = torch.cat(outs, -1)
    fused = snake_epilogue == "fused"
    checks = {"oneshot_vs_golden": ((out.flatten() - wave[: out.numel()]).abs().max().item(), 1e-5),
              "oneshot_vs_ref": ((out - ref).abs().max().item(), 1e-5),
              "stream_vs_ref": ((streamed - ref[..., : streamed.shape[-1]]).abs().max().item(), 1e-4)}
    want = "_forward_triton" if snake_epilogue else "_forward_fused"
    return {"checks": checks, "flags": {"used_kernel": _kernel_used(codec),
                                        "decoder_path": bool(used) and set(used) == {want},
                                        # the fused mode's two fusions ran (and only in it)
                                        "fused_entries": bool(entries) == fused,
                                        "fused_prologues": any(prologues) == fused,
                                        # packed ahead: every 2-tap transposed conv keeps one copy
                                        "transposed_shared": not pack or all(
                                            m.shares_packed_weight and m.conv.weight.numel() == 0
                                            for m in codec.decoder.modules() if getattr(m, "as_gemm", False))}}


def _fused_entry_case() -> dict:
    """A transposed conv's 2-tap GEMM with the bias and the Snake in its epilogue
    (``gemm_forward_snake``) writes the bits of ``gemm_forward`` followed by the Snake kernel
    with the bias (bf16: the bias is added after the GEMM's rounding), into a buffer after a
    context as the decoder does."""
    from shoal.codec.layers import CausalConvTranspose1d
    from shoal.kernels.snake import snake

    torch.manual_seed(5)
    dt, B, ci, co, st, L, pad = torch.bfloat16, 2, 32, 16, 4, 9, 6
    ct = CausalConvTranspose1d(ci, co, 2 * st, stride=st, weight_norm=False).to(dt)
    with torch.no_grad():
        ct.conv.bias.normal_()
    ct.channels_last, ct.triton_conv = True, True
    alpha = (torch.rand(1, co, 1) + 0.5).to(dt)
    buf = ct.input_buffer(torch.zeros(B, ci, L, dtype=dt), L)
    buf.copy_(torch.randn(B, ci, L + 1).to(dt))
    # the GEMM's fp32 sums (the fp32 kernel reads the same tiles; the interpreter's bf16
    # store truncates, the GPU's rounds to nearest even like torch's cast), then the bias
    y32 = cc.conv1d_cl_triton(buf.float(), ct.packed_weight().float(), None, 1)
    y = y32.transpose(1, 2).reshape(B, st * L, co).transpose(1, 2).to(dt)
    want_h = y + ct.conv.bias[None, :, None]
    want_s = snake(want_h, alpha)[0]
    h = torch.empty(B, st * L, co, dtype=dt).transpose(1, 2)
    cbuf = torch.full((B, pad + st * L, co), 7.0, dtype=dt).transpose(1, 2)
    ct.gemm_forward_snake(buf, alpha, h, cbuf[..., pad:])
    return {"checks": {"h_diff": ((h.float() - want_h.float()).abs().max().item(), 0.0),
                       "s_diff": ((cbuf[..., pad:].float() - want_s.float()).abs().max().item(), 0.0)},
            "flags": {"context_untouched": bool((cbuf[..., :pad] == 7).all()),
                      "bias_matters": not torch.equal(h, y)}}


def _tma_failure_case() -> dict:
    """A descriptor variant that fails to build (an older Triton or GPU) runs on pointer loads,
    with one warning, and is not tried again."""
    import logging

    x, w, b, d, r = conv_inputs("k7_d3_res_whole", torch.float32)
    packed = cc.pack_conv_weight(w)
    real, calls = cc._kernel, []

    class Failing:
        def __getitem__(self, grid):
            def run(*a, **k):
                calls.append(k["TMA"])
                if k["TMA"]:
                    raise RuntimeError("no descriptors here")
                return real()[grid](*a, **k)
            return run

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    cc.log.addHandler(handler)
    cc._kernel = Failing
    try:
        cfg = tuple(cc.conv_config(32, 48, 0, 7)[:5]) + (1, 0)
        first = cc.conv1d_cl_triton(x, packed, b, d, residual=r, config=cfg)
        second = cc.conv1d_cl_triton(x, packed, b, d, residual=r, config=cfg)
    finally:
        cc._kernel = real
        cc.log.removeHandler(handler)
    failed = len(cc._TMA_FAILED)
    cc._TMA_FAILED.clear()  # later cases in this worker may use the variant
    plain = cc.conv1d_cl_triton(x, packed, b, d, residual=r, config=cfg[:5] + (0, 0))
    return {"checks": {"first_diff": ((first - plain).abs().max().item(), 0.0),
                       "second_diff": ((second - plain).abs().max().item(), 0.0)},
            "flags": {"tried_once_then_pointers": calls == [True, False, False], "remembered": failed == 1,
                      "one_warning": len(records) == 1 and "pointer loads" in records[0].getMessage()}}


def _fused_vs_k1_case() -> dict:
    """The whole tiny decoder in fp16 (whose interpreter casts round to nearest even, as the
    GPU's do): the fused Snake mode gives the bits of the default k1 mode, one-shot and
    streamed in row groups."""
    from shoal.bench.codec import build_codec, random_codes
    from shoal.codec import StreamingDecoder

    codec = build_codec(True, torch.device("cpu")).to(torch.float16)
    codes = random_codes(2, 2, "cpu", seed=9)
    outs = {}
    for mode in ("k1", "fused"):
        # groups of 4 positions: each chunk's 2 streams run as 2 groups
        codec.configure_serving(channels_last=True, triton_conv=True, snake_epilogue=mode, group_positions=4)
        dec = StreamingDecoder(codec)
        st = dec.new_state(2)
        outs[mode] = torch.cat([dec.decode_chunk(codes[:, :, i:i + 1], st) for i in range(2)], -1)
    diff = (outs["fused"].float() - outs["k1"].float()).abs().max().item()
    return {"checks": {"streamed_diff": (diff, 0.0)},
            "flags": {"finite": bool(torch.isfinite(outs["fused"]).all())}}


def _split_case(dt: torch.dtype) -> dict:
    """Two output-channel tiles per program (``BN2``): the bits of the one-tile config, with
    every epilogue (bias, residual, Snake) and the input Snake, on pointer and descriptor
    loads, unrolled and flat; 48 = 32 + 16 channels (whole programs) and 40 (the second tile
    partly masked)."""
    from shoal.kernels.snake import snake

    g = torch.Generator().manual_seed(13)
    checks, flags = {}, {}
    for co, k, d in ((48, 7, 3), (40, 3, 1), (48, 1, 1)):
        B, ci, L = 2, 32, 29
        L_in = L + (k - 1) * d
        x = torch.randn(B, L_in + 3, ci, generator=g).to(dt)[:, 3:].transpose(1, 2)
        w = (torch.randn(co, ci, k, generator=g) / (ci * k) ** 0.5).to(dt)
        b = torch.randn(co, generator=g).to(dt)
        r = torch.randn(B, co, L, generator=g).to(dt)
        alpha = (torch.rand(co, generator=g) + 0.5).to(dt)
        pre = (torch.rand(ci, generator=g) + 0.5).to(dt) if k == 1 else None
        packed = cc.pack_conv_weight(w)
        one_s = torch.empty(B, L, co, dtype=dt).transpose(1, 2)
        one = cc.conv1d_cl_triton(x, packed, b, d, residual=r, snake_alpha=alpha, snake_out=one_s,
                                  pre_snake_alpha=pre, config=(16, 64, 16, 4, 2, 0, 0))
        xin = x if pre is None else snake(x, pre)[0]
        ref = r.float() + F.conv1d(xin.float(), w.float(), b.float(), 1, 0, d)
        tol = 1e-5 if dt == torch.float32 else 4 * torch.finfo(dt).eps * ref.abs().max().item()
        ulp = 8 * torch.finfo(torch.float32).eps if dt == torch.float32 else torch.finfo(dt).eps
        checks[f"one_tile_vs_ref_{co}_k{k}"] = ((one.float() - ref).abs().max().item(), tol)
        for tma, flat in ((0, 0), (0, 1), (1, 0), (1, 1)):
            got_s = torch.full_like(one_s, float("nan"))
            got = cc.conv1d_cl_triton(x, packed, b, d, residual=r, snake_alpha=alpha, snake_out=got_s,
                                      pre_snake_alpha=pre, config=(16, 32, 16, 4, 2, tma, flat, 16))
            key = f"{co}_k{k}_tma{tma}_flat{flat}"
            # Another tile shape may sum in another order (the interpreter's matmul blocks by
            # shape and CPU): a few units in the last place, never an indexing error's O(1).
            checks[f"out_{key}"] = ((got.float() - one.float()).abs().max().item(), ulp * one.float().abs().max().item())
            checks[f"snake_{key}"] = ((got_s.float() - one_s.float()).abs().max().item(),
                                      ulp * one_s.float().abs().max().item())
            flags[f"all_written_{key}"] = bool(torch.isfinite(got_s).all())
    return {"checks": checks, "flags": flags}


def _pre_snake_case(dt: torch.dtype, ci: int = 40) -> dict:
    """A k=1 conv with ``pre_snake_alpha`` equals the Snake kernel followed by the plain conv,
    bit for bit (residual and epilogue Snake included), on a view after a context."""
    from shoal.kernels.snake import snake

    g = torch.Generator().manual_seed(11)
    B, co, L = 2, 48, 37  # 40 input channels: a partly masked channel slice; 32: whole (TMA)
    x = torch.randn(B, L + 3, ci, generator=g).to(dt)[:, 3:].transpose(1, 2)
    w = (torch.randn(co, ci, 1, generator=g) / ci ** 0.5).to(dt)
    b = torch.randn(co, generator=g).to(dt)
    alpha = (torch.rand(ci, generator=g) + 0.5).to(dt)
    alpha2 = (torch.rand(co, generator=g) + 0.5).to(dt)
    r = torch.randn(B, co, L, generator=g).to(dt)
    s = snake(x, alpha)[0]
    packed = cc.pack_conv_weight(w)
    want_s = torch.empty(B, L, co, dtype=dt).transpose(1, 2)
    got_s = torch.empty_like(want_s)
    want = cc.conv1d_cl_triton(s, packed, b, 1, residual=r, snake_alpha=alpha2, snake_out=want_s)
    got = cc.conv1d_cl_triton(x, packed, b, 1, residual=r, snake_alpha=alpha2, snake_out=got_s, pre_snake_alpha=alpha)
    plain = cc.conv1d_cl_triton(x, packed, b, 1, residual=r)
    return {"checks": {"out_diff": ((got.float() - want.float()).abs().max().item(), 0.0),
                       "snake_out_diff": ((got_s.float() - want_s.float()).abs().max().item(), 0.0)},
            "flags": {"snake_changes_the_input": not torch.equal(plain, got)}}


def _row_groups_case() -> dict:
    """Two streams decoded in two chunks with the high-rate blocks in row groups of one
    stream (the serving path, k=1 epilogues) equal the same decode in one group."""
    from shoal.codec import CodecConfig, StreamingDecoder, load_codec

    codec = load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json"))
    codec.configure_serving(channels_last=True, triton_conv=True, snake_epilogue="k1")
    g = torch.Generator().manual_seed(3)
    codes = torch.cat([torch.randint(0, 4096, (2, 1, 2), generator=g),
                       torch.randint(0, 1024, (2, 9, 2), generator=g)], 1)

    def run(group_positions):
        codec.configure_serving(group_positions=group_positions)
        dec = StreamingDecoder(codec)
        st = dec.new_state(2)
        outs, i = [], 0
        for t in (1, 1):
            outs.append(dec.decode_chunk(codes[:, :, i:i + t], st))
            i += t
        return torch.cat(outs, -1), st

    whole, st_whole = run(None)
    calls = []
    real = codec.decoder.row_groups
    codec.decoder.row_groups = lambda *a: (calls.append(real(*a)), calls[-1])[1]
    grouped, st_grouped = run(1)
    state_diff = max((st_whole.tensors[k].float() - st_grouped.tensors[k].float()).abs().max().item()
                     for k in st_whole.tensors)
    codec.configure_serving(group_head_blocks=0)  # the first block in the groups too
    grouped0, st_grouped0 = run(1)
    codec.configure_serving(group_head_blocks=1)
    state_diff0 = max((st_whole.tensors[k].float() - st_grouped0.tensors[k].float()).abs().max().item()
                      / max(1.0, st_whole.tensors[k].float().abs().max().item()) for k in st_whole.tensors)
    return {"checks": {"grouped_vs_whole": ((grouped - whole).abs().max().item(), 1e-6),
                       "state_diff": (state_diff, 1e-6),
                       "grouped_all_blocks_vs_whole": ((grouped0 - whole).abs().max().item(), 1e-6),
                       "state_diff_all_blocks_rel": (state_diff0, 1e-6)},
            "flags": {"split": bool(calls) and all(len(c) == 2 for c in calls),
                      "used_kernel": _kernel_used(codec)}}


def _kernel_used(codec) -> bool:
    from shoal.codec.layers import CausalConv1d

    return any(m._packed is not None for m in codec.decoder.modules() if isinstance(m, CausalConv1d))


def _interp_case(name: str) -> dict:
    short = dict(frames=2, chunks=(1, 1))
    if name == "golden_decode_fp32":  # tma_golden_decode_fp32: the descriptor loads, short
        return _golden_decode_case(**(short if os.environ.get("SHOAL_CODEC_CONV_TMA") == "1" else {}))
    if name == "golden_decode_fp32_separate_snakes":
        return _golden_decode_case(snake_epilogue=False, **short)
    if name == "golden_decode_fp32_k1_epilogues":
        return _golden_decode_case(snake_epilogue="k1", pack=True, **short)
    if name == "golden_decode_fp32_fused":
        return _golden_decode_case(snake_epilogue="fused", pack=True, **short)
    if name == "fused_entry_bf16":
        return _fused_entry_case()
    if name == "pre_snake_bf16":
        return _pre_snake_case(torch.bfloat16, 32 if os.environ.get("SHOAL_CODEC_CONV_TMA") == "1" else 40)
    if name == "tma_failure_falls_back":
        return _tma_failure_case()
    if name == "fused_vs_k1_fp16":
        return _fused_vs_k1_case()
    if name == "pre_snake_fp32":
        return _pre_snake_case(torch.float32)
    if name in ("split_fp32", "split_bf16"):
        return _split_case(torch.float32 if name == "split_fp32" else torch.bfloat16)
    if name == "golden_decode_fp32_row_groups":
        return _row_groups_case()
    if name.startswith("tma_"):  # operands read through tensor descriptors
        os.environ["SHOAL_CODEC_CONV_TMA"] = "1"
        try:
            return _interp_case(name[len("tma_"):])
        finally:
            del os.environ["SHOAL_CODEC_CONV_TMA"]
    if name.startswith("flat_"):  # the (tap, channel-slice) single-loop variant
        os.environ["SHOAL_CODEC_CONV_FLAT"] = "1"
        try:
            return _interp_case(name[len("flat_"):])
        finally:
            del os.environ["SHOAL_CODEC_CONV_FLAT"]
    dt_name, shape = name.split("_", 1)
    return _conv_case(dt_name, shape)


@pytest.fixture(scope="module")
def interp_results():
    if not cc.HAS_TRITON:
        pytest.skip("triton not installed")
    return run_worker(__file__)


@pytest.mark.parametrize("name", INTERP_CASES)
def test_codec_conv_interpreter(interp_results, name):
    if "golden_decode_fp32" in name and not (TINY / "codec.pth").is_file():
        pytest.skip("golden vectors not available")
    assert_case(interp_results[name], need_any=True)


# --------------------------------------------------------------------------------------
# Reference, validation, configuration
# --------------------------------------------------------------------------------------


def test_reference_is_conv1d_plus_residual():
    x, w, b, d, r = conv_inputs("k7_d3_res", torch.float32)
    assert torch.equal(cc.conv1d_cl_ref(x, w, b, d, r), r + F.conv1d(x, w, b, 1, 0, d))


def test_pack_layout():
    w = torch.randn(5, 3, 7)
    p = cc.pack_conv_weight(w)
    assert p.shape == (7, 3, 5) and p.is_contiguous()
    assert torch.equal(p[2, 1], w[:, 1, 2])
    with pytest.raises(ValueError):
        cc.pack_conv_weight(torch.randn(5, 3))


def test_triton_conv_needs_channels_last():
    from shoal.codec import CodecConfig, load_codec

    if not (TINY / "codec.pth").is_file():
        pytest.skip("golden vectors not available")
    codec = load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json"), device="cpu")
    with pytest.raises(ValueError, match="channels_last"):
        codec.configure_serving(channels_last=False, triton_conv=True)


def test_serving_default_by_dtype(monkeypatch):
    """Unset: Triton convs for 16-bit codecs only (measured there); 1 forces, 0 refuses."""
    if not cc.HAS_TRITON:
        pytest.skip("triton not installed")
    monkeypatch.delenv("SHOAL_CODEC_TRITON_CONV", raising=False)
    assert cc.codec_conv_enabled(torch.bfloat16) and cc.codec_conv_enabled(torch.float16)
    assert not cc.codec_conv_enabled(torch.float32)
    monkeypatch.setenv("SHOAL_CODEC_TRITON_CONV", "1")
    assert cc.codec_conv_enabled(torch.float32)
    monkeypatch.setenv("SHOAL_CODEC_TRITON_CONV", "0")
    assert not cc.codec_conv_enabled(torch.bfloat16)
    monkeypatch.setenv("SHOAL_CODEC_TRITON_CONV", "off")
    assert not cc.codec_conv_enabled(torch.bfloat16)
    monkeypatch.setenv("SHOAL_CODEC_TRITON_CONV", "")  # empty: auto, not "forced on"
    assert not cc.codec_conv_enabled(torch.float32) and cc.codec_conv_enabled(torch.bfloat16)


def test_tma_needs_aligned_whole_slices():
    """The descriptor path's preconditions (CPU tensors: the GPU capability gate is not
    consulted): channels-last, 16-byte aligned base, whole channel slices, row batch strides."""
    buf = torch.zeros(2, 40, 32, dtype=torch.bfloat16)
    x = buf.transpose(1, 2)  # [B, C, L], channels-last memory
    packed = torch.zeros(7, 32, 48, dtype=torch.bfloat16)
    assert cc._tma_ok(x, packed, 32)
    assert not cc._tma_ok(x, packed, 64)  # a 64-wide slice would run into the next tap
    assert not cc._tma_ok(buf.flatten()[1:1 + 2 * 39 * 32].view(2, 39, 32).transpose(1, 2), packed, 32)  # 2-byte offset
    assert not cc._tma_ok(torch.zeros(2, 32, 40, dtype=torch.bfloat16), packed, 32)  # channels-first
    assert cc._tma_ok(buf[:, 8:].transpose(1, 2), packed, 32)  # a view after a context
    assert cc._tma_ok(buf[:1].transpose(1, 2), packed, 32)


def test_fit_stages():
    assert cc.fit_stages(256, 128, 32, 6, 2, 195 * 1024) == 6  # 144 KiB
    assert cc.fit_stages(128, 256, 64, 4, 2, 131 * 1024) == 2  # 48 KiB a stage: an A100-sized budget
    assert cc.fit_stages(128, 256, 64, 4, 2, 1024) == 2  # never below two


def test_fp32_tiles_fit_shared_memory():
    """An fp32 conv on a bf16-tuned config (deep pipelines) gets tiles that compile: each
    shipped config, once shrunk, keeps its operand tiles within the budget."""
    for key, cfg in cc._CONFIGS.items():
        bt, bn, bc, _, stages, _, _, bn2 = cc.full_config(cfg)
        bn += bn2  # both output-channel tiles
        bc32, st32 = cc.fp32_tiles(bt, bn, bc, stages)
        assert bc32 <= 32 and 2 <= st32 <= stages, key
        assert st32 * (bt * bc32 + bc32 * bn) * 4 <= cc.FP32_SMEM_BUDGET, key
    assert cc.fp32_tiles(256, 128, 32, 6) == (32, 3)


def test_config_env_override(monkeypatch):
    monkeypatch.setenv("SHOAL_CODEC_CONV_CFG", "64,32,16,4,2")
    assert cc.conv_config(96, 96, 1000) == (64, 32, 16, 4, 2, 0, 0, 0)
    monkeypatch.setenv("SHOAL_CODEC_CONV_CFG", "64,32,16,4,2,1,1")
    assert cc.conv_config(96, 96, 1000, 7) == (64, 32, 16, 4, 2, 1, 1, 0)
    monkeypatch.setenv("SHOAL_CODEC_CONV_CFG", "64,64,16,4,2,1,1,32")
    assert cc.conv_config(96, 96, 1000, 7) == (64, 64, 16, 4, 2, 1, 1, 32)
    monkeypatch.setenv("SHOAL_CODEC_CONV_CFG", "64,64,16,4,2,1,1,24")  # BN2 must be a power of two
    with pytest.raises(ValueError, match="BN2"):
        cc.conv_config(96, 96, 1000, 7)
    monkeypatch.setenv("SHOAL_CODEC_CONV_CFG", "64,32,16")
    with pytest.raises(ValueError, match="BT,BN,BC"):
        cc.conv_config(96, 96, 1000)
    monkeypatch.delenv("SHOAL_CODEC_CONV_CFG")
    # by kernel size first: the k=7 and k=1 convs of one channel count differ
    assert cc.conv_config(96, 96, 0, 7) != cc.conv_config(96, 96, 0, 1)
    assert cc.conv_config(96, 96, 0, 2) == cc.conv_config(96, 96, 0)  # no K entry: the channel pair's
    monkeypatch.setenv("SHOAL_CODEC_CONV_TMA", "0")
    monkeypatch.setenv("SHOAL_CODEC_CONV_FLAT", "1")
    assert cc.conv_config(96, 96, 0, 7)[5:7] == (0, 1)
    assert all(len(cc.conv_config(*key, 0) if len(key) == 2 else cc.conv_config(key[0], key[1], 0, key[2]))
               == cc.CONFIG_LEN for key in cc._CONFIGS)
    monkeypatch.delenv("SHOAL_CODEC_CONV_TMA")
    monkeypatch.delenv("SHOAL_CODEC_CONV_FLAT")
    bt, bn, bc = cc.conv_config(40, 24, 10)[:3]
    assert bt == 128 and bn == 32 and bc == 64
    assert cc.conv_config(40, 24, 100000) == cc.conv_config(40, 24, 10)


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 96, 96, 7, 9, 4096), (4, 768, 768, 7, 3, 300), (8, 384, 384, 1, 1, 2049)])
def test_gpu_conv_matches_reference(dtype, shape):
    B, ci, co, k, d, L_out = shape
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, L_out + (k - 1) * d, ci, generator=g).to(dtype).cuda().transpose(1, 2)
    w = (torch.randn(co, ci, k, generator=g) / (ci * k) ** 0.5).to(dtype).cuda()
    b = torch.randn(co, generator=g).to(dtype).cuda()
    r = torch.randn(B, co, L_out, generator=g).to(dtype).cuda()
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # fp32: IEEE products (TF32 follows this switch)
    try:
        out = cc.conv1d_cl_triton(x, cc.pack_conv_weight(w), b, d, residual=r)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    ref = r.double() + F.conv1d(x.double(), w.double(), b.double(), 1, 0, d)
    tol = (1e-5 if dtype == torch.float32 else 1e-2) * ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() <= tol


def gpu_conv_inputs(shape: tuple, seed: int):
    """bf16 CUDA inputs of a conv (B, C_in, C_out, K, dilation, L_out): the generator (for
    more draws), ``x`` a channels-last view after an 8-sample context, weight, bias, residual."""
    B, ci, co, k, d, L_out = shape
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(B, L_out + (k - 1) * d + 8, ci, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(co, ci, k, generator=g) / (ci * k) ** 0.5).to(torch.bfloat16).cuda()
    b = torch.randn(co, generator=g).to(torch.bfloat16).cuda()
    r = torch.randn(B, co, L_out, generator=g).to(torch.bfloat16).cuda()
    return g, buf[:, 8:].transpose(1, 2), w, b, r


@gpu
@pytest.mark.parametrize("flat", ["0", "1"])
@pytest.mark.parametrize("shape", [(64, 96, 96, 7, 9, 4096), (3, 192, 192, 7, 1, 1000), (5, 384, 384, 1, 1, 777),
                                   (1, 96, 96, 7, 3, 999), (4, 384, 768, 2, 1, 500)])
def test_gpu_tma_conv_is_bit_identical_to_pointer_loads(flat, shape):
    """The tensor-descriptor variant reads the same tiles in the same order: the same bits,
    on an input that is a view after a carried context (as in a streaming call)."""
    B, ci, co, k, d, L_out = shape
    g, x, w, b, r = gpu_conv_inputs(shape, 2)
    packed = cc.pack_conv_weight(w)
    cfg = tuple(cc.conv_config(ci, co, L_out, k)[:5])
    assert cc._tma_ok(x, packed, cfg[2])
    plain = cc.conv1d_cl_triton(x, packed, b, d, residual=r, config=cfg + (0, int(flat)))
    tma = cc.conv1d_cl_triton(x, packed, b, d, residual=r, config=cfg + (1, int(flat)))
    assert torch.equal(plain, tma)
    unrolled = cc.conv1d_cl_triton(x, packed, b, d, residual=r, config=cfg + (0, 0))
    assert torch.equal(plain, unrolled)  # the flat loop sums in the same order


@gpu
@pytest.mark.parametrize("tma", [0, 1])
@pytest.mark.parametrize("shape,cfg", [((64, 96, 96, 7, 9, 4096), (256, 64, 32, 8, 6, 1, 32)),
                                       ((3, 192, 192, 7, 1, 1000), (128, 128, 32, 8, 5, 1, 64)),
                                       ((5, 96, 96, 1, 1, 777), (128, 64, 32, 4, 4, 0, 32)),
                                       ((2, 192, 192, 7, 3, 333), (128, 128, 64, 8, 4, 0, 64))])
def test_gpu_split_tiles_are_bit_identical(tma, shape, cfg):
    """Two output-channel tiles per program (BN + BN2 = the channel count) write the bits of
    one padded power-of-two tile, residual and Snake epilogue included."""
    B, ci, co, k, d, L_out = shape
    g, x, w, b, r = gpu_conv_inputs(shape, 4)
    alpha = (torch.rand(co, generator=g) + 0.5).to(torch.bfloat16).cuda()
    packed = cc.pack_conv_weight(w)
    bt, bn, bc, warps, stages, flat, bn2 = cfg
    one_s = torch.empty(B, L_out, co, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    two_s = torch.full_like(one_s, float("nan"))
    one = cc.conv1d_cl_triton(x, packed, b, d, residual=r, snake_alpha=alpha, snake_out=one_s,
                              config=(bt, 1 << (co - 1).bit_length(), bc, warps, stages, tma, flat))
    two = cc.conv1d_cl_triton(x, packed, b, d, residual=r, snake_alpha=alpha, snake_out=two_s,
                              config=(bt, bn, bc, warps, stages, tma, flat, bn2))
    assert torch.equal(one, two)
    assert torch.equal(one_s, two_s)


@gpu
@pytest.mark.skipif(not (TINY / "codec.pth").is_file(), reason="golden vectors not available")
# the epilogue variant (off by default) in fp32 only: each case compiles ~20 kernel variants
@pytest.mark.parametrize("dtype,snake_epilogue", [(torch.float32, False), (torch.bfloat16, False),
                                                  (torch.float32, True), (torch.float32, "k1"),
                                                  (torch.float32, "fused")])
def test_gpu_triton_decoder_matches_cudnn_decoder(dtype, snake_epilogue):
    from shoal.codec import CodecConfig, StreamingDecoder, load_codec

    codec = load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json"), device="cuda", dtype=dtype)
    g = torch.Generator().manual_seed(3)
    codes = torch.cat([torch.randint(0, 4096, (3, 1, 40), generator=g),
                       torch.randint(0, 1024, (3, 9, 40), generator=g)], 1).cuda()
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        ref = codec.decode(codes).float()
        codec.configure_serving(channels_last=True, triton_conv=True, snake_epilogue=snake_epilogue)
        out = codec.decode(codes).float()
        dec = StreamingDecoder(codec)
        st = dec.new_state(3)
        outs, i = [], 0
        for t in (4, 8, 4, 8, 16):
            outs.append(dec.decode_chunk(codes[:, :, i:i + t], st))
            i += t
        streamed = torch.cat(outs, -1).float()
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
        codec.configure_serving(channels_last=False, triton_conv=False)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert (out - ref).abs().max().item() <= tol
    assert (streamed - out).abs().max().item() <= (1e-4 if dtype == torch.float32 else 5e-2)


def test_snake_epilogue_modes_parse(monkeypatch):
    from shoal.bench.codec import build_codec
    from shoal.codec.streaming import snake_epilogue_mode

    codec = build_codec(True, torch.device("cpu"))
    for given, stored in ((True, True), ("all", True), ("k1", "k1"), ("K1", "k1"), ("none", False), (False, False),
                          (1, True), (0, False), ("fused", "fused"), ("FUSED", "fused"), ("unit", "unit")):
        codec.configure_serving(snake_epilogue=given)
        assert codec.decoder.snake_epilogue == stored
    with pytest.raises(ValueError, match="snake_epilogue"):
        codec.configure_serving(snake_epilogue="k7")
    for env, mode in (("0", False), ("1", True), ("k1", "k1"), ("K1", "k1"), ("off", False), ("", "unit"),
                      ("fused", "fused"), ("unit", "unit")):
        monkeypatch.setenv("SHOAL_CODEC_CONV_EPILOGUE", env)
        assert snake_epilogue_mode() == mode
    monkeypatch.setenv("SHOAL_CODEC_CONV_EPILOGUE", "kl")
    with pytest.raises(ValueError, match="SHOAL_CODEC_CONV_EPILOGUE"):
        snake_epilogue_mode()
    monkeypatch.delenv("SHOAL_CODEC_CONV_EPILOGUE")
    assert snake_epilogue_mode() == "unit"  # the serving default


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_graphed_fused_decoder_equals_eager_k1(dtype):
    """The fused Snake mode through CUDA graphs (warm-up, capture, replay, the tiled bias and
    alpha built ahead) writes the bits of the eager default mode, in row groups too."""
    from shoal.bench.codec import build_codec, random_codes
    from shoal.codec import StreamingDecoder
    from shoal.codec.streaming import GraphedStreamingDecoder, pack_conv_weights

    codec = build_codec(True, torch.device("cuda")).to(dtype)
    codes = random_codes(3, 16, "cuda", seed=6)
    chunks = ((0, 4), (4, 4), (8, 8))
    try:
        codec.configure_serving(channels_last=True, triton_conv=True, snake_epilogue="k1", group_positions=16)
        eager = StreamingDecoder(codec)
        st = eager.new_state(3)
        ref = torch.cat([eager.decode_chunk(codes[:, :, i:i + t], st) for i, t in chunks], -1)
        codec.configure_serving(snake_epilogue="fused")
        pack_conv_weights(codec)
        graphed = GraphedStreamingDecoder(codec, chunk_frames=(4, 8), max_batch=4)
        st = graphed.new_state(3)
        out = torch.cat([graphed.decode_chunk(codes[:, :, i:i + t], st) for i, t in chunks], -1)
    finally:
        codec.configure_serving(channels_last=False, triton_conv=False, snake_epilogue=False, group_positions=None)
    assert graphed.stats.replays == len(chunks) and graphed.stats.eager == 0
    assert torch.equal(out, ref)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ci,tma", [(96, 1), (96, 0), (192, 1), (40, 0)])
def test_gpu_pre_snake_and_fused_entry_kernels(dtype, ci, tma):
    """The fused mode's two kernel features at real channel counts, descriptor loads on and
    off: a k=1 conv with ``pre_snake_alpha`` equals the Snake kernel then the conv, and a
    transposed conv's GEMM with its bias and Snake in the epilogue equals ``gemm_forward``
    then the Snake kernel with the bias (so a mismatch in the decoder test is traced here)."""
    from shoal.codec.layers import CausalConvTranspose1d
    from shoal.kernels.snake import snake

    g = torch.Generator().manual_seed(ci)
    dev = "cuda"
    B, L, co = 8, 3000, ci
    x = torch.randn(B, L + 6, ci, generator=g).to(dtype).to(dev)[:, 6:].transpose(1, 2)
    w = (torch.randn(co, ci, 1, generator=g) / ci ** 0.5).to(dtype).to(dev)
    b = torch.randn(co, generator=g).to(dtype).to(dev)
    alpha = (torch.rand(ci, generator=g) + 0.5).to(dtype).to(dev)
    r = torch.randn(B, co, L, generator=g).to(dtype).to(dev)
    packed = cc.pack_conv_weight(w)
    cfg = tuple(cc.conv_config(ci, co, L, 1)[:5]) + (tma, 0)
    want = cc.conv1d_cl_triton(snake(x, alpha)[0], packed, b, 1, residual=r, config=cfg)
    got = cc.conv1d_cl_triton(x, packed, b, 1, residual=r, pre_snake_alpha=alpha, config=cfg)
    assert torch.equal(got, want)

    st, cout = 2, ci // 2
    ct = CausalConvTranspose1d(ci, cout, 2 * st, stride=st, weight_norm=False).to(dev, dtype)
    with torch.no_grad():
        ct.conv.bias.normal_()
    ct.channels_last, ct.triton_conv = True, True
    a2 = (torch.rand(1, cout, 1, generator=g) + 0.5).to(dtype).to(dev)
    buf = ct.input_buffer(x, L)
    buf.copy_(torch.randn(B, ci, L + 1, generator=g).to(dtype).to(dev))
    want_s, want_h = snake(ct.gemm_forward(buf), a2, None, ct.conv.bias, write_h=True)
    h = torch.empty(B, st * L, cout, device=dev, dtype=dtype).transpose(1, 2)
    cbuf = torch.empty(B, 6 + st * L, cout, device=dev, dtype=dtype).transpose(1, 2)
    ct.gemm_forward_snake(buf, a2, h, cbuf[..., 6:])
    assert torch.equal(h, want_h)
    assert torch.equal(cbuf[..., 6:], want_s)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_gpu_snake_epilogue_modes_are_bit_identical(dtype):
    """Separate Snake kernels, every Snake in a conv epilogue, and the k1-only epilogues round
    alike: the same waveform bits one-shot and streamed (random tiny codec, no golden files)."""
    from shoal.bench.codec import build_codec, random_codes
    from shoal.codec import StreamingDecoder

    codec = build_codec(True, torch.device("cuda")).to(dtype)
    codes = random_codes(3, 24, "cuda", seed=4)
    outs = {}
    try:
        for mode in (False, "k1", True, "fused", ("fused", 8)):
            m, groups = mode if isinstance(mode, tuple) else (mode, None)
            codec.configure_serving(channels_last=True, triton_conv=True, snake_epilogue=m, group_positions=groups)
            dec = StreamingDecoder(codec)
            st = dec.new_state(3)
            parts = [dec.decode_chunk(codes[:, :, i:i + t], st) for i, t in ((0, 4), (4, 12), (16, 8))]
            outs[mode] = (codec.decode(codes), torch.cat(parts, -1))
    finally:
        codec.configure_serving(channels_last=False, triton_conv=False, snake_epilogue=False, group_positions=None)
    for mode in ("k1", True, "fused", ("fused", 8)):
        assert torch.equal(outs[mode][0], outs[False][0]), mode
        assert torch.equal(outs[mode][1], outs[False][1]), mode


if __name__ == "__main__":
    report_cases(INTERP_CASES, _interp_case)
