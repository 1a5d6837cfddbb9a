"""Codec decode at serving scale: the Snake kernel, the fused decoder path, channels-last,
the CUDA-graph decoder's code path, the batched encoder, and the codec benchmark's smoke run.

Interpreter cases of the Snake kernel run in a subprocess (this file as a script with
``TRITON_INTERPRET=1``), as in test_fused_kernels.py. GPU tests skip without CUDA.
"""

import os

if __name__ == "__main__":  # interpreter worker: must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import random
import zlib
from pathlib import Path

import pytest
import torch
from interpreter_worker import assert_case, report_cases, run_worker

from shoal.bench.kernels_fused import ulp_diff
from shoal.kernels import snake as sk

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"
TINY = GOLDEN / "codec_tiny"
golden = pytest.mark.skipif(not (TINY / "codec.pth").is_file(), reason="golden vectors not available")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def old_snake(x, alpha):
    """layers.Snake before the kernel existed (dac.nn.layers.snake)."""
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def snake_inputs(B, C, L, dtype, seed, channels_last=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, C, L, generator=g) * 3).to(dtype)
    y = torch.randn(B, C, L, generator=g).to(dtype)
    if channels_last:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
        y = y.transpose(1, 2).contiguous().transpose(1, 2)
    alpha = (torch.rand(1, C, 1, generator=g) * 2 + 0.05).to(dtype)
    bias = (torch.randn(C, generator=g) * 0.5).to(dtype)
    return x, y, alpha, bias


# --------------------------------------------------------------------------------------
# Interpreter worker
# --------------------------------------------------------------------------------------

INTERP_CASES = [f"{dt}_{lay}_{mode}" for dt in ("fp32", "bf16") for lay in ("nct", "ntc")
                for mode in ("plain", "add", "bias", "add_bias_out")]
INTERP_CASES += [f"{dt}_flat_{mode}" for dt in ("fp32", "bf16") for mode in ("plain", "add_bias_out")]


def _flat_case(dt_name, mode):
    """The flat channels-last kernel (SHOAL_SNAKE_FLAT=1): bit-equal to the tiled kernel, and
    within the reference's tolerance; ``add_bias_out`` writes into a channels-last conv buffer
    after 11 context samples (batch stride != L * C)."""
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt_name]
    x, y, alpha, bias = snake_inputs(2, 37, 301, dt, 11 if mode == "plain" else 12, channels_last=True)
    yy, bb = (y, bias) if mode == "add_bias_out" else (None, None)
    outs, launches = {}, []
    real = sk._flat_kernel
    sk._flat_kernel = lambda: (launches.append(1), real())[1]
    try:
        for flat in ("0", "1"):
            os.environ["SHOAL_SNAKE_FLAT"] = flat
            buf = torch.full((2, 312, 37), 7.0, dtype=dt).transpose(1, 2)
            out = buf[..., 11:] if mode == "add_bias_out" else None
            s, h = sk.snake_triton(x, alpha, yy, bb, out=out, write_h=True)
            outs[flat] = (s.clone(), h.clone(), buf)
            if flat == "0":
                n_tiled = len(launches)
    finally:
        os.environ.pop("SHOAL_SNAKE_FLAT", None)
        sk._flat_kernel = real
    (s0, h0, _), (s1, h1, buf) = outs["0"], outs["1"]
    rs, rh = sk.snake_ref(x, alpha, yy, bb)
    flags = {"flat_layout": sk._flat_rows(37, x, yy, buf[..., 11:] if mode == "add_bias_out" else s1),
             "flat_equals_tiled": torch.equal(s0, s1) and torch.equal(h0, h1), "h_exact": torch.equal(h1, rh),
             "dispatch": n_tiled == 0 and len(launches) == 1}  # the tiled run, then the flat one
    if mode == "add_bias_out":
        flags["context_untouched"] = bool((buf[..., :11] == 7).all())
    if dt == torch.float32:
        checks = {"rel_err": ((s1 - rs).abs().max().item() / rs.abs().max().item(), 1e-6)}
    else:
        u = ulp_diff(s1, rs)
        checks = {"max_ulp": (float(u.max()), 1.0), "mismatch_frac": ((u > 0).float().mean().item(), 1e-2)}
    return {"checks": checks, "flags": flags}


def _interp_case(name):
    if "_flat_" in name:
        dt_name, _, mode = name.split("_", 2)
        return _flat_case(dt_name, mode)
    dt_name, lay, mode = name.split("_", 2)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt_name]
    x, y, alpha, bias = snake_inputs(2, 37, 301, dt, zlib.crc32(name.encode()) % 1000, channels_last=lay == "ntc")
    yy = y if "add" in mode else None
    bb = bias if "bias" in mode else None
    checks, flags = {}, {}
    if mode == "add_bias_out":  # strided out: a conv buffer after 11 context samples
        buf = torch.full((2, 37, 312), 7.0, dtype=dt)
        s, h = sk.snake_triton(x, alpha, yy, bb, out=buf[..., 11:], write_h=True)
        flags["context_untouched"] = bool((buf[..., :11] == 7).all())
        flags["out_is_view"] = s.data_ptr() == buf[..., 11:].data_ptr()
    else:
        s, h = sk.snake_triton(x, alpha, yy, bb, write_h=True)
    rs, rh = sk.snake_ref(x, alpha, yy, bb)
    flags["h_exact"] = torch.equal(h, rh)
    if dt == torch.float32:
        checks["rel_err"] = ((s - rs).abs().max().item() / rs.abs().max().item(), 1e-6)
    else:
        u = ulp_diff(s, rs)
        checks["max_ulp"] = (float(u.max()), 1.0)
        checks["mismatch_frac"] = ((u > 0).float().mean().item(), 1e-2)
    flags["dispatch"] = sk.use_triton(x)
    return {"checks": checks, "flags": flags}


@pytest.fixture(scope="module")
def interp_results():
    if not sk.HAS_TRITON:
        pytest.skip("triton not installed")
    return run_worker(__file__)


@pytest.mark.parametrize("name", INTERP_CASES)
def test_snake_kernel_matches_reference_interpreter(interp_results, name):
    assert_case(interp_results[name])


# --------------------------------------------------------------------------------------
# Reference and CPU dispatch
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_snake_ref_is_layers_snake(dtype):
    x, y, alpha, bias = snake_inputs(2, 16, 50, dtype, 1)
    s, h = sk.snake_ref(x, alpha)
    assert torch.equal(s, old_snake(x, alpha)) and h is x
    s, h = sk.snake_ref(x, alpha, y, bias)
    hh = (x + y) + bias[:, None]
    assert torch.equal(h, hh) and torch.equal(s, old_snake(hh, alpha))


def test_snake_cpu_dispatch_is_reference():
    if sk.triton_interpreting():
        pytest.skip("triton imported in interpreter mode in this process")
    x, y, alpha, bias = snake_inputs(2, 8, 40, torch.float32, 2)
    out, h_out = torch.empty_like(x), torch.empty_like(x)
    s, h = sk.snake(x, alpha, y, bias, out=out, h_out=h_out)
    rs, rh = sk.snake_ref(x, alpha, y, bias)
    assert s is out and h is h_out and torch.equal(s, rs) and torch.equal(h, rh)
    with pytest.raises(ValueError):
        sk.snake_ref(x, alpha[:, :4])


# --------------------------------------------------------------------------------------
# Decoder paths (tiny golden codec, CPU fp32)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def codec():
    from shoal.codec import CodecConfig, load_codec

    if not (TINY / "codec.pth").is_file():
        pytest.skip("golden vectors not available")
    return load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json"))


@pytest.fixture(scope="module")
def golden_out():
    from safetensors.torch import load_file

    return load_file(str(TINY / "outputs" / "codec_golden_fp32.safetensors"))


def random_codes(T, seed, batch=1):
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(0, 4096, (batch, 1, T), generator=g),
                      torch.randint(0, 1024, (batch, 9, T), generator=g)], 1)


def stream(dec, codes, schedule):
    st = dec.new_state(codes.shape[0])
    outs, i = [], 0
    for t in schedule:
        outs.append(dec.decode_chunk(codes[:, :, i:i + t], st))
        i += t
    return torch.cat(outs, -1)


@golden
@pytest.mark.parametrize("channels_last", [False, True])
def test_fused_decoder_matches_golden_and_module_path(codec, golden_out, channels_last):
    from shoal.codec import StreamingDecoder

    codes = golden_out["decode_encoded.input_codes"][None]
    try:
        codec.configure_serving(fused=False, channels_last=False)
        ref = codec.decode(codes)
        codec.configure_serving(fused=True, channels_last=channels_last)
        out = codec.decode(codes)
        assert (out.flatten() - golden_out["decode_encoded.waveform"]).abs().max() <= 1e-5
        assert (out - ref).abs().max() <= 1e-6
        dec = StreamingDecoder(codec)
        for sched in ([1] * 28, [3] * 9 + [1], [4, 8, 16]):
            assert (stream(dec, codes, sched) - ref).abs().max() <= 1e-4
    finally:
        codec.configure_serving(fused=True, channels_last=False)


def test_channels_last_needs_fused(codec):
    with pytest.raises(ValueError):
        codec.configure_serving(fused=False, channels_last=True)
    codec.configure_serving(fused=True, channels_last=False)


@golden
def test_graph_code_path_equals_eager(codec, monkeypatch):
    """run_static is what a CUDA graph records: static buffers, fixed RoPE table, padded bucket
    (here with the opt-in shared output buffer, SHOAL_CODEC_STATIC_OUT=1)."""
    from shoal.codec import GraphedStreamingDecoder, StreamingDecoder

    monkeypatch.setenv("SHOAL_CODEC_STATIC_OUT", "1")

    eager = StreamingDecoder(codec)
    gd = GraphedStreamingDecoder(codec, batch_buckets=(2, 4), chunk_frames=(4, 8))
    codes = random_codes(150, seed=7, batch=4)  # > window 128: KV eviction
    sched = [8, 4, 8] * 7 + [4, 4, 2]
    for B in (4, 3):  # bucket-exact: bit-equal; padded 3 -> 4: batch-dependent CPU kernels only
        se, sg = eager.new_state(B), gd.new_state(B)
        i = 0
        for t in sched:
            a = eager.decode_chunk(codes[:B, :, i:i + t], se)
            b = gd.run_static(codes[:B, :, i:i + t], sg)
            i += t
            if B == 4:
                assert torch.equal(a, b)
            else:
                assert (a - b).abs().max() <= 1e-5
        assert se.bounds == sg.bounds
        for k in se.tensors:
            if B == 4:
                assert torch.equal(se.tensors[k], sg.tensors[k]), k
            else:
                assert (se.tensors[k].float() - sg.tensors[k].float()).abs().max() <= 1e-4, k
    # every call's audio went through the one shared output buffer (the graphs' last copy):
    # the largest bucket x the longest chunk, and what the calls returned are copies of it
    buf = gd._out_buf
    assert buf is not None and tuple(buf.shape) == (4, 1, 8 * codec.frame_length)
    assert b.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    assert torch.equal(buf[:4, :, : b.shape[-1]][:3], b)  # the last call's rows, padding row after


def test_static_output_buffer_views(monkeypatch):
    """The shared output buffer's views: one per (bucket, frames) call that fits its layout,
    None for calls that do not (too long, other channels or dtype, a bigger bucket), none at
    all by default (opt-in: SHOAL_CODEC_STATIC_OUT=1)."""
    from shoal.bench.codec import build_codec
    from shoal.codec import GraphedStreamingDecoder

    codec = build_codec(True, torch.device("cpu"))
    hop = codec.frame_length
    monkeypatch.delenv("SHOAL_CODEC_STATIC_OUT", raising=False)
    default = GraphedStreamingDecoder(codec, batch_buckets=(2, 4), chunk_frames=(4, 8), enabled=False)
    y = torch.randn(2, 1, 4 * hop)
    assert default._to_static_out(y, 2, 4) is y and default._out_buf is None
    monkeypatch.setenv("SHOAL_CODEC_STATIC_OUT", "1")
    gd = GraphedStreamingDecoder(codec, batch_buckets=(2, 4), chunk_frames=(4, 8), enabled=False)
    like = torch.randn(4, 1, 8 * hop)
    v = gd._out_view(like, 4, 8)
    assert v is not None and tuple(gd._out_buf.shape) == (4, 1, 8 * hop)
    assert v.data_ptr() == gd._out_buf.data_ptr() and tuple(v.shape) == (4, 1, 8 * hop)
    out = gd._to_static_out(torch.randn(2, 1, 4 * hop), 2, 4)
    assert out.data_ptr() == gd._out_buf.data_ptr() and tuple(out.shape) == (2, 1, 4 * hop)
    assert gd._out_view(torch.randn(4, 1, 16 * hop), 4, 16) is None  # longer than the buffer
    assert gd._out_view(torch.randn(4, 2, 4 * hop), 4, 4) is None  # other channels
    assert gd._out_view(torch.randn(4, 1, 4 * hop, dtype=torch.float64), 4, 4) is None
    assert gd._out_view(torch.randn(4, 1, 4 * hop + 1), 4, 4) is None  # not whole frames
    x = torch.randn(3, 1, 4 * hop)
    assert gd._to_static_out(x, 3, 4) is not x  # rows = bucket rows: 3 fits the 4-row buffer
    # first used under inference_mode (the engine's decode path), written outside it later
    # (a capture at warm-up): the buffer is a normal tensor
    late = GraphedStreamingDecoder(codec, batch_buckets=(2, 4), chunk_frames=(4, 8), enabled=False)
    with torch.inference_mode():
        late._to_static_out(torch.randn(2, 1, 4 * hop), 2, 4)
    assert not late._out_buf.is_inference()
    with torch.no_grad():
        late._to_static_out(torch.randn(4, 1, 8 * hop), 4, 8)
    monkeypatch.setenv("SHOAL_CODEC_STATIC_OUT", "off")
    off = GraphedStreamingDecoder(codec, batch_buckets=(2, 4), chunk_frames=(4, 8), enabled=False)
    y = torch.randn(2, 1, 4 * hop)
    assert off._to_static_out(y, 2, 4) is y and off._out_buf is None


@golden
def test_graph_code_path_pooled_rows(codec):
    from shoal.codec import GraphedStreamingDecoder, StreamingDecoder

    eager = StreamingDecoder(codec)
    gd = GraphedStreamingDecoder(codec, batch_buckets=(2,), chunk_frames=(4,))
    codes = random_codes(12, seed=9, batch=2)
    pool_e, pool_g = eager.new_state(5), gd.new_state(5)
    idx = torch.tensor([3, 1])
    for i in range(0, 12, 4):
        a = eager.decode_rows(codes[:, :, i:i + 4], pool_e, idx)
        b = gd.run_static(codes[:, :, i:i + 4], pool_g, idx)
        assert torch.equal(a, b)
    for k in pool_e.tensors:
        assert torch.equal(pool_e.tensors[k], pool_g.tensors[k]), k
    assert (torch.cat([eager.decode_rows(codes[:, :, :4], eager.new_state(2), torch.tensor([0, 1]))], -1)
            - codec.decode(codes[:, :, :4])).abs().max() <= 1e-4


@golden
@pytest.mark.parametrize("group_positions,window_state", [(None, "kv"), (16, "kv"), (16, "hidden"), (16, "ring")])
def test_bound_decoder_decodes_pool_rows_in_place(codec, group_positions, window_state):
    """A decoder bound to the streamer's slot pool records its graphs over the pool's rows
    (no state copy of its own): its code path equals eager decode_rows on a copy of the pool,
    with padded buckets, row groups and KV eviction (or the hidden-input window's); rows it
    was not given are untouched but the scratch row; an unbound state runs eagerly."""
    codec.configure_serving(group_positions=group_positions, window_state=window_state)
    try:
        _bound_decoder_case(codec)
    finally:
        codec.configure_serving(group_positions=None, window_state="kv")


def _bound_decoder_case(codec):
    from shoal.codec import GraphedStreamingDecoder, StreamingDecoder
    from shoal.codec.layers import IndexedState

    eager = StreamingDecoder(codec)
    gd = GraphedStreamingDecoder(codec, batch_buckets=(2, 4), chunk_frames=(4, 8))
    pool_g = gd.new_state(7)  # 6 stream rows + the scratch row
    gd.bind(pool_g, 6)
    assert gd._static_state is None  # a bound decoder keeps no state rows of its own
    pool_e = eager.new_state(7)
    codes = random_codes(140, seed=13, batch=3)  # > window 128: KV eviction
    idx = torch.tensor([5, 0, 2])
    untouched = {k: v[[1, 3, 4]].clone() for k, v in pool_g.tensors.items()}
    i = 0
    for n, t in [(3, 8), (2, 4), (3, 8)] * 6 + [(3, 4), (1, 8)]:  # 3 -> bucket 4 (padding), 2 exact, 1
        a = eager.decode_rows(codes[:n, :, i:i + t], pool_e, idx[:n])
        b = gd.run_static(codes[:n, :, i:i + t], pool_g, idx[:n])
        assert (a - b).abs().max() <= 1e-5
        if n == 3:
            i += t
        else:  # the other rows caught up next call: decode them the same frames
            a = eager.decode_rows(codes[n:3, :, i:i + t], pool_e, idx[n:3])
            b = gd.run_static(codes[n:3, :, i:i + t], pool_g, idx[n:3])
            assert (a - b).abs().max() <= 1e-5
            i += t
    for k in pool_e.tensors:
        assert (pool_e.tensors[k][idx].float() - pool_g.tensors[k][idx].float()).abs().max() <= 1e-4, k
        assert torch.equal(pool_g.tensors[k][[1, 3, 4]], untouched[k]), k
    assert pool_g.bounds == pool_e.bounds
    # row groups over an indexed view select rows of the index
    view = IndexedState(pool_g, torch.tensor([4, 1, 3]))
    assert view.select(slice(1, 3)).index.tolist() == [1, 3] and view.nbytes() == 0
    with pytest.raises(TypeError):
        view["x"] = torch.zeros(1)
    with pytest.raises(RuntimeError):  # graphs exist: too late to re-bind
        gd.graphs[(4, 4)] = object()
        gd.bind(pool_g, 6)
    gd.graphs.clear()
    with pytest.raises(ValueError):
        gd.bind(pool_g, 7)


@golden
def test_graphed_decoder_falls_back_to_eager_on_cpu(codec):
    from shoal.codec import GraphedStreamingDecoder, StreamingDecoder, serving_decoder

    gd = GraphedStreamingDecoder(codec, max_batch=4)
    assert not gd.enabled and gd.batch_buckets == (1, 2, 4)
    codes = random_codes(20, seed=3, batch=2)
    ref = codec.decode(codes)
    assert (stream(gd, codes, [4, 8, 3, 5]) - ref).abs().max() <= 1e-4
    assert gd.stats.replays == 0 and gd.stats.eager == 4
    assert type(serving_decoder(codec)) is StreamingDecoder
    with pytest.raises(ValueError):
        gd.decode_chunk(torch.zeros(2, 9, 4, dtype=torch.long), gd.new_state(2))


# --------------------------------------------------------------------------------------
# Batched encoder
# --------------------------------------------------------------------------------------


@golden
def test_encode_batch_equals_per_item(codec):
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    lengths = [2048 * 5, 3000, 2048 * 9 + 17, 777, 2048 * 2]
    clips = [torch.randn(n, generator=g) * 0.3 for n in lengths]
    rng.shuffle(clips)
    singles = [codec.encode(c[None, None])[0][0] for c in clips]
    for max_batch in (16, 2):
        batched = codec.encode_batch(clips, max_batch=max_batch)
        for c, a, b in zip(clips, singles, batched):
            assert b.shape == (10, -(-c.numel() // 2048))
            assert torch.equal(a, b)
    # a padded batch through encode() directly: valid codes equal per-item codes
    longest = max(lengths)
    batch = torch.zeros(len(clips), 1, longest)
    for i, c in enumerate(clips):
        batch[i, 0, : c.numel()] = c
    codes, code_lengths = codec.encode(batch, torch.tensor([c.numel() for c in clips]))
    for i, a in enumerate(singles):
        assert int(code_lengths[i]) == a.shape[-1]
        assert torch.equal(codes[i, :, : a.shape[-1]], a)


# --------------------------------------------------------------------------------------
# Benchmark smoke run (CPU, tiny config)
# --------------------------------------------------------------------------------------


def test_bench_codec_smoke(tmp_path):
    import json

    from shoal.bench import codec as bench

    assert bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--batches", "1,2",
                       "--chunks", "4,8", "--iters", "1", "--oneshot-frames", "16",
                       "--latency-reps", "2", "--variants", "none", "--serving-streams", "2"]) == 0
    res = json.loads((tmp_path / "codec.json").read_text())
    assert res["throughput"] and all("error" not in r for r in res["throughput"])
    assert res["latency"] and res["memory"]["weights_gib"] > 0
    assert "reference" in res
    with pytest.raises(SystemExit):  # a window state that does not exist is refused up front
        bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--window-states", "kv,fp8"])


def test_bench_interference_smoke(tmp_path):
    """The LLM-step-vs-codec-load benchmark runs end to end (CPU: eager, no streams) and
    reports both sides alone and under load."""
    import json

    from shoal.bench import interference

    out = tmp_path / "interference.json"
    assert interference.main(["--device", "cpu", "--shape", "tiny", "--batch", "2", "--codec", "2x4",
                              "--seconds", "0.2", "--context", "40", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["codec_call_ms_alone"] > 0 and len(res["runs"]) == 1
    run = res["runs"][0]
    assert run["step_ms_alone"] > 0 and run["frames_per_s_loaded"] > 0
    # (no bound on the sharing ratio: it is a timing, and CPU timings under load swing widely)
    assert run["codec_audio_s_per_s_loaded"] > 0 and run["sharing"] > 0


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nct", "ntc", "ntc_flat"])
def test_gpu_snake_kernel(dtype, layout, monkeypatch):
    monkeypatch.setenv("SHOAL_SNAKE_FLAT", "1" if layout == "ntc_flat" else "0")
    x, y, alpha, bias = snake_inputs(1, 96, 600001, dtype, 5, layout != "nct")  # > 65535 L-blocks
    x, y, alpha, bias = (t.cuda() for t in (x, y, alpha, bias))
    s, h = sk.snake(x, alpha, y, bias, write_h=True)
    rs, rh = sk.snake_ref(x, alpha, y, bias)
    assert torch.equal(h, rh)
    if dtype == torch.float32:
        assert (s - rs).abs().max() <= 1e-6 * rs.abs().max()
    else:
        assert ulp_diff(s, rs).max() <= 1


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 100.0])
@pytest.mark.parametrize("sin", ["default", "accurate"])
def test_gpu_snake_sine_modes(dtype, scale, sin, monkeypatch):
    """The SFU sine (the bf16 default, range-reduced first) and libdevice's sine (fp16's
    default) both stay within 1 ulp of PyTorch's Snake, also for arguments far outside [-pi, pi]."""
    monkeypatch.setenv("SHOAL_SNAKE_ACCURATE_SIN", "1" if sin == "accurate" else "0")
    x, y, alpha, bias = snake_inputs(2, 192, 50001, torch.float32, 7, channels_last=True)
    x = (x * scale).to(dtype).cuda()
    alpha = alpha.to(dtype).cuda()
    s, _ = sk.snake(x, alpha)
    rs, _ = sk.snake_ref(x, alpha)
    assert ulp_diff(s, rs).max() <= 1
    assert (s != rs).float().mean() < 1e-3  # rare last-bit differences only


def test_snake_sin_mode_selection(monkeypatch):
    monkeypatch.delenv("SHOAL_SNAKE_ACCURATE_SIN", raising=False)
    assert sk.sin_mode(torch.float32, interpret=True) == 0
    assert sk.sin_mode(torch.bfloat16, interpret=True) == 0
    assert sk.sin_mode(torch.float32, interpret=False) == 1  # fp32: PyTorch's accurate sine
    assert sk.sin_mode(torch.bfloat16, interpret=False) == 2
    assert sk.sin_mode(torch.float16, interpret=False) == 1  # 2-ulp differences with the SFU sine
    monkeypatch.setenv("SHOAL_SNAKE_ACCURATE_SIN", "1")
    assert sk.sin_mode(torch.bfloat16, interpret=False) == 1


@gpu
@golden
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_graph_replay_equals_eager(dtype):
    from shoal.codec import CodecConfig, load_codec

    codec = load_codec(TINY / "codec.pth", CodecConfig.from_json(TINY / "config.json"), device="cuda", dtype=dtype)
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # batch 3 vs bucket 4
    try:
        _graph_vs_eager(codec, dtype)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def _graph_vs_eager(codec, dtype):
    from shoal.codec import GraphedStreamingDecoder, StreamingDecoder

    eager = StreamingDecoder(codec)
    gd = GraphedStreamingDecoder(codec, batch_buckets=(1, 4), chunk_frames=(4, 8))
    codes = random_codes(140, seed=1, batch=3).cuda()
    se, sg = eager.new_state(3), gd.new_state(3)
    i = 0
    for t in [4, 8] * 11 + [2, 8, 4, 8]:
        a = eager.decode_chunk(codes[:, :, i:i + t], se)
        b = gd.decode_chunk(codes[:, :, i:i + t], sg)
        i += t
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        assert (a.float() - b.float()).abs().max() <= tol
    assert gd.stats.replays == 25 and gd.stats.eager == 1



@gpu
def test_gpu_graph_pool_keeps_no_live_block(monkeypatch):
    """With the shared output buffer (opt-in) the graph pool holds nothing live once every graph
    is captured (each graph's audio lands in the buffer, outside the pool), and replays still
    equal the eager decode."""
    monkeypatch.setenv("SHOAL_CODEC_STATIC_OUT", "1")
    from shoal.bench.codec import build_codec, random_codes
    from shoal.codec import GraphedStreamingDecoder, StreamingDecoder

    codec = build_codec(True, torch.device("cuda"))

    def pools_allocated() -> int:
        return sum(seg["allocated_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))

    import gc

    gc.collect()
    torch.cuda.synchronize()
    before = pools_allocated()
    gd = GraphedStreamingDecoder(codec, batch_buckets=(1, 2, 4), chunk_frames=(4, 8))
    gd.warmup()
    torch.cuda.synchronize()
    assert gd.stats.captures == 6 and gd._out_buf is not None and gd.stats.own_outputs == 0
    assert pools_allocated() <= before  # (another test's pools may have been freed meanwhile)
    eager = StreamingDecoder(codec)
    codes = random_codes(2, 16, "cuda", seed=3)
    se, sg = eager.new_state(2), gd.new_state(2)
    for i in range(0, 16, 4):
        a = eager.decode_chunk(codes[:, :, i:i + 4], se)
        b = gd.decode_chunk(codes[:, :, i:i + 4], sg)
        assert (a - b).abs().max() <= 1e-4
    assert gd.stats.replays == 4


@gpu
def test_gpu_primed_pool_replays_equal_unprimed():
    """The graph pool primed with one segment of the first capture's peak (``_prime``) changes
    where the activations live, not what the graphs compute: the same outputs as graphs
    captured into an unprimed pool, call after call."""
    from shoal.bench.codec import build_codec
    from shoal.codec import GraphedStreamingDecoder

    codec = build_codec(True, torch.device("cuda"))  # tiny random codec, fp32
    decs = []
    for prime in (True, False):
        gd = GraphedStreamingDecoder(codec, batch_buckets=(1, 4), chunk_frames=(4, 8))
        gd.prime_pool = prime
        gd.warmup()
        decs.append(gd)
    primed, plain = decs
    assert primed.stats.primed_bytes > 0 and primed.stats.primed_bytes % (2 << 20) == 0
    assert primed._primer is not None
    assert plain.stats.primed_bytes == 0 and plain._primer is None
    codes = random_codes(96, seed=3, batch=3).cuda()
    sa, sb = primed.new_state(3), plain.new_state(3)
    i = 0
    for t in [8, 4] * 8:
        a = primed.decode_chunk(codes[:, :, i:i + t], sa)
        b = plain.decode_chunk(codes[:, :, i:i + t], sb)
        i += t
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert primed.stats.replays == plain.stats.replays == 16


def test_prime_pool_switch(monkeypatch, codec):
    from shoal.codec import GraphedStreamingDecoder

    gd = GraphedStreamingDecoder(codec, enabled=False)
    assert gd.prime_pool and gd.prime_margin_mib == 0
    monkeypatch.setenv("SHOAL_CODEC_PRIME_POOL", "0")
    monkeypatch.setenv("SHOAL_CODEC_PRIME_MARGIN_MIB", "48")
    gd = GraphedStreamingDecoder(codec, enabled=False)
    assert not gd.prime_pool and gd.prime_margin_mib == 48


def test_prime_bytes_whole_pages_with_margin():
    from shoal.codec.streaming import prime_bytes

    mib = 1 << 20
    assert prime_bytes(0) == 0 and prime_bytes(-5, 64) == 0  # nothing measured: no segment
    assert prime_bytes(1) == 2 * mib
    assert prime_bytes(214 * mib) == 214 * mib
    assert prime_bytes(213 * mib + 1) == 214 * mib
    assert prime_bytes(214 * mib, 50) == 264 * mib
    assert prime_bytes(214 * mib, 49) == 264 * mib  # rounded up to a whole 2 MiB page
    assert prime_bytes(214 * mib, -8) == 214 * mib

if __name__ == "__main__":
    assert sk.triton_interpreting(), "worker must import triton with TRITON_INTERPRET=1"
    report_cases(INTERP_CASES, _interp_case)


def test_warmup_order_captures_the_largest_call_first():
    """Graphs share one pool; capturing the largest call first lets every later capture reuse
    its blocks (the smallest-first order held 3-4x the pool on an H200)."""
    from shoal.codec.streaming import warmup_order

    order = warmup_order((1, 2, 4, 32), (4, 32, 8))
    assert order[0] == (32, 32) and order[-1] == (1, 4)
    assert sorted(order) == sorted((b, t) for b in (1, 2, 4, 32) for t in (4, 8, 32))
    sizes = [b * t for b, t in order]
    assert sizes == sorted(sizes, reverse=True)
    # equal sizes: the bigger batch first, deterministically
    assert order.index((32, 4)) < order.index((4, 32))


@golden
def test_warmup_captures_in_warmup_order(codec):
    from shoal.codec import GraphedStreamingDecoder
    from shoal.codec.streaming import warmup_order

    gd = GraphedStreamingDecoder(codec, batch_buckets=(1, 2, 4), chunk_frames=(4, 8), enabled=True)
    calls = []
    gd.capture = lambda b, t: calls.append((b, t))  # the order, not the capture (CPU)
    gd.warmup()
    assert calls == warmup_order((1, 2, 4), (4, 8)) and calls[0] == (4, 8)


@golden
def test_new_state_is_the_packed_fresh_state(codec):
    """new_state allocates its packed buffers once, zeroed, from the modules' state shapes;
    that is the state the modules' own fresh tensors packed together would give."""
    from shoal.codec.layers import StreamState
    from shoal.codec.streaming import StreamingDecoder

    dec = StreamingDecoder(codec)
    fresh = {}
    for m in dec._stateful:
        fresh.update(m.init_stream_state(3, codec.device, codec.dtype))
    ref = StreamState.packed(fresh, {codec.quantizer.post_module.state_key: 0})
    st = dec.new_state(3)
    assert st.layout == ref.layout and st.bounds == ref.bounds
    assert {dt: f.shape for dt, f in st.flat.items()} == {dt: f.shape for dt, f in ref.flat.items()}
    assert all(torch.equal(st.flat[dt], ref.flat[dt]) for dt in ref.flat)
    assert all(torch.count_nonzero(v) == 0 for v in fresh.values())
    assert st.nbytes() == 3 * dec.state_nbytes_per_stream()


@golden
def test_conv_weights_packed_ahead_of_the_first_call(codec):
    """pack_conv_weights builds every Triton conv's packed weight once (the layout serving
    uses), so no call allocates one between its activations; later calls reuse it."""
    import copy

    from shoal.codec.layers import CausalConv1d, CausalConvTranspose1d
    from shoal.codec.streaming import pack_conv_weights
    from shoal.kernels.codec_conv import pack_conv_weight

    c = copy.deepcopy(codec)
    ptrs0 = {id(m): m.conv.weight.data_ptr() for m in c.decoder.modules()
             if isinstance(m, (CausalConv1d, CausalConvTranspose1d))}
    c.configure_serving(channels_last=True, triton_conv=True)
    weights = {id(m): (m.conv.weight.detach().clone(), m.conv.weight.data_ptr())
               for m in c.decoder.modules() if isinstance(m, (CausalConv1d, CausalConvTranspose1d))}
    # the channels-last layout written over each weight's own storage (no freed block left)
    assert {k: p for k, (_, p) in weights.items()} == ptrs0
    n = pack_conv_weights(c)
    convs = [m for m in c.decoder.modules() if getattr(m, "shares_packed_weight", False)]
    assert convs and n == sum(m.packed_weight().numel() * m.packed_weight().element_size() for m in convs)
    for m in convs:
        before = m.packed_weight()
        assert m.packed_weight() is before  # not packed again
        w0, ptr0 = weights[id(m)]
        if isinstance(m, CausalConv1d):  # one copy: the weight is a view of its packed form
            assert m.conv.weight.data_ptr() == before.data_ptr() == ptr0  # packed in place
            assert torch.equal(m.conv.weight, w0)
            assert torch.equal(before, pack_conv_weight(m.conv.weight.detach()))
        else:  # one copy: the packed form over the weight's own storage, the parameter empty
            assert before.data_ptr() == ptr0 and m.conv.weight.numel() == 0
            assert torch.equal(m.full_weight(), w0)
    # the transposed convs that run as 2-tap GEMMs are packed too
    assert any(getattr(m, "as_gemm", False) for m in convs)
    # setting the serving layout again (every serving_decoder() does) moves no packed weight:
    # graphs captured before read those pointers
    ptrs = {id(m): m.packed_weight().data_ptr() for m in convs}
    c.configure_serving(channels_last=True, triton_conv=True)
    pack_conv_weights(c)
    assert {id(m): m.packed_weight().data_ptr() for m in convs} == ptrs
    # the Triton conv off: each weight in its own storage again (cuDNN's layout), same values;
    # also with the layout switched in the same call (the shared weight unshared first)
    c2 = copy.deepcopy(c)
    c.configure_serving(triton_conv=False)
    c2.configure_serving(channels_last=False, triton_conv=False)
    convs2 = [m for m in c2.decoder.modules() if isinstance(m, (CausalConv1d, CausalConvTranspose1d))]
    for m in convs:
        assert m._packed is None and not m.shares_packed_weight
        assert m.conv.weight.unsqueeze(2).is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(m.conv.weight, weights[id(m)][0])
    assert all(not m.shares_packed_weight and m.conv.weight.is_contiguous() for m in convs2)
    assert sorted(m.conv.weight.numel() for m in convs2) == sorted(w.numel() for w, _ in weights.values())


def test_rewrite_in_own_storage_only_where_nothing_else_reads_it():
    """A weight's new layout goes over its own storage only when the weight is the storage's
    only tensor: an alias (a view, ``.data``, a detached reader) keeps its values, the weight
    then gets a new tensor; the values are the new layout's either way."""
    from shoal.codec.layers import CausalConv1d, rewrite_in_own_storage

    torch.manual_seed(0)
    conv = CausalConv1d(8, 6, 7, weight_norm=False)
    w = conv.conv.weight
    ptr, ref = w.data_ptr(), w.detach().clone()
    cl = w.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last).squeeze(2)
    stride = cl.stride()
    w.data = rewrite_in_own_storage(w, cl)
    del cl
    assert w.data_ptr() == ptr and w.stride() == stride and torch.equal(w, ref)
    # the packed form over the same storage, conv.weight a view of it with the same values
    packed = conv.share_packed_weight()
    assert packed.data_ptr() == ptr and conv.shares_packed_weight and torch.equal(conv.conv.weight, ref)
    x = torch.randn(2, 8, 20)
    with torch.no_grad():
        torch.testing.assert_close(conv(x), torch.nn.functional.conv1d(torch.nn.functional.pad(x, (6, 0)),
                                                                       ref, conv.conv.bias))
    # an alias alive: nothing is rewritten under it
    other = CausalConv1d(8, 6, 7, weight_norm=False)
    reader = other.conv.weight.detach()
    keep = reader.clone()
    got = other.share_packed_weight()
    assert got.data_ptr() != reader.data_ptr() and torch.equal(reader, keep)
    assert torch.equal(other.conv.weight, keep)
    # shapes, dtypes or storages that do not match: the new tensor itself
    t = torch.randn(4, 5)
    keep = t.clone()
    for new in (torch.randn(5, 5), torch.randn(4, 5, dtype=torch.float64),  # size, dtype
                torch.randn(4, 10)[:, ::2],  # not dense
                t.T):  # already on t's storage
        assert rewrite_in_own_storage(t, new) is new
    assert torch.equal(t, keep)
    big = torch.randn(40)
    view = big[:20]
    del big
    new = torch.randn(20)
    assert rewrite_in_own_storage(view, new) is new  # a view of a larger storage


def _transposed(dt=torch.float32, ci=12, co=8, st=4, seed=3):
    from shoal.codec.layers import CausalConvTranspose1d

    torch.manual_seed(seed)
    ct = CausalConvTranspose1d(ci, co, 2 * st, stride=st, weight_norm=False).to(dt)
    with torch.no_grad():
        ct.conv.bias.normal_()
    return ct


def test_transposed_conv_keeps_one_packed_copy():
    """A 2-tap transposed conv's shared packed weight: the values packed over the weight's own
    storage, the reference layout rebuilt exactly, the same outputs one-shot and streamed
    through the paths that read the full weight, a state dict in the checkpoint layout."""
    from shoal.codec.layers import StreamState

    ct = _transposed()
    w0, ptr = ct.conv.weight.detach().clone(), ct.conv.weight.data_ptr()
    x = torch.randn(2, 12, 9)
    want_packed = ct.packed_weight().clone()
    one_shot = ct(x)
    st = StreamState(ct.init_stream_state(2, x.device, x.dtype))
    streamed = torch.cat([ct(x[..., :4], st), ct(x[..., 4:], st)], -1)
    sd0 = {k: v.clone() for k, v in ct.state_dict().items()}

    packed = ct.share_packed_weight()
    assert ct.shares_packed_weight and ct.share_packed_weight() is packed
    assert packed.data_ptr() == ptr and torch.equal(packed, want_packed)
    assert ct.conv.weight.numel() == 0 and ct.packed_weight() is packed
    assert torch.equal(ct.full_weight(), w0)
    assert torch.equal(ct(x), one_shot)
    st = StreamState(ct.init_stream_state(2, x.device, x.dtype))
    assert torch.equal(torch.cat([ct(x[..., :4], st), ct(x[..., 4:], st)], -1), streamed)
    sd = ct.state_dict()
    assert set(sd) == set(sd0) and all(torch.equal(sd[k], sd0[k]) for k in sd0)
    assert "_packed_w" not in sd  # not persistent: the checkpoint format is unchanged

    # a cast moves the packed form with the module; unshare gives the same weight back
    half = ct.to(torch.bfloat16)
    assert half.packed_weight().dtype == torch.bfloat16
    assert torch.equal(half.full_weight(), w0.to(torch.bfloat16))
    half.unshare_packed_weight()
    assert not half.shares_packed_weight and torch.equal(half.conv.weight, w0.to(torch.bfloat16))


def test_transposed_conv_loads_into_a_shared_weight():
    """load_state_dict into a conv that keeps only its packed weight unshares it first; the
    packed form then follows the loaded weight."""
    ct, other = _transposed(seed=3), _transposed(seed=4)
    ct.share_packed_weight()
    ct.load_state_dict(other.state_dict())
    assert not ct.shares_packed_weight
    assert torch.equal(ct.conv.weight, other.conv.weight)
    assert torch.equal(ct.packed_weight(), other.packed_weight())
    x = torch.randn(1, 12, 5)
    assert torch.equal(ct(x), other(x))


def test_only_two_tap_transposed_convs_share():
    from shoal.codec.layers import CausalConvTranspose1d

    ct = CausalConvTranspose1d(4, 4, 4, stride=4, weight_norm=False)
    with pytest.raises(ValueError, match="2-tap"):
        ct.share_packed_weight()


@golden
def test_graphs_hand_positions_past_their_rope_table_to_eager(codec):
    """A graphed call whose rows may be past the graphs' fixed RoPE table (the state's bound)
    runs eagerly instead of reading clamped positions."""
    from shoal.codec import GraphedStreamingDecoder

    gd = GraphedStreamingDecoder(codec, batch_buckets=(2,), chunk_frames=(4,), enabled=True)
    n = gd.rope.shape[0]
    st = gd.new_state(2)
    key = codec.quantizer.post_module.state_key
    st.bounds[key] = n - 4
    assert gd._eager_reason(2, 4, st) is None  # the last positions still in the table
    st.bounds[key] = n - 3
    assert gd._eager_reason(2, 4, st) == "positions past the RoPE table"
