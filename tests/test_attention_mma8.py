"""The swap-AB decode attention on an FP8 KV cache (shoal.kernels.paged_attention_fp8):
against the PyTorch reference and against the widening kernel's error, on the standard and the
token-minor V layout, under the Triton interpreter on CPU; at S2-Pro sizes (with CUDA-graph
replay) on a GPU."""

from __future__ import annotations

import sys

import pytest
import torch

if __name__ != "__main__":
    from interpreter_worker import assert_case, run_worker


def _cache(g, nb, bs, hkv, d, dev, minor):
    from shoal.kernels.paged_attention_fp8 import token_minor_like
    from shoal.quant.kv import quantize_kv

    k8, ks = quantize_kv(torch.randn(nb, bs, hkv, d, generator=g) * 2)
    v8, vs = quantize_kv(torch.randn(nb, bs, hkv, d, generator=g))
    if minor:
        vm = token_minor_like(v8.shape, "cpu")
        vm.copy_(v8)
        v8 = vm
    return k8.to(dev), v8.to(dev), ks.to(dev), vs.to(dev)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _case_decode(H, Hkv, splits, minor, dev="cpu", D=64, B=4, block_n=64, lens=(1, 17, 64, 150), bs=16, cfg=None):
    """mma8 against the reference: a bf16 output's rounding away, and no worse than 1.25x the
    widening kernel's error (both read the same e4m3 K / V). ``cfg``: a ``SHOAL_ATTN_FP8_CONFIG``
    string in force for the case (the kernel's variants; the e4m3 operands must change the
    output's bits against the default launch)."""
    import os

    args = (H, Hkv, splits, minor, dev, D, B, block_n, lens, bs)
    if cfg is None:
        return _decode(*args)[0]
    old = os.environ.get("SHOAL_ATTN_FP8_CONFIG")
    try:
        os.environ["SHOAL_ATTN_FP8_CONFIG"] = cfg
        res, out = _decode(*args)
        if "f16ops=0" in cfg:  # the e4m3 operands: other bits than the default's fp16 ones
            os.environ["SHOAL_ATTN_FP8_CONFIG"] = ""
            res["flags"]["variant_in_effect"] = not torch.equal(out, _decode(*args)[1])
    finally:
        if old is None:
            os.environ.pop("SHOAL_ATTN_FP8_CONFIG")
        else:
            os.environ["SHOAL_ATTN_FP8_CONFIG"] = old
    return res


def _decode(H, Hkv, splits, minor, dev, D, B, block_n, lens, bs):
    from shoal.kernels.paged_attention import paged_decode_attention_ref, paged_decode_attention_triton

    g = torch.Generator().manual_seed(H * 31 + Hkv + splits + 7 * minor + bs)
    nb = max(48, B * -(-max(lens) // bs))
    k8, v8, ks, vs = _cache(g, nb, bs, Hkv, D, dev, minor)
    q = (torch.randn(B, H, D, generator=g) * 3).to(torch.bfloat16).to(dev)
    maxb = -(-max(lens) // bs)
    bt = torch.randperm(nb, generator=g)[: B * maxb].reshape(B, maxb).int().to(dev)
    cl = torch.tensor(lens[:B], dtype=torch.int32, device=dev)
    ref = paged_decode_attention_ref(q.float(), k8, v8, bt, cl, D ** -0.5, k_scale=ks, v_scale=vs)
    out = paged_decode_attention_triton(q, k8, v8, bt, cl, D ** -0.5, k_scale=ks, v_scale=vs, cvt="mma8",
                                        num_splits=splits, block_n=block_n)
    e_new = _rel(out, ref)
    flags = {"finite": bool(torch.isfinite(out.float()).all())}
    if minor:  # the widening kernel reads the standard layout only
        v_std = v8.contiguous()
    else:
        v_std = v8
    old = paged_decode_attention_triton(q, k8, v_std, bt, cl, D ** -0.5, k_scale=ks, v_scale=vs, cvt="f16",
                                        num_splits=splits, block_n=block_n)
    e_old = _rel(old, ref)
    checks = {"rel_err": (e_new, 8e-3), "vs_widening": (e_new, 1.25 * e_old + 1e-4)}
    if minor and bs in (32, 64, 128):
        # pages of 32-128 tokens: the TMA path (a page per tile) and the pointer gather (the
        # same tile) agree to the last bit; empty splits and whole stale pages included
        from shoal.kernels.paged_attention_fp8 import tma_descriptors

        flags["tma_applies"] = tma_descriptors(k8, v8) is not None
        a = paged_decode_attention_triton(q, k8, v8, bt, cl, D ** -0.5, k_scale=ks, v_scale=vs, cvt="mma8",
                                          num_splits=splits, tma=True)
        b = paged_decode_attention_triton(q, k8, v8, bt, cl, D ** -0.5, k_scale=ks, v_scale=vs, cvt="mma8",
                                          num_splits=splits, block_n=bs, tma=False)
        checks["tma_vs_gather"] = ((a.float() - b.float()).abs().max().item(), 0.0)
    return {"checks": checks, "flags": flags}, (a if minor and bs in (32, 64, 128) else out)


def _case_write_minor(dev="cpu"):
    """The fused qk-norm/RoPE/cache-write kernel into a token-minor V: the same logical bytes
    as write_kv into standard caches."""
    from shoal.kernels import fused as fz
    from shoal.kernels.paged_attention_fp8 import token_minor_like
    from shoal.model.layers import rope_table

    g = torch.Generator().manual_seed(5)
    H, Hkv, D, N, nb, bs = 4, 2, 64, 9, 6, 16
    qkv = (torch.randn(N, (H + 2 * Hkv) * D, generator=g) * 3).to(torch.bfloat16).to(dev)
    pos = torch.randint(0, 60, (N,), generator=g).to(dev)
    tab = rope_table(64, D, 10000.0).to(torch.bfloat16).to(dev)
    qw = (torch.rand(D, generator=g) + 0.5).to(torch.bfloat16).to(dev)
    kw = (torch.rand(D, generator=g) + 0.5).to(torch.bfloat16).to(dev)
    slots = torch.randperm(nb * bs, generator=g)[:N].to(dev)
    slots[4] = -1  # a padding row: nothing written
    kc = torch.zeros(nb, bs, Hkv, D, dtype=torch.float8_e4m3fn, device=dev)
    vc = token_minor_like(kc.shape, dev)
    ks, vs = torch.zeros(nb, bs, Hkv, device=dev), torch.zeros(nb, bs, Hkv, device=dev)
    q = fz.qk_norm_rope_write_triton(qkv, pos, tab, qw, kw, 1e-6, kc, vc, slots, H, Hkv, D, k_scale=ks, v_scale=vs)
    rk, rv = torch.zeros_like(kc), torch.zeros_like(kc)
    rks, rvs = torch.zeros_like(ks), torch.zeros_like(vs)
    keep = slots >= 0
    qr = fz.qk_norm_rope_write_ref(qkv[keep], pos[keep], tab, qw, kw, 1e-6, rk, rv, slots[keep], H, Hkv, D, rks, rvs)
    same = lambda a, b: torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))  # noqa: E731
    return {"checks": {"q_err": ((q[keep].float() - qr.float()).abs().max().item(), 0.0)},
            "flags": {"k_bytes_equal": same(kc, rk), "v_bytes_equal": same(vc, rv), "v_scales_equal": torch.equal(vs, rvs),
                      "written": bool((rv.view(torch.uint8) != 0).any())}}


def _case_prefill_minor(dev="cpu"):
    """Prefill attention on a token-minor V equals the same call on the standard layout."""
    from shoal.kernels.prefill_attention import paged_prefill_attention_triton

    g = torch.Generator().manual_seed(11)
    H, Hkv, D, nb, bs = 8, 2, 64, 30, 16
    k8, v8m, ks, vs = _cache(g, nb, bs, Hkv, D, dev, True)
    cu = torch.tensor([0, 20, 21, 60], device=dev)
    start = torch.tensor([0, 40, 5], device=dev)
    q = torch.randn(64, H, D, generator=g).to(torch.bfloat16).to(dev)
    bt = torch.randperm(nb, generator=g)[:24].reshape(3, 8).int().to(dev)
    a = paged_prefill_attention_triton(q, k8, v8m, bt, cu, start, D ** -0.5, k_scale=ks, v_scale=vs)
    b = paged_prefill_attention_triton(q, k8, v8m.contiguous(), bt, cu, start, D ** -0.5, k_scale=ks, v_scale=vs)
    return {"checks": {"diff": ((a.float() - b.float()).abs().max().item(), 0.0)}, "flags": {}}


def _case_stale_nan(dev="cpu"):
    """NaN keys and values written by both writers (write_kv and the fused qk-norm/RoPE/write
    kernel) into the slots past a sequence's context on its last page -- an earlier request's
    stale tokens -- leave its decode attention unchanged: stored e4m3 is always finite, so the
    whole-page value loads meet no NaN (0 x NaN would leak into the output)."""
    from shoal.engine.attention import PagedKVCache
    from shoal.kernels import fused as fz
    from shoal.kernels.paged_attention import paged_decode_attention_triton
    from shoal.model.layers import rope_table

    g = torch.Generator().manual_seed(13)
    H, Hkv, D, nb, bs, B = 8, 2, 64, 8, 16, 2
    lens = torch.tensor([5, 21], dtype=torch.int32, device=dev)  # last pages: 5 of 16 and 5 of 16 slots
    bt = torch.tensor([[3, 0], [6, 1]], dtype=torch.int32, device=dev)
    clean = PagedKVCache(1, nb, bs, Hkv, D, torch.bfloat16, dev, kv_dtype="fp8", v_token_minor=True)
    live = torch.tensor([3 * bs + t for t in range(5)] + [6 * bs + t for t in range(16)]
                        + [1 * bs + t for t in range(5)], device=dev)
    k = torch.randn(len(live), Hkv, D, generator=g).to(dev)
    v = torch.randn(len(live), Hkv, D, generator=g).to(dev)
    clean.write(0, live, k, v)
    dirty = PagedKVCache(1, nb, bs, Hkv, D, torch.bfloat16, dev, kv_dtype="fp8", v_token_minor=True)
    dirty.write(0, live, k, v)
    stale = torch.tensor([3 * bs + t for t in range(5, 16)], device=dev)  # sequence 0's last page, past 5
    nan = torch.full((len(stale), Hkv, D), float("nan"), device=dev)
    dirty.write(0, stale, nan, nan)  # write_kv
    # the fused writer: the slots past sequence 1's context on its last page (page 1, from 5)
    N = 11
    qkv = torch.full((N, (H + 2 * Hkv) * D), float("nan"), dtype=torch.bfloat16, device=dev)
    pos = torch.arange(N, device=dev)
    tab = rope_table(64, D, 10000.0).to(torch.bfloat16).to(dev)
    w = torch.ones(D, dtype=torch.bfloat16, device=dev)
    fz.qk_norm_rope_write_triton(qkv, pos, tab, w, w, 1e-6, dirty.k(0), dirty.v(0),
                                 torch.arange(1 * bs + 5, 2 * bs, device=dev), H, Hkv, D,
                                 k_scale=dirty.k_scale(0), v_scale=dirty.v_scale(0))
    q = torch.randn(B, H, D, generator=g).to(torch.bfloat16).to(dev)
    outs = [paged_decode_attention_triton(q, c.k(0), c.v(0), bt, lens, D ** -0.5, k_scale=c.k_scale(0),
                                          v_scale=c.v_scale(0), cvt="mma8") for c in (clean, dirty)]
    return {"checks": {"diff": ((outs[0].float() - outs[1].float()).abs().max().item(), 0.0)},
            "flags": {"finite": bool(torch.isfinite(outs[1].float()).all()),
                      "stale_bytes_finite": bool(torch.isfinite(dirty.v(0).float()).all()
                                                 and torch.isfinite(dirty.k(0).float()).all())}}


CASES = {
    "stale_nan": _case_stale_nan,
    "write_minor": _case_write_minor,
    "prefill_minor": _case_prefill_minor,
    "g4_1split_std": lambda: _case_decode(8, 2, 1, False),
    "g4_3splits_std": lambda: _case_decode(8, 2, 3, False),
    "g4_1split_minor": lambda: _case_decode(8, 2, 1, True),
    "g4_3splits_minor": lambda: _case_decode(8, 2, 3, True),
    "g1_minor": lambda: _case_decode(4, 4, 2, True),
    "g8_std_bn128": lambda: _case_decode(16, 2, 1, False, block_n=128),
    "g8_minor_bn32": lambda: _case_decode(16, 2, 2, True, block_n=32),
    "g16_minor": lambda: _case_decode(16, 1, 1, True),
    "g4_minor_bs64_tma": lambda: _case_decode(8, 2, 1, True, bs=64, block_n=64),
    "g4_minor_bs32_tma_3splits": lambda: _case_decode(8, 2, 3, True, bs=32, block_n=32),
    # the kernel's variants: the e4m3 hi / lo operands (f16ops=0), fp16 operands with the
    # per-tile reductions as before, the joint maxima and row-kept denominators alone or forced
    # on at one split (the default turns them on only where the context is split)
    "e4m3_minor_bs64_tma": lambda: _case_decode(8, 2, 1, True, bs=64, block_n=64,
                                                cfg="f16ops=0,joint_max=0,lazy_l=0"),
    "e4m3_std_3splits": lambda: _case_decode(8, 2, 3, False, cfg="f16ops=0,joint_max=0,lazy_l=0"),
    "f16_only_minor_bs32_tma_3splits": lambda: _case_decode(8, 2, 3, True, bs=32, block_n=32,
                                                            cfg="f16ops=1,joint_max=0,lazy_l=0"),
    "jl_only_minor_bs64_tma": lambda: _case_decode(8, 2, 1, True, bs=64, block_n=64,
                                                   cfg="f16ops=0,joint_max=1,lazy_l=1"),
    "f16jl_minor_bs64_tma_1split": lambda: _case_decode(8, 2, 1, True, bs=64, block_n=64,
                                                        cfg="joint_max=1,lazy_l=1"),
}

if __name__ == "__main__":  # child process: TRITON_INTERPRET=1
    from interpreter_worker import report_cases

    report_cases(CASES, lambda name: CASES[name]())
    sys.exit(0)


@pytest.fixture(scope="module")
def interpreted():
    return run_worker(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_mma8_under_the_interpreter(interpreted, name):
    assert_case(interpreted[name], need_any=True)


def test_token_minor_layout():
    from shoal.kernels.paged_attention_fp8 import is_token_minor, token_minor_like

    t = token_minor_like((5, 16, 2, 64), "cpu")
    assert t.shape == (5, 16, 2, 64) and t.dtype == torch.float8_e4m3fn and is_token_minor(t)
    assert t.stride(1) == 1 and t.stride(3) == 16
    assert not is_token_minor(torch.zeros(5, 16, 2, 64))
    src = torch.randn(5, 16, 2, 64).to(torch.float8_e4m3fn)
    t.copy_(src)  # the same logical tensor
    assert torch.equal(t.float(), src.float())


def test_mma8_falls_back_for_groups_past_sixteen_and_fp32_queries(monkeypatch):
    """More than 16 query heads per KV head, or fp32 queries (the exact path): the widening kernel
    runs instead (the call is the same as with its own cvt)."""
    from shoal.kernels import paged_attention as pa

    seen = []
    monkeypatch.setattr(pa, "_kernels", lambda interpret: (_Spy(seen, "widen"), _Spy(seen, "reduce")))
    import shoal.kernels.paged_attention_fp8 as p8

    monkeypatch.setattr(p8, "mma8_kernel", lambda interpret: _Spy(seen, "mma8"))
    monkeypatch.setattr(pa, "triton_interpreting", lambda: True)
    g = torch.Generator().manual_seed(0)
    k8, v8, ks, vs = _cache(g, 8, 16, 1, 64, "cpu", False)
    bt = torch.arange(4, dtype=torch.int32)[None]
    cl = torch.tensor([40], dtype=torch.int32)
    for H, dt, want in ((32, torch.bfloat16, "widen"), (4, torch.float32, "widen"), (16, torch.bfloat16, "mma8")):
        seen.clear()
        q = torch.randn(1, H, 64).to(dt)
        pa.paged_decode_attention_triton(q, k8, v8, bt, cl, 0.125, k_scale=ks, v_scale=vs, cvt="mma8",
                                         num_splits=1)
        assert seen == [want], (H, dt, seen)


class _Spy:
    def __init__(self, seen, name):
        self.seen, self.name = seen, name

    def __getitem__(self, grid):
        return lambda *a, **k: self.seen.append(self.name)


def test_write_kv_into_a_token_minor_cache_equals_the_standard_layout():
    from shoal.engine.attention import PagedKVCache

    g = torch.Generator().manual_seed(2)
    a = PagedKVCache(2, 5, 16, 2, 64, torch.bfloat16, "cpu", kv_dtype="fp8", v_token_minor=True)
    b = PagedKVCache(2, 5, 16, 2, 64, torch.bfloat16, "cpu", kv_dtype="fp8", v_token_minor=False)
    assert a.data is None and a.v(1).stride(1) == 1 and b.v(1).stride(-1) == 1
    assert a.nbytes == b.nbytes
    slots = torch.tensor([0, 17, 33, 79])
    k, v = torch.randn(4, 2, 64, generator=g), torch.randn(4, 2, 64, generator=g)
    for c in (a, b):
        c.write(1, slots, k, v)
    for l in (0, 1):
        assert torch.equal(a.k(l).view(torch.uint8), b.k(l).view(torch.uint8))
        assert torch.equal(a.v(l).contiguous().view(torch.uint8), b.v(l).view(torch.uint8))
    with pytest.raises(ValueError, match="token-minor"):
        PagedKVCache(1, 2, 16, 2, 64, torch.bfloat16, "cpu", v_token_minor=True)


@pytest.mark.parametrize("block_size", [16, 64])
def test_engine_with_a_token_minor_fp8_cache_equals_the_fp8_reference_loop(monkeypatch, tiny_s2_checkpoint, block_size):
    """The engine (chunked prefill, the fused path) on an FP8 cache whose values are stored
    token-minor decodes exactly as the reference loop with its FP8 contiguous cache."""
    import numpy as np

    from shoal.checkpoint import load_dualar
    from shoal.engine.engine import Engine, EngineConfig
    from shoal.engine.generate import generate
    from shoal.engine.request import EngineRequest, FinishEvent
    from shoal.engine.sampling import SamplingParams
    from shoal.kernels import paged_attention_fp8 as p8
    from test_kv_fp8 import _session, fp8_reference

    model, tok = load_dualar(tiny_s2_checkpoint, dtype=torch.float32)
    monkeypatch.setattr(p8, "wants_token_minor", lambda dtype, group: True)
    voice = np.random.default_rng(3).integers(0, 1024, size=(10, 40))
    greedy = SamplingParams(greedy=True)
    with fp8_reference(model):
        want = {f"r{i}": generate(model, _session(tok, i, voice).grid(), greedy, tok.im_end_id, 6 + i).codes
                for i in range(3)}
    try:
        eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=2, num_blocks=96, prefill_chunk=7,
                                                               kv_cache_dtype="fp8", fused_kernels=True,
                                                               block_size=block_size))
        assert eng.runner.kv.v_token_minor
        for i in range(3):
            eng.add_request(EngineRequest(session=_session(tok, i, voice), params=greedy, max_new_tokens=6 + i,
                                          request_id=f"r{i}"))
        done = {e.request_id: e for e in eng.run_until_done() if isinstance(e, FinishEvent)}
    finally:
        model.fused = False
    for rid, codes in want.items():
        assert np.array_equal(done[rid].codes, codes), rid


# ------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.parametrize("minor", [False, True])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("bs", [16, 64])
def test_gpu_mma8_at_s2_pro_sizes(minor, splits, bs):
    res = _case_decode(32, 8, splits, minor, dev="cuda", D=128, B=6, block_n=64,
                       lens=(1, 15, 16, 333, 1000, 1024), bs=bs)
    for k, (a, b) in res["checks"].items():
        assert a <= b, (k, a, b)
    assert all(res["flags"].values())


@gpu
@pytest.mark.parametrize("minor", [False, True])
def test_gpu_mma8_graph_replay(minor):
    from shoal.kernels.paged_attention import paged_decode_attention_triton

    g = torch.Generator().manual_seed(3)
    k8, v8, ks, vs = _cache(g, 200, 16, 8, 128, "cuda", minor)
    B = 64
    q = torch.randn(B, 32, 128, generator=g).to(torch.bfloat16).cuda()
    bt = torch.randperm(200, generator=g)[: 3 * 64].reshape(64, 3).int().cuda() % 200
    cl = torch.randint(1, 48, (B,), generator=g).int().cuda()
    out = torch.empty_like(q)

    def call():
        paged_decode_attention_triton(q, k8, v8, bt, cl, 128 ** -0.5, out=out, k_scale=ks, v_scale=vs, cvt="mma8")

    call()
    want = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@gpu
@pytest.mark.parametrize("case", ["write_minor", "prefill_minor", "stale_nan"])
def test_gpu_token_minor_writers_and_prefill(case):
    res = {"write_minor": _case_write_minor, "prefill_minor": _case_prefill_minor,
           "stale_nan": _case_stale_nan}[case]("cuda")
    for k, (a, b) in res["checks"].items():
        assert a <= b, (k, a, b)
    assert all(res["flags"].values()), res["flags"]


def test_fp8_options_auto_follow_the_split_count(monkeypatch):
    """``joint_max`` / ``lazy_l`` of 2 (the default) turn on only where the context is split."""
    from shoal.kernels.paged_attention import _auto, fp8_kv_config

    monkeypatch.delenv("SHOAL_ATTN_FP8_CONFIG", raising=False)
    cfg = fp8_kv_config()
    assert cfg["f16ops"] == 1 and cfg["joint_max"] == 2 and cfg["lazy_l"] == 2
    assert [_auto(2, n) for n in (1, 2, 8)] == [False, True, True]
    assert [_auto(1, n) for n in (1, 4)] == [True, True] and [_auto(0, n) for n in (1, 4)] == [False, False]


@pytest.mark.parametrize("bad", ["f16ops=2", "joint_max=3", "lazy_l=-1"])
def test_fp8_options_out_of_range_are_refused(monkeypatch, bad):
    from shoal.kernels.paged_attention import fp8_kv_config

    monkeypatch.setenv("SHOAL_ATTN_FP8_CONFIG", bad)
    with pytest.raises(ValueError, match=bad.split("=")[0]):
        fp8_kv_config()
