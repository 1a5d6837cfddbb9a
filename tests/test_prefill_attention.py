"""Paged varlen prefill attention (kernel vs reference vs dense), the prefill backend against
the previous per-segment one, the padded (graph-shaped) prefill, and on GPU the captured
prefill graphs against eager prefill.

The interpreter cases run in one subprocess (this file executed as a script with
``TRITON_INTERPRET=1``, see tests/interpreter_worker.py).
"""

import os

if __name__ == "__main__":  # interpreter worker: must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import math
import zlib

import numpy as np
import pytest
import torch
from interpreter_worker import assert_case, report_cases, run_worker

from shoal.kernels import prefill_attention as pf

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TOL = {"fp32": 1e-4, "bf16": 2e-2}


# --------------------------------------------------------------------------------------
# Case construction
# --------------------------------------------------------------------------------------


def make_case(H, H_kv, D, bs, segs, dtype=torch.float32, *, pad=0, rows=False, fill="neg1", seed=0,
              device="cpu", poison=True, index_dtype=torch.int32):
    """Random paged caches holding positions [0, start + n) of every segment (start, n), packed
    queries (``pad`` padding tokens after the segments), a random block table.

    Returns (q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, kwargs, dense) where
    ``dense[s]`` = (K [end, H_kv, D], V) of segment s and ``kwargs`` holds ``block_table_rows``
    when ``rows`` (the segments' rows sit at other indices of a larger table). With ``poison``
    every slot not holding a written position is NaN."""
    g = torch.Generator().manual_seed(seed)
    S = len(segs)
    need = [max(1, -(-(s + n) // bs)) for s, n in segs]
    max_blocks = max(need) + 1
    num_blocks = sum(need) + 3
    k_cache = torch.full((num_blocks, bs, H_kv, D), float("nan") if poison else 0.0)
    v_cache = torch.full((num_blocks, bs, H_kv, D), float("nan") if poison else 0.0)
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.empty((S, max_blocks), dtype=torch.int32)
    dense = []
    p = 0
    for i, (start, n) in enumerate(segs):
        pages = perm[p: p + need[i]]
        p += need[i]
        end = start + n
        kd = torch.randn(end, H_kv, D, generator=g)
        vd = torch.randn(end, H_kv, D, generator=g)
        t = torch.arange(end)
        k_cache[pages[t // bs], t % bs] = kd
        v_cache[pages[t // bs], t % bs] = vd
        dense.append((kd.to(dtype).to(device), vd.to(dtype).to(device)))
        if fill == "neg1":
            bt[i].fill_(-1)
        elif fill == "garbage":
            bt[i] = torch.randint(10**6, 2**30, (max_blocks,), generator=g, dtype=torch.int32)
        else:
            bt[i].zero_()
        bt[i, : need[i]] = pages.to(torch.int32)
    N = sum(n for _, n in segs) + pad
    q = torch.randn(N, H, D, generator=g) * 2.0
    cu = torch.tensor([0] + np.cumsum([n for _, n in segs]).tolist(), dtype=index_dtype)
    st = torch.tensor([s for s, _ in segs], dtype=index_dtype)
    kwargs = {}
    if rows:  # the segments' rows in a larger table, in another order
        big = torch.full((S + 3, max_blocks), 5, dtype=torch.int32)
        r = torch.randperm(S + 3, generator=g)[:S]
        big[r] = bt
        bt = big
        kwargs["block_table_rows"] = r.to(index_dtype).to(device)
    out = [q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), bt, cu, st]
    return (*[t.to(device) for t in out], kwargs, dense)


def dense_attention(q, cu, st, dense, D):
    """Naive per-segment causal attention on contiguous K/V, fp32, explicit GQA expansion."""
    N, H, _ = q.shape
    out = torch.zeros(N, H, D)
    cu, st = cu.tolist(), st.tolist()
    for s, (kd, vd) in enumerate(dense):
        lo, hi = cu[s], cu[s + 1]
        if hi == lo:
            continue
        rep = H // kd.shape[1]
        k = kd.float().cpu().repeat_interleave(rep, dim=1)
        v = vd.float().cpu().repeat_interleave(rep, dim=1)
        qs = q[lo:hi].float().cpu()
        sc = torch.einsum("nhd,lhd->hnl", qs, k) / math.sqrt(D)
        qpos = st[s] + torch.arange(hi - lo)
        mask = torch.arange(k.shape[0])[None, :] <= qpos[:, None]
        sc = sc.masked_fill(~mask[None], float("-inf"))
        out[lo:hi] = torch.einsum("hnl,lhd->nhd", sc.softmax(-1), v)
    return out


def _err(a, b):
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


# --------------------------------------------------------------------------------------
# Interpreter cases (run in the worker subprocess)
# --------------------------------------------------------------------------------------

# name -> (H, H_kv, D, block_size, segments (start, n), dtype, pad, rows, fill, block_m, block_n)
INTERP_CASES = {
    "g2_d32_bs16_fp32_first_and_continuation": (4, 2, 32, 16, [(0, 20), (33, 17), (0, 5)], "fp32", 3, False,
                                                "neg1", None, None),
    "g2_d32_bs16_bf16_first_and_continuation": (4, 2, 32, 16, [(0, 20), (33, 17), (0, 5)], "bf16", 3, False,
                                                "neg1", None, None),
    "g4_d64_bs8_bf16_rows_garbage": (8, 2, 64, 8, [(5, 40), (0, 70), (64, 1)], "bf16", 0, True, "garbage",
                                     None, 16),
    "g1_d16_bs16_fp32_empty_segments": (2, 2, 16, 16, [(0, 1), (100, 3), (0, 0), (16, 16), (7, 0)], "fp32", 10,
                                        True, "zero", None, None),
    "g3_d32_bs8_fp32_nonpow2_group": (6, 2, 32, 8, [(0, 9), (16, 25)], "fp32", 2, False, "neg1", 8, 16),
    "s2pro_heads_bf16": (32, 8, 128, 16, [(0, 30), (64, 40)], "bf16", 5, False, "neg1", None, None),
    "s2pro_heads_fp32_small_tiles": (32, 8, 128, 16, [(70, 20), (0, 33)], "fp32", 0, True, "neg1", 4, 16),
    "g2_d64_bs16_bf16_long_prefix": (4, 2, 64, 16, [(300, 50), (0, 64)], "bf16", 1, False, "neg1", 16, 32),
}
EXTRA_CASES = ["public_dispatch_int64_out_strided", "runner_prefill_kv_vs_segmented"]


def _run_interp_case(name):
    checks, flags = {}, {}
    if name in INTERP_CASES:
        H, H_kv, D, bs, segs, dt, pad, rows, fill, block_m, block_n = INTERP_CASES[name]
        q, k, v, bt, cu, st, kw, dense = make_case(H, H_kv, D, bs, segs, _DTYPES[dt], pad=pad, rows=rows,
                                                   fill=fill, seed=zlib.crc32(name.encode()) % 1000)
        o = pf.paged_prefill_attention_triton(q, k, v, bt, cu, st, D ** -0.5, block_m=block_m,
                                              block_n=block_n or 64, **kw)
        r = pf.paged_prefill_attention_ref(q, k, v, bt, cu, st, D ** -0.5, **kw)
        checks["kernel_vs_ref"] = (_err(o, r), _TOL[dt])
        checks["ref_vs_dense"] = (_err(r, dense_attention(q, cu, st, dense, D)), _TOL[dt])
        flags["finite"] = bool(torch.isfinite(o).all())
        flags["dtype"] = o.dtype == q.dtype
        flags["padding_zero"] = bool((o[int(cu[-1]):] == 0).all())
    elif name == "public_dispatch_int64_out_strided":
        q, k, v, bt, cu, st, kw, dense = make_case(8, 2, 32, 8, [(3, 12), (0, 20)], torch.float32, pad=4,
                                                   rows=True, seed=11, index_dtype=torch.int64)
        N = q.shape[0]
        q_big = torch.zeros(N, 9, 48)
        q_big[:, :8, :32] = q
        out_big = torch.full((N, 8, 40), 7.0)
        out = out_big[:, :, :32]
        res = pf.paged_prefill_attention(q_big[:, :8, :32], k, v, bt, cu, st, 0.2, out=out, **kw)
        r = pf.paged_prefill_attention_ref(q, k, v, bt, cu, st, 0.2, **kw)
        checks["kernel_vs_ref"] = (_err(out, r), 1e-4)
        flags["interpreting"] = pf.use_kernel(q)
        flags["wrote_out"] = res.data_ptr() == out.data_ptr() and bool((out_big[:, :, 32:] == 7.0).all())
    elif name == "runner_prefill_kv_vs_segmented":
        new, old = runner_kv(prefill_impl="paged"), runner_kv(prefill_impl="segmented")
        checks["kv_vs_segmented"] = (_err(new, old), 1e-5)
        flags["finite"] = bool(torch.isfinite(new).all())
    else:
        raise KeyError(name)
    return {"checks": checks, "flags": flags}


# --------------------------------------------------------------------------------------
# A tiny model's runner (CPU, or CUDA for the GPU tests)
# --------------------------------------------------------------------------------------


def tiny_model(device="cpu", dtype=torch.float32, seed=3):
    from shoal.bench.random_model import random_dualar, tiny_config

    model = random_dualar(tiny_config(512), device, dtype, seed=seed)
    model.norm.weight.fill_(28.0)  # clear logit margins, as the golden models have
    return model


def make_runner(model, prefill_graphs=False, buckets=None, max_slots=4, num_blocks=40):
    from shoal.bench.random_model import S2_IM_END
    from shoal.engine.runner import ModelRunner, RunnerConfig

    cfg = RunnerConfig(max_slots=max_slots, num_blocks=num_blocks, block_size=16,
                       max_blocks_per_seq=model.config.max_seq_len // 16,
                       cuda_graphs=model.device.type == "cuda", graph_buckets=[1],
                       prefill_graphs=prefill_graphs, prefill_buckets=buckets)
    return ModelRunner(model, S2_IM_END, cfg)


def prompt_grids(cfg, lengths, seed=0):
    from shoal.bench.random_model import random_prompt

    rng = np.random.default_rng(seed)
    return [random_prompt(cfg, n - n // 3, n // 3, rng) for n in lengths]


# three sequences in blocks of 16 (non-contiguous), prefilled in two steps: step 1 holds two
# first chunks and one continuation chunk over a "cached" prefix; step 2 continues all three
LENGTHS = [70, 45, 90]
BLOCKS = [[3, 9, 1, 12, 20], [5, 0, 17], [2, 8, 30, 11, 4, 25]]
STEPS = [[(0, 0, 37), (1, 0, 45), (2, 32, 60)], [(0, 37, 70), (2, 60, 90)]]
PREFIX = (2, 0, 32)  # computed before STEPS[0] (a prefix-cache hit in the engine)


def run_steps(runner, grids, steps=None):
    steps = steps if steps is not None else [[PREFIX]] + STEPS
    for slot, blocks in enumerate(BLOCKS):
        runner.set_block_table(slot, blocks)
    with torch.inference_mode():
        for step in steps:
            runner.prefill([(grids[i], a, b, BLOCKS[i], i) for i, a, b in step])


def runner_kv(prefill_impl="paged", device="cpu"):
    """K/V of every layer at the written slots after :data:`STEPS`, [layers, 2, tokens, H_kv, D]."""
    model = tiny_model(device)
    runner = make_runner(model)
    runner.prefill_impl = prefill_impl
    grids = prompt_grids(model.config, LENGTHS)
    run_steps(runner, grids)
    return written_kv(runner)


def written_kv(runner):
    flat = runner.kv.data.flatten(2, 3)  # [layers, 2, blocks * bs, H_kv, D]
    slots = torch.tensor([b * 16 + t % 16 for blocks, n in zip(BLOCKS, LENGTHS)
                          for t, b in enumerate(np.repeat(blocks, 16)[:n])])
    return flat[:, :, slots.to(flat.device)].float().cpu()


# --------------------------------------------------------------------------------------
# Interpreter tests
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interp_results():
    if not pf.HAS_TRITON:
        pytest.skip("triton not installed")
    res = run_worker(__file__)
    if "__unusable__" in res:
        import triton

        pytest.skip(f"Triton {triton.__version__} interpreter unusable here: {res['__unusable__']}")
    return res


@pytest.mark.parametrize("name", list(INTERP_CASES) + EXTRA_CASES)
def test_kernel_matches_reference_interpreter(interp_results, name):
    assert_case(interp_results[name], need_any=True)


# --------------------------------------------------------------------------------------
# In-process CPU tests
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("H,H_kv,D,bs,segs,pad,rows", [
    (4, 2, 32, 16, [(0, 20), (33, 17), (0, 5)], 3, False),
    (8, 2, 64, 8, [(5, 40), (0, 70), (64, 1)], 0, True),
    (2, 2, 16, 16, [(0, 1), (100, 3), (0, 0), (16, 16)], 6, True),
    (32, 8, 128, 16, [(0, 30), (64, 40)], 2, False),
])
def test_reference_matches_dense(H, H_kv, D, bs, segs, pad, rows):
    q, k, v, bt, cu, st, kw, dense = make_case(H, H_kv, D, bs, segs, pad=pad, rows=rows, seed=H + D)
    r = pf.paged_prefill_attention_ref(q, k, v, bt, cu, st, D ** -0.5, **kw)
    assert torch.isfinite(r).all()
    torch.testing.assert_close(r, dense_attention(q, cu, st, dense, D), atol=1e-5, rtol=1e-5)
    assert (r[int(cu[-1]):] == 0).all()
    # host-side bounds only size the work
    ends = max(s + n for s, n in segs)
    r2 = pf.paged_prefill_attention_ref(q, k, v, bt, cu, st, D ** -0.5, max_context=ends,
                                        max_query=max(n for _, n in segs), **kw)
    torch.testing.assert_close(r2, r, atol=1e-6, rtol=1e-6)


def test_reference_bf16_output_dtype_and_close():
    q, k, v, bt, cu, st, _, dense = make_case(8, 2, 64, 16, [(10, 30), (0, 17)], torch.bfloat16, pad=2, seed=4)
    r = pf.paged_prefill_attention_ref(q, k, v, bt, cu, st, 0.125)
    assert r.dtype == torch.bfloat16
    torch.testing.assert_close(r.float(), dense_attention(q, cu, st, dense, 64), atol=2e-2, rtol=2e-2)


def test_cpu_fallback_is_reference():
    if pf.triton_interpreting():
        pytest.skip("triton imported in interpreter mode in this process: CPU calls use the kernel")
    q, k, v, bt, cu, st, _, _ = make_case(4, 2, 32, 8, [(0, 9), (8, 8)], pad=1, seed=9)
    r = pf.paged_prefill_attention_ref(q, k, v, bt, cu, st, 0.3)
    assert torch.equal(pf.paged_prefill_attention(q, k, v, bt, cu, st, 0.3), r)
    out = torch.empty_like(q)
    assert pf.paged_prefill_attention(q, k, v, bt, cu, st, 0.3, out=out) is out and torch.equal(out, r)


def test_input_validation():
    q, k, v, bt, cu, st, _, _ = make_case(6, 4, 32, 8, [(0, 3)], seed=1)  # 6 % 4 != 0
    with pytest.raises(ValueError):
        pf.paged_prefill_attention_ref(q, k, v, bt, cu, st, 0.1)
    q, k, v, bt, cu, st, _, _ = make_case(4, 2, 32, 8, [(0, 3), (0, 4)], seed=1)
    with pytest.raises(ValueError):
        pf.paged_prefill_attention_ref(q, k, v, bt, cu, st[:1], 0.1)
    with pytest.raises(ValueError):
        pf.paged_prefill_attention_ref(q, k, v, bt[:1], cu, st, 0.1)
    with pytest.raises(ValueError):
        pf.paged_prefill_attention_ref(q, k.to(torch.bfloat16), v, bt, cu, st, 0.1)


def test_max_tiles_covers_every_split():
    """The grid (cdiv(N, BLOCK_M) + S programs per KV head) has a program for every segment
    tile and every padding tile, for any split of N tokens into S segments."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        bm = int(rng.choice([1, 4, 16, 32]))
        S = int(rng.integers(1, 9))
        N = int(rng.integers(0, 300))
        used = int(rng.integers(0, N + 1))
        cuts = np.sort(rng.integers(0, used + 1, S - 1))
        lens = np.diff(np.concatenate([[0], cuts, [used]]))
        need = int(sum(-(-n // bm) for n in lens)) + -(-(N - used) // bm)
        assert need <= pf.max_tiles(N, S, bm)


def test_backend_matches_segmented_backend_kv_and_logits():
    """The paged varlen backend gives the previous per-segment SDPA backend's K/V (every layer)
    and logits for packed first and continuation chunks (CPU: the reference attention)."""
    from shoal.engine.attention import (
        PagedKVCache,
        PagedPrefillBackend,
        SegmentedPrefillBackend,
    )

    model = tiny_model()
    s = model.config.slow
    grids = prompt_grids(model.config, LENGTHS)
    step = [(0, 0, 37), (1, 0, 45), (2, 32, 60)]
    results = []
    for kind in ("paged", "segmented"):
        cache = PagedKVCache(s.n_layer, 40, 16, s.n_local_heads, s.head_dim, torch.float32, "cpu")
        # the continuation chunk's prefix [0, 32) of sequence 2 is already cached
        pre = PagedPrefillBackend(cache, s.n_head, s.n_local_heads, s.head_dim)
        slots2 = torch.tensor([BLOCKS[2][t // 16] * 16 + t % 16 for t in range(32)])
        pre.set(slots2, torch.tensor([0, 32]), torch.tensor([0]), torch.tensor([BLOCKS[2]]))
        x = torch.as_tensor(grids[2][:, :32])[None]
        model.forward_slow(x, torch.arange(32)[None], pre, head=None)
        cols = np.concatenate([grids[i][:, a:b] for i, a, b in step], axis=1)
        pos = torch.as_tensor(np.concatenate([np.arange(a, b) for _, a, b in step]))
        slots = torch.tensor([BLOCKS[i][t // 16] * 16 + t % 16 for i, a, b in step for t in range(a, b)])
        if kind == "paged":
            be = PagedPrefillBackend(cache, s.n_head, s.n_local_heads, s.head_dim)
            bt = torch.full((3, 8), 39, dtype=torch.int32)
            for i, blocks in enumerate(BLOCKS):
                bt[i, : len(blocks)] = torch.tensor(blocks)
            be.set(slots, torch.tensor([0, 37, 82, 110]), torch.tensor([0, 0, 32]), bt)
        else:
            be = SegmentedPrefillBackend(cache, s.n_head, s.n_local_heads)
            off, segs = 0, []
            for i, a, b in step:
                segs.append((off, b - a, torch.tensor(BLOCKS[i][: -(-b // 16)]), a, b))
                off += b - a
            be.set(slots, segs)
        out = model.forward_slow(torch.as_tensor(cols)[None], pos[None], be, head="full")
        results.append((cache.data.clone(), out.logits, out.hidden))
    (kv_a, lg_a, h_a), (kv_b, lg_b, h_b) = results
    torch.testing.assert_close(kv_a, kv_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h_a, h_b, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lg_a, lg_b, atol=1e-4, rtol=1e-5)
    assert int(lg_a.argmax()) == int(lg_b.argmax())


def test_runner_prefill_matches_segmented_runner():
    torch.testing.assert_close(runner_kv("paged"), runner_kv("segmented"), atol=1e-5, rtol=1e-5)


def test_padded_prefill_body_matches_eager_on_cpu():
    """What a captured prefill graph replays, run eagerly on CPU: the step padded to its token
    bucket with the maximum number of segments gives the eager step's K/V at every written
    slot, the padding tokens write only the scratch block, and no other block changes."""
    model = tiny_model()
    grids = prompt_grids(model.config, LENGTHS)
    eager = make_runner(model)
    run_steps(eager, grids)
    padded = make_runner(model, buckets=[64, 128])
    for slot, blocks in enumerate(BLOCKS):
        padded.set_block_table(slot, blocks)
    with torch.inference_mode():
        for step in [[PREFIX]] + STEPS:
            chunks = [(grids[i], a, b, BLOCKS[i], i) for i, a, b in step]
            n = sum(b - a for _, a, b in step)
            bucket = 64 if n <= 64 else 128
            lay = padded._prefill_layouts[bucket]
            host = np.empty(lay.size, dtype=np.int64)
            padded._fill_prefill(lay, host, chunks)
            padded._prefill_static[bucket] = torch.from_numpy(host)
            padded._prefill_body(bucket)
    torch.testing.assert_close(written_kv(padded), written_kv(eager), atol=1e-5, rtol=1e-5)
    used = sorted({b for blocks in BLOCKS for b in blocks})
    other = [b for b in range(padded.kv.num_blocks) if b not in used and b != padded.scratch_block]
    assert (padded.kv.data[:, :, other] == 0).all()
    assert (padded.kv.data[:, :, padded.scratch_block] != 0).any()  # the padding tokens went here


def test_prefill_buckets_and_fallback_choice():
    from shoal.engine.runner import default_prefill_buckets

    assert default_prefill_buckets(1024) == [64, 128, 256, 512, 1024]
    assert default_prefill_buckets(300) == [64, 128, 256, 300]
    assert default_prefill_buckets(4096) == [64, 128, 256, 512, 1024, 2048]
    assert default_prefill_buckets(7) == [7]
    runner = make_runner(tiny_model(), buckets=[64, 128])
    assert runner.prefill_bucket_for(10, 2) is None  # nothing captured (CPU)
    runner.prefill_graphs = {64: object(), 128: object()}
    assert runner.prefill_bucket_for(10, 2) == 64
    assert runner.prefill_bucket_for(64, 4) == 64
    assert runner.prefill_bucket_for(65, 1) == 128
    assert runner.prefill_bucket_for(129, 1) is None  # above the largest bucket: eager
    assert runner.prefill_bucket_for(10, 5) is None  # more segments than captured


def test_engine_prefill_graph_switch(monkeypatch):
    """Prefill graphs need CUDA + cuda_graphs; EngineConfig.prefill_graphs / SHOAL_PREFILL_GRAPHS
    decide otherwise (CPU: always off, the same eager code runs)."""
    from shoal.bench.random_model import S2_IM_END
    from shoal.engine.engine import Engine, EngineConfig

    model = tiny_model()
    monkeypatch.setenv("SHOAL_PREFILL_GRAPHS", "1")
    eng = Engine(model, S2_IM_END, config=EngineConfig(max_running=2, num_blocks=16, prefill_graphs=True))
    assert not eng.prefill_graphs and not eng.runner.prefill_graphs_enabled
    assert eng.prefill_buckets == [64, 128, 256, 512, 1024]
    eng.warmup(show_progress=False)  # no-op on CPU
    assert not eng.runner.prefill_graphs


def test_benchmark_smoke_on_cpu(tmp_path):
    """shoal.bench.kernels_prefill runs end to end (tiny model, CPU: no graphs, timings
    meaningless) and its old / new paths write the same K/V."""
    import json

    from shoal.bench import kernels_prefill

    rc = kernels_prefill.main(["--device", "cpu", "--shape", "tiny", "--iters", "1", "--segments",
                               "0:40,0:24,48:40", "--methods", "eager_old,eager_new", "--out",
                               str(tmp_path / "p.json")])
    rep = json.loads((tmp_path / "p.json").read_text())
    assert rc == 0, rep["errors"]
    assert set(rep["timings"]) == {"eager_old", "eager_new"}
    assert rep["kv_check"]["eager_old"]["max_abs_diff_vs_eager_new"] < 1e-5


# --------------------------------------------------------------------------------------
# GPU tests (compiled kernel, CUDA graphs)
# --------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and pf.HAS_TRITON and not pf.triton_interpreting()),
    reason="needs CUDA and Triton in compiled mode",
)


def _gpu_case(segs, dtype, H=32, H_kv=8, D=128, bs=16, pad=0, seed=0, max_blocks=None):
    """Random paged caches on the GPU (every slot random: the kernel must not read past ends)."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    need = [-(-(s + n) // bs) for s, n in segs]
    max_blocks = max_blocks or max(need) + 2
    num_blocks = sum(need) + 7
    k = torch.randn(num_blocks, bs, H_kv, D, device=dev, generator=g).to(dtype)
    v = torch.randn(num_blocks, bs, H_kv, D, device=dev, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, device=dev, generator=g).to(torch.int32)
    bt = torch.full((len(segs), max_blocks), -1, dtype=torch.int32, device=dev)
    p = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[p: p + n]
        p += n
    N = sum(n for _, n in segs) + pad
    q = (2.0 * torch.randn(N, H, D, device=dev, generator=g)).to(dtype)
    cu = torch.tensor([0] + np.cumsum([n for _, n in segs]).tolist(), dtype=torch.int32, device=dev)
    st = torch.tensor([s for s, _ in segs], dtype=torch.int32, device=dev)
    return q, k, v, bt, cu, st


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("segs,pad", [
    ([(0, 256), (0, 256), (512, 256), (1024, 256)], 0),  # the benchmark's 1,024-token step
    ([(0, 1), (17, 1000), (0, 3), (2000, 20)], 0),
    ([(5, 100), (0, 0), (64, 64)], 90),
])
def test_gpu_kernel_matches_reference_s2pro(segs, pad, dtype):
    q, k, v, bt, cu, st = _gpu_case(segs, dtype, pad=pad, seed=len(segs) + pad)
    o = pf.paged_prefill_attention(q, k, v, bt, cu, st, 128 ** -0.5)
    r = pf.paged_prefill_attention_ref(q, k, v, bt, cu, st, 128 ** -0.5,
                                       max_context=max(s + n for s, n in segs), max_query=max(n for _, n in segs))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(o.float(), r.float(), atol=tol, rtol=tol)
    assert (o[int(cu[-1]):] == 0).all()


@gpu
@pytest.mark.parametrize("block_m,block_n,warps", [(16, 64, 4), (32, 64, 8), (8, 32, 4), (16, 128, 8)])
@pytest.mark.parametrize("H,H_kv,D", [(32, 8, 128), (4, 2, 32), (8, 8, 64)])
def test_gpu_kernel_tile_configs(block_m, block_n, warps, H, H_kv, D):
    segs = [(0, 77), (300, 150), (16, 16)]
    q, k, v, bt, cu, st = _gpu_case(segs, torch.bfloat16, H=H, H_kv=H_kv, D=D, pad=13, seed=block_m)
    o = pf.paged_prefill_attention_triton(q, k, v, bt, cu, st, D ** -0.5, block_m=block_m, block_n=block_n,
                                          num_warps=warps)
    r = pf.paged_prefill_attention_ref(q, k, v, bt, cu, st, D ** -0.5, max_context=450, max_query=150)
    torch.testing.assert_close(o.float(), r.float(), atol=2e-2, rtol=2e-2)


@gpu
def test_gpu_kernel_cuda_graph_replay_with_new_metadata():
    S = 8  # 512 query tokens
    q, k, v, bt, cu, st = _gpu_case([(0, 64)] * S, torch.bfloat16, seed=1, max_blocks=128)
    out = torch.empty_like(q)
    pf.paged_prefill_attention(q, k, v, bt, cu, st, 128 ** -0.5, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pf.paged_prefill_attention(q, k, v, bt, cu, st, 128 ** -0.5, out=out)
    for step, segs in enumerate(([(0, 500), (0, 12)] + [(0, 0)] * 6,
                                 [(1000, 100), (0, 1), (33, 64), (200, 200), (0, 0), (7, 9), (0, 0), (1, 1)],
                                 [(0, 30)] * 8)):
        used = sum(n for _, n in segs)
        cu.copy_(torch.tensor([0] + np.cumsum([n for _, n in segs]).tolist(), dtype=torch.int32))
        st.copy_(torch.tensor([s for s, _ in segs], dtype=torch.int32))
        bt.copy_(torch.randperm(k.shape[0], device="cuda")[: bt.numel()].reshape(bt.shape).to(torch.int32)
                 if k.shape[0] >= bt.numel() else torch.randint(0, k.shape[0], bt.shape, device="cuda",
                                                                dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        r = pf.paged_prefill_attention_ref(q, k, v, bt, cu, st, 128 ** -0.5, max_context=1100, max_query=500)
        torch.testing.assert_close(out.float(), r.float(), atol=2e-2, rtol=2e-2, msg=f"replay {step}")
        assert (out[used:] == 0).all()


def _gpu_runner_kv(model, graphs, steps, buckets=(64, 128)):
    runner = make_runner(model, prefill_graphs=graphs, buckets=list(buckets))
    if graphs:
        runner.capture_graphs(show_progress=False)
        assert set(runner.prefill_graphs) == set(buckets)
    grids = prompt_grids(model.config, LENGTHS)
    run_steps(runner, grids, steps)
    torch.cuda.synchronize()
    return written_kv(runner), runner


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_prefill_graphs_equal_eager_prefill(dtype):
    """Captured prefill (padded to the bucket) vs eager prefill: bit-identical when a step fills
    its bucket exactly (same GEMM shapes), within bf16 / fp32 tolerance otherwise; a step above
    the largest bucket falls back to eager."""
    model = tiny_model("cuda", dtype)
    exact = [[(0, 0, 64)], [(1, 0, 45), (2, 0, 19)], [(0, 64, 70), (2, 19, 90)]]  # 64, 64, 77 tokens
    a, ra = _gpu_runner_kv(model, True, exact, buckets=(64, 128))
    b, _ = _gpu_runner_kv(model, False, exact, buckets=(64, 128))
    n_first = 64 + 45 + 19  # slots written by the two 64-token steps: [seq0 0:64, seq1 0:45, seq2 0:19]
    idx = np.r_[0:64, 70:115, 115:134]
    assert torch.equal(a[:, :, idx], b[:, :, idx]), "exact-bucket steps must be bit-identical"
    assert len(idx) == n_first
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    big = [[(0, 0, 70), (1, 0, 45), (2, 0, 90)]]  # 205 tokens > 128: eager
    assert ra.prefill_bucket_for(205, 3) is None
    c, _ = _gpu_runner_kv(model, True, big, buckets=(64, 128))
    d, _ = _gpu_runner_kv(model, False, big, buckets=(64, 128))
    assert torch.equal(c, d)


@gpu
def test_gpu_engine_codes_same_with_prefill_graphs_on_and_off(tiny_s2_checkpoint):
    """Greedy and sampled codes through the engine (chunked prefill, a shared voice hitting the
    prefix cache) are the same with prefill graphs on and off, and equal the reference loop."""
    from shoal.checkpoint import load_dualar
    from shoal.engine.engine import Engine, EngineConfig
    from shoal.engine.generate import generate
    from shoal.engine.request import EngineRequest, FinishEvent
    from shoal.engine.sampling import SamplingParams
    from shoal.text import Reference, build_session

    model, tok = load_dualar(tiny_s2_checkpoint, dtype=torch.float32, device="cuda")
    voice = np.random.default_rng(3).integers(0, 1024, size=(10, 40))
    texts = ["Hello world, this is a test.", "How are you doing today my friend?",
             "Speech synthesis is fun.", "The quick brown fox jumps over the lazy dog."]

    def sess(i):
        return build_session("s2", tok, texts[i % 4], [Reference("A voice reference transcript.", voice)]
                             if i % 2 else [], None)

    params = [SamplingParams(greedy=True) if i % 3 else SamplingParams(temperature=0.8, top_p=0.8, top_k=30)
              for i in range(6)]
    got = {}
    for graphs in (True, False):
        eng = Engine(model, tok.im_end_id, config=EngineConfig(max_running=4, num_blocks=128, prefill_chunk=64,
                                                               prefill_graphs=graphs))
        eng.warmup(show_progress=False)
        assert bool(eng.runner.prefill_graphs) == graphs
        got[graphs] = {}
        for wave in (range(4), range(4, 6)):  # the second wave's voice prompt hits the prefix cache
            for i in wave:
                eng.add_request(EngineRequest(session=sess(i), params=params[i], seed=100 + i, max_new_tokens=8,
                                              request_id=f"r{i}"))
            got[graphs].update({e.request_id: e.codes for e in eng.run_until_done() if isinstance(e, FinishEvent)})
        assert eng.pool.hit_tokens > 0
    for i in range(6):
        want = generate(model, sess(i).grid(), params[i], tok.im_end_id, 8, seed=100 + i).codes
        assert np.array_equal(got[True][f"r{i}"], got[False][f"r{i}"]), i
        assert np.array_equal(got[True][f"r{i}"], want), i


@gpu
def test_gpu_fp8_prefill_graphs_equal_eager_prefill():
    """FP8 weights (fused FP8 layer): the captured prefill equals eager prefill bit for bit
    when a step fills its bucket."""
    from shoal.bench.random_model import random_dualar
    from shoal.model.config import ModelConfig, TransformerShape

    slow = TransformerShape(dim=256, n_layer=2, n_head=4, n_local_heads=2, head_dim=64,
                            intermediate_size=640, qk_norm=True)
    fast = TransformerShape(dim=256, n_layer=2, n_head=4, n_local_heads=2, head_dim=64, intermediate_size=640)
    cfg = ModelConfig(family="s2", vocab_size=155776, slow=slow, fast=fast, max_seq_len=512,
                      semantic_begin_id=151678, semantic_end_id=151678 + 4095, eos_token_id=151645)
    model = random_dualar(cfg, "cuda", torch.bfloat16, seed=2, quantization="fp8")
    model.enable_fused_kernels()
    exact = [[(0, 0, 64)], [(1, 0, 45), (2, 0, 19)]]
    a, _ = _gpu_runner_kv(model, True, exact, buckets=(64,))
    b, _ = _gpu_runner_kv(model, False, exact, buckets=(64,))
    idx = np.r_[0:64, 70:115, 115:134]
    assert torch.isfinite(a[:, :, idx]).all()
    assert torch.equal(a[:, :, idx], b[:, :, idx])


if __name__ == "__main__":
    assert pf.triton_interpreting(), "worker must import triton with TRITON_INTERPRET=1"
    report_cases(list(INTERP_CASES) + EXTRA_CASES, _run_interp_case)
