"""The fast transformer's position 0 and its head, on the engine's fast cache.

Position 0 (the slow hidden state) only fills the fast KV cache: nothing reads its output, so
the last fast layer writes its K/V and stops there (no attention, wo or MLP). The last
residual add runs fused with the final norm on the fused path. Both must leave every K/V
entry and every logit exactly as the full computation gives them.
"""

from __future__ import annotations

import pytest
import torch

from shoal.bench.random_model import random_dualar, tiny_config
from weight_spy import record_weight_reads
from shoal.engine.attention import FastCacheBackend


def _backend(model, rows):
    sh = model.config.fast
    fb = FastCacheBackend(sh.n_layer, rows, model.config.num_codebooks, sh.n_head, sh.n_local_heads,
                          sh.head_dim, model.dtype, model.device)
    fb._rows = rows
    return fb


def _full_position(model, x, fb, position):
    """Every fast layer run whole at ``position`` (the plain Block code), output dropped."""
    h = x.unsqueeze(1)
    cos_sin = model.fast_rope[position].expand(h.shape[0], 1, *model.fast_rope.shape[1:])
    for i, layer in enumerate(model.fast_layers):
        h = layer(h, cos_sin, fb, i)
    return h


def _run_positions(model, fb, xs, fused):
    """Fast positions 0, 1, ... with inputs ``xs`` through ``forward_fast`` (position 0 K/V
    only); the logits of positions 1, 2, ..."""
    model.enable_fused_kernels(fused)
    try:
        got = []
        for k, x in enumerate(xs):
            fb.position = k
            out = model.forward_fast(x, k, fb, n_out=0 if k == 0 else None)
            if k:
                got.append(out)
    finally:
        model.enable_fused_kernels(False)
    return got


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_dualar(tiny_config(256), "cpu", torch.float32, seed=3)


@pytest.mark.parametrize("fused", [False, True])
def test_position_zero_writes_the_same_kv_without_the_last_layers_output(model, fused, monkeypatch):
    rows = 3
    x = torch.randn(rows, model.config.fast.dim)
    ref = _backend(model, rows)
    _full_position(model, x, ref, 0)

    # every weight a projection reads, on either path (module calls and the fused path's GEMMs)
    last = model.fast_layers[-1]
    used, hooks = record_weight_reads(monkeypatch, (last.attention.wo, last.feed_forward.w1, last.feed_forward.w2))
    model.enable_fused_kernels(fused)
    try:
        fb = _backend(model, rows)
        fb.position = 0
        assert model.forward_fast(x, 0, fb, n_out=0) is None
    finally:
        model.enable_fused_kernels(False)
        for h in hooks:
            h.remove()
    assert any(w is last.attention.wqkv.weight for w in used) == fused  # the fused path was taken
    skipped = [last.attention.wo.weight, last.feed_forward.w1.weight, last.feed_forward.w2.weight]
    skipped += [last.feed_forward.w13] if fused else []
    assert not [w for w in used if any(w is s for s in skipped)]  # stopped after the K/V write
    assert torch.equal(fb.k[:, :rows, 0], ref.k[:, :rows, 0])
    assert torch.equal(fb.v[:, :rows, 0], ref.v[:, :rows, 0])
    assert fb.k[:, :rows, 0].abs().sum() > 0


@pytest.mark.parametrize("fused", [False, True])
def test_fast_logits_after_the_kv_only_position_equal_the_full_computation(model, fused):
    rows, C = 2, model.config.num_codebooks
    torch.manual_seed(1)
    xs = [torch.randn(rows, model.config.fast.dim) for _ in range(3)]
    ref = _backend(model, rows)
    want = []
    for k, x in enumerate(xs):
        ref.position = k
        h = _full_position(model, x, ref, k)
        want.append(model.fast_output(model.fast_norm(h[:, 0])))

    got = _run_positions(model, _backend(model, rows), xs, fused)
    assert C > 2
    for k in (1, 2):
        assert torch.equal(got[k - 1], want[k]), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the fused Triton kernels)")
def test_gpu_fused_kv_only_position_and_fused_final_norm_keep_the_bits():
    """On the GPU's fused kernels (bf16): position 0 run K/V-only writes the bits the whole
    position writes, and the head's input from the fused last add + norm equals the separate
    add then norm."""
    from shoal.kernels.fused import add_rmsnorm

    model = random_dualar(tiny_config(256), "cuda", torch.bfloat16, seed=5)
    model.enable_fused_kernels(True)
    rows = 5
    x = torch.randn(rows, model.config.fast.dim, device="cuda").bfloat16()
    full, kv_only = _backend(model, rows), _backend(model, rows)
    pos = torch.zeros(rows, 1, dtype=torch.long, device="cuda")
    model._layers_fused(x.unsqueeze(1), model.fast_layers, pos, model.fast_rope, full)
    assert model.forward_fast(x, 0, kv_only, n_out=0) is None
    assert torch.equal(kv_only.k[:, :rows, 0], full.k[:, :rows, 0])
    assert torch.equal(kv_only.v[:, :rows, 0], full.v[:, :rows, 0])

    e = torch.randn(rows, model.config.fast.dim, device="cuda").bfloat16()
    a, b, c = _backend(model, rows), _backend(model, rows), _backend(model, rows)
    for fb in (a, b, c):
        fb.k.copy_(full.k)
        fb.v.copy_(full.v)
        fb.position = 1
    pos1 = torch.ones(rows, 1, dtype=torch.long, device="cuda")
    h1 = model._layers_fused(e.unsqueeze(1), model.fast_layers, pos1, model.fast_rope, a)
    want = add_rmsnorm(h1[:, 0], None, model.fast_norm.weight, model.config.norm_eps)[0]
    want = want @ model.fast_output.weight.T
    got = model.forward_fast(e, 1, b)
    assert torch.equal(a.k, b.k)
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()  # cuBLAS vs ours for the head
    normed, _ = model._layers_fused(e.unsqueeze(1), model.fast_layers, pos1, model.fast_rope, c,
                                    final_norm=model.fast_norm.weight)
    sep = add_rmsnorm(h1[:, 0], None, model.fast_norm.weight, model.config.norm_eps)[0]
    assert torch.equal(normed, sep)


def _fast_run(model, rows, switch, monkeypatch, device="cpu"):
    """Positions 0..3 of the fused fast path with ``SHOAL_FAST_ROPE_ATTN`` as given: the caches
    and the logits of positions 1..3, and how often the one-kernel backend call ran."""
    from shoal.kernels import fused

    monkeypatch.setattr(fused, "fast_rope_attention_enabled", lambda: switch)
    calls = []
    fb = _backend(model, rows)
    real = fb.rope_attend
    monkeypatch.setattr(fb, "rope_attend", lambda *a: (calls.append(a[0]), real(*a))[1])
    torch.manual_seed(2)
    xs = [torch.randn(rows, model.config.fast.dim, device=device).to(model.dtype) for _ in range(4)]
    return fb, _run_positions(model, fb, xs, True), calls


def test_one_kernel_rope_attention_keeps_the_fast_path(model, monkeypatch):
    """``SHOAL_FAST_ROPE_ATTN``: RoPE, the K/V write and the attention of every fast layer
    through the backend's one call (except position 0's K/V-only last layer) leave the
    caches and the logits exactly as the two-step path does."""
    rows, n = 3, model.config.fast.n_layer
    off, want, none = _fast_run(model, rows, False, monkeypatch)
    on, got, calls = _fast_run(model, rows, True, monkeypatch)
    assert none == [] and len(calls) == (n - 1) + 3 * n  # position 0: all but the last layer
    assert torch.equal(on.k, off.k) and torch.equal(on.v, off.v)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the fused Triton kernels)")
def test_gpu_one_kernel_rope_attention_keeps_the_bits(monkeypatch):
    model = random_dualar(tiny_config(256), "cuda", torch.bfloat16, seed=5)
    rows = 5
    off, want, _ = _fast_run(model, rows, False, monkeypatch, "cuda")
    on, got, calls = _fast_run(model, rows, True, monkeypatch, "cuda")
    assert calls
    assert torch.equal(on.k, off.k) and torch.equal(on.v, off.v)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
