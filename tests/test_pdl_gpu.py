"""Programmatic dependent launch (on by default, SHOAL_PDL=0 off; shoal.kernels.paged_attention.pdl_enabled):
the engine's decode step with every Triton kernel launched with PDL produces exactly the codes
it produces without (PDL only lets a kernel be scheduled early; its memory effects still
follow its predecessor's). GPU only; the model is small but runs every decode kernel: fused
norms / RoPE / KV writes, paged and fast-cache attention, the fused sampler, and the bf16
decode GEMM (a dense table covering the model's shapes is installed for the test).
On CPU, the option is inert (checked without a GPU)."""

import json

import numpy as np
import pytest
import torch

from shoal.kernels import dense, paged_attention

cuda = pytest.mark.skipif(not torch.cuda.is_available() or not paged_attention.HAS_TRITON,
                          reason="needs CUDA + triton")


def test_pdl_is_inert_on_cpu(monkeypatch):
    monkeypatch.setenv(paged_attention.PDL_ENV, "1")
    paged_attention.pdl_enabled.cache_clear()
    try:
        assert paged_attention.pdl_options(torch.zeros(1)) == {}
    finally:
        paged_attention.pdl_enabled.cache_clear()


def _codes(pdl: bool, monkeypatch, sampler_overlap: str = "0") -> dict:
    from shoal.bench.random_model import S2_IM_END, S2_SEMANTIC_BEGIN, random_dualar, random_prompt
    from shoal.engine.engine import Engine, EngineConfig
    from shoal.engine.request import EngineRequest, FinishEvent, GridSession
    from shoal.engine.sampling import SamplingParams
    from shoal.model.config import ModelConfig, TransformerShape

    monkeypatch.setenv(paged_attention.PDL_ENV, "1" if pdl else "0")
    monkeypatch.setenv("SHOAL_SAMPLER_OVERLAP", sampler_overlap)
    paged_attention.pdl_enabled.cache_clear()
    assert paged_attention.pdl_enabled() == pdl
    shape = TransformerShape(dim=256, n_layer=2, n_head=4, n_local_heads=2, head_dim=64, intermediate_size=512,
                             qk_norm=True)
    cfg = ModelConfig(family="s2", vocab_size=155776, slow=shape, fast=shape, max_seq_len=1024,
                      semantic_begin_id=S2_SEMANTIC_BEGIN, semantic_end_id=S2_SEMANTIC_BEGIN + 4095,
                      eos_token_id=S2_IM_END)
    model = random_dualar(cfg, "cuda", torch.bfloat16, seed=3)
    model.norm.weight.fill_(20.0)
    model.fast_norm.weight.fill_(20.0)
    rng = np.random.default_rng(0)
    eng = Engine(model, S2_IM_END, config=EngineConfig(max_running=8, max_seq_len=1024, prefill_chunk=64,
                                                       num_blocks=256))
    eng.warmup(show_progress=False)
    for i in range(6):
        p = SamplingParams(greedy=True) if i % 2 else SamplingParams(temperature=0.8, top_p=0.8, top_k=30)
        eng.add_request(EngineRequest(session=GridSession(random_prompt(cfg, 20 + 5 * i, 12 + 3 * i, rng)), params=p,
                                      seed=i, max_new_tokens=20, ignore_eos=True, request_id=str(i)))
    return {e.request_id: e.codes for e in eng.run_until_done() if isinstance(e, FinishEvent)}


def _test_table(tmp_path) -> None:
    cfgs = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2}
    table = {"configs": {f"{n},{k}": {"16": dict(cfgs), "128": {**cfgs, "BLOCK_M": 128}}
                         for n, k in ((512, 256), (256, 256), (1024, 256), (256, 512), (4097, 256))}}
    (tmp_path / "dense_tuned.json").write_text(json.dumps(table))
    dense.set_dense_table(tmp_path)


def _assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b) and len(a) == 6
    for rid in a:
        assert np.array_equal(a[rid], b[rid]), rid


@cuda
def test_pdl_engine_codes_identical(monkeypatch, tmp_path):
    _test_table(tmp_path)
    try:
        off = _codes(False, monkeypatch)
        on = _codes(True, monkeypatch)
    finally:
        dense.set_dense_table(None)
        paged_attention.pdl_enabled.cache_clear()
    _assert_same(on, off)


@cuda
def test_sampler_overlap_engine_codes_identical(monkeypatch, tmp_path):
    """The main-token sampler on its side stream beside the fast position 0
    (``SHOAL_SAMPLER_OVERLAP``), in the captured decode graphs, with PDL: the same codes."""
    _test_table(tmp_path)
    try:
        seq = _codes(True, monkeypatch, "0")
        side = _codes(True, monkeypatch, "on")
    finally:
        dense.set_dense_table(None)
        paged_attention.pdl_enabled.cache_clear()
    _assert_same(side, seq)


def test_sampler_overlap_switch(monkeypatch):
    from shoal.engine.runner import sampler_overlap_max_batch

    for v, want in (("", 1 << 30), ("0", 0), ("off", 0), ("on", 1 << 30), ("all", 1 << 30), ("1", 1), ("16", 16)):
        monkeypatch.setenv("SHOAL_SAMPLER_OVERLAP", v)
        assert sampler_overlap_max_batch() == want, v
    for bad in ("-2", "sometimes"):
        monkeypatch.setenv("SHOAL_SAMPLER_OVERLAP", bad)
        with pytest.raises(ValueError, match="SHOAL_SAMPLER_OVERLAP"):
            sampler_overlap_max_batch()
