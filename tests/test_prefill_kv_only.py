"""A prefill chunk only writes K/V: ``DualAR.prefill_kv``.

Nothing reads a prompt chunk's outputs (the last prompt column is the first decode input), so
the engine's prefill stops the last slow layer after its K/V write: no attention, ``wo``, MLP
or final norm. The cache it leaves must be exactly the full forward's, on the plain layer code
and on the fused path, for first and continuation chunks packed into one step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.engine.attention import PagedKVCache, PagedPrefillBackend
from weight_spy import record_weight_reads

LENGTHS = [70, 45, 90]
BLOCKS = [[3, 9, 1, 12, 20], [5, 0, 17], [2, 8, 30, 11, 4, 25]]
STEPS = [[(2, 0, 32)], [(0, 0, 37), (1, 0, 45), (2, 32, 60)], [(0, 37, 70), (2, 60, 90)]]


@pytest.fixture(scope="module")
def model():
    from shoal.bench.random_model import random_dualar, tiny_config

    return random_dualar(tiny_config(512), "cpu", torch.float32, seed=5)


def _grids(cfg):
    from shoal.bench.random_model import random_prompt

    rng = np.random.default_rng(1)
    return [random_prompt(cfg, n - n // 3, n // 3, rng) for n in LENGTHS]


def _run(model, grids, kv_only: bool) -> torch.Tensor:
    s = model.config.slow
    dev = model.device
    cache = PagedKVCache(s.n_layer, 40, 16, s.n_local_heads, s.head_dim, model.dtype, dev)
    bt = torch.full((3, 8), 39, dtype=torch.int32)
    for i, blocks in enumerate(BLOCKS):
        bt[i, : len(blocks)] = torch.tensor(blocks)
    for step in STEPS:
        cols = np.concatenate([grids[i][:, a:b] for i, a, b in step], axis=1)
        pos = torch.as_tensor(np.concatenate([np.arange(a, b) for _, a, b in step]))
        slots = torch.tensor([BLOCKS[i][t // 16] * 16 + t % 16 for i, a, b in step for t in range(a, b)])
        cu = torch.tensor(np.cumsum([0] + [b - a for _, a, b in step]))
        be = PagedPrefillBackend(cache, s.n_head, s.n_local_heads, s.head_dim)
        be.set(slots.to(dev), cu.to(dev), torch.tensor([a for _, a, _ in step], device=dev), bt.to(dev),
               torch.tensor([i for i, _, _ in step], device=dev))
        x = torch.as_tensor(cols, device=dev)[None]
        pos = pos.to(dev)
        if kv_only:
            assert model.prefill_kv(x, pos[None], be) is None
        else:
            model.forward_slow(x, pos[None], be, head=None)
    return cache.data.clone()


@pytest.mark.parametrize("fused", [False, True])
def test_prefill_kv_leaves_the_full_forwards_cache_without_the_last_layers_output(model, fused, monkeypatch):
    grids = _grids(model.config)
    model.enable_fused_kernels(fused)
    try:
        ref = _run(model, grids, kv_only=False)
        last = model.layers[-1]
        used, hooks = record_weight_reads(monkeypatch, (last.attention.wo, last.feed_forward.w1,
                                                        last.feed_forward.w2, last.attention.wqkv))
        norm_calls = []
        hooks.append(model.norm.register_forward_hook(lambda *a: norm_calls.append(1)))
        try:
            got = _run(model, grids, kv_only=True)
        finally:
            for h in hooks:
                h.remove()
    finally:
        model.enable_fused_kernels(False)
    assert any(w is last.attention.wqkv.weight for w in used)  # the last layer's K/V were computed
    skipped = [last.attention.wo.weight, last.feed_forward.w1.weight, last.feed_forward.w2.weight]
    skipped += [last.feed_forward.w13] if getattr(last.feed_forward, "w13", None) is not None else []
    assert not [w for w in used if any(w is s for s in skipped)]  # stopped after the K/V write
    assert not norm_calls  # no final norm
    assert torch.equal(got, ref)
    assert got[-1].abs().sum() > 0  # the last layer's K/V were written


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefill_kv_keeps_the_cache_bits():
    """The same on the GPU in bf16 through the Triton kernels (fused path, paged varlen
    attention kernel)."""
    from shoal.bench.random_model import random_dualar, tiny_config

    model = random_dualar(tiny_config(512), "cuda", torch.bfloat16, seed=5)
    grids = _grids(model.config)
    model.enable_fused_kernels(True)
    try:
        ref = _run(model, grids, kv_only=False)
        got = _run(model, grids, kv_only=True)
    finally:
        model.enable_fused_kernels(False)
    assert torch.equal(got, ref)
    assert got[-1].float().abs().sum() > 0


def test_runner_prefill_goes_through_prefill_kv(monkeypatch):
    """The engine runner's prefill writes K/V through ``prefill_kv`` (never the full forward),
    and the last layer's MLP does not run."""
    from shoal.bench.random_model import random_dualar, random_prompt, tiny_config
    from shoal.engine.runner import ModelRunner, RunnerConfig

    model = random_dualar(tiny_config(512), "cpu", torch.float32, seed=7)
    cfg = RunnerConfig(max_slots=2, num_blocks=16, block_size=16, max_blocks_per_seq=8, cuda_graphs=False)
    runner = ModelRunner(model, model.config.vocab_size - 1, cfg)
    calls = []
    last_ff = model.layers[-1].feed_forward
    monkeypatch.setattr(last_ff, "forward", lambda x: calls.append("mlp") or torch.zeros_like(x))
    monkeypatch.setattr(model, "forward_slow", lambda *a, **k: calls.append("forward_slow"))
    grid = random_prompt(model.config, 20, 10, np.random.default_rng(0))
    runner.block_tables[0, :2] = torch.tensor([0, 1], dtype=torch.int32)
    runner.prefill([(grid, 0, grid.shape[1], [0, 1], 0)])
    assert calls == []
    assert runner.kv.k(model.config.slow.n_layer - 1).abs().sum() > 0  # the last layer's K written
