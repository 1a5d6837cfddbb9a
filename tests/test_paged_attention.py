"""Paged decode attention: Triton kernel vs PyTorch reference vs dense attention.

Triton decides whether its kernels run in the interpreter when ``triton`` is first
imported, so the interpreter cases do not run in the pytest process (another test
module may already have imported triton in compiled mode, and the GPU tests below need
compiled mode). They run together in one subprocess -- this file executed as a script,
which sets ``TRITON_INTERPRET=1`` before anything imports triton -- and each case's
error is then checked by its own parametrized test here.
"""

import os

if __name__ == "__main__":  # interpreter worker: must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import json
import math
import zlib

import pytest
import torch
from interpreter_worker import run_worker

from shoal.kernels import paged_attention as pa

# --------------------------------------------------------------------------------------
# Case construction (shared by the worker, the CPU tests and the GPU tests)
# --------------------------------------------------------------------------------------

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TOL = {"fp32": 1e-4, "bf16": 2e-2}


def make_case(
    B,
    H,
    H_kv,
    D,
    block_size,
    lens,
    dtype=torch.float32,
    *,
    fill="neg1",
    seed=0,
    device="cpu",
    poison=True,
    spare_blocks=3,
    max_blocks=None,
):
    """Random q, paged K/V and a random (non-contiguous) block table.

    Returns ``(q, k_cache, v_cache, block_tables, context_lens, dense_k, dense_v)``
    where ``dense_k[b]`` is the ``[len_b, H_kv, D]`` contiguous K of sequence ``b``.
    With ``poison`` every cache slot not holding a valid token (unused pages and the
    tail of each last page) is NaN, so reading one would show up in the output.
    ``fill``: what block-table entries past a sequence's last page hold.
    """
    g = torch.Generator().manual_seed(seed)
    need = [max(1, -(-n // block_size)) for n in lens]
    if max_blocks is None:
        max_blocks = max(need) + 1
    total = sum(need)
    num_blocks = total + spare_blocks
    k_cache = torch.full((num_blocks, block_size, H_kv, D), float("nan") if poison else 0.0)
    v_cache = torch.full((num_blocks, block_size, H_kv, D), float("nan") if poison else 0.0)
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.empty((B, max_blocks), dtype=torch.int32)
    dense_k, dense_v = [], []
    pos = 0
    for b, n in enumerate(lens):
        pages = perm[pos : pos + need[b]]
        pos += need[b]
        kd = torch.randn(n, H_kv, D, generator=g)
        vd = torch.randn(n, H_kv, D, generator=g)
        dense_k.append(kd)
        dense_v.append(vd)
        for t in range(n):
            k_cache[pages[t // block_size], t % block_size] = kd[t]
            v_cache[pages[t // block_size], t % block_size] = vd[t]
        if fill == "neg1":
            bt[b].fill_(-1)
        elif fill == "zero":
            bt[b].zero_()
        elif fill == "garbage":
            bt[b] = torch.randint(10**6, 2**30, (max_blocks,), generator=g, dtype=torch.int32)
        else:
            raise ValueError(fill)
        bt[b, : need[b]] = pages.to(torch.int32)
    q = torch.randn(B, H, D, generator=g) * 2.0  # peakier softmax than unit scale
    cl = torch.tensor(lens, dtype=torch.int32)
    out = [q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), bt, cl]
    out = [t.to(device) for t in out]
    dense_k = [t.to(dtype).to(device) for t in dense_k]
    dense_v = [t.to(dtype).to(device) for t in dense_v]
    return (*out, dense_k, dense_v)


def dense_attention(q, dense_k, dense_v):
    """Naive per-sequence attention on contiguous K/V, fp32, explicit GQA expansion."""
    B, H, D = q.shape
    outs = []
    for b in range(B):
        k = dense_k[b].float()  # [L, H_kv, D]
        v = dense_v[b].float()
        rep = H // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)  # [L, H, D]
        v = v.repeat_interleave(rep, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].float(), k) / math.sqrt(D)
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(outs)


# --------------------------------------------------------------------------------------
# Interpreter cases (run in the worker subprocess)
# --------------------------------------------------------------------------------------

# name -> (B, H, H_kv, D, block_size, lens, dtype, num_splits, block_n, fill)
INTERP_CASES = {
    "g4_d128_bs16_bf16_auto": (4, 8, 2, 128, 16, [1, 15, 16, 77], "bf16", None, None, "neg1"),
    "g1_d32_bs8_fp32_s3_bn16": (5, 2, 2, 32, 8, [1, 7, 8, 29, 50], "fp32", 3, 16, "neg1"),
    "g1_d32_bs8_bf16_s3_bn16": (5, 2, 2, 32, 8, [1, 7, 8, 29, 50], "bf16", 3, 16, "garbage"),
    "g2_d64_bs32_fp32_s2_bn32": (3, 4, 2, 64, 32, [31, 32, 100], "fp32", 2, 32, "zero"),
    "g2_d64_bs16_bf16_s5_bn16": (3, 4, 2, 64, 16, [16, 33, 64], "bf16", 5, 16, "neg1"),
    "g4_d32_bs8_bf16_s4_bn16_empty_splits": (2, 8, 2, 32, 8, [57, 3], "bf16", 4, 16, "neg1"),
    "g4_d128_bs32_fp32_s1_bn16": (2, 4, 1, 128, 32, [1, 70], "fp32", 1, 16, "garbage"),
    "g4_d64_bs8_fp32_s1_bn64": (3, 8, 2, 64, 8, [5, 64, 65], "fp32", 1, 64, "neg1"),
    "g8_d32_bs16_fp32_s2": (2, 8, 1, 32, 16, [20, 9], "fp32", 2, 16, "neg1"),
    "g16_d32_bs8_bf16_s2": (2, 16, 1, 32, 8, [12, 40], "bf16", 2, 16, "zero"),
    "s2pro_heads_bf16_auto": (2, 32, 8, 128, 16, [40, 100], "bf16", None, None, "neg1"),
    "s2pro_heads_fp32_s3_bn16": (1, 32, 8, 128, 32, [90], "fp32", 3, 16, "neg1"),
}
# Extra worker checks: public entry point dispatch, out=, strided q / caches.
EXTRA_CASES = ["public_dispatch_bf16", "out_and_strided_fp32", "fused_reduce_bitwise", "tma_bitwise"]

# name -> (B, H, H_kv, D, block_size, lens, dtype, num_splits): page-per-tile descriptor reads
TMA_CASES = {
    "bs64_bf16_auto": (5, 32, 8, 128, 64, [1, 63, 64, 65, 200], "bf16", None),
    "bs32_bf16_s3": (2, 32, 8, 128, 32, [5, 100], "bf16", 3),
    "bs32_fp32_s1": (3, 8, 2, 64, 32, [31, 32, 33], "fp32", 1),
    "bs128_bf16_s2_g8": (2, 8, 1, 32, 128, [129, 7], "bf16", 2),
}


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


def _run_interp_case(name):
    if name in INTERP_CASES:
        B, H, H_kv, D, bs, lens, dt, splits, block_n, fill = INTERP_CASES[name]
        q, k, v, bt, cl, _, _ = make_case(B, H, H_kv, D, bs, lens, _DTYPES[dt], fill=fill, seed=zlib.crc32(name.encode()) % 1000)
        scale = 1.0 / math.sqrt(D)
        o = pa.paged_decode_attention_triton(q, k, v, bt, cl, scale, num_splits=splits, block_n=block_n)
        r = pa.paged_decode_attention_ref(q, k, v, bt, cl, scale)
        return {"err": _err(o, r), "finite": bool(torch.isfinite(o).all()), "dtype_ok": o.dtype == q.dtype, "tol": _TOL[dt]}
    if name == "public_dispatch_bf16":
        q, k, v, bt, cl, _, _ = make_case(3, 8, 2, 64, 16, [3, 16, 45], torch.bfloat16, seed=11)
        o = pa.paged_decode_attention(q, k, v, bt, cl, 0.125)
        r = pa.paged_decode_attention_ref(q, k, v, bt, cl, 0.125)
        ok = pa.triton_interpreting()
        return {"err": _err(o, r), "finite": bool(torch.isfinite(o).all()), "dtype_ok": ok and o.dtype == q.dtype, "tol": 2e-2}
    if name == "out_and_strided_fp32":
        B, H, H_kv, D, bs = 3, 4, 2, 32, 8
        q, k, v, bt, cl, _, _ = make_case(B, H, H_kv, D, bs, [9, 24, 2], torch.float32, seed=5)
        # q with padded row strides, K/V as views into one interleaved KV tensor.
        q_big = torch.zeros(B, H + 1, D + 16)
        q_big[:, :H, :D] = q
        qs = q_big[:, :H, :D]
        kv = torch.stack([k, v], dim=2).contiguous()  # [NB, bs, 2, H_kv, D]
        ks, vs = kv[:, :, 0], kv[:, :, 1]
        out_big = torch.full((B, H, D + 8), 7.0)
        out = out_big[:, :, :D]
        res = pa.paged_decode_attention_triton(qs, ks, vs, bt, cl, 0.2, out=out, num_splits=2, block_n=16)
        r = pa.paged_decode_attention_ref(q, k, v, bt, cl, 0.2)
        untouched = bool((out_big[:, :, D:] == 7.0).all())
        return {"err": _err(out, r), "finite": bool(torch.isfinite(out).all()),
                "dtype_ok": res.data_ptr() == out.data_ptr() and untouched, "tol": 1e-4}
    if name == "fused_reduce_bitwise":
        # the splits merged by their last program equal the reduce kernel's output bit for bit
        # (split cases above incl. empty splits and S2-Pro heads), and every counter is reset
        from shoal.kernels import fp8

        same = True
        for case in ("g1_d32_bs8_fp32_s3_bn16", "g2_d64_bs16_bf16_s5_bn16", "g4_d32_bs8_bf16_s4_bn16_empty_splits",
                     "s2pro_heads_fp32_s3_bn16"):
            B, H, H_kv, D, bs, lens, dt, splits, block_n, fill = INTERP_CASES[case]
            q, k, v, bt, cl, _, _ = make_case(B, H, H_kv, D, bs, lens, _DTYPES[dt], fill=fill, seed=3)
            a = pa.paged_decode_attention_triton(q, k, v, bt, cl, 0.1, num_splits=splits, block_n=block_n,
                                                 fused_reduce=False)
            b = pa.paged_decode_attention_triton(q, k, v, bt, cl, 0.1, num_splits=splits, block_n=block_n,
                                                 fused_reduce=True)
            same = same and torch.equal(a, b)
        counters = fp8._counters.get(("cpu", None))
        reset = counters is not None and not bool(counters.any())
        return {"err": 0.0 if same else 1.0, "finite": True, "dtype_ok": reset, "tol": 0.0}
    if name == "tma_bitwise":
        # a page per tile through tensor descriptors equals the pointer gather with block_n = the
        # page size bit for bit (NaN in every slot past a context: the value rows there are
        # zeroed), with both reduce forms; and the public entry point takes the descriptor path
        errs, applied = [], True
        for case, (B, H, H_kv, D, bs, lens, dt, splits) in TMA_CASES.items():
            q, k, v, bt, cl, _, _ = make_case(B, H, H_kv, D, bs, lens, _DTYPES[dt], seed=zlib.crc32(case.encode()) % 1000)
            applied = applied and pa.kv_tma_descriptors(k, v) is not None
            g = pa.paged_decode_attention_triton(q, k, v, bt, cl, 0.09, num_splits=splits, block_n=bs, tma=False)
            for fused in (False, True):
                t = pa.paged_decode_attention_triton(q, k, v, bt, cl, 0.09, num_splits=splits, tma=True,
                                                     fused_reduce=fused)
                errs.append(0.0 if torch.equal(t, g) else max(_err(t, g), 1.0))
            r = pa.paged_decode_attention_ref(q, k, v, bt, cl, 0.09)
            errs.append(_err(t, r) / (50 if dt == "bf16" else 1))  # within the dtype's tolerance
        q, k, v, bt, cl, _, _ = make_case(2, 8, 2, 64, 16, [5, 40], torch.bfloat16, seed=2)
        applied = applied and pa.kv_tma_descriptors(k, v) is None  # 16-token pages: gather
        return {"err": max(errs), "finite": True, "dtype_ok": applied, "tol": 1e-3}
    raise KeyError(name)


def _interpreter_probe():
    """None if this Triton interpreter runs the constructs the kernel relies on (scalar
    loads feeding dynamic ``range`` bounds), else the error. Seen failing with triton
    3.6 + numpy 2.5 (the interpreter converts a shape-(1,) array to int), unrelated to
    the kernel; triton 3.9's interpreter is fine."""
    import triton
    import triton.language as tl

    def probe(n_ptr, o_ptr):
        n = tl.load(n_ptr + tl.program_id(0))
        lo = tl.program_id(0) * n
        acc = tl.zeros([16], dtype=tl.float32)
        for i in range(lo, tl.minimum(lo + n, 100)):
            acc += 1.0
        tl.store(o_ptr + tl.program_id(0) * 16 + tl.arange(0, 16), acc)

    try:
        n = torch.tensor([2, 3], dtype=torch.int32)
        o = torch.zeros(2, 16)
        triton.jit(probe)[(2,)](n, o)
        assert o[:, 0].tolist() == [2.0, 3.0], o
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:300]}"


def _worker_main():
    assert pa.triton_interpreting(), "worker must import triton with TRITON_INTERPRET=1"
    probe_error = _interpreter_probe()
    if probe_error is not None:
        print("@@RESULTS@@" + json.dumps({"__unusable__": probe_error}))
        return
    torch.manual_seed(0)
    results = {}
    for name in list(INTERP_CASES) + EXTRA_CASES:
        try:
            results[name] = _run_interp_case(name)
        except Exception as e:  # reported per case by the parent
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    print("@@RESULTS@@" + json.dumps(results))


@pytest.fixture(scope="module")
def interp_results():
    if not pa.HAS_TRITON:
        pytest.skip("triton not installed")
    results = run_worker(__file__)
    if "__unusable__" in results:
        import triton

        pytest.skip(f"Triton {triton.__version__} interpreter unusable here: {results['__unusable__']}")
    return results


@pytest.mark.parametrize("name", list(INTERP_CASES) + EXTRA_CASES)
def test_kernel_matches_reference_interpreter(interp_results, name):
    res = interp_results[name]
    assert "error" not in res, res.get("error")
    assert res["finite"], res
    assert res["dtype_ok"], res
    assert res["err"] <= res["tol"], res


# --------------------------------------------------------------------------------------
# In-process CPU tests (no triton needed)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "B,H,H_kv,D,bs,lens,fill",
    [
        (1, 2, 2, 32, 8, [1], "neg1"),
        (4, 8, 2, 64, 16, [1, 15, 16, 100], "zero"),
        (3, 32, 8, 128, 32, [31, 33, 200], "garbage"),
        (2, 4, 1, 32, 8, [64, 7], "neg1"),
    ],
)
def test_reference_matches_dense(B, H, H_kv, D, bs, lens, fill):
    q, k, v, bt, cl, dk, dv = make_case(B, H, H_kv, D, bs, lens, fill=fill, seed=B * 7 + D)
    r = pa.paged_decode_attention_ref(q, k, v, bt, cl, 1.0 / math.sqrt(D))
    d = dense_attention(q, dk, dv)
    assert torch.isfinite(r).all()
    torch.testing.assert_close(r, d, atol=1e-5, rtol=1e-5)


def test_reference_bf16_output_dtype_and_close():
    q, k, v, bt, cl, dk, dv = make_case(2, 8, 2, 64, 16, [5, 40], torch.bfloat16, seed=3)
    r = pa.paged_decode_attention_ref(q, k, v, bt, cl, 0.125)
    assert r.dtype == torch.bfloat16
    torch.testing.assert_close(r.float(), dense_attention(q, dk, dv), atol=2e-2, rtol=2e-2)


def test_cpu_fallback_is_reference():
    if pa.triton_interpreting():
        pytest.skip("triton imported in interpreter mode in this process: CPU calls use the kernel")
    q, k, v, bt, cl, _, _ = make_case(3, 4, 2, 32, 8, [1, 8, 21], seed=9)
    r = pa.paged_decode_attention_ref(q, k, v, bt, cl, 0.3)
    o = pa.paged_decode_attention(q, k, v, bt, cl, 0.3)
    assert torch.equal(o, r)
    out = torch.empty_like(q)
    o2 = pa.paged_decode_attention(q, k, v, bt, cl, 0.3, out=out)
    assert o2 is out and torch.equal(out, r)


def test_max_splits_override(monkeypatch):
    """SHOAL_ATTN_MAX_SPLITS caps the heuristic's split count; 0 or unset leaves it; garbage is an error."""
    base = pa.choose_num_splits(1, 8, 32768, 64)
    assert base > 8
    monkeypatch.setenv("SHOAL_ATTN_MAX_SPLITS", "8")
    assert pa.choose_num_splits(1, 8, 32768, 64) == 8
    assert pa.choose_num_splits(128, 8, 32768, 64) == 1
    monkeypatch.setenv("SHOAL_ATTN_MAX_SPLITS", "0")
    assert pa.choose_num_splits(1, 8, 32768, 64) == base
    monkeypatch.setenv("SHOAL_ATTN_MAX_SPLITS", "many")
    with pytest.raises(ValueError, match="SHOAL_ATTN_MAX_SPLITS"):
        pa.choose_num_splits(1, 8, 32768, 64)


def test_input_validation():
    q, k, v, bt, cl, _, _ = make_case(2, 6, 4, 32, 8, [3, 4], seed=1)  # 6 % 4 != 0
    with pytest.raises(ValueError):
        pa.paged_decode_attention_ref(q, k, v, bt, cl, 0.1)
    q, k, v, bt, cl, _, _ = make_case(2, 4, 2, 32, 8, [3, 4], seed=1)
    with pytest.raises(ValueError):
        pa.paged_decode_attention_ref(q, k, v, bt[:1], cl, 0.1)
    with pytest.raises(ValueError):
        pa.paged_decode_attention_ref(q, k.to(torch.bfloat16), v, bt, cl, 0.1)


def test_choose_num_splits():
    sms = 132
    # Enough (sequence, KV head) programs already (>= 3 per SM): no split.
    assert pa.choose_num_splits(128, 8, 4096, 64, sms) == 1
    assert pa.choose_num_splits(64, 8, 4096, 64, sms) == 1
    # Fewer: split so that programs cover the SMs about three times.
    assert pa.choose_num_splits(32, 8, 4096, 64, sms) == 2
    assert pa.choose_num_splits(16, 8, 4096, 64, sms) == 4
    s = pa.choose_num_splits(1, 8, 4096, 64, sms)
    assert 8 * s >= sms and s <= 64
    # Never more splits than half the tiles of the maximum context.
    assert pa.choose_num_splits(1, 8, 128, 64, sms) == 1
    assert pa.choose_num_splits(1, 8, 512, 64, sms) == 4
    for B in (1, 2, 3, 5, 16, 64):
        for ctx in (1, 16, 100, 1000, 8192):
            s = pa.choose_num_splits(B, 8, ctx, 64, sms)
            assert 1 <= s <= 64


# --------------------------------------------------------------------------------------
# GPU tests (compiled kernels)
# --------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and pa.HAS_TRITON and not pa.triton_interpreting()),
    reason="needs CUDA and Triton in compiled mode",
)


def _gpu_case(B, H, H_kv, D, bs, lens, dtype, seed=0, fill="neg1"):
    # Built on the GPU directly (the python-loop writer in make_case is slow for big shapes).
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    max_blocks = max(need) + 2
    num_blocks = sum(need) + 5
    k = torch.randn(num_blocks, bs, H_kv, D, device=dev, generator=g, dtype=torch.float32).to(dtype)
    v = torch.randn(num_blocks, bs, H_kv, D, device=dev, generator=g, dtype=torch.float32).to(dtype)
    perm = torch.randperm(num_blocks, device=dev, generator=g).to(torch.int32)
    bt = torch.full((B, max_blocks), -1 if fill == "neg1" else 0, dtype=torch.int32, device=dev)
    pos = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[pos : pos + n]
        pos += n
    q = (2.0 * torch.randn(B, H, D, device=dev, generator=g)).to(dtype)
    cl = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q, k, v, bt, cl


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("B", [1, 7, 64, 130])
def test_gpu_s2pro_shapes(B, bs, dtype):
    g = torch.Generator().manual_seed(B * 100 + bs)
    lens = torch.randint(1, 3000, (B,), generator=g).tolist()
    lens[0] = 1
    if B > 1:
        lens[1] = 2047
    q, k, v, bt, cl = _gpu_case(B, 32, 8, 128, bs, lens, dtype, seed=B)
    o = pa.paged_decode_attention(q, k, v, bt, cl, 128**-0.5)
    r = pa.paged_decode_attention_ref(q, k, v, bt, cl, 128**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(o.float(), r.float(), atol=tol, rtol=tol)


@gpu
@pytest.mark.parametrize("splits", [1, 2, 7, 64])
@pytest.mark.parametrize("block_n", [16, 64, 128])
@pytest.mark.parametrize("D,H,H_kv,bs", [(128, 32, 8, 16), (64, 8, 4, 8), (32, 4, 4, 32)])
def test_gpu_splits_and_tiles(splits, block_n, D, H, H_kv, bs):
    lens = [1, bs - 1, bs, 3 * bs + 5, 1000, 777]
    q, k, v, bt, cl = _gpu_case(len(lens), H, H_kv, D, bs, lens, torch.bfloat16, seed=splits + block_n)
    o = pa.paged_decode_attention_triton(q, k, v, bt, cl, D**-0.5, num_splits=splits, block_n=block_n)
    r = pa.paged_decode_attention_ref(q, k, v, bt, cl, D**-0.5)
    torch.testing.assert_close(o.float(), r.float(), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("splits", [2, 7, 64])
@pytest.mark.parametrize("B", [1, 5])
def test_gpu_fused_reduce_is_bit_identical(splits, B):
    """The splits merged by their last program (SHOAL_ATTN_FUSED_REDUCE) equal the reduce kernel
    bit for bit at S2-Pro heads, also inside a CUDA graph, and leave every counter at 0."""
    from shoal.kernels import fp8

    lens = [1, 2047, 700, 33, 4000][:B]
    q, k, v, bt, cl = _gpu_case(B, 32, 8, 128, 16, lens, torch.bfloat16, seed=splits)
    a = pa.paged_decode_attention_triton(q, k, v, bt, cl, 128**-0.5, num_splits=splits, fused_reduce=False)
    b = pa.paged_decode_attention_triton(q, k, v, bt, cl, 128**-0.5, num_splits=splits, fused_reduce=True)
    assert torch.equal(a, b)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa.paged_decode_attention_triton(q, k, v, bt, cl, 128**-0.5, num_splits=splits, fused_reduce=True, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, a)
    counters = fp8._counters.get(("cuda", q.device.index))
    assert counters is not None and not bool(counters.any())


@gpu
@pytest.mark.parametrize("splits", [None, 1, 5])
@pytest.mark.parametrize("bs", [32, 64, 128])
def test_gpu_tma_tiles_equal_the_gather(bs, splits):
    """A page per tile through tensor descriptors (SHOAL_ATTN_TMA) equals the pointer gather with
    ``block_n`` = the page size bit for bit at S2-Pro heads, with NaN in every slot past the
    contexts, also when replayed in a CUDA graph on new lengths and tables."""
    lens = [1, bs - 1, bs, bs + 1, 700, 2047, 33]
    q, k, v, bt, cl = _gpu_case(len(lens), 32, 8, 128, bs, lens, torch.bfloat16, seed=bs + (splits or 0))
    pos = torch.arange(bt.shape[1] * bs, device="cuda")
    past = (pos[None, :] >= cl[:, None]) & (bt.long()[:, pos // bs] >= 0)
    pages, slots = bt.long()[:, pos // bs][past], (pos % bs).expand(len(lens), -1)[past]
    k[pages, slots] = float("nan")
    v[pages, slots] = float("nan")
    assert pa.kv_tma_descriptors(k, v) is not None
    g = pa.paged_decode_attention_triton(q, k, v, bt, cl, 128**-0.5, num_splits=splits, block_n=bs, tma=False)
    t = pa.paged_decode_attention_triton(q, k, v, bt, cl, 128**-0.5, num_splits=splits, tma=True)
    assert torch.isfinite(t).all()
    assert torch.equal(t, g)
    r = pa.paged_decode_attention_ref(q, k, v, bt, cl, 128**-0.5)
    torch.testing.assert_close(t.float(), r.float(), atol=2e-2, rtol=2e-2)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa.paged_decode_attention_triton(q, k, v, bt, cl, 128**-0.5, num_splits=splits, tma=True, out=out)
    bt.copy_(bt.flip(0))  # each row's new length within its new pages
    cl.copy_(torch.tensor([20, 1500, 2 * bs - 3, bs + 1, 2, bs - 1, 1], dtype=torch.int32))
    graph.replay()
    g = pa.paged_decode_attention_triton(q, k, v, bt, cl, 128**-0.5, num_splits=splits, block_n=bs, tma=False)
    # slots past the new contexts may now be NaN or old values: the gather masks them, so must TMA
    assert torch.equal(out, g)


@gpu
def test_gpu_cuda_graph_capture_and_replay():
    B, H, H_kv, D, bs = 8, 32, 8, 128, 16
    max_blocks = 64
    num_blocks = B * max_blocks + 4
    dev = "cuda"
    k = torch.randn(num_blocks, bs, H_kv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(num_blocks, bs, H_kv, D, device=dev, dtype=torch.bfloat16)
    q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
    bt = torch.randperm(num_blocks, device=dev)[: B * max_blocks].reshape(B, max_blocks).to(torch.int32)
    cl = torch.full((B,), 10, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)

    pa.paged_decode_attention(q, k, v, bt, cl, D**-0.5, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa.paged_decode_attention(q, k, v, bt, cl, D**-0.5, out=out)

    for step, lens in enumerate(([1, 2, 3, 4, 5, 6, 7, 8], [1024, 17, 999, 16, 33, 64, 500, 1], [5] * 8)):
        q.copy_(torch.randn_like(q))
        cl.copy_(torch.tensor(lens, dtype=torch.int32))
        bt.copy_(torch.randperm(num_blocks, device=dev)[: B * max_blocks].reshape(B, max_blocks).to(torch.int32))
        graph.replay()
        r = pa.paged_decode_attention_ref(q, k, v, bt, cl, D**-0.5)
        torch.testing.assert_close(out.float(), r.float(), atol=2e-2, rtol=2e-2, msg=f"replay {step}")


if __name__ == "__main__":
    _worker_main()
