"""Prompt builders (token grids) against the golden vectors of both families."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shoal.text import (
    PromptSession,
    Reference,
    TextPart,
    VQPart,
    build_session,
    encode_parts,
    format_grid,
    format_parts,
    group_turns_into_batches,
    load_tokenizer,
    split_batches,
    split_text_by_speaker,
)

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"
S2 = GOLDEN / "s2_tiny"
S1 = GOLDEN / "s1mini_tiny"

needs_golden = pytest.mark.skipif(not GOLDEN.is_dir(), reason=f"golden vectors not found at {GOLDEN}")


@pytest.fixture(scope="module")
def s2_tok():
    if not GOLDEN.is_dir():
        pytest.skip(f"golden vectors not found at {GOLDEN}")
    return load_tokenizer(S2 / "checkpoint")


@pytest.fixture(scope="module")
def s1_tok():
    if not GOLDEN.is_dir():
        pytest.skip(f"golden vectors not found at {GOLDEN}")
    return load_tokenizer(S1 / "checkpoint")


@pytest.fixture(scope="module")
def s2_generation():
    if not GOLDEN.is_dir():
        pytest.skip(f"golden vectors not found at {GOLDEN}")
    from safetensors.numpy import load_file

    return load_file(str(S2 / "outputs" / "generation_fp32.safetensors"))


def _cases(root: Path) -> dict:
    return json.loads((root / "inputs" / "cases.json").read_text())


def _refs(root: Path, case: dict) -> list[Reference]:
    return [
        Reference(text, np.load(root / "inputs" / f))
        for text, f in zip(case["prompt_text"], case["prompt_codes"])
    ]


def _check_parts(tok, parts, golden_parts):
    assert len(parts) == len(golden_parts)
    for p, g in zip(parts, golden_parts):
        if g["type"] == "text":
            assert isinstance(p, TextPart)
            assert p.text == g["text"]
            assert tok.encode(p.text) == g["ids"]
        else:
            assert isinstance(p, VQPart)
            assert list(p.codes.shape) == g["shape"]
            assert p.codes[0, :5].tolist() == g["row0_first5"]


S2_CASES = ["no_ref", "one_ref", "two_refs", "multispeaker"]


# ---------------------------------------------------------------------- S2 goldens


@needs_golden
@pytest.mark.parametrize("name", S2_CASES)
def test_s2_golden_grids(name, s2_tok, s2_generation):
    case = _cases(S2)[name]
    golden = json.loads((S2 / "prompts" / "prompts.json").read_text())[name]
    session = build_session("s2", s2_tok, case["text"], _refs(S2, case), case["chunk_length"])
    assert session.batches == golden["batches"]
    assert len(golden["batch"]) == len(session.batches)
    for b, gb in enumerate(golden["batch"]):
        assert not session.done()
        assert session.batch_text == gb["batch_text"]
        grid = session.grid()
        expected = np.load(S2 / "prompts" / gb["grid_file"])
        assert grid.dtype == np.int64
        assert grid.shape == (11, gb["T"])
        np.testing.assert_array_equal(grid, expected)
        np.testing.assert_array_equal(grid, s2_generation[f"{name}.b{b}.prompt_grid"])
        _check_parts(s2_tok, session.parts(), gb["parts"])
        np.testing.assert_array_equal(encode_parts(s2_tok, session.parts()), expected)
        # feed the golden generated codes (multispeaker b1 depends on b0's codes)
        session.commit(s2_generation[f"{name}.b{b}.codes"])
    assert session.done()


@needs_golden
def test_s2_two_refs_generation_grid(s2_tok, s2_generation):
    case = _cases(S2)["two_refs"]
    grid = build_session("s2", s2_tok, case["text"], _refs(S2, case), case["chunk_length"]).grid()
    np.testing.assert_array_equal(grid, s2_generation["two_refs.b0.prompt_grid"])
    # the second transcript already had <|speaker:3|>: kept, not re-tagged
    assert "<|speaker:0|>Good morning to you too.\n<|speaker:3|>A journey" in s2_tok.decode(grid[0])


@needs_golden
def test_s2_multispeaker_context_persists(s2_tok, s2_generation):
    case = _cases(S2)["multispeaker"]
    s = build_session("s2", s2_tok, case["text"], _refs(S2, case), case["chunk_length"])
    g0 = s.grid()
    assert s.grid() is not g0 and np.array_equal(s.grid(), g0)  # grid() is repeatable
    codes = s2_generation["multispeaker.b0.codes"]
    s.commit(codes)
    g1 = s.grid()
    # batch 1 = batch 0's grid (with the open assistant turn) + codes + im_end + next turn
    np.testing.assert_array_equal(g1[:, : g0.shape[1]], g0)
    n = codes.shape[1]
    vq = g1[:, g0.shape[1] : g0.shape[1] + n]
    np.testing.assert_array_equal(vq[0], s2_tok.semantic_begin_id + codes[0])
    np.testing.assert_array_equal(vq[1:], codes)
    assert len(s.generated) == 1


@needs_golden
def test_s2_turns_and_batches(s2_tok):
    golden = json.loads((S2 / "prompts" / "prompts.json").read_text())
    for name, g in golden.items():
        turns = split_text_by_speaker(g["text"])
        assert turns == g["turns"], name
        if turns:
            assert group_turns_into_batches(turns, 5, g["chunk_length"]) == g["batches"]
        assert split_batches(g["text"], g["chunk_length"]) == g["batches"]


# ---------------------------------------------------------------------- S1 goldens


@needs_golden
@pytest.mark.parametrize("name", ["no_ref", "one_ref", "two_refs"])
def test_s1_golden_grids(name, s1_tok):
    case = _cases(S1)[name]
    golden = json.loads((S1 / "prompts" / "prompts.json").read_text())[name]
    session = build_session("s1", s1_tok, case["text"], _refs(S1, case), case["chunk_length"])
    assert session.batches == [case["text"]]
    grid = session.grid()
    expected = np.load(S1 / "prompts" / golden["grid_file"])
    assert grid.shape == (11, golden["T"])
    np.testing.assert_array_equal(grid, expected)
    _check_parts(s1_tok, session.parts(), golden["parts"])
    session.commit(np.zeros((10, 12), dtype=np.int64))
    assert session.done()
    with pytest.raises(RuntimeError):
        session.grid()
    with pytest.raises(RuntimeError):
        session.commit(np.zeros((10, 1), dtype=np.int64))


@needs_golden
def test_s1_ignores_chunk_length_and_tags(s1_tok):
    text = "<|speaker:0|>Hi there. <|speaker:1|>Hello!"
    a = build_session("s1", s1_tok, text, [], 10)
    b = build_session("s1", s1_tok, text, [], None)
    assert a.batches == [text] == b.batches
    np.testing.assert_array_equal(a.grid(), b.grid())
    # every reference is speaker 0, whatever its index
    refs = [Reference("a", np.zeros((10, 2), np.int64)), Reference("b", np.ones((10, 3), np.int64))]
    parts = build_session("s1", s1_tok, "x", refs).parts()
    assert [p.text for p in parts if isinstance(p, TextPart)].count("<|speaker:0|>") == 3


# ---------------------------------------------------------------------- splitting rules


def test_split_text_by_speaker_rules():
    assert split_text_by_speaker("no tags here") == []
    assert split_text_by_speaker("pre <|speaker:0|> a  <|speaker:12|>b\n") == [
        "<|speaker:0|> a",
        "<|speaker:12|>b",
    ]
    assert split_text_by_speaker("<|speaker:1|>") == ["<|speaker:1|>"]
    assert split_text_by_speaker("<|speaker:1|><|speaker:2|>x") == ["<|speaker:1|>", "<|speaker:2|>x"]
    assert split_text_by_speaker("<|speaker:x|>not a tag") == []


def test_group_turns_joiners_not_counted():
    # 3 turns of 10 bytes with max_bytes 30: one batch of 32 bytes (the "\n" joiners are free)
    turns = ["a" * 10, "b" * 10, "c" * 10]
    batches = group_turns_into_batches(turns, max_speakers=5, max_bytes=30)
    assert batches == ["\n".join(turns)]
    assert len(batches[0].encode()) == 32
    assert group_turns_into_batches(turns, max_speakers=5, max_bytes=29) == ["\n".join(turns[:2]), turns[2]]


def test_group_turns_limits():
    turns = [f"t{i}" for i in range(7)]
    assert group_turns_into_batches(turns, max_speakers=5, max_bytes=1000) == [
        "\n".join(turns[:5]),
        "\n".join(turns[5:]),
    ]
    # an oversize turn forms its own batch; bytes are UTF-8 bytes, not characters
    assert group_turns_into_batches(["x" * 50, "y"], max_bytes=10) == ["x" * 50, "y"]
    assert group_turns_into_batches(["é" * 5, "z"], max_bytes=10) == ["é" * 5, "z"]
    assert group_turns_into_batches(["é" * 4, "z"], max_bytes=9) == ["é" * 4 + "\nz"]
    assert group_turns_into_batches([]) == []


def test_split_batches_untagged_text_is_one_batch():
    text = "word " * 500
    assert split_batches(text, 50) == [text]
    assert split_batches(text, None) == [text]
    with pytest.raises(ValueError):
        split_batches(text, 0)


# ---------------------------------------------------------------------- grids and errors


@needs_golden
def test_encode_parts_layout(s2_tok):
    codes = np.arange(30, dtype=np.int64).reshape(10, 3)
    g = encode_parts(s2_tok, [TextPart("<|im_end|>"), VQPart(codes), TextPart("")])
    assert g.shape == (11, 4) and g.dtype == np.int64
    assert g[0].tolist() == [605] + (638 + codes[0]).tolist()
    assert (g[1:, 0] == 0).all()
    np.testing.assert_array_equal(g[1:, 1:], codes)
    assert encode_parts(s2_tok, []).shape == (11, 0)
    with pytest.raises(ValueError):
        encode_parts(s2_tok, [VQPart(np.zeros((9, 2), np.int64))])
    with pytest.raises(ValueError):
        encode_parts(s2_tok, [VQPart(np.full((10, 2), 4096, np.int64))])
    with pytest.raises(ValueError):
        encode_parts(s2_tok, [VQPart(np.full((10, 2), -1, np.int64))])
    # residual codes >= 1024 are legal (the S2 fast head produces them)
    big = np.full((10, 1), 2000, np.int64)
    assert encode_parts(s2_tok, [VQPart(big)])[2:, 0].tolist() == [2000] * 9


@needs_golden
def test_session_errors(s2_tok):
    with pytest.raises(ValueError, match="family"):
        build_session("s3", s2_tok, "hi", [], None)
    with pytest.raises(ValueError, match="empty"):
        build_session("s2", s2_tok, "   ", [], None)
    with pytest.raises(ValueError):
        build_session("s2", s2_tok, "hi", [Reference("r", np.zeros((8, 4), np.int64))], None)
    with pytest.raises(ValueError):
        Reference("r", np.zeros((10, 4), np.float32))
    with pytest.raises(ValueError):
        Reference("r", np.zeros(10, np.int64))
    s = build_session("s2", s2_tok, "hi", [], None)
    assert isinstance(s, PromptSession) and s.family == "s2"
    with pytest.raises(ValueError):
        s.commit(np.zeros((9, 3), np.int64))
    s.commit(np.zeros((10, 0), np.int64))  # an empty generation is allowed
    assert s.done()


@needs_golden
def test_format_grid(s2_tok, s1_tok):
    g = np.load(S2 / "prompts" / "grid_one_ref_b0.npy")
    out = format_grid(g, s2_tok)
    assert "[11, 124]" in out and "T=124" in out
    assert "[VQ x 23 frames]" in out and "3712 2503 1443" in out
    assert "'<|im_start|>assistant\\n<|voice|>'" in out
    out1 = format_grid(np.load(S1 / "prompts" / "grid_two_refs.npy"), s1_tok)
    assert "[VQ x 19 frames]" in out1 and "[VQ x 14 frames]" in out1 and "T=106" in out1
    s = build_session("s1", s1_tok, "hello", [])
    assert "'<|interleave|>'" in format_parts(s.parts(), s1_tok)
