"""Tokenizers of both checkpoint formats against the golden vectors."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from shoal.text import (
    HFTokenizer,
    TextTokenizer,
    TiktokenTokenizer,
    TokenizerLoadError,
    load_tokenizer,
)

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"
S2_CKPT = GOLDEN / "s2_tiny" / "checkpoint"
S1_CKPT = GOLDEN / "s1mini_tiny" / "checkpoint"

needs_golden = pytest.mark.skipif(not GOLDEN.is_dir(), reason=f"golden vectors not found at {GOLDEN}")


def _text_parts(prompts_json: Path) -> list[tuple[str, list[int]]]:
    data = json.loads(prompts_json.read_text())
    out = []
    for case in data.values():
        for batch in case.get("batch") or [case]:
            for p in batch["parts"]:
                if p["type"] == "text":
                    out.append((p["text"], p["ids"]))
    return out


@pytest.fixture(scope="module")
def s2_tok() -> TextTokenizer:
    if not GOLDEN.is_dir():
        pytest.skip(f"golden vectors not found at {GOLDEN}")
    return load_tokenizer(S2_CKPT)


@pytest.fixture(scope="module")
def s1_tok() -> TextTokenizer:
    if not GOLDEN.is_dir():
        pytest.skip(f"golden vectors not found at {GOLDEN}")
    return load_tokenizer(S1_CKPT)


# ---------------------------------------------------------------------- S2 (HF)


def test_s2_kind_and_ids(s2_tok):
    assert isinstance(s2_tok, HFTokenizer)
    assert s2_tok.kind == "hf"
    assert (s2_tok.semantic_begin_id, s2_tok.semantic_end_id) == (638, 4733)
    assert s2_tok.num_semantic_tokens == 4096
    assert (s2_tok.im_start_id, s2_tok.im_end_id) == (604, 605)
    assert s2_tok.voice_id == 633
    assert s2_tok.interleave_id == 634
    cfg = json.loads((S2_CKPT / "config.json").read_text())
    assert s2_tok.semantic_begin_id == cfg["semantic_start_token_id"]
    assert s2_tok.semantic_end_id == cfg["semantic_end_token_id"]
    assert s2_tok.im_end_id == cfg["eos_token_id"]
    assert s2_tok.token_to_id("<|semantic:17|>") == 638 + 17
    assert s2_tok.id_to_token(638 + 4095) == "<|semantic:4095|>"
    assert s2_tok.token_to_id("<|no such token|>") is None
    assert s2_tok.id_to_token(10**7) is None
    assert s2_tok.id_to_token(-1) is None


@needs_golden
def test_s2_every_golden_part(s2_tok):
    parts = _text_parts(GOLDEN / "s2_tiny" / "prompts" / "prompts.json")
    assert len(parts) == 48
    for text, ids in parts:
        assert s2_tok.encode(text) == ids, text
        assert s2_tok.decode(ids) == text


def test_s2_inline_specials_and_speaker_tag(s2_tok):
    # special tokens written inline are specials; no BOS/EOS added
    assert s2_tok.encode("<|im_end|>") == [605]
    assert s2_tok.encode("<|semantic:5|><|voice|>") == [643, 633]
    # <|speaker:N|> is plain BPE text in S2: <| speaker : 1 2 |>
    assert s2_tok.encode("<|speaker:12|>") == [519, 524, 25, 16, 17, 525]
    assert s2_tok.encode("") == []


# ---------------------------------------------------------------------- S1 (tiktoken)


def test_s1_kind_and_ids(s1_tok):
    assert isinstance(s1_tok, TiktokenTokenizer)
    assert s1_tok.kind == "tiktoken"
    assert (s1_tok.semantic_begin_id, s1_tok.semantic_end_id) == (618, 4713)
    assert s1_tok.num_semantic_tokens == 4096
    assert (s1_tok.im_start_id, s1_tok.im_end_id) == (606, 607)
    assert s1_tok.token_to_id("<|pad|>") == 605
    assert s1_tok.token_to_id("<|begin_of_text|>") == 603
    assert s1_tok.voice_id == 613
    assert s1_tok.interleave_id == 614
    assert s1_tok.vocab_size == 603 + 4111
    assert s1_tok.id_to_token(614) == "<|interleave|>"
    assert s1_tok.id_to_token(220) == " "
    assert s1_tok.token_to_id(" ") == 220
    assert s1_tok.id_to_token(4714) is None
    assert s1_tok.token_to_id("<|speaker:0|>") is None


@needs_golden
def test_s1_every_golden_part(s1_tok):
    parts = _text_parts(GOLDEN / "s1mini_tiny" / "prompts" / "prompts.json")
    assert len(parts) == 18
    for text, ids in parts:
        assert s1_tok.encode(text) == ids, text
        assert s1_tok.decode(ids) == text


def test_s1_escaped_lookahead_quirk(s1_tok):
    # quirk 12: "?  I" -> "?", "  ", "I" (the intended regex would give "?", " ", " I")
    assert s1_tok.encode("?  I") == [30, 220, 220, 40]
    assert s1_tok.encode("today?  I")[-4:] == [30, 220, 220, 40]
    # a single space still attaches to the following word
    assert s1_tok.encode("? I") == [30, 545]
    # digits are single pieces, the space before a digit is its own piece
    assert s1_tok.encode(" 24/7") == [220, 17, 19, 14, 22]


def test_s1_inline_specials(s1_tok):
    # quirk 11: allowed_special="all"
    assert s1_tok.encode("<|im_end|>") == [607]
    assert s1_tok.encode("a<|semantic:5|>") == [64, 623]
    assert s1_tok.encode("<|speaker:0|>") == [531, 540, 25, 15, 541]
    with pytest.raises(ValueError):
        s1_tok.decode([5000])


# ---------------------------------------------------------------------- loader errors


def test_missing_dir(tmp_path):
    with pytest.raises(TokenizerLoadError, match="not found"):
        load_tokenizer(tmp_path / "nope")


def test_no_tokenizer_files(tmp_path):
    with pytest.raises(TokenizerLoadError) as ei:
        load_tokenizer(tmp_path)
    msg = str(ei.value)
    assert str(tmp_path) in msg and "tokenizer.json" in msg and "tokenizer.tiktoken" in msg
    assert isinstance(ei.value, ValueError)


def test_malformed_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def _copy_s1(tmp_path: Path) -> Path:
    if not GOLDEN.is_dir():
        pytest.skip("golden vectors absent")
    shutil.copy(S1_CKPT / "tokenizer.tiktoken", tmp_path)
    shutil.copy(S1_CKPT / "special_tokens.json", tmp_path)
    return tmp_path


def test_missing_special_tokens_json(tmp_path):
    _copy_s1(tmp_path)
    (tmp_path / "special_tokens.json").unlink()
    with pytest.raises(TokenizerLoadError, match="special_tokens.json"):
        load_tokenizer(tmp_path)


def test_malformed_tiktoken(tmp_path):
    _copy_s1(tmp_path)
    with open(tmp_path / "tokenizer.tiktoken", "a") as f:
        f.write("this is not base64 rank\n")
    with pytest.raises(TokenizerLoadError, match="tokenizer.tiktoken"):
        load_tokenizer(tmp_path)


def test_malformed_special_tokens(tmp_path):
    _copy_s1(tmp_path)
    (tmp_path / "special_tokens.json").write_text("[1, 2")
    with pytest.raises(TokenizerLoadError, match="special_tokens.json"):
        load_tokenizer(tmp_path)


def test_s1_stored_ids_ignored_with_warning(tmp_path):
    _copy_s1(tmp_path)
    path = tmp_path / "special_tokens.json"
    specials = json.loads(path.read_text())
    specials = {k: v + 1000 for k, v in specials.items()}  # wrong stored values, same key order
    path.write_text(json.dumps(specials))
    with pytest.warns(UserWarning, match="disagree"):
        tok = load_tokenizer(tmp_path)
    assert tok.im_end_id == 607 and tok.semantic_begin_id == 618


def test_s1_golden_specials_load_without_warning():
    if not GOLDEN.is_dir():
        pytest.skip("golden vectors absent")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_tokenizer(S1_CKPT)


def test_s1_noncontiguous_semantic(tmp_path):
    _copy_s1(tmp_path)
    path = tmp_path / "special_tokens.json"
    specials = json.loads(path.read_text())
    keys = list(specials)
    keys.remove("<|semantic:5|>")
    keys.append("<|semantic:5|>")  # moved to the end: its id jumps past <|semantic:4095|>
    path.write_text(json.dumps({k: i + 603 for i, k in enumerate(keys)}))
    with pytest.raises(TokenizerLoadError, match="not contiguous"):
        load_tokenizer(tmp_path)


def test_s1_missing_semantic(tmp_path):
    _copy_s1(tmp_path)
    path = tmp_path / "special_tokens.json"
    specials = json.loads(path.read_text())
    del specials["<|semantic:4095|>"]
    path.write_text(json.dumps(specials))
    with pytest.raises(TokenizerLoadError, match="semantic"):
        load_tokenizer(tmp_path)


def test_s2_noncontiguous_semantic(tmp_path):
    if not GOLDEN.is_dir():
        pytest.skip("golden vectors absent")
    data = json.loads((S2_CKPT / "tokenizer.json").read_text())
    # move <|semantic:5|> to the end of the added tokens: every later one shifts down by 1
    added = data["added_tokens"]
    i = next(k for k, t in enumerate(added) if t["content"] == "<|semantic:5|>")
    moved = added.pop(i)
    for t in added[i:]:
        t["id"] -= 1
    moved["id"] = 4733
    added.append(moved)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerLoadError, match="not contiguous"):
        load_tokenizer(tmp_path)


def test_hf_preferred_when_both_present(tmp_path):
    _copy_s1(tmp_path)
    shutil.copy(S2_CKPT / "tokenizer.json", tmp_path)
    assert load_tokenizer(tmp_path).kind == "hf"
