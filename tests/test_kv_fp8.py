"""FP8 KV cache (shoal.quant.kv): kernels against their PyTorch references (Triton interpreter),
the engine against the reference loop decoding with the same FP8 cache, memory accounting and
input checks (the correctness gate with FP8 KV: tests/test_quantize.py). GPU checks at S2-Pro sizes run when CUDA is
available."""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import pytest
import torch

if __name__ != "__main__":
    from interpreter_worker import assert_case, run_worker

from shoal.quant.kv import FP8_KV_DTYPE, dequantize_kv, parse_kv_cache_dtype, quantize_kv

# ------------------------------------------------------------------------------- kernel cases


def _rope_table(length, d):
    from shoal.model.layers import rope_table

    return rope_table(length, d, 10000.0)


def _case_write(split: int, dt: torch.dtype, dev: str = "cpu") -> dict:
    """The fused qk-norm/RoPE/cache-write kernel into an FP8 cache == write_kv's bytes."""
    from shoal.kernels import fused as fz
    from shoal.kernels.fp8 import SplitKPartials

    g = torch.Generator().manual_seed(1 + split)
    H, Hkv, D, N, nb, bs = 4, 2, 64, 9, 6, 16
    width = (H + 2 * Hkv) * D
    if split > 1:
        qkv = SplitKPartials((torch.randn(split, N, width, generator=g) * 2).to(dev))
        dense = qkv.reduce()
    else:
        dense = qkv = (torch.randn(N, width, generator=g) * 3).to(dt).to(dev)
    pos = torch.randint(0, 60, (N,), generator=g).to(dev)
    tab = _rope_table(64, D).to(dt if split == 1 else torch.bfloat16).to(dev)
    wdt = dense.dtype
    qw = (torch.rand(D, generator=g) + 0.5).to(wdt).to(dev)
    kw = (torch.rand(D, generator=g) + 0.5).to(wdt).to(dev)
    slots = torch.randperm(nb * bs, generator=g)[:N].to(dev)
    slots[4] = -1  # a padding row: nothing written

    def caches():
        kc = torch.zeros(nb, bs, Hkv, D, dtype=FP8_KV_DTYPE, device=dev)
        return kc, torch.zeros_like(kc), torch.zeros(nb, bs, Hkv, device=dev), torch.zeros(nb, bs, Hkv, device=dev)

    kc, vc, ks, vs = caches()
    q = fz.qk_norm_rope_write_triton(qkv, pos, tab, qw, kw, 1e-6, kc, vc, slots, H, Hkv, D,
                                     k_scale=ks, v_scale=vs)
    rk, rv, rks, rvs = caches()
    keep = slots >= 0
    qr = fz.qk_norm_rope_write_ref(dense[keep], pos[keep], tab, qw, kw, 1e-6, rk, rv, slots[keep],
                                   H, Hkv, D, rks, rvs)
    written = bool((ks > 0).sum() == (N - 1) * Hkv and (rk.view(torch.uint8) != 0).any())
    if dt == torch.float32:  # fp32 qk-norm may differ from F.rms_norm by an ulp: compare values
        kd, rkd = dequantize_kv(kc, ks), dequantize_kv(rk, rks)
        return {"checks": {"q_err": ((q[keep].float() - qr.float()).abs().max().item(), 1e-5),
                           "k_err": ((kd - rkd).abs().max().item(), 2e-2 * rkd.abs().max().item()),
                           "v_err": ((dequantize_kv(vc, vs) - dequantize_kv(rv, rvs)).abs().max().item(), 0.0)},
                "flags": {"written": written}}
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731
    return {"checks": {"q_err": ((q[keep].float() - qr.float()).abs().max().item(), 0.0)},
            "flags": {"k_bytes_equal": same(kc, rk), "v_bytes_equal": same(vc, rv),
                      "k_scales_equal": torch.equal(ks, rks), "v_scales_equal": torch.equal(vs, rvs),
                      "written": written}}


def _fp8_cache(g, nb, bs, Hkv, D, dev):
    k = torch.randn(nb, bs, Hkv, D, generator=g) * 2
    v = torch.randn(nb, bs, Hkv, D, generator=g)
    k[0, :3] *= 40  # outlier tokens: their own scales
    k8, ks = quantize_kv(k)
    v8, vs = quantize_kv(v)
    return k8.to(dev), v8.to(dev), ks.to(dev), vs.to(dev)


def _excess(o: torch.Tensor, r: torch.Tensor, rtol: float) -> float:
    """max(|o - r| - rtol * |r|): compared with an absolute tolerance, torch.testing's
    atol + rtol * |r| rule (what the bf16 attention tests use)."""
    return ((o.float() - r.float()).abs() - rtol * r.float().abs()).max().item()


def _case_decode(dt: torch.dtype, splits: int, dev: str = "cpu") -> dict:
    from shoal.kernels.paged_attention import paged_decode_attention_ref, paged_decode_attention_triton

    g = torch.Generator().manual_seed(7 + splits)
    B, H, Hkv, D, nb, bs = 4, 8, 2, 64, 24, 16
    k8, v8, ks, vs = _fp8_cache(g, nb, bs, Hkv, D, dev)
    q = torch.randn(B, H, D, generator=g).to(dt).to(dev)
    bt = torch.randperm(nb, generator=g)[: B * 6].reshape(B, 6).int().to(dev)
    lens = torch.tensor([1, 17, 64, 96], dtype=torch.int32, device=dev)
    ref = paged_decode_attention_ref(q, k8, v8, bt, lens, D ** -0.5, k_scale=ks, v_scale=vs)
    # 32-token tiles: the longer contexts span several tiles per split (per-tile value-scale
    # normalisation, online-softmax rescaling)
    out = paged_decode_attention_triton(q, k8, v8, bt, lens, D ** -0.5, k_scale=ks, v_scale=vs,
                                        num_splits=splits, block_n=32, cvt="q" if splits == 3 else "f16")
    tol = 1e-4 if dt == torch.float32 else 2e-2
    return {"checks": {"err": (_excess(out, ref, tol), tol)}, "flags": {}}


def _case_prefill(dt: torch.dtype, dev: str = "cpu") -> dict:
    from shoal.kernels.prefill_attention import paged_prefill_attention_ref, paged_prefill_attention_triton

    g = torch.Generator().manual_seed(11)
    H, Hkv, D, nb, bs = 8, 2, 64, 30, 16
    k8, v8, ks, vs = _fp8_cache(g, nb, bs, Hkv, D, dev)
    cu = torch.tensor([0, 20, 21, 60], device=dev)
    start = torch.tensor([0, 40, 5], device=dev)
    q = torch.randn(64, H, D, generator=g).to(dt).to(dev)
    bt = torch.randperm(nb, generator=g)[:24].reshape(3, 8).int().to(dev)
    ref = paged_prefill_attention_ref(q, k8, v8, bt, cu, start, D ** -0.5, k_scale=ks, v_scale=vs)
    out = paged_prefill_attention_triton(q, k8, v8, bt, cu, start, D ** -0.5, k_scale=ks, v_scale=vs)
    tol = 1e-4 if dt == torch.float32 else 2e-2
    return {"checks": {"err": (_excess(out, ref, tol), tol)}, "flags": {}}


CASES = {
    "write_bf16": lambda: _case_write(1, torch.bfloat16),
    "write_fp32": lambda: _case_write(1, torch.float32),
    "write_splitk3": lambda: _case_write(3, torch.bfloat16),
    "decode_bf16_1split": lambda: _case_decode(torch.bfloat16, 1),
    "decode_bf16_3splits": lambda: _case_decode(torch.bfloat16, 3),
    "decode_fp32_2splits": lambda: _case_decode(torch.float32, 2),
    "prefill_bf16": lambda: _case_prefill(torch.bfloat16),
    "prefill_fp32": lambda: _case_prefill(torch.float32),
}

if __name__ == "__main__":  # child process: TRITON_INTERPRET=1
    from interpreter_worker import report_cases

    report_cases(CASES, lambda name: CASES[name]())
    sys.exit(0)


@pytest.fixture(scope="module")
def interpreted():
    return run_worker(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_under_the_interpreter(interpreted, name):
    assert_case(interpreted[name], need_any=True)


# ------------------------------------------------------------------------------- reference math


def test_quantize_kv_rule_and_error():
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16) * 4
    x[0, 0] = 0  # an all-zero head: floored amax, zeros stay zero
    q, s = quantize_kv(x)
    assert q.dtype == FP8_KV_DTYPE and s.shape == (3, 5) and s.dtype == torch.float32
    amax = x.float().abs().amax(-1).clamp_min(1e-10)
    assert torch.equal(s, torch.ones_like(amax) / (torch.full_like(amax, 448.0) / amax))
    assert q.float().abs().amax(-1)[1:].eq(448).all()  # each head's largest value maps to 448
    d = dequantize_kv(q, s)
    assert torch.equal(d[0, 0], torch.zeros(128))
    rel = ((d - x.float()).norm(dim=-1) / x.float().norm(dim=-1).clamp_min(1e-30))[1:]
    assert 0.005 < rel.max() < 0.06  # e4m3: 3 mantissa bits


def test_write_kv_rejects_mismatched_cache_and_scales():
    from shoal.kernels.fused import write_kv

    k = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 5, 9])
    k8 = torch.zeros(2, 16, 2, 64, dtype=FP8_KV_DTYPE)
    sc = torch.zeros(2, 16, 2)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        write_kv(k8, k8.clone(), slots, k, k)  # an FP8 cache without scales
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        write_kv(torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64), slots, k, k, sc, sc)
    write_kv(k8, k8.clone(), slots, k, k, sc, sc.clone())
    assert (sc.view(-1, 2)[slots] > 0).all()


def test_kv_cache_dtype_env_is_read_by_the_clis_only(monkeypatch, s2):
    from shoal.engine.engine import Engine, EngineConfig
    from shoal.quant.kv import kv_cache_dtype_arg

    monkeypatch.setenv("SHOAL_KV_CACHE_DTYPE", "fp8")
    assert kv_cache_dtype_arg(None) == "fp8" and kv_cache_dtype_arg("auto") == "auto"
    model, tok = s2
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=1, num_blocks=8))
    assert eng.kv_cache_dtype is None and eng.runner.kv.data.dtype == model.dtype
    monkeypatch.setenv("SHOAL_KV_CACHE_DTYPE", "fp4")
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        kv_cache_dtype_arg(None)


def test_parse_kv_cache_dtype():
    assert parse_kv_cache_dtype("auto") is None and parse_kv_cache_dtype(None) is None
    assert parse_kv_cache_dtype("fp8") is FP8_KV_DTYPE and parse_kv_cache_dtype(FP8_KV_DTYPE) is FP8_KV_DTYPE
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        parse_kv_cache_dtype("int4")


def test_attention_rejects_fp8_cache_without_or_with_bad_scales():
    from shoal.kernels.paged_attention import paged_decode_attention_ref

    q = torch.randn(1, 4, 64)
    k8, ks = quantize_kv(torch.randn(4, 16, 2, 64))
    bt = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs k_scale"):
        paged_decode_attention_ref(q, k8, k8, bt, lens, 0.125)
    with pytest.raises(ValueError, match="k_scale must be"):
        paged_decode_attention_ref(q, k8, k8, bt, lens, 0.125, k_scale=ks.transpose(1, 2), v_scale=ks)
    with pytest.raises(ValueError, match="for an FP8"):
        paged_decode_attention_ref(q, k8.float(), k8.float(), bt, lens, 0.125, k_scale=ks, v_scale=ks)


# ------------------------------------------------------------------------------- engine


TEXTS = ["Hello world, this is a test.", "How are you doing today my friend?",
         "Speech synthesis is fun.", "The quick brown fox jumps over the lazy dog."]


@contextlib.contextmanager
def fp8_reference(model):
    """The reference loop decoding with an FP8 slow cache (model.kv_cache_dtype)."""
    model.kv_cache_dtype = FP8_KV_DTYPE
    try:
        yield
    finally:
        model.kv_cache_dtype = None


@pytest.fixture(scope="module")
def s2(tiny_s2_checkpoint):
    from shoal.checkpoint import load_dualar

    model, tok = load_dualar(tiny_s2_checkpoint, dtype=torch.float32)
    return model, tok


def _session(tok, i, voice):
    from shoal.text import Reference, build_session

    refs = [Reference("A voice reference transcript.", voice)] if i % 2 else []
    return build_session("s2", tok, TEXTS[i % len(TEXTS)], refs, None)


@pytest.mark.parametrize("prefill_chunk,fused", [(1024, False), (7, False), (1024, True)])
def test_engine_with_fp8_kv_equals_the_fp8_reference_loop(s2, prefill_chunk, fused):
    """Greedy and sampled requests in one batch, chunked prefill, the fused path: the engine's
    FP8 paged cache decodes exactly as the reference loop with its FP8 contiguous cache."""
    from shoal.engine.engine import Engine, EngineConfig
    from shoal.engine.generate import generate
    from shoal.engine.request import EngineRequest, FinishEvent
    from shoal.engine.sampling import SamplingParams

    model, tok = s2
    voice = np.random.default_rng(3).integers(0, 1024, size=(10, 40))
    greedy, sampled = SamplingParams(greedy=True), SamplingParams(temperature=0.8, top_p=0.8, top_k=30)
    want = {}
    with fp8_reference(model):
        for i in range(5):
            params = greedy if i % 3 else sampled
            want[f"r{i}"] = generate(model, _session(tok, i, voice).grid(), params, tok.im_end_id, 6 + i,
                                     seed=100 + i).codes
    try:
        eng = Engine(model, tok.im_end_id, config=EngineConfig(
            max_running=3, num_blocks=96, prefill_chunk=prefill_chunk, kv_cache_dtype="fp8",
            fused_kernels=fused))
        assert eng.runner.kv.data.dtype == FP8_KV_DTYPE and eng.runner.kv.scales is not None
        for i in range(5):
            eng.add_request(EngineRequest(session=_session(tok, i, voice), params=greedy if i % 3 else sampled,
                                          seed=100 + i, max_new_tokens=6 + i, request_id=f"r{i}"))
        done = {e.request_id: e for e in eng.run_until_done() if isinstance(e, FinishEvent)}
    finally:
        model.fused = False
    for rid, codes in want.items():
        assert np.array_equal(done[rid].codes, codes), rid
    assert eng.pool.num_used == 0


@pytest.mark.parametrize("block_size", [16, 64])
def test_fp8_kv_prefix_hit_equals_a_cold_prefill(s2, block_size):
    """Whole-page hits and the partial page's copy (codes, scales) decode as a cold prefill."""
    from shoal.engine.engine import Engine, EngineConfig
    from shoal.engine.generate import generate
    from shoal.engine.request import EngineRequest, FinishEvent
    from shoal.engine.sampling import SamplingParams

    model, tok = s2
    voice = np.random.default_rng(5).integers(0, 1024, size=(10, 48))
    eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=2, num_blocks=64, kv_cache_dtype="fp8",
                                                           block_size=block_size))
    g = SamplingParams(greedy=True)
    g1, g3 = _session(tok, 1, voice).grid(), _session(tok, 3, voice).grid()
    n = min(g1.shape[1], g3.shape[1])
    same = (g1[:, :n] == g3[:, :n]).all(axis=0)
    shared = int(np.argmin(same))
    assert shared % block_size
    # the first request fills the page its shared part ends in, so that page is registered
    first = max(4, -(-shared // block_size) * block_size - g1.shape[1] + 2)
    for rid, i, k in (("first", 1, first), ("second", 3, 4)):
        eng.add_request(EngineRequest(session=_session(tok, i, voice), params=g, max_new_tokens=k,
                                      ignore_eos=rid == "first", request_id=rid))
        done = {e.request_id: e for e in eng.run_until_done() if isinstance(e, FinishEvent)}
    assert eng.pool.hit_tokens == shared and eng.pool.copied_tokens == shared % block_size
    with fp8_reference(model):
        want = generate(model, _session(tok, 3, voice).grid(), g, tok.im_end_id, 4).codes
    assert np.array_equal(done["second"].codes, want)


def test_fp8_kv_cache_takes_about_half_the_bytes():
    from shoal.engine.attention import PagedKVCache

    bf16 = PagedKVCache.bytes_per_block(36, 16, 8, 128, torch.bfloat16)
    fp8 = PagedKVCache.bytes_per_block(36, 16, 8, 128, torch.bfloat16, "fp8")
    assert fp8 / bf16 == pytest.approx((128 + 4) / 256)
    c = PagedKVCache(2, 5, 16, 8, 128, torch.bfloat16, "cpu", kv_dtype="fp8", group=4)
    assert c.nbytes == PagedKVCache.bytes_per_block(2, 16, 8, 128, torch.bfloat16, "fp8") * 5
    assert c.k(1).dtype == FP8_KV_DTYPE and c.k_scale(1).shape == (5, 16, 8)
    with pytest.raises(ValueError, match="needs group"):  # the value layout depends on the group
        PagedKVCache(2, 5, 16, 8, 128, torch.bfloat16, "cpu", kv_dtype="fp8")


def test_engine_rejects_an_unknown_kv_cache_dtype(s2):
    from shoal.engine.engine import Engine, EngineConfig

    model, tok = s2
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        Engine(model, tok.im_end_id, config=EngineConfig(max_running=1, num_blocks=8, kv_cache_dtype="fp4"))


# ------------------------------------------------------------------------------- GPU


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("name", ["write_bf16", "write_splitk3"])
def test_gpu_write_kernel_bytes(name):
    res = _case_write(3 if "splitk" in name else 1, torch.bfloat16, "cuda")
    assert all(res["flags"].values()), res


@needs_cuda
def test_gpu_fp8_attention_at_s2_pro_sizes():
    from shoal.kernels.paged_attention import (paged_decode_attention, paged_decode_attention_ref,
                                               paged_decode_attention_triton)
    from shoal.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, nb, bs = 64, 32, 8, 128, 64 * 40 + 1, 16
    k8, v8, ks, vs = _fp8_cache(g, nb, bs, Hkv, D, "cuda")
    q = torch.randn(B, H, D, generator=g).bfloat16().cuda()
    bt = torch.randperm(nb - 1, generator=g)[: B * 40].reshape(B, 40).int().cuda()
    lens = torch.randint(1, 640, (B,), generator=g).int().cuda()
    ref = paged_decode_attention_ref(q, k8, v8, bt, lens, D ** -0.5, k_scale=ks, v_scale=vs)
    out = paged_decode_attention(q, k8, v8, bt, lens, D ** -0.5, k_scale=ks, v_scale=vs)
    assert _excess(out, ref, 2e-2) <= 2e-2
    for cvt in ("f16", "q"):  # the launch variants of the FP8-cache loop
        for block_n, splits in ((32, 1), (64, 3), (128, 2)):
            o = paged_decode_attention_triton(q, k8, v8, bt, lens, D ** -0.5, k_scale=ks, v_scale=vs,
                                              cvt=cvt, block_n=block_n, num_splits=splits)
            assert _excess(o, ref, 2e-2) <= 2e-2, (cvt, block_n, splits)
    qp = torch.randn(300, H, D, generator=g).bfloat16().cuda()
    cu = torch.tensor([0, 100, 300]).cuda()
    start = torch.tensor([200, 0]).cuda()
    outp = paged_prefill_attention(qp, k8, v8, bt[:2], cu, start, D ** -0.5, k_scale=ks, v_scale=vs)
    refp = paged_prefill_attention_ref(qp, k8, v8, bt[:2], cu, start, D ** -0.5, k_scale=ks, v_scale=vs)
    assert _excess(outp, refp, 2e-2) <= 2e-2


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8-token-minor"])
def test_copy_blocks_in_order_on_every_layout(kind):
    """PagedKVCache.copy_blocks equals copying the pairs one by one, in order: K, V (either value
    layout) and the FP8 scales, every layer; a destination reused as a later source, several
    copies to one destination, a block onto itself."""
    from shoal.engine.attention import PagedKVCache

    kv = None if kind == "bf16" else "fp8"
    c = PagedKVCache(3, 8, 4, 2, 8, torch.bfloat16, "cpu", kv_dtype=kv, group=4,
                     v_token_minor=kind == "fp8-token-minor" if kv else None)
    g = torch.Generator().manual_seed(0)
    tensors = ([c.data] if c.data is not None else [c.k_data, c.v_data]) + ([c.scales] if c.scales is not None else [])
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))

    def snapshot():
        return ([c.k(l).float().clone() for l in range(3)], [c.v(l).float().clone() for l in range(3)],
                None if c.scales is None else c.scales.clone())

    for copies in ([(1, 4), (2, 5), (3, 5), (4, 4)],  # gather + scatter; last copy to 5 wins
                   [(1, 4), (4, 6), (6, 0)]):  # chained: pair by pair
        k, v, sc = snapshot()
        want_k, want_v = [x.clone() for x in k], [x.clone() for x in v]
        want_s = None if sc is None else sc.clone()
        for src, dst in copies:
            for l in range(3):
                want_k[l][dst] = want_k[l][src]
                want_v[l][dst] = want_v[l][src]
            if want_s is not None:
                want_s[:, :, dst] = want_s[:, :, src]
        c.copy_blocks(copies)
        k, v, sc = snapshot()
        for l in range(3):
            assert torch.equal(k[l], want_k[l]) and torch.equal(v[l], want_v[l])
        assert sc is None or torch.equal(sc, want_s)
