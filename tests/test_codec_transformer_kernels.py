"""The codec transformer's fused streaming path (``Codec.configure_serving(transformer_kernels=True)``):
the RoPE kernel (shoal.kernels.codec_rope) bit-equal to the module's ``apply_rotary_emb``, the
add+RMSNorm kernel's LayerScale residual against the module form, and whole streaming calls of a
small transformer with the kernels against the modules, for the ``kv`` and ``ring`` window states
(Triton interpreter; GPU at the real codec's sizes)."""

from __future__ import annotations

import sys

import pytest
import torch

if __name__ != "__main__":
    from interpreter_worker import assert_case, run_worker

from shoal.codec.config import TransformerConfig
from shoal.codec.layers import (IndexedState, LayerScale, RMSNorm, StreamState, WindowLimitedTransformer,
                                apply_rotary_emb, rope_table)
from shoal.kernels import codec_rope
from shoal.kernels.fused import add_rmsnorm

SMALL = TransformerConfig(dim=64, n_layer=2, n_head=4, head_dim=16, intermediate_size=96, window_size=8)


def _transformer(dt: torch.dtype, seed: int = 0, cfg: TransformerConfig = SMALL, device="cpu") -> WindowLimitedTransformer:
    torch.manual_seed(seed)
    tr = WindowLimitedTransformer(cfg)
    with torch.no_grad():  # LayerScales and norms away from their init, so a dropped one shows
        for p in tr.parameters():
            if p.dim() == 1:
                p.copy_(torch.rand_like(p) + 0.5)
            else:
                p.mul_(4.0)
    tr.state_key = "t"
    return tr.to(device=device, dtype=dt).eval()


def _stream(tr: WindowLimitedTransformer, schedule: list[int], seed: int, kernels: bool, ws: str,
            device="cpu", pooled: bool = False, B: int = 3) -> tuple[torch.Tensor, StreamState]:
    """``B`` streams through ``schedule``; ``pooled``: three streams whose state is rows 3, 0, 4
    of a pool of six (an IndexedState, as the serving decoder's slot pool), the other rows NaN."""
    if pooled and B != 3:
        raise ValueError("the pooled state holds three streams")
    tr.window_state, tr.kernels = ws, kernels
    dt = tr.norm.weight.dtype
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, tr.cfg.dim, sum(schedule), generator=g).to(device=device, dtype=dt)
    if pooled:
        init = tr.init_stream_state(6, device, dt)
        index = torch.tensor([3, 0, 4], device=device)
        for v in init.values():
            if v.is_floating_point():
                v[[1, 2, 5]] = float("nan")
        pool = StreamState(init)
        state = IndexedState(pool, index)
    else:
        state = StreamState(tr.init_stream_state(B, device, dt))
    outs, a = [], 0
    with torch.no_grad():
        for t in schedule:
            outs.append(tr(x[:, :, a:a + t], state))
            if pooled:
                pool.bounds.update(state.bounds)
            a += t
    return torch.cat(outs, dim=2), (pool if pooled else state)


def _rope_case(dt: torch.dtype, clamp: bool) -> dict:
    g = torch.Generator().manual_seed(3)
    B, t, H, D = 3, 5, 4, 16
    qkv = (torch.randn(B, t, 3 * H * D, generator=g) * 4).to(dt)
    table = rope_table(16, D, 10000.0)[:19 if clamp else 32]
    # with clamp the last stream runs past the 19-row table (positions 16..20: 19 and 20 clamp)
    pos = torch.tensor([0, 9, 16 if clamp else 14])
    q, k, v = codec_rope.rope_qkv_triton(qkv, table, pos, H, D, clamp)
    p = pos[:, None] + torch.arange(t)
    cs = table[p.clamp(max=table.shape[0] - 1) if clamp else p]
    mq, mk, mv = qkv.view(B, t, 3, H, D).unbind(2)
    return {"checks": {}, "flags": {
        "clamped": (not clamp) or bool((p >= table.shape[0]).any()),
        "q_bits": torch.equal(q, apply_rotary_emb(mq, cs).transpose(1, 2)),
        "k_bits": torch.equal(k, apply_rotary_emb(mk, cs).transpose(1, 2)),
        "v_bits": torch.equal(v, mv.transpose(1, 2)),
        "ref_bits": all(torch.equal(a, b) for a, b in zip((q, k, v), codec_rope.rope_qkv_ref(qkv, table, pos, H, D, clamp)))}}


def _norm_case(dt: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 64, generator=g) * 3).to(dt)
    y = (torch.randn(6, 64, generator=g) * 30).to(dt)
    norm, ls = RMSNorm(64).to(dt), LayerScale(64).to(dt)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
        ls.gamma.copy_(torch.rand(64, generator=g))
    h_mod = x + ls(y)
    n_mod = norm(h_mod)
    n, h = add_rmsnorm(x, y, norm.weight, norm.eps, residual_scale=ls.gamma)
    ulp = 2.0 ** -7 if dt == torch.bfloat16 else 2.0 ** -20
    return {"checks": {"normed": ((n.float() - n_mod.float()).abs().max().item(), ulp * n_mod.float().abs().max().item())},
            "flags": {"h_bits": torch.equal(h, h_mod)}}


def _stream_case(dt: torch.dtype, ws: str, schedule: list[int], pooled: bool = False) -> dict:
    tr = _transformer(dt)
    want, s_want = _stream(tr, schedule, 7, False, ws, pooled=pooled)
    calls = []
    kernel = codec_rope.rope_qkv_triton
    codec_rope.rope_qkv_triton = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    try:
        got, s_got = _stream(tr, schedule, 7, True, ws, pooled=pooled)
    finally:
        codec_rope.rope_qkv_triton = kernel
    scale = want.float().abs().max().item()
    tol = (2.0 ** -7 if dt == torch.bfloat16 else 1e-5) * scale
    rows = [3, 0, 4] if pooled else slice(None)  # the other pool rows must stay NaN
    state_diff = max((s_got.tensors[k][rows].float() - s_want.tensors[k][rows].float()).abs().max().item()
                     for k in s_want.tensors)
    kv_scale = max(v[rows].float().abs().max().item() for v in s_want.tensors.values())
    untouched = (not pooled) or all(bool(torch.isnan(v[[1, 2, 5]]).all()) for v in s_got.tensors.values()
                                    if v.is_floating_point())
    return {"checks": {"out": ((got.float() - want.float()).abs().max().item(), tol),
                       "state": (state_diff, (2.0 ** -7 if dt == torch.bfloat16 else 1e-5) * kv_scale)},
            "flags": {"kernels_ran": len(calls) == len(schedule) * tr.cfg.n_layer,
                      "other_pool_rows_untouched": untouched,
                      "w1_w3_views": all(  # the kernels' calls stacked w1|w3 and left views behind
                          ff.__dict__.get("_w13") is not None and ff.w1.weight.data_ptr() == ff._w13.data_ptr()
                          for ff in (layer.feed_forward for layer in tr.layers))}}


# launch options Triton 3.6's compiled launcher accepts besides a kernel's own parameters
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "launch_pdl", "maxnreg",
                  "launch_cooperative_grid", "debug"}


def _launch_keywords_case() -> dict:
    """Every kernel of the fused path launched with the keywords a CUDA launch gets (PDL's among
    them, as ``pdl_options`` gives on an sm_90 GPU) names only its own parameters or launch
    options: the compiled launcher raises on an unknown keyword, the interpreter ignores it, so
    the launches are checked here (the RoPE kernel was once launched with a PDL it lacks)."""
    from triton.runtime.interpreter import InterpretedFunction

    from shoal.kernels import fused

    unknown: list[str] = []
    launched: set[str] = set()
    real_run, real_pdl = InterpretedFunction.run, fused.pdl_options

    def run(self, *args, grid, warmup, **kwargs):
        launched.add(self.fn.__name__)
        unknown.extend(f"{self.fn.__name__}:{k}" for k in kwargs
                       if k not in self.arg_names and k not in LAUNCH_OPTIONS)
        kwargs = {k: v for k, v in kwargs.items() if k != "launch_pdl"}
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    fused.pdl_options = lambda t: {"PDL": False, "launch_pdl": False}  # a CUDA launch's keys
    try:
        for ws in ("kv", "ring"):
            _stream(_transformer(torch.float32), [2, 3], 5, True, ws)
    finally:
        InterpretedFunction.run, fused.pdl_options = real_run, real_pdl
    if unknown:
        print("unknown launch keywords:", sorted(set(unknown)), file=sys.stderr)
    return {"checks": {}, "flags": {"no_unknown_keywords": not unknown,
                                    "rope_and_norm_launched": {"_rope_qkv_kernel", "_add_rmsnorm_kernel"} <= launched}}


CASES = {
    "launch_keywords": _launch_keywords_case,
    "rope_fp32": lambda: _rope_case(torch.float32, False),
    "rope_bf16_clamp": lambda: _rope_case(torch.bfloat16, True),
    "norm_scale_fp32": lambda: _norm_case(torch.float32),
    "norm_scale_bf16": lambda: _norm_case(torch.bfloat16),
    # a young window, a call past the window (t > P), the ring wrapping
    "stream_kv_fp32": lambda: _stream_case(torch.float32, "kv", [3, 9, 2, 5]),
    "stream_ring_fp32": lambda: _stream_case(torch.float32, "ring", [3, 9, 2, 5]),
    "stream_ring_bf16": lambda: _stream_case(torch.bfloat16, "ring", [1, 4, 11]),
    # the serving decoder's slot pool: rows gathered / written in place (IndexedState)
    "stream_kv_fp32_pooled": lambda: _stream_case(torch.float32, "kv", [5, 4], pooled=True),
    "stream_ring_bf16_pooled": lambda: _stream_case(torch.bfloat16, "ring", [2, 9], pooled=True),
}

if __name__ == "__main__":  # child process: TRITON_INTERPRET=1
    from interpreter_worker import report_cases

    report_cases(CASES, lambda name: CASES[name]())
    sys.exit(0)


@pytest.fixture(scope="module")
def interpreted():
    if not codec_rope.HAS_TRITON:
        pytest.skip("triton not installed")
    return run_worker(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_under_the_interpreter(interpreted, name):
    assert_case(interpreted[name], need_any=True)


def test_cpu_runs_the_modules():
    """Without CUDA or the interpreter the flag changes nothing: the module path, same bits."""
    if codec_rope.use_triton(torch.zeros(1)):
        pytest.skip("the interpreter is on in this process")
    tr = _transformer(torch.float32)
    want, _ = _stream(tr, [2, 5], 1, False, "ring")
    got, _ = _stream(tr, [2, 5], 1, True, "ring")
    assert not tr._use_kernels(torch.zeros(1, 2, tr.cfg.dim))
    assert torch.equal(got, want) and "_w13" not in tr.layers[0].feed_forward.__dict__


def test_stacked_w13_shares_storage_and_follows_moves():
    tr = _transformer(torch.float32)
    ff = tr.layers[0].feed_forward
    w1, w3 = ff.w1.weight.detach().clone(), ff.w3.weight.detach().clone()
    buf = ff.stacked_w13()
    assert torch.equal(buf, torch.cat([w1, w3]))
    assert ff.w1.weight.data_ptr() == buf.data_ptr() and ff.stacked_w13() is buf
    assert set(tr.state_dict()) == set(_transformer(torch.float32).state_dict())  # no new entries
    tr.to(torch.bfloat16)  # the module move replaces both weights: stacked again, in bf16
    buf2 = ff.stacked_w13()
    assert buf2.dtype == torch.bfloat16 and torch.equal(buf2, torch.cat([w1, w3]).to(torch.bfloat16))
    assert ff.w3.weight.data_ptr() == buf2[w1.shape[0]:].data_ptr()


def test_place_moves_w13_stacked(monkeypatch):
    """A codec placed on another device gets each feed-forward's w1 | w3 as one stacked buffer
    made before the move (no separate device copies whose freed blocks would stay reserved);
    the stacked form is the one the fused path reads, and the values are the weights'."""
    from shoal.bench.codec import build_codec
    from shoal.codec.layers import FeedForward

    ff = FeedForward(8, 12)
    w1, w3 = ff.w1.weight.detach().clone(), ff.w3.weight.detach().clone()
    buf = ff.place_w13(torch.device("cpu"), torch.bfloat16)
    assert buf.shape == (24, 8) and buf.dtype == torch.bfloat16
    assert ff.w1.weight.data_ptr() == buf.data_ptr() and ff.w3.weight.data_ptr() == buf[12:].data_ptr()
    assert torch.equal(ff.w1.weight, w1.to(torch.bfloat16)) and torch.equal(ff.w3.weight, w3.to(torch.bfloat16))
    assert ff.stacked_w13() is buf  # nothing stacked again
    ff.to(torch.bfloat16)  # a move that changes nothing keeps the stacked buffer
    assert ff.__dict__.get("_w13") is buf
    ff.to(torch.float32)  # one that gives the weights new storage drops it
    assert "_w13" not in ff.__dict__ and ff.w1.weight.dtype == torch.float32
    assert ff.stacked_w13().dtype == torch.float32

    calls = []
    real = FeedForward.place_w13

    def spy(self, device, dtype):
        calls.append((torch.device(device).type, dtype))
        return real(self, device, dtype)

    monkeypatch.setattr(FeedForward, "place_w13", spy)
    codec = build_codec(True, torch.device("cpu"))
    n_ff = sum(isinstance(m, FeedForward) for m in codec.modules())
    codec.place("cpu", torch.float32, torch.bfloat16)  # same device: nothing moves
    assert calls == []
    codec.place("meta", torch.float32, torch.bfloat16)
    assert len(calls) == n_ff > 0 and {c[0] for c in calls} == {"meta"}
    post = codec.quantizer.post_module.layers[0].feed_forward
    assert post.w1.weight.dtype == torch.bfloat16 and post.__dict__["_w13"].device.type == "meta"
    assert post.stacked_w13() is post.__dict__["_w13"]  # nothing stacked again on the device


def test_configure_serving_sets_the_flag(tmp_path, monkeypatch):
    from shoal.bench.codec import build_codec
    from shoal.codec.streaming import transformer_kernels_default

    codec = build_codec(True, torch.device("cpu"))
    tr = codec.quantizer.post_module
    codec.configure_serving(transformer_kernels=True)
    assert tr.kernels
    for layer in tr.layers:  # stacked at once, not inside a first (perhaps captured) call
        ff = layer.feed_forward
        assert ff.__dict__.get("_w13") is not None and ff.w1.weight.data_ptr() == ff._w13.data_ptr()
    codec.configure_serving(transformer_kernels=False)
    assert not tr.kernels

    monkeypatch.setenv("SHOAL_CODEC_TRANSFORMER_KERNELS", "1")
    assert transformer_kernels_default() is True
    monkeypatch.setenv("SHOAL_CODEC_TRANSFORMER_KERNELS", "0")
    assert transformer_kernels_default() is False
    monkeypatch.setenv("SHOAL_CODEC_TRANSFORMER_KERNELS", "maybe")
    with pytest.raises(ValueError, match="SHOAL_CODEC_TRANSFORMER_KERNELS"):
        transformer_kernels_default()
    monkeypatch.delenv("SHOAL_CODEC_TRANSFORMER_KERNELS")
    assert transformer_kernels_default() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ws", ["kv", "ring"])
def test_gpu_real_size_streams_match_the_modules(ws):
    """The real codec transformer's shapes (1024 wide, 8 layers, 16 heads x 64, window 128), bf16,
    64 streams over calls of 32, 1, 8 and 128 frames: the kernels equal the modules to bf16
    rounding, outputs and carried keys / values; q and k bit-equal to the module's RoPE."""
    cfg = TransformerConfig(dim=1024, n_layer=8, n_head=16, head_dim=64, intermediate_size=3072, window_size=128)
    tr = _transformer(torch.bfloat16, 0, cfg, "cuda")
    with torch.no_grad():  # real-checkpoint-like magnitudes: small LayerScales, unit norms
        for layer in tr.layers:
            layer.attention_layer_scale.gamma.fill_(0.05)
            layer.ffn_layer_scale.gamma.fill_(0.05)
            for p in layer.parameters():
                if p.dim() == 2:
                    p.div_(4.0)
    want, s_want = _stream(tr, [32, 1, 8, 128], 2, False, ws, "cuda", B=64)
    got, s_got = _stream(tr, [32, 1, 8, 128], 2, True, ws, "cuda", B=64)
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= 2.0 ** -6 * scale
    for k in s_want.tensors:
        a, b = s_got.tensors[k].float(), s_want.tensors[k].float()
        assert (a - b).abs().max().item() <= 2.0 ** -6 * max(b.abs().max().item(), 1e-6), k
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(64, 32, 3 * 1024, device="cuda", generator=g).to(torch.bfloat16)
    table = rope_table(4096, 64, 10000.0, "cuda")
    pos = torch.randint(0, 4000, (64,), device="cuda", generator=g)
    pos[0] = 4090  # runs past the table: the clamp a CUDA graph's fixed table needs
    q, k, v = codec_rope.rope_qkv_triton(qkv, table, pos, 16, 64, clamp=True)
    rq, rk, rv = codec_rope.rope_qkv_ref(qkv, table, pos, 16, 64, clamp=True)
    assert torch.equal(q, rq) and torch.equal(k, rk) and torch.equal(v, rv)
