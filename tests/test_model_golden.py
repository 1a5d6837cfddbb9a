"""Slow and fast forwards against the reference goldens (fp32 tight, bf16 within 3%)."""

import pytest
import torch
from safetensors.torch import load_file

from golden_paths import GOLDEN, requires_golden
from shoal.checkpoint import load_dualar

pytestmark = requires_golden

CASES = [("s2_tiny", "fp32", torch.float32, 1e-5), ("s2_tiny", "bf16", torch.bfloat16, 0.03),
         ("s1mini_tiny", "fp32", torch.float32, 1e-5), ("s1mini_tiny", "bf16", torch.bfloat16, 0.03)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("folder,name,dtype,tol", CASES)
def test_forward_matches_golden(folder, name, dtype, tol):
    model, tok = load_dualar(GOLDEN / folder / "checkpoint", dtype=dtype, max_seq_len=2560)
    gold = load_file(GOLDEN / folder / "outputs" / f"forward_{name}.safetensors")
    grid = gold["prompt_grid"]
    T = grid.shape[1]
    layer_out = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, idx=idx: layer_out.__setitem__(idx, o))
             for idx, layer in enumerate(model.layers)]
    cache = model.new_slow_cache(1, T)
    pos = torch.arange(T)[None]
    cache.bind(pos)
    with torch.inference_mode():
        emb = model.embed(grid[None])[0]
        out = model.forward_slow(grid[None], pos, cache)
    for h in hooks:
        h.remove()
    if name == "fp32":
        assert torch.equal(emb, gold["embed_out"]), "embedding must be exact in fp32"
    assert rel(emb, gold["embed_out"]) <= tol
    assert rel(layer_out[0][0], gold["layer0_out"]) <= tol
    assert rel(layer_out[1][0], gold["layer1_out"]) <= tol
    assert rel(out.logits[0], gold["prefill_logits_last"]) <= tol
    assert rel(out.fast_input[0], gold["prefill_hidden_last"]) <= tol

    codes = gold["fast_fixed_codes"]
    fast_cache = model.new_fast_cache(1)
    x = out.fast_input
    rows = []
    with torch.inference_mode():
        for k in range(10):
            fast_cache.bind(torch.tensor([[k]]))
            if k:
                x = model.fast_embeddings(codes[k - 1: k])
            rows.append(model.forward_fast(x, k, fast_cache)[0])
    fast = torch.stack(rows)
    ref = gold["fast_logits"]
    assert rel(fast[:, : ref.shape[1]], ref) <= tol


def test_batched_forward_equals_single():
    """Two prompts of different lengths in one padded batch give each one's solo logits."""
    model, tok = load_dualar(GOLDEN / "s2_tiny" / "checkpoint", dtype=torch.float32, max_seq_len=2560)
    import numpy as np
    g1 = torch.from_numpy(np.load(GOLDEN / "s2_tiny/prompts/grid_no_ref_b0.npy"))
    g2 = torch.from_numpy(np.load(GOLDEN / "s2_tiny/prompts/grid_one_ref_b0.npy"))
    solo = []
    for g in (g1, g2):
        c = model.new_slow_cache(1, 256)
        p = torch.arange(g.shape[1])[None]
        c.bind(p)
        solo.append(model.forward_slow(g[None], p, c).logits[0])
    T = max(g1.shape[1], g2.shape[1])
    batch = torch.zeros(2, 11, T, dtype=torch.long)
    batch[0, :, : g1.shape[1]] = g1
    batch[1, :, : g2.shape[1]] = g2
    pos = torch.arange(T)[None].repeat(2, 1)
    c = model.new_slow_cache(2, 256)
    c.bind(pos)
    out = model.forward_slow(batch, pos, c, last_index=torch.tensor([g1.shape[1] - 1, g2.shape[1] - 1]))
    assert torch.allclose(out.logits[0], solo[0], atol=1e-4, rtol=0)
    assert torch.allclose(out.logits[1], solo[1], atol=1e-4, rtol=0)
