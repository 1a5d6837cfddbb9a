"""Streaming decode == one-shot decode, for any chunk schedule and across batched streams."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from shoal.codec import CodecConfig, DecoderState, StreamingDecoder, load_codec

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"
TINY = GOLDEN / "codec_tiny"

pytestmark = pytest.mark.skipif(not (TINY / "codec.pth").is_file(), reason="golden vectors not available")

TOL = 1e-4


@pytest.fixture(scope="module", params=["kv", "hidden", "ring"])
def codec(request):
    """The tiny codec carrying either window state (``window_state``: the transformer's keys
    and values, or its layers' normed inputs with keys and values recomputed per call)."""
    c = load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json"))
    return c.configure_serving(window_state=request.param)


@pytest.fixture(scope="module")
def dec(codec):
    return StreamingDecoder(codec)


@pytest.fixture(scope="module")
def golden_codes():
    from safetensors.torch import load_file

    g = load_file(str(TINY / "outputs" / "codec_golden_fp32.safetensors"))
    return {k.split(".")[0]: v for k, v in g.items() if k.endswith(".input_codes")}


def random_codes(T: int, seed: int, batch: int = 1, oob: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hi = 4096 if oob else 1024
    return torch.cat(
        [torch.randint(0, 4096, (batch, 1, T), generator=g), torch.randint(0, hi, (batch, 9, T), generator=g)], 1
    )


def stream(dec, codes: torch.Tensor, schedule, state=None) -> torch.Tensor:
    state = dec.new_state(codes.shape[0]) if state is None else state
    outs, i = [], 0
    for t in schedule:
        outs.append(dec.decode_chunk(codes[:, :, i : i + t], state))
        assert outs[-1].shape == (codes.shape[0], 1, 2048 * min(t, codes.shape[-1] - i))
        i += t
    assert i >= codes.shape[-1]
    return torch.cat(outs, -1)


def err(a, b) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize(
    "schedule",
    [[1] * 28, [2] * 14, [3] * 9 + [1], [8, 8, 8, 4], [1, 2, 3, 5, 8, 9], [28]],
    ids=["1", "2", "3", "8", "mixed", "whole"],
)
def test_schedules_match_one_shot(codec, dec, golden_codes, schedule):
    codes = golden_codes["decode_encoded"][None]
    ref = codec.decode(codes)
    out = stream(dec, codes, schedule)
    assert out.shape == ref.shape
    assert err(out, ref) <= TOL


def test_oob_codes_stream_and_caller_tensor_untouched(codec, dec, golden_codes):
    codes = golden_codes["decode_oob"][None].clone()
    keep = codes.clone()
    out = stream(dec, codes, [2, 1, 4])
    assert torch.equal(codes, keep)
    assert err(out, codec.decode(keep)) <= TOL


def test_long_stream_beyond_window(codec, dec):
    # 200 frames > post-module window 128: exercises KV eviction and RoPE positions
    codes = random_codes(200, seed=3)
    ref = codec.decode(codes)
    rng = random.Random(0)
    sched = []
    while sum(sched) < 200:
        sched.append(rng.choice([1, 2, 3, 5, 8, 13]))
    state = dec.new_state(1)
    sizes = {k: v.shape for k, v in state.tensors.items()}
    out = stream(dec, codes, sched, state)
    assert err(out, ref) <= TOL
    # bounded state: nothing grows with the stream length (past frames are never re-decoded)
    assert {k: v.shape for k, v in state.tensors.items()} == sizes
    assert int(state["quantizer.post_module.pos"][0]) == 200


def test_batch_of_streams_with_different_schedules(codec, dec, golden_codes):
    a = golden_codes["decode_encoded"][None]  # 28 frames
    b = random_codes(20, seed=11, oob=True)  # 20 frames
    ref_a, ref_b = codec.decode(a), codec.decode(b)

    # each stream starts alone with its own schedule ...
    sa, sb = dec.new_state(1), dec.new_state(1)
    outs_a = [dec.decode_chunk(a[:, :, 0:3], sa), dec.decode_chunk(a[:, :, 3:8], sa)]  # a at frame 8
    outs_b = [dec.decode_chunk(b[:, :, 0:1], sb)]  # b at frame 1
    # ... then they are stacked and decoded together (different positions per row)
    st = DecoderState.cat([sa, sb])
    ia, ib = 8, 1
    for t in [1, 4, 2, 7, 5]:
        chunk = torch.cat([a[:, :, ia : ia + t], b[:, :, ib : ib + t]], 0)
        out = dec.decode_chunk(chunk, st)
        outs_a.append(out[:1])
        outs_b.append(out[1:])
        ia += t
        ib += t
    assert (ia, ib) == (27, 20)
    # b finished: split a off and finish it alone
    sa = st.select([0])
    outs_a.append(dec.decode_chunk(a[:, :, ia:], sa))
    assert err(torch.cat(outs_a, -1), ref_a) <= TOL
    assert err(torch.cat(outs_b, -1), ref_b) <= TOL


def test_batched_same_schedule_different_codes(codec, dec):
    codes = random_codes(40, seed=5, batch=2)
    ref = codec.decode(codes)
    out = stream(dec, codes, [1, 3, 8, 2, 16, 10])
    assert err(out, ref) <= TOL


@pytest.mark.parametrize("group_positions,head_blocks", [(1, 1), (4, 1), (9, 1), (10 ** 6, 1), (4, 0), (9, 0)])
def test_row_groups_equal_one_group(group_positions, head_blocks):
    """The decoder's high-rate blocks (or, with no head blocks, all of them) run over row
    groups (a bounded activation peak): every stream's audio and carried state equal the
    one-group decode's, for ragged groups too."""
    c = load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json"))
    c.configure_serving(group_head_blocks=head_blocks)
    codes = random_codes(13, seed=11, batch=5)

    def run(gp):
        c.configure_serving(group_positions=gp)
        d = StreamingDecoder(c)
        st = d.new_state(5)
        return stream(d, codes, [2, 3, 8], st), st

    whole, st_whole = run(None)
    grouped, st_grouped = run(group_positions)
    # the 3-frame chunk (12 input positions): one stream per group up to 12 positions
    expected = 1 if group_positions >= 5 * 12 else -(-5 // max(1, group_positions // 12))
    assert len(c.decoder.row_groups(5, 12)) == expected
    assert err(grouped, whole) <= 1e-6
    for k in st_whole.tensors:  # fp32 CPU convs over fewer rows may block their sums apart
        ref = st_whole.tensors[k].float()
        assert err(st_grouped.tensors[k].float(), ref) <= 1e-6 * max(1.0, float(ref.abs().max())), k
    with pytest.raises(ValueError, match="group_positions"):
        c.configure_serving(group_positions=0)
    with pytest.raises(ValueError, match="group_head_blocks"):
        c.configure_serving(group_head_blocks=-1)


def test_row_groups_split_rows():
    c = load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json"))
    d = c.decoder
    d.group_positions = None
    assert d.row_groups(64, 128) == [(0, 64)]
    d.group_positions = 1024
    assert d.row_groups(32, 32) == [(0, 32)]  # fits
    assert d.row_groups(32, 128) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert d.row_groups(5, 600) == [(r, r + 1) for r in range(5)]  # a group holds >= 1 stream
    assert d.row_groups(1, 10 ** 6) == [(0, 1)]


def test_slot_reset_and_update(codec, dec):
    """Engine-style slot pool: reuse a slot for a new request mid-way."""
    x = random_codes(30, seed=21)
    y = random_codes(30, seed=22)
    z = random_codes(12, seed=23)
    pool = dec.new_state(2)
    o0 = dec.decode_chunk(torch.cat([x[:, :, :10], y[:, :, :10]]), pool)
    # slot 1 finishes its request; a new request z takes the slot
    pool.reset_([1])
    o1 = dec.decode_chunk(torch.cat([x[:, :, 10:22], z]), pool)
    assert err(torch.cat([o0[:1], o1[:1]], -1), codec.decode(x[:, :, :22])) <= TOL
    assert err(o1[1:], codec.decode(z)) <= TOL
    # update_: continue slot 0 in a separate single-stream state, write it back
    single = pool.select([0])
    o2 = dec.decode_chunk(x[:, :, 22:26], single)
    pool.update_([0], single)
    o3 = dec.decode_chunk(torch.cat([x[:, :, 26:30], z[:, :, :4]]), pool)
    assert err(torch.cat([o0[:1], o1[:1], o2, o3[:1]], -1), codec.decode(x)) <= TOL


def test_empty_chunk_and_validation(dec):
    st = dec.new_state(2)
    snap = st.clone()
    out = dec.decode_chunk(torch.zeros(2, 10, 0, dtype=torch.long), st)
    assert out.shape == (2, 1, 0)
    assert all(torch.equal(st.tensors[k], snap.tensors[k]) for k in st.tensors)
    with pytest.raises(ValueError):
        dec.decode_chunk(torch.zeros(3, 10, 1, dtype=torch.long), st)
    with pytest.raises(ValueError):
        dec.decode_chunk(torch.zeros(2, 9, 1, dtype=torch.long), st)


def test_state_layout(dec, codec):
    layout = dec.state_layout()
    assert layout["quantizer.post_module.pos"] == ((), torch.int64)
    w = codec.config.quantizer.post_module
    if codec.quantizer.post_module.window_state in ("kv", "ring"):
        assert layout["quantizer.post_module.layers.0.k"][0] == (w.n_head, w.window_size - 1, w.head_dim)
        assert "quantizer.post_module.layers.0.h" not in layout
    else:  # half the bytes: one [window - 1, dim] row per layer instead of keys and values
        assert layout["quantizer.post_module.layers.0.h"][0] == (w.window_size - 1, w.dim)
        assert "quantizer.post_module.layers.0.k" not in layout
    # dilated k7 conv of the last residual unit keeps (7 - 1) * 9 samples
    assert layout["decoder.model.4.block.4.block.1"][0] == (4, 54)
    # decoder transposed conv (k = 2 stride) keeps a stride-long overlap tail
    assert layout["decoder.model.1.block.1"][0] == (32, 8)
    st = dec.new_state(3)
    assert all(v.shape[0] == 3 for v in st.tensors.values())
    assert st.batch_size == 3


def test_packed_state_rows_move_together(dec):
    """new_state packs every tensor as a view of one [B, n] buffer per dtype: a row set in the
    buffer is that row of every tensor; select / update_ / reset_ keep rows apart; replacing a
    tensor unpacks the state, and per-tensor paths still work."""
    from shoal.codec import DecoderState

    st = dec.new_state(3)
    assert st.flat is not None and {v.dtype for v in st.tensors.values()} == set(st.flat)
    for f in st.flat.values():
        f[1].fill_(1)
    assert all(bool((v[1] == 1).all()) and not bool(v[0].any()) and not bool(v[2].any())
               for v in st.tensors.values())
    sub = st.select([1, 2])
    assert sub.same_packing(st)
    assert all(torch.equal(sub.tensors[k], st.tensors[k][[1, 2]]) for k in st.tensors)
    st.reset_([1])
    assert not any(bool(v.any()) for v in st.tensors.values())
    st.update_([0, 2], sub)  # packed into packed: one scatter per dtype
    assert all(bool((v[0] == 1).all()) and not bool(v[2].any()) for v in st.tensors.values())
    plain = DecoderState({k: v.clone() for k, v in sub.tensors.items()})
    assert plain.flat is None and not plain.same_packing(st)
    st.update_([1, 0], plain)  # per-tensor path
    assert all(bool((v[1] == 1).all()) and not bool(v[0].any()) for v in st.tensors.values())
    key = next(iter(st.tensors))
    st[key] = st.tensors[key].clone()
    assert st.flat is None


def test_window_states_give_the_same_audio():
    """The hidden-input window recomputes the keys and values the kv window carries: the same
    function (fp32: to rounding), at half the per-stream bytes of the transformer's window."""
    a = load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json"))
    b = load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json")).configure_serving(
        window_state="hidden")
    codes = random_codes(150, seed=9, batch=2)  # past the 128-frame window
    sched = [1, 7, 32, 3, 64, 43]
    da, db = StreamingDecoder(a), StreamingDecoder(b)
    out_a, out_b = stream(da, codes, sched), stream(db, codes, sched)
    assert err(out_a, out_b) <= 1e-5
    def window_bytes(d):
        return sum(v.numel() * v.element_size() for k, v in d.new_state(1).tensors.items()
                   if ".layers." in k and k.startswith("quantizer.post_module"))
    assert 2 * window_bytes(db) == window_bytes(da)
    with pytest.raises(ValueError, match="window_state"):
        a.configure_serving(window_state="fp8")


def test_window_states_agree_on_a_clamped_fixed_rope_table():
    """With a fixed RoPE table (what CUDA graphs read) shorter than the stream, positions past
    it are clamped; the hidden window's recomputed keys are clamped the same way as the kv
    window's stored ones, so both states still decode the same audio."""
    from shoal.codec.layers import rope_table

    a = load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json"))
    b = load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json")).configure_serving(
        window_state="hidden")
    pm = a.quantizer.post_module.cfg
    table = rope_table(64, pm.head_dim, pm.rope_base)[:24]  # frames 24.. are clamped to 23
    codes = random_codes(40, seed=21, batch=2)
    outs = []
    for c in (a, b):
        d = StreamingDecoder(c)
        st = d.new_state(2)
        with torch.no_grad():
            outs.append(torch.cat([d._decode(codes[:, :, i:i + 4], st, table) for i in range(0, 40, 4)], -1))
    assert err(outs[0], outs[1]) <= 1e-5
