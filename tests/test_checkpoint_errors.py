"""Broken checkpoints fail with messages that name the file, the key and the shapes."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from golden_paths import GOLDEN, requires_golden
from shoal.checkpoint import load_dualar
from shoal.model.config import ConfigError, ModelConfig
from shoal.model.loader import CheckpointError, remap_s2_key

pytestmark = requires_golden

SHARD2 = "model-00002-of-00002.safetensors"


@pytest.fixture()
def s2_copy(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(GOLDEN / "s2_tiny" / "checkpoint", dst)
    return dst


@pytest.fixture()
def s1_copy(tmp_path):
    dst = tmp_path / "ckpt1"
    shutil.copytree(GOLDEN / "s1mini_tiny" / "checkpoint", dst)
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_dualar(tmp_path / "nope")


def test_missing_shard_names_the_file(s2_copy):
    (s2_copy / SHARD2).unlink()
    with pytest.raises(CheckpointError, match=SHARD2):
        load_dualar(s2_copy)


def test_missing_weights_file(s2_copy):
    for f in s2_copy.glob("model*"):
        f.unlink()
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        load_dualar(s2_copy)


def test_missing_config(s2_copy):
    (s2_copy / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        load_dualar(s2_copy)


def test_shape_mismatch_names_file_key_and_shapes(s2_copy):
    sd = load_file(s2_copy / SHARD2)
    sd["text_model.model.norm.weight"] = torch.ones(65, dtype=torch.bfloat16)
    save_file(sd, s2_copy / SHARD2)
    with pytest.raises(CheckpointError) as e:
        load_dualar(s2_copy)
    msg = str(e.value)
    assert SHARD2 in msg and "norm.weight" in msg and "[64]" in msg and "[65]" in msg


def test_unknown_key_is_rejected(s2_copy):
    sd = load_file(s2_copy / SHARD2)
    sd["text_model.model.layers.7.attention.wqkv.weight"] = torch.ones(2, 2, dtype=torch.bfloat16)
    save_file(sd, s2_copy / SHARD2)
    with pytest.raises(CheckpointError, match="unexpected key 'text_model.model.layers.7"):
        load_dualar(s2_copy)


def test_missing_key_is_reported(s2_copy):
    sd = load_file(s2_copy / SHARD2)
    del sd["audio_decoder.output.weight"]
    save_file(sd, s2_copy / SHARD2)
    with pytest.raises(CheckpointError, match=r"missing weights: fast_output.weight \[4096, 64\]"):
        load_dualar(s2_copy)


def test_stale_buffers_are_ignored(s2_copy):
    sd = load_file(s2_copy / SHARD2)
    sd["text_model.model.freqs_cis"] = torch.zeros(4, 2)
    save_file(sd, s2_copy / SHARD2)
    load_dualar(s2_copy)


def test_unsupported_model_type(s2_copy):
    cfg = json.loads((s2_copy / "config.json").read_text())
    cfg["model_type"] = "llama"
    (s2_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        load_dualar(s2_copy)


def test_semantic_ids_must_agree_with_tokenizer(s2_copy):
    cfg = json.loads((s2_copy / "config.json").read_text())
    cfg["semantic_start_token_id"] = 600
    (s2_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="disagree"):
        load_dualar(s2_copy)


def test_s1_pth_wrapped_and_prefixed(s1_copy):
    """A Lightning-style {'state_dict': {'model.xxx': ...}} file loads like the plain one."""
    sd = torch.load(s1_copy / "model.pth", weights_only=True)
    torch.save({"state_dict": {"model." + k: v for k, v in sd.items()}}, s1_copy / "model.pth")
    model, _ = load_dualar(s1_copy, dtype=torch.float32)
    assert torch.equal(model.output.weight, sd["output.weight"].float())


def test_s1_legacy_separate_qkv(s1_copy):
    sd = torch.load(s1_copy / "model.pth", weights_only=True)
    ref_model, _ = load_dualar(s1_copy, dtype=torch.float32)
    new = {}
    for k, v in sd.items():
        if k.endswith("attention.wqkv.weight"):
            base = k[: -len("wqkv.weight")]
            fast = k.startswith("fast_")
            heads, kv, hd = (4, 2, 8) if fast else (4, 2, 16)
            q, kk, vv = v.split([heads * hd, kv * hd, kv * hd])
            new[base + "wq.weight"], new[base + "wk.weight"], new[base + "wv.weight"] = q, kk, vv
        else:
            new[k] = v
    torch.save(new, s1_copy / "model.pth")
    model, _ = load_dualar(s1_copy, dtype=torch.float32)
    assert torch.equal(model.layers[0].attention.wqkv.weight, ref_model.layers[0].attention.wqkv.weight)


def test_s1_truncated_pth(s1_copy):
    (s1_copy / "model.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="model.pth"):
        load_dualar(s1_copy)


def test_remap():
    assert remap_s2_key("text_model.model.layers.3.attention.wo.weight") == "layers.3.attention.wo.weight"
    assert remap_s2_key("audio_decoder.codebook_embeddings.weight") == "codebook_embeddings.weight"
    assert remap_s2_key("audio_decoder.layers.0.ffn_norm.weight") == "fast_layers.0.ffn_norm.weight"
    assert remap_s2_key("audio_decoder.output.weight") == "fast_output.weight"


def test_s2_config_values():
    cfg = ModelConfig.from_file(GOLDEN / "s2_tiny/checkpoint/config.json")
    assert cfg.family == "s2" and cfg.norm_fastlayer_input and cfg.scale_codebook_embeddings
    assert cfg.slow.head_dim == 32 and cfg.slow.qk_norm and not cfg.fast.qk_norm
    assert cfg.tie_word_embeddings and cfg.max_seq_len == 2560


def test_real_s2_pro_parameter_count():
    """The real S2-Pro config flattens to exactly the published 4,561,852,416 parameters."""
    text = {"dim": 2560, "n_layer": 36, "n_head": 32, "n_local_heads": 8, "head_dim": 128,
            "intermediate_size": 9728, "attention_qk_norm": True, "vocab_size": 155776,
            "max_seq_len": 32768, "rope_base": 1000000, "norm_eps": 1e-6, "tie_word_embeddings": True}
    adc = {"dim": 2560, "n_layer": 4, "n_head": 32, "n_local_heads": 8, "head_dim": 128,
           "intermediate_size": 9728, "num_codebooks": 10, "vocab_size": 4096}
    cfg = ModelConfig.from_dict({"model_type": "fish_qwen3_omni", "text_config": text,
                                 "audio_decoder_config": adc})
    total = sum(int(torch.tensor(s).prod()) for s in cfg.expected_shapes().values())
    assert total == 4_561_852_416
