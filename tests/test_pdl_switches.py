"""The PDL launch switches: a normal launch after a cuBLAS GEMM (``SHOAL_PDL_AFTER_CUBLAS=0``)
and for the prefill forward (the default; ``SHOAL_PDL_PREFILL=1`` launches it with PDL). The launch options are decided on the
host, so they are tested here with a stand-in CUDA tensor; the GPU effect is measured by the
benchmarks (docs/benchmarks.md)."""

from __future__ import annotations

import numpy as np
import torch

from shoal.kernels import paged_attention as pa


class _CudaLike:
    is_cuda = True


PDL = {"PDL": True, "launch_pdl": True}
PLAIN = {"PDL": True}  # the same compiled kernel, launched without the PDL attribute


def _enable(monkeypatch, after_foreign: bool = True, in_prefill: bool = True) -> None:
    monkeypatch.setattr(pa, "pdl_enabled", lambda: True)
    monkeypatch.setattr(pa, "pdl_after_foreign", lambda: after_foreign)
    monkeypatch.setattr(pa, "pdl_in_prefill", lambda: in_prefill)
    monkeypatch.setattr(pa, "_pdl_local", type(pa._pdl_local)())  # fresh thread state


def test_pdl_launch_by_default(monkeypatch):
    _enable(monkeypatch)
    t = _CudaLike()
    assert pa.pdl_options(t) == PDL
    pa.note_foreign_kernel(t)  # the default keeps PDL after cuBLAS too
    assert pa.pdl_options(t) == PDL
    assert pa.pdl_options(torch.zeros(1)) == {}  # a CPU tensor: no PDL at all


def test_one_normal_launch_after_a_foreign_kernel(monkeypatch):
    _enable(monkeypatch, after_foreign=False)
    t = _CudaLike()
    pa.note_foreign_kernel(t)
    assert pa.pdl_options(t) == PLAIN  # the kernel right after the cuBLAS GEMM
    assert pa.pdl_options(t) == PDL  # the one after it follows our own kernel again
    pa.note_foreign_kernel(torch.zeros(1))  # nothing was enqueued on a GPU
    assert pa.pdl_options(t) == PDL


def test_pdl_suppressed_nests_and_restores(monkeypatch):
    _enable(monkeypatch)
    t = _CudaLike()
    with pa.pdl_suppressed():
        assert pa.pdl_options(t) == PLAIN
        with pa.pdl_suppressed(False):  # inactive: the outer suppression holds
            assert pa.pdl_options(t) == PLAIN
        assert pa.pdl_options(t) == PLAIN
    assert pa.pdl_options(t) == PDL
    with pa.pdl_suppressed(False):
        assert pa.pdl_options(t) == PDL


def test_dense_linear_marks_its_cublas_fallback(monkeypatch):
    """``dense_linear`` falling back to ``F.linear`` notes the foreign kernel."""
    from shoal.kernels import dense

    noted = []
    monkeypatch.setattr(dense, "note_foreign_kernel", lambda t: noted.append(t))
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    assert torch.equal(dense.dense_linear(x, w), torch.nn.functional.linear(x, w))
    assert noted and noted[0] is x


def test_runner_prefill_runs_inside_the_prefill_switch(monkeypatch):
    """The runner's prefill forward runs under ``pdl_suppressed`` exactly when
    ``SHOAL_PDL_PREFILL`` is off (the default); the decode step does not."""
    from shoal.bench.random_model import random_dualar, random_prompt, tiny_config
    from shoal.engine import runner as runner_mod
    from shoal.engine.runner import ModelRunner, RunnerConfig

    model = random_dualar(tiny_config(512), "cpu", torch.float32, seed=7)
    cfg = RunnerConfig(max_slots=2, num_blocks=16, block_size=16, max_blocks_per_seq=8, cuda_graphs=False)
    grid = random_prompt(model.config, 20, 10, np.random.default_rng(0))
    for in_prefill in (True, False):
        _enable(monkeypatch, in_prefill=in_prefill)
        monkeypatch.setattr(runner_mod, "pdl_in_prefill", lambda v=in_prefill: v)
        runner = ModelRunner(model, model.config.vocab_size - 1, cfg)
        seen = []
        real = model.prefill_kv
        monkeypatch.setattr(model, "prefill_kv", lambda *a, **k: (seen.append(pa.pdl_options(_CudaLike())),
                                                                 real(*a, **k))[1])
        runner.block_tables[0, :2] = torch.tensor([0, 1], dtype=torch.int32)
        runner.prefill([(grid, 0, grid.shape[1], [0, 1], 0)])
        assert seen == [PDL if in_prefill else PLAIN]
        assert pa.pdl_options(_CudaLike()) == PDL  # restored after the prefill
        monkeypatch.setattr(model, "prefill_kv", real)
