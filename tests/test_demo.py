"""The tiny checkpoint writers produce the real S2 / S1 on-disk formats."""

from __future__ import annotations

import base64
import json
import re
import threading
from pathlib import Path

import pytest
import torch

from shoal import demo
from shoal.demo import (
    DEFAULT_CHECKPOINT_NAME,
    S1_SPECIAL_TOKENS,
    S1_TIKTOKEN_PATTERN,
    S2_FISH_SPECIAL_TOKENS,
    default_checkpoint,
    write_tiny_s1_checkpoint,
    write_tiny_s2_checkpoint,
)

SEMANTIC = [f"<|semantic:{i}|>" for i in range(4096)]


# --------------------------------------------------------------------- helpers


def file_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def key_tree(obj):
    """Nested key structure of a JSON object (values dropped)."""
    if isinstance(obj, dict):
        return {k: key_tree(v) for k, v in obj.items()}
    return None


def layerless(keys) -> set[str]:
    return {re.sub(r"layers\.\d+\.", "layers.N.", k) for k in keys}


def read_json(p: Path):
    return json.loads(p.read_text(encoding="utf-8"))


def s2_weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                out[k] = s.get_tensor(k)
    return out


def load_tiktoken(d: Path):
    import tiktoken

    ranks = {}
    for line in (d / "tokenizer.tiktoken").read_text(encoding="utf-8").splitlines():
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    specials = read_json(d / "special_tokens.json")
    # The S1 code ignores the stored values: ids = len(ranks) + key position.
    special_ids = {t: len(ranks) + i for i, t in enumerate(specials)}
    enc = tiktoken.Encoding("shoal-s1-tiny", pat_str=S1_TIKTOKEN_PATTERN,
                            mergeable_ranks=ranks, special_tokens=special_ids)
    return enc, ranks, specials


# ----------------------------------------------------------------- determinism


def test_s2_deterministic(tiny_s2_checkpoint, tmp_path):
    again = write_tiny_s2_checkpoint(tmp_path / "again", seed=0)
    assert file_bytes(again) == file_bytes(tiny_s2_checkpoint)
    other = write_tiny_s2_checkpoint(tmp_path / "other", seed=1, with_codec=False)
    a, b = s2_weights(tiny_s2_checkpoint), s2_weights(other)
    assert a.keys() == b.keys()
    assert not torch.equal(a["text_model.model.embeddings.weight"], b["text_model.model.embeddings.weight"])
    # The tokenizer does not depend on the seed.
    assert (other / "tokenizer.json").read_bytes() == (tiny_s2_checkpoint / "tokenizer.json").read_bytes()


def test_s1_deterministic(tiny_s1_checkpoint, tmp_path):
    again = write_tiny_s1_checkpoint(tmp_path / "again", seed=0)
    assert file_bytes(again) == file_bytes(tiny_s1_checkpoint)
    other = write_tiny_s1_checkpoint(tmp_path / "other", seed=1, with_codec=False)
    assert (other / "model.pth").read_bytes() != (tiny_s1_checkpoint / "model.pth").read_bytes()


def test_weight_recipe_reproduces_golden(golden_dir):
    """The init recipe, with the golden seeds and sizes, gives the golden weights bit for bit."""
    s2 = demo._Shapes(vocab_size=4736, dim=64, n_layer=2, n_head=4, n_local_heads=2, head_dim=32,
                      intermediate=128, qk_norm=True, untied_output=False, fast_dim=64, n_fast_layer=2,
                      fast_n_head=4, fast_n_local_heads=2, fast_head_dim=32, fast_intermediate=128)
    gold = s2_weights(golden_dir / "s2_tiny" / "checkpoint")
    ours = {demo.s2_disk_key(k): v for k, v in demo._native_state_dict(s2, 1234).items()}
    assert ours.keys() == gold.keys()
    for k in gold:
        assert torch.equal(ours[k], gold[k]), k

    s1 = demo._Shapes(vocab_size=4736, dim=32, n_layer=2, n_head=4, n_local_heads=2, head_dim=16,
                      intermediate=96, qk_norm=True, untied_output=True, fast_dim=32, n_fast_layer=2,
                      fast_n_head=4, fast_n_local_heads=2, fast_head_dim=8, fast_intermediate=96)
    gold1 = torch.load(golden_dir / "s1mini_tiny" / "checkpoint" / "model.pth", weights_only=True)
    ours1 = demo._native_state_dict(s1, 5155, zero_rows_from=4714)
    assert list(ours1) == list(gold1)
    for k in gold1:
        assert torch.equal(ours1[k], gold1[k]), k


# ------------------------------------------------------------------ S2 format


def test_s2_file_set_matches_golden(tiny_s2_checkpoint, golden_dir):
    golden = golden_dir / "s2_tiny" / "checkpoint"
    assert sorted(p.name for p in tiny_s2_checkpoint.iterdir()) == sorted(p.name for p in golden.iterdir())


def test_s2_json_key_sets_match_golden(tiny_s2_checkpoint, golden_dir):
    golden = golden_dir / "s2_tiny" / "checkpoint"
    for name in ("config.json", "special_tokens_map.json", "model.safetensors.index.json"):
        ours, gold = read_json(tiny_s2_checkpoint / name), read_json(golden / name)
        if name == "model.safetensors.index.json":
            assert ours.keys() == gold.keys() and ours["metadata"].keys() == gold["metadata"].keys()
        else:
            assert key_tree(ours) == key_tree(gold), name
    ours, gold = read_json(tiny_s2_checkpoint / "tokenizer_config.json"), read_json(golden / "tokenizer_config.json")
    assert list(ours) == list(gold)
    for k in ours:
        if k != "added_tokens_decoder":
            assert ours[k] == gold[k], k
    # Same added tokens, same flags, same relative order (ids shift with the BPE size).
    assert list(ours["added_tokens_decoder"].values()) == list(gold["added_tokens_decoder"].values())
    cfg = read_json(tiny_s2_checkpoint / "config.json")
    assert cfg["model_type"] == "fish_qwen3_omni" and cfg["dtype"] == "bfloat16"


def test_s2_weights_match_golden_names(tiny_s2_checkpoint, golden_dir):
    ours = s2_weights(tiny_s2_checkpoint)
    gold = s2_weights(golden_dir / "s2_tiny" / "checkpoint")
    assert layerless(ours) == layerless(gold)
    assert all(t.dtype == torch.bfloat16 for t in ours.values())
    assert not any("lm_head" in k or k.endswith("output.weight") and k.startswith("text_model") for k in ours)

    cfg = read_json(tiny_s2_checkpoint / "config.json")
    tc, ac = cfg["text_config"], cfg["audio_decoder_config"]
    n_slow = {int(m.group(1)) for k in ours if (m := re.match(r"text_model\.model\.layers\.(\d+)\.", k))}
    n_fast = {int(m.group(1)) for k in ours if (m := re.match(r"audio_decoder\.layers\.(\d+)\.", k))}
    assert n_slow == set(range(tc["n_layer"])) and n_fast == set(range(ac["n_layer"]))
    dim, hd = tc["dim"], tc["head_dim"]
    assert ours["text_model.model.embeddings.weight"].shape == (tc["vocab_size"], dim)
    assert ours["text_model.model.layers.0.attention.wqkv.weight"].shape == (
        (tc["n_head"] + 2 * tc["n_local_heads"]) * hd, dim)
    assert ours["text_model.model.layers.0.attention.wo.weight"].shape == (dim, tc["n_head"] * hd)
    assert ours["text_model.model.layers.0.attention.q_norm.weight"].shape == (hd,)
    assert ours["audio_decoder.codebook_embeddings.weight"].shape == (ac["vocab_size"] * ac["num_codebooks"], dim)
    assert ours["audio_decoder.embeddings.weight"].shape == (ac["vocab_size"], ac["dim"])
    assert ours["audio_decoder.output.weight"].shape == (ac["vocab_size"], ac["dim"])

    index = read_json(tiny_s2_checkpoint / "model.safetensors.index.json")
    assert index["weight_map"].keys() == ours.keys()
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in ours.values())
    assert index["metadata"]["total_size"] == 2 * index["metadata"]["total_parameters"]
    from safetensors import safe_open

    for key, fname in index["weight_map"].items():
        with safe_open(str(tiny_s2_checkpoint / fname), "pt") as s:
            assert key in s.keys()
            assert s.metadata() == {"format": "pt"}


def test_s2_tokenizer(tiny_s2_checkpoint, golden_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_s2_checkpoint / "tokenizer.json"))
    cfg = read_json(tiny_s2_checkpoint / "config.json")
    sem = [tok.token_to_id(t) for t in SEMANTIC]
    assert sem == list(range(sem[0], sem[0] + 4096))
    assert (cfg["semantic_start_token_id"], cfg["semantic_end_token_id"]) == (sem[0], sem[-1])
    assert cfg["eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert cfg["pad_token_id"] == tok.token_to_id("<|pad|>")
    assert cfg["audio_pad_token_id"] == tok.token_to_id("<|audio_pad|>")
    base = tok.get_vocab_size(with_added_tokens=False)
    assert tok.token_to_id("<|endoftext|>") == base
    assert sem[-1] + 1 == tok.get_vocab_size()
    vocab = cfg["text_config"]["vocab_size"]
    assert vocab % 64 == 0 and 0 <= vocab - tok.get_vocab_size() < 64
    for t in S2_FISH_SPECIAL_TOKENS:
        assert tok.token_to_id(t) is not None

    # Same pipeline as the golden (Qwen2 split regex + byte level, NFC, BPE settings).
    ours = read_json(tiny_s2_checkpoint / "tokenizer.json")
    gold = read_json(golden_dir / "s2_tiny" / "checkpoint" / "tokenizer.json")
    for k in ("version", "truncation", "padding", "normalizer", "pre_tokenizer", "post_processor", "decoder"):
        assert ours[k] == gold[k], k
    drop = ("vocab", "merges")
    assert {k: v for k, v in ours["model"].items() if k not in drop} == \
        {k: v for k, v in gold["model"].items() if k not in drop}
    strip = [{k: v for k, v in a.items() if k != "id"} for a in ours["added_tokens"]]
    assert strip == [{k: v for k, v in a.items() if k != "id"} for a in gold["added_tokens"]]

    text = "Hello world, this is shoal. <|im_start|>user\nHi!<|im_end|><|semantic:7|>"
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert tok.token_to_id("<|semantic:7|>") in enc.ids
    assert "<|speaker:0|>" not in tok.get_vocab()  # BPE text, as in S2


@pytest.mark.parametrize("which", ["s2", "s1"])
def test_codec_matches_golden_format(which, tiny_s2_checkpoint, tiny_s1_checkpoint, golden_dir):
    from shoal.codec.config import CodecConfig
    from shoal.codec.loader import load_codec

    d = tiny_s2_checkpoint if which == "s2" else tiny_s1_checkpoint
    golden = golden_dir / "codec_tiny"
    assert CodecConfig.from_json(d / "codec_config.json") == CodecConfig.from_json(golden / "config.json")
    ours = torch.load(d / "codec.pth", weights_only=True)
    gold = torch.load(golden / "codec.pth", weights_only=True)
    assert list(ours) == list(gold)
    assert all(ours[k].shape == gold[k].shape and ours[k].dtype == gold[k].dtype for k in gold)
    load_codec(d)  # the shoal loader accepts it (strict)


# ------------------------------------------------------------------ S1 format


def test_s1_file_set_and_config_match_golden(tiny_s1_checkpoint, golden_dir):
    golden = golden_dir / "s1mini_tiny" / "checkpoint"
    assert sorted(p.name for p in tiny_s1_checkpoint.iterdir()) == sorted(p.name for p in golden.iterdir())
    ours_text = (tiny_s1_checkpoint / "config.json").read_text(encoding="utf-8")
    ours, gold = json.loads(ours_text), read_json(golden / "config.json")
    assert list(ours) == list(gold) == sorted(gold)
    assert ours_text == json.dumps(ours, indent=4, sort_keys=True)  # BaseModelArgs.save layout
    assert ours["model_type"] == "dual_ar" and ours["tie_word_embeddings"] is False
    assert list(read_json(tiny_s1_checkpoint / "special_tokens.json")) == list(read_json(golden / "special_tokens.json"))


def test_s1_weights(tiny_s1_checkpoint, golden_dir):
    sd = torch.load(tiny_s1_checkpoint / "model.pth", weights_only=True)
    gold = torch.load(golden_dir / "s1mini_tiny" / "checkpoint" / "model.pth", weights_only=True)
    assert type(sd) is type(gold)
    assert layerless(sd) == layerless(gold)
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    cfg = read_json(tiny_s1_checkpoint / "config.json")
    _, ranks, specials = load_tiktoken(tiny_s1_checkpoint)
    n_tokens = len(ranks) + len(specials)
    assert sd["output.weight"].shape == sd["embeddings.weight"].shape == (cfg["vocab_size"], cfg["dim"])
    assert cfg["vocab_size"] % 64 == 0 and n_tokens <= cfg["vocab_size"]
    assert torch.count_nonzero(sd["output.weight"][n_tokens:]) == 0
    assert torch.count_nonzero(sd["output.weight"][:n_tokens].float().abs().sum(-1) == 0) == 0
    assert sd["layers.0.attention.wqkv.weight"].shape == (
        (cfg["n_head"] + 2 * cfg["n_local_heads"]) * cfg["head_dim"], cfg["dim"])
    assert sd["fast_layers.0.attention.wqkv.weight"].shape == (
        (cfg["fast_n_head"] + 2 * cfg["fast_n_local_heads"]) * cfg["fast_head_dim"], cfg["fast_dim"])
    assert not any(k.startswith("fast_layers.") and "q_norm" in k for k in sd)


def test_s1_tiktoken(tiny_s1_checkpoint):
    enc, ranks, specials = load_tiktoken(tiny_s1_checkpoint)
    assert sorted(ranks.values()) == list(range(len(ranks)))
    order = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    order += [b for b in range(256) if b not in order]
    assert [next(k for k, v in ranks.items() if v == r) for r in range(256)] == [bytes([b]) for b in order]
    assert len(ranks) > 256  # learned merges

    assert list(specials) == S1_SPECIAL_TOKENS + SEMANTIC
    assert list(specials.values()) == list(range(len(ranks), len(ranks) + len(specials)))
    text = "Hello world, it's a tiny test: 24/7 café!"
    ids = enc.encode(text, allowed_special="all")
    assert enc.decode(ids) == text and max(ids) < len(ranks)
    assert enc.encode("<|im_end|><|semantic:0|>", allowed_special="all") == [
        specials["<|im_end|>"], specials["<|semantic:0|>"]]
    # S1 regex quirk: a run of spaces is one piece and the next word has no leading space.
    pieces = [enc.decode_single_token_bytes(t) for t in enc.encode("today?  I", allowed_special="all")]
    assert pieces[-1] == b"I" and b"".join(pieces[:-1]).endswith(b"?  ")


def test_s1_pattern_matches_golden_tokenizer(golden_dir):
    """The embedded S1 regex reproduces every tokenized part of the S1 golden prompts."""
    enc, _, _ = load_tiktoken(golden_dir / "s1mini_tiny" / "checkpoint")
    parts = []

    def walk(o):
        if isinstance(o, dict):
            if isinstance(o.get("text"), str) and isinstance(o.get("ids"), list):
                parts.append((o["text"], o["ids"]))
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(read_json(golden_dir / "s1mini_tiny" / "prompts" / "prompts.json"))
    assert parts
    for text, ids in parts:
        assert enc.encode(text, allowed_special="all") == ids, text


# ------------------------------------------------------- atomic write, default


def test_existing_dir_rules(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_tiny_s2_checkpoint(empty, with_codec=False) == empty
    assert (empty / "config.json").is_file()
    with pytest.raises(FileExistsError):
        write_tiny_s2_checkpoint(empty, with_codec=False)
    (empty / "stale.txt").write_text("x")
    write_tiny_s1_checkpoint(empty, with_codec=False, overwrite=True)
    assert sorted(p.name for p in empty.iterdir()) == [
        "config.json", "model.pth", "special_tokens.json", "tokenizer.tiktoken"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no temp dirs left behind


def test_shard_count(tmp_path):
    d = write_tiny_s2_checkpoint(tmp_path / "c", shards=3, n_layer=3, with_codec=False)
    index = read_json(d / "model.safetensors.index.json")
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in d.glob("*.safetensors")) == files
    assert len(s2_weights(d)) == len(index["weight_map"])


def test_default_checkpoint_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path / "cache"))
    path = default_checkpoint()
    assert path == tmp_path / "cache" / DEFAULT_CHECKPOINT_NAME
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "generating" in err
    assert (path / "config.json").is_file() and (path / "codec.pth").is_file()
    stamp = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}

    assert default_checkpoint() == path
    assert capsys.readouterr().err == ""
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == stamp

    # Seeded as documented, so every machine gets the same demo model.
    ref = write_tiny_s2_checkpoint(tmp_path / "ref", seed=demo.DEFAULT_SEED)
    assert file_bytes(ref) == file_bytes(path)

    # An explicit cache_dir wins over $SHOAL_CACHE; a damaged cache is rebuilt.
    other = default_checkpoint(tmp_path / "explicit")
    assert other == tmp_path / "explicit" / DEFAULT_CHECKPOINT_NAME
    (other / "tokenizer.json").unlink()
    assert default_checkpoint(tmp_path / "explicit") == other
    assert file_bytes(other) == file_bytes(path)


def test_default_checkpoint_concurrent(tmp_path, capsys):
    results, errors = [], []

    def worker():
        try:
            results.append(default_checkpoint(tmp_path))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert demo._is_complete_s2(results[0])
    assert capsys.readouterr().err.count("generating") == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [DEFAULT_CHECKPOINT_NAME]
