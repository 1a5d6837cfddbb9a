"""FP8 serving path on the GPU: FP8Linear's Triton body, the stacked w1|w3 GEMM with the fused
SwiGLU + quantize feeding w2, the sliced fast head, and the engine's graph-captured decode with
FP8 weights. (The CPU FP8 path -- fake quantization in PyTorch -- is covered by test_quantize.)"""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import fp8 as kfp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not kfp8.HAS_TRITON,
                                reason="needs CUDA + triton")


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _config():
    from shoal.model.config import ModelConfig, TransformerShape

    slow = TransformerShape(dim=256, n_layer=2, n_head=4, n_local_heads=2, head_dim=64,
                            intermediate_size=640, qk_norm=True)
    fast = TransformerShape(dim=256, n_layer=2, n_head=4, n_local_heads=2, head_dim=64, intermediate_size=640)
    return ModelConfig(family="s2", vocab_size=155776, slow=slow, fast=fast, max_seq_len=1024,
                       semantic_begin_id=151678, semantic_end_id=151678 + 4095, eos_token_id=151645)


def test_fp8_linear_kernels_match_cpu_path():
    from shoal.quant.fp8 import FP8Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(2560, 6144, bias=False).bfloat16()
    f = FP8Linear.from_linear(lin)
    x = torch.randn(3, 5, 2560).bfloat16()
    y_cpu = f(x)
    g = FP8Linear.from_linear(lin.cuda())
    assert g.use_kernels(x.cuda())
    y_gpu = g(x.cuda())
    assert y_gpu.shape == (3, 5, 6144) and y_gpu.dtype == torch.bfloat16
    assert _rel(y_gpu.cpu(), y_cpu) < 1e-2


def test_concat_and_fused_mlp_match_unfused():
    from shoal.bench.random_model import random_dualar
    from shoal.kernels.fused import silu_mul

    model = random_dualar(_config(), "cuda", torch.bfloat16, quantization="fp8")
    ff = model.layers[0].feed_forward
    x = torch.randn(7, 256, device="cuda").bfloat16()
    ref = ff.w2(silu_mul(torch.cat([ff.w1(x), ff.w3(x)], -1)))
    model.enable_fused_kernels()
    w13 = ff.w13_fp8
    assert w13.weight_q.data_ptr() == ff.w1.weight_q.data_ptr()  # w1 / w3 are views of the stack
    gu = w13(x)
    assert torch.equal(gu[:, :640], ff.w1(x)) and torch.equal(gu[:, 640:], ff.w3(x))
    fused = ff.w2.forward_kernels(gu, quantized=kfp8.silu_mul_quant(gu))
    assert _rel(fused, ref) < 1e-2


def test_engine_fp8_graphs_equal_eager():
    """Graph-captured fused FP8 decode == the same FP8 engine without graphs (same kernels and
    the same counter-based sampling noise, so the same codes)."""
    import numpy as np

    from shoal.bench.random_model import S2_IM_END, random_dualar, random_prompt
    from shoal.engine.engine import Engine, EngineConfig
    from shoal.engine.request import EngineRequest, FinishEvent, GridSession
    from shoal.engine.sampling import SamplingParams

    cfg = _config()
    rng = np.random.default_rng(0)
    grids = [random_prompt(cfg, 40, 30, rng) for _ in range(3)]
    outs = []
    for graphs in (False, True):
        model = random_dualar(cfg, "cuda", torch.bfloat16, quantization="fp8")
        eng = Engine(model, S2_IM_END, config=EngineConfig(max_running=4, cuda_graphs=graphs, max_seq_len=1024,
                                                           num_blocks=256))
        eng.warmup()
        for i, g in enumerate(grids):
            eng.add_request(EngineRequest(session=GridSession(g), params=SamplingParams(temperature=0.8, top_p=0.8,
                                                                                        top_k=30),
                                          seed=i, max_new_tokens=12, ignore_eos=True, request_id=f"r{i}"))
        done = {e.request_id: e for e in eng.run_until_done() if isinstance(e, FinishEvent)}
        outs.append([done[f"r{i}"].codes for i in range(len(grids))])
    for a, b in zip(*outs):
        assert a.shape == (10, 12)
        assert np.array_equal(a, b)
