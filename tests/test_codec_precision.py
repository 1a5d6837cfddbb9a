"""A codec whose decode side runs in bf16 and encode side in fp32 (``--codec-dtype auto`` on CUDA),
checked on CPU against the all-fp32 and all-bf16 codecs, and the ``--codec-dtype`` resolution."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch

from shoal.checkpoint import CODEC_DTYPE_CHOICES, dtype_name, resolve_codec_dtypes
from shoal.codec import CodecConfig, GraphedStreamingDecoder, StreamingDecoder, load_codec

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"
TINY = GOLDEN / "codec_tiny"

golden = pytest.mark.skipif(not (TINY / "codec.pth").is_file(), reason="golden vectors not available")

BF16_TOL = 5e-2  # max |difference| the bf16 streaming / graph tests allow (test_codec_serving.py)
F32, B16 = torch.float32, torch.bfloat16


def _load(**kw):
    return load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json"), **kw)


@pytest.fixture(scope="module")
def codecs():
    if not (TINY / "codec.pth").is_file():
        pytest.skip("golden vectors not available")
    return {"fp32": _load(), "bf16": _load(dtype=B16), "mixed": _load(decode_dtype=B16)}


@pytest.fixture(scope="module")
def golden_codes():
    from safetensors.torch import load_file

    g = load_file(str(TINY / "outputs" / "codec_golden_fp32.safetensors"))
    return g["decode_encoded.input_codes"][None]


@pytest.fixture(scope="module")
def clip() -> torch.Tensor:
    import soundfile as sf

    data, sr = sf.read(str(TINY / "input_1p3s.wav"), dtype="float32")
    assert sr == 44100
    return torch.from_numpy(data)


def snr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum()))


def _param_dtypes(mods) -> set[torch.dtype]:
    return {p.dtype for m in mods for p in m.parameters()}


# ----------------------------------------------------------------------------- layout
@golden
def test_mixed_codec_dtypes(codecs):
    fp32, mixed = codecs["fp32"], codecs["mixed"]
    assert (mixed.dtype, mixed.encode_dtype) == (B16, F32)
    assert (fp32.dtype, fp32.encode_dtype) == (F32, F32) and codecs["bf16"].encode_dtype == B16
    assert _param_dtypes(mixed.decode_modules()) == {B16}
    assert _param_dtypes(mixed.encode_modules()) == {F32}
    # the two sides cover every parameter exactly once
    ids = [id(p) for m in mixed.encode_modules() + mixed.decode_modules() for p in m.parameters()]
    assert len(ids) == len(set(ids)) == len(list(mixed.parameters()))
    # the decode side's weights are those of the all-bf16 codec (one cast from fp32)
    for (k, a), b in zip(mixed.state_dict().items(), codecs["bf16"].state_dict().values()):
        if a.dtype == B16:
            assert torch.equal(a, b), k
    # set_decode_dtype on a loaded fp32 codec gives the same codec
    late = _load().set_decode_dtype(B16)
    assert all(torch.equal(a, b) for a, b in zip(late.state_dict().values(), mixed.state_dict().values()))


@golden
def test_place_on_another_device_casts_first(monkeypatch):
    """Placing on another device casts each side where its weights are, then moves it (no
    staging copies in the source dtype on the target): every module's first ``to`` is a
    dtype-only cast on the source device, then a move; the result's dtypes are the requested."""
    import torch.nn as nn

    calls = []
    real_to = nn.Module.to

    def spy(self, *args, **kwargs):
        calls.append((self, kwargs.get("device"), kwargs.get("dtype")))
        return real_to(self, *args, **kwargs)

    for dec in (B16, None):
        codec = _load()
        calls.clear()
        monkeypatch.setattr(nn.Module, "to", spy)
        moved = codec.place("meta", F32, dec)
        monkeypatch.setattr(nn.Module, "to", real_to)
        assert {p.device.type for p in moved.parameters()} == {"meta"}
        assert _param_dtypes(moved.decode_modules()) == {dec or F32}
        assert _param_dtypes(moved.encode_modules()) == {F32}
        sides = [(m, dec or F32) for m in codec.decode_modules()] if dec else [(codec, F32)]
        for m, dt in sides:
            mine = [(d, t) for mod, d, t in calls if mod is m]
            assert mine[:2] == [(None, dt), (torch.device("meta"), dt)], mine
    # on the same device place() is one cast per side: the mixed codec's decode weights are
    # the fp32 weights cast once
    ref = _load(decode_dtype=B16)
    host = _load()
    for m in host.decode_modules():
        m.to(dtype=B16)
    assert all(torch.equal(a, b) for a, b in zip(host.state_dict().values(), ref.state_dict().values()))


# ----------------------------------------------------------------------------- encode
@golden
def test_mixed_encode_is_the_fp32_encode(codecs, clip):
    fp32, mixed = codecs["fp32"], codecs["mixed"]
    x = clip[None, None]
    c32, l32 = fp32.encode(x)
    cm, lm = mixed.encode(x)
    assert torch.equal(cm, c32) and torch.equal(lm, l32)
    # a bf16 input is cast to the encoder's fp32 (as the fp32 codec would)
    assert torch.equal(mixed.encode(x.to(B16))[0], fp32.encode(x.to(B16))[0])
    clips = [clip[:30000], clip, clip[:5000]]
    for a, b in zip(mixed.encode_batch(clips), fp32.encode_batch(clips)):
        assert torch.equal(a, b)


@golden
def test_voice_encoder_and_fingerprint(codecs, clip):
    from shoal.voices.codec import codec_encoder, codec_fingerprint

    samples = clip[:20000].numpy()
    np.testing.assert_array_equal(codec_encoder(codecs["mixed"])(samples), codec_encoder(codecs["fp32"])(samples))
    # the codes depend on the encode side only: mixed and fp32 share stored voice codes
    assert codec_fingerprint(codecs["mixed"]) == codec_fingerprint(codecs["fp32"])
    assert codec_fingerprint(codecs["bf16"]) != codec_fingerprint(codecs["fp32"])


# ----------------------------------------------------------------------------- decode
@golden
def test_mixed_decode_vs_bf16_and_fp32(codecs, golden_codes):
    fp32, b16, mixed = codecs["fp32"], codecs["bf16"], codecs["mixed"]
    out = mixed.decode(golden_codes)
    assert out.dtype == B16 and out.shape == (1, 1, 2048 * golden_codes.shape[-1])
    # exactly the all-bf16 decode side run on the fp32 codebook lookup rounded once to bf16
    q = b16.quantizer
    z = mixed.quantizer.codes_to_latent(q.clamp_codes(golden_codes))
    assert z.dtype == F32
    with torch.no_grad():
        ref = b16.decoder(q.upsample(q.post_module(z.to(B16))))
    assert torch.equal(out, ref)
    # the all-bf16 codec differs only in its bf16 lookup; both are ~34 dB from fp32
    assert (out.float() - b16.decode(golden_codes).float()).abs().max() <= BF16_TOL
    a32 = fp32.decode(golden_codes)
    assert snr_db(out, a32) > 30  # measured 34.6 dB (all-bf16: 34.0 dB)
    assert snr_db(b16.decode(golden_codes), a32) > 30
    assert mixed.decode(golden_codes[:, :, :0]).dtype == B16


@golden
def test_mixed_streaming_decode(codecs, golden_codes):
    mixed = codecs["mixed"]
    dec = StreamingDecoder(mixed)
    st = dec.new_state(2)
    pm = mixed.quantizer.post_module.state_key
    for k, v in st.tensors.items():
        assert v.dtype == (torch.long if k == f"{pm}.pos" else B16), k
    codes = torch.cat([golden_codes, golden_codes.flip(-1)])
    ref = mixed.decode(codes)
    outs, i = [], 0
    for t in (1, 3, 8, 4, 12):
        outs.append(dec.decode_chunk(codes[:, :, i:i + t], st))
        i += t
    out = torch.cat(outs, -1)
    assert out.dtype == B16 and out.shape == ref.shape
    assert (out.float() - ref.float()).abs().max() <= BF16_TOL
    # an explicit dtype still forces one precision for every state tensor
    forced = dec.new_state(1, dtype=F32)
    assert {v.dtype for k, v in forced.tensors.items() if not k.endswith(".pos")} == {F32}
    assert {dt for k, (_, dt) in dec.state_layout().items() if not k.endswith(".pos")} == {B16}


@golden
def test_mixed_graph_code_path(codecs, golden_codes):
    """The CUDA-graph decoder's static path (static state pool, padded bucket, fixed RoPE table),
    run uncaptured on CPU, equals the eager streaming decoder for the mixed codec."""
    mixed = codecs["mixed"]
    eager = StreamingDecoder(mixed)
    gd = GraphedStreamingDecoder(mixed, batch_buckets=(1, 4), chunk_frames=(4,), max_frames=64, enabled=False)
    assert {v.dtype for k, v in gd.static_state.tensors.items() if not k.endswith(".pos")} == {B16}
    codes = torch.cat([golden_codes, golden_codes.roll(5, -1), golden_codes.flip(-1)])
    se, sg = eager.new_state(3), gd.new_state(3)
    for i in range(0, 12, 4):
        a = eager.decode_chunk(codes[:, :, i:i + 4], se)
        b = gd.run_static(codes[:, :, i:i + 4], sg)
        assert (a.float() - b.float()).abs().max() <= BF16_TOL
    for k in se.tensors:
        assert se.tensors[k].dtype == sg.tensors[k].dtype


# ----------------------------------------------------------------------------- --codec-dtype
def test_resolve_codec_dtypes():
    assert CODEC_DTYPE_CHOICES == ("auto", "fp32", "bf16")
    for dev in ("cuda", "cuda:1", torch.device("cuda"), torch.device("cuda", 0)):
        assert resolve_codec_dtypes("auto", dev) == (F32, B16)  # (encode, decode)
        assert resolve_codec_dtypes(None, dev) == (F32, B16)
        assert resolve_codec_dtypes("fp32", dev) == (F32, F32)
        assert resolve_codec_dtypes("bf16", dev) == (B16, B16)
    for dev in ("cpu", torch.device("cpu")):
        assert resolve_codec_dtypes("auto", dev) == (F32, F32)
        assert resolve_codec_dtypes("bf16", dev) == (B16, B16)
    assert resolve_codec_dtypes(torch.float16, "cuda") == (torch.float16, torch.float16)
    with pytest.raises(ValueError):
        resolve_codec_dtypes("int8", "cuda")
    assert [dtype_name(d) for d in (F32, B16, torch.float16)] == ["fp32", "bf16", "fp16"]


def test_codec_dtype_flags():
    from shoal.cli import build_parser
    from shoal.server.cli import add_serve_parser

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    assert p.parse_args(["serve"]).codec_dtype == "auto"
    for choice in ("auto", "fp32", "bf16"):
        assert p.parse_args(["serve", "--codec-dtype", choice]).codec_dtype == choice
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--codec-dtype", "fp16"])
    top = build_parser()
    assert top.parse_args(["say", "hi", "-o", "x.wav"]).codec_dtype == "auto"
    assert top.parse_args(["say", "hi", "-o", "x.wav", "--codec-dtype", "fp32"]).codec_dtype == "fp32"
    assert top.parse_args(["batch", "r.jsonl", "--out", "o"]).codec_dtype == "auto"
    assert top.parse_args(["batch", "r.jsonl", "--out", "o", "--codec-dtype", "bf16"]).codec_dtype == "bf16"


def test_auto_is_fp32_on_cpu(tiny_s2_checkpoint):
    """CPU outputs are unchanged: ``auto`` (the default) loads the whole codec in fp32 there."""
    from shoal.bench.random_tts import random_tts
    from shoal.tts import TTS

    for tts in (TTS.load(tiny_s2_checkpoint, device="cpu"), TTS.load(tiny_s2_checkpoint, device="cpu",
                                                                      codec_dtype="auto"),
                random_tts("tiny", device="cpu")):
        assert {p.dtype for p in tts.codec.parameters()} == {F32}
    tts = TTS.load(tiny_s2_checkpoint, device="cpu", codec_dtype="bf16")
    assert {p.dtype for p in tts.codec.parameters()} == {B16}
    codec = random_tts("tiny", device="cpu", codec_dtype="bf16").codec
    assert (codec.encode_dtype, codec.dtype) == (B16, B16)
