"""Block-FP8 quantization: math, checkpoint format, verified loading, the correctness gate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shoal.checkpoint import load_dualar
from shoal.demo import write_tiny_s2_checkpoint
from shoal.model.loader import CheckpointError
from shoal.quant import (
    FP8Linear,
    dequantize_weight_block,
    fake_quantize_act,
    fingerprint,
    is_fp8_checkpoint,
    load_fp8_dualar,
    quantize_checkpoint,
    quantize_model,
    quantize_state_dict,
    quantize_weight_block,
    read_fp8_tensors,
    scale_shape,
)
from shoal.quant.cli import add_quantize_parser
from shoal.quant.gate import add_gate_parser, run_gate


# ------------------------------------------------------------------ math
def test_block_quantize_round_trip_bounds():
    torch.manual_seed(0)
    w = torch.randn(300, 520) * torch.logspace(-3, 1, 520)  # heterogeneous columns, partial blocks
    w = w.to(torch.bfloat16)
    q, s = quantize_weight_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(300, 520) == (3, 5)
    assert s.is_contiguous()
    wf = w.float()
    # scale = amax/448 per block (row-major [N/128, K/128])
    for i in range(3):
        for j in range(5):
            blk = wf[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            assert torch.isclose(s[i, j], blk.abs().max() / 448, rtol=1e-6)
    d = dequantize_weight_block(q, s)
    # e4m3: 3 mantissa bits -> elementwise rel. error <= 2^-4 for normals; overall ~2-3 %
    assert float((d - wf).norm() / wf.norm()) < 0.04
    big = wf.abs() > s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :520] * 2 ** -6 * 64
    assert float(((d - wf).abs() / wf.abs())[big].max()) <= 2 ** -4 + 1e-6


def test_block_quantize_exact_cases():
    w = torch.ones(128, 128)
    w[3, 5] = 16.0
    q, s = quantize_weight_block(w)
    assert float(s[0, 0]) == pytest.approx(16 / 448, rel=1e-7)
    assert float(dequantize_weight_block(q, s)[3, 5]) == pytest.approx(16.0, rel=1e-6)
    z = quantize_weight_block(torch.zeros(10, 10))
    assert torch.all(dequantize_weight_block(*z) == 0)


def test_act_fake_quant_and_fp8_linear():
    torch.manual_seed(0)
    x = torch.randn(3, 7, 200)
    xq = fake_quantize_act(x)
    assert xq.shape == x.shape and float((xq - x).norm() / x.norm()) < 0.04
    lin = torch.nn.Linear(200, 96, bias=True)
    f = FP8Linear.from_linear(lin)
    y_ref = lin(x).detach()
    y = f(x).detach()
    assert y.dtype == x.dtype and float((y - y_ref).norm() / y_ref.norm()) < 0.06
    assert tuple(f.weight_scale.shape) == (1, 2)


def test_quantize_state_dict_selects_linears():
    state = {"layers.0.attention.wqkv.weight": torch.randn(64, 32),
             "layers.0.attention_norm.weight": torch.ones(32),
             "embeddings.weight": torch.randn(50, 32),
             "fast_output.weight": torch.randn(40, 32)}
    rest, fp8 = quantize_state_dict(state)
    assert set(fp8) == {"layers.0.attention.wqkv.weight"}
    assert "embeddings.weight" in rest and "fast_output.weight" in rest
    _, fp8 = quantize_state_dict(state, include_heads=True)
    assert "fast_output.weight" in fp8 and "embeddings.weight" not in fp8


# ------------------------------------------------------------------ checkpoints
ALPHA = 0.002  # residual-dominant layers -> logits with clear margins (see docs/quantization.md)
HETERO = 16.0  # block-to-block magnitude spread, so a wrong scale layout is numerically loud


def _margin_checkpoint(out: Path, seed: int = 0) -> Path:
    """A tiny S2 checkpoint (dim 256: 2x2 square and 2x3 / 3x2 scale grids) whose greedy tokens
    are robust to ~1 % noise: small layer outputs (wo, w2 scaled by ALPHA) and a fast head equal
    to the fast embeddings. Off-diagonal blocks of wo / w2 differ by HETERO^2 in magnitude."""
    p = write_tiny_s2_checkpoint(out, seed=seed, dim=256, n_head=4, n_local_heads=2, head_dim=64,
                                 intermediate=384, fast_layers=2)
    files = sorted(p.glob("*.safetensors"))
    fe = None
    for f in files:
        fe = load_file(str(f)).get("audio_decoder.embeddings.weight", fe)
    for f in files:
        sd = load_file(str(f))
        for k, v in sd.items():
            if k.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                w = v.float() * ALPHA
                w[:128, 128:256] *= HETERO
                w[128:256, :128] /= HETERO
                sd[k] = w.to(torch.bfloat16)
            elif k == "audio_decoder.output.weight":
                sd[k] = fe.clone()
        save_file(sd, str(f), metadata={"format": "pt"})
    return p


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory) -> Path:
    return _margin_checkpoint(tmp_path_factory.mktemp("q") / "s2_margin")


@pytest.fixture(scope="module")
def fp8_ckpt(bf16_ckpt, tmp_path_factory) -> Path:
    return quantize_checkpoint(bf16_ckpt, tmp_path_factory.mktemp("q") / "s2_fp8", progress=False)


@pytest.fixture(scope="module")
def ref_model(bf16_ckpt):
    return load_dualar(bf16_ckpt, dtype="bf16")


def test_quantized_checkpoint_layout(bf16_ckpt, fp8_ckpt):
    names = {f.name for f in fp8_ckpt.iterdir()}
    assert {"config.json", "tokenizer.json", "codec.pth", "model.safetensors.index.json",
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= names
    assert is_fp8_checkpoint(fp8_ckpt) and not is_fp8_checkpoint(bf16_ckpt)
    index = json.loads((fp8_ckpt / "model.safetensors.index.json").read_text())
    n_q = 0
    for f in sorted(fp8_ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            meta = h.metadata()
            assert meta["format"] == "shoal-fp8-block" and meta["version"] == "1"
            assert meta["block"] == "128x128" and meta["scale_layout"] == "row-major [N/128, K/128]"
            fps = json.loads(meta["fingerprints"])
            for k in h.keys():
                assert index["weight_map"][k] == f.name
                t = h.get_tensor(k)
                if k.endswith(".weight_scale"):
                    w = h.get_tensor(k[: -len("_scale")])
                    assert w.dtype == torch.float8_e4m3fn
                    assert tuple(t.shape) == scale_shape(*w.shape) and t.dtype == torch.float32
                    assert fps[k[: -len("_scale")]] == fingerprint(w, t)
                    n_q += 1
                elif "embeddings" in k or "norm" in k or k.endswith("output.weight"):
                    assert t.dtype == torch.bfloat16
    assert n_q == 4 * 5  # 2 slow + 2 fast layers x (wqkv, wo, w1, w3, w2)


def test_gate_with_fp8_kv_cache(bf16_ckpt, fp8_ckpt, capsys):
    """The gate decodes the checked side with the FP8 KV cache (shoal.quant.kv): with FP8 weights
    and with bf16 weights (KV only) the tokens still match bf16; the KV quantization shows in the
    per-layer errors, and the CLI takes --kv-cache-dtype alone."""
    from shoal.cli import main as shoal_main
    from shoal.quant.gate import correctness_gate

    weights = correctness_gate(str(bf16_ckpt), str(fp8_ckpt), frames=5)
    both = correctness_gate(str(bf16_ckpt), str(fp8_ckpt), frames=5, kv_cache_dtype="fp8")
    kv_only = correctness_gate(str(bf16_ckpt), frames=5, kv_cache_dtype="fp8", quantize_weights=False)
    for r in (weights, both, kv_only):
        assert r.passed, r.report()
    assert "FP8 KV cache" in both.report() and "FP8 KV cache" not in weights.report()
    assert kv_only.weights == "bf16" and "bf16 weights, FP8 KV cache" in kv_only.report()
    kv_err = kv_only.prompts[0].layer_errors
    assert kv_err["layers.0"] > 1e-3  # the cache is really quantized (bf16 weights otherwise)
    assert both.prompts[0].layer_errors != weights.prompts[0].layer_errors
    assert shoal_main(["gate", "correctness", "--checkpoint", str(bf16_ckpt), "--kv-cache-dtype", "fp8"]) == 0
    assert "gate: PASS" in capsys.readouterr().out


def test_fp8_checkpoint_passes_gate(bf16_ckpt, fp8_ckpt, ref_model):
    ref, tok = ref_model
    fp8, _ = load_fp8_dualar(fp8_ckpt, dtype=torch.bfloat16)
    assert isinstance(fp8.layers[0].attention.wo, FP8Linear)
    result = run_gate(ref, fp8, tok, frames=5)
    assert result.passed, result.report()
    # quantize-at-load gives the same weights as the offline checkpoint
    q, _ = load_dualar(bf16_ckpt, dtype="bf16")
    quantize_model(q)
    assert torch.equal(q.layers[1].feed_forward.w2.weight_scale, fp8.layers[1].feed_forward.w2.weight_scale)
    assert torch.equal(q.layers[1].feed_forward.w2.weight_q.view(torch.uint8),
                       fp8.layers[1].feed_forward.w2.weight_q.view(torch.uint8))


def _corrupt(src: Path, dst: Path, fn) -> Path:
    """Copy ``src`` and apply ``fn(key, tensor) -> tensor | None`` to every tensor, keeping the
    header metadata (a writer bug, not a missing header)."""
    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            meta = h.metadata()
            sd = {k: h.get_tensor(k) for k in h.keys()}
        sd = {k: (fn(k, v) if fn(k, v) is not None else v) for k, v in sd.items()}
        save_file(sd, str(f), metadata=meta)
    return dst


def _transpose_wo_scale(k, v):
    if k.endswith("attention.wo.weight_scale"):
        assert v.shape == (2, 2)
        return v.t().contiguous()
    return None


def test_transposed_square_scale_rejected(fp8_ckpt, ref_model, tmp_path):
    bad = _corrupt(fp8_ckpt, tmp_path / "bad", _transpose_wo_scale)
    with pytest.raises(CheckpointError) as e:
        load_fp8_dualar(bad)
    msg = str(e.value)
    assert "fingerprint mismatch" in msg and "attention.wo.weight_scale" in msg
    assert ".safetensors" in msg and "expected" in msg and "found" in msg

    assert load_fp8_dualar(bad, verify=False)  # the layout is only caught by the fingerprint


def test_stride_bug_forced_past_loader_fails_gate(fp8_ckpt, ref_model, tmp_path):
    """Every scale's bytes K-major under the row-major header (the fso stride bug; square grids
    transposed, the others permuted, all shapes right): the loader rejects it, and when forced
    past the loader the gate fails and reports per-layer errors."""
    bad = _corrupt(fp8_ckpt, tmp_path / "bad", _k_major_bytes)
    with pytest.raises(CheckpointError, match="fingerprint mismatch"):
        read_fp8_tensors(bad)
    ref, tok = ref_model
    fp8, _ = load_fp8_dualar(bad, dtype=torch.bfloat16, verify=False)
    result = run_gate(ref, fp8, tok, frames=5)
    assert not result.passed
    report = result.report()
    assert "gate: FAIL" in report and "per-layer relative error" in report
    assert "layers.0" in report and "fast_layers.1" in report
    assert max(result.prompts[0].layer_errors.values()) > 0.25


def test_transposed_nonsquare_scale_rejected(fp8_ckpt, tmp_path):
    def fn(k, v):
        return v.t().contiguous() if k.endswith("feed_forward.w2.weight_scale") else None
    bad = _corrupt(fp8_ckpt, tmp_path / "bad", fn)
    with pytest.raises(CheckpointError, match=r"w2\.weight_scale.*expected scale shape \[2, 3\].*found \[3, 2\]"):
        read_fp8_tensors(bad)


def test_swapped_scale_rows_rejected(fp8_ckpt, tmp_path):
    def fn(k, v):
        return v[[1, 0, 2, 3]].contiguous() if k.endswith("layers.1.attention.wqkv.weight_scale") else None
    bad = _corrupt(fp8_ckpt, tmp_path / "bad", fn)
    with pytest.raises(CheckpointError, match=r"layers\.1\.attention\.wqkv\.weight_scale.*fingerprint"):
        read_fp8_tensors(bad)


def test_missing_or_wrong_metadata_rejected(fp8_ckpt, tmp_path):
    for name, meta in (("nometa", None), ("wrongfmt", {"format": "pt"}),
                       ("badlayout", "layout")):
        dst = tmp_path / name
        shutil.copytree(fp8_ckpt, dst)
        f = min(dst.glob("*.safetensors"))
        with safe_open(str(f), "pt") as h:
            m = h.metadata()
            sd = {k: h.get_tensor(k) for k in h.keys()}
        if meta == "layout":
            meta = dict(m, scale_layout="col-major [K/128, N/128]")
        save_file(sd, str(f), metadata=meta)
        with pytest.raises(CheckpointError, match=f.name):
            read_fp8_tensors(dst)


def test_missing_scale_rejected(fp8_ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(fp8_ckpt, bad)
    for f in sorted(bad.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            m = h.metadata()
            sd = {k: h.get_tensor(k) for k in h.keys() if not k.endswith("layers.0.attention.wo.weight_scale")}
        save_file(sd, str(f), metadata=m)
    with pytest.raises(CheckpointError, match="has no"):
        read_fp8_tensors(bad)


def test_cli_quantize_and_gate(bf16_ckpt, fp8_ckpt, tmp_path, capsys):
    import argparse

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    add_quantize_parser(sub)
    add_gate_parser(sub)
    args = p.parse_args(["quantize", str(bf16_ckpt), str(tmp_path / "out"), "--include-heads"])
    assert args.func(args) == 0
    with safe_open(str(tmp_path / "out" / "model-00002-of-00002.safetensors"), "pt") as h:
        assert h.get_tensor("audio_decoder.output.weight").dtype == torch.float8_e4m3fn
    args = p.parse_args(["gate", "correctness", "--checkpoint", str(bf16_ckpt),
                         "--fp8-checkpoint", str(fp8_ckpt), "--frames", "5"])
    assert args.func(args) == 0
    assert "gate: PASS" in capsys.readouterr().out
    bad = _corrupt(fp8_ckpt, tmp_path / "bad", _k_major_bytes)
    args = p.parse_args(["gate", "correctness", "--checkpoint", str(bf16_ckpt),
                         "--fp8-checkpoint", str(bad), "--skip-verify"])
    assert args.func(args) == 1
    assert "gate: FAIL" in capsys.readouterr().out
    args = p.parse_args(["gate", "correctness", "--checkpoint", str(bf16_ckpt), "--quantize"])
    assert args.func(args) == 0


def test_s1_checkpoint_round_trip(tiny_s1_checkpoint, tmp_path):
    out = quantize_checkpoint(tiny_s1_checkpoint, tmp_path / "s1_fp8", include_heads=True,
                              progress=False)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.tiktoken").is_file()
    model, tok = load_fp8_dualar(out, dtype=torch.bfloat16)
    assert isinstance(model.output, FP8Linear) and isinstance(model.fast_output, FP8Linear)
    ref, _ = load_dualar(tiny_s1_checkpoint, dtype="bf16")
    w = ref.layers[0].feed_forward.w1.weight.float()
    d = model.layers[0].feed_forward.w1.dequantized_weight()
    assert float((d - w).norm() / w.norm()) < 0.04
    result = run_gate(ref, model, tok, frames=2)  # runs end to end (random S1 has no margins)
    assert set(result.prompts[0].layer_errors) >= {"layers.0", "fast_layers.0"}


def _k_major_bytes(k, v):
    """The stride bug: scale bytes written K-major under the row-major header shape."""
    if k.endswith(".weight_scale"):
        return v.t().contiguous().reshape(v.shape)
    return None


def test_load_dualar_quantizes_at_load_and_detects_fp8_checkpoints(tiny_s2_checkpoint, tmp_path):
    """``--quantization fp8`` quantizes a bf16 checkpoint at load; an FP8 checkpoint written by
    `shoal quantize` loads as FP8 without the flag; both give the same weights."""
    from shoal.checkpoint import load_dualar
    from shoal.quant.convert import quantize_checkpoint
    from shoal.quant.fp8 import FP8Linear

    plain, _ = load_dualar(tiny_s2_checkpoint, dtype="fp32")
    assert not any(isinstance(m, FP8Linear) for m in plain.modules())
    at_load, _ = load_dualar(tiny_s2_checkpoint, dtype="fp32", quantization="fp8")
    q_at_load = {n: m for n, m in at_load.named_modules() if isinstance(m, FP8Linear)}
    assert "layers.0.attention.wqkv" in q_at_load and "fast_output" in q_at_load
    out = tmp_path / "fp8"
    quantize_checkpoint(tiny_s2_checkpoint, out, include_heads=True)
    stored, _ = load_dualar(out, dtype="fp32")
    q_stored = {n: m for n, m in stored.named_modules() if isinstance(m, FP8Linear)}
    assert q_stored.keys() == q_at_load.keys()
    for n, m in q_stored.items():
        assert torch.equal(m.weight_q.view(torch.uint8), q_at_load[n].weight_q.view(torch.uint8)), n
        assert torch.equal(m.weight_scale, q_at_load[n].weight_scale), n
    with pytest.raises(ValueError, match="unknown quantization"):
        load_dualar(tiny_s2_checkpoint, quantization="int4")
