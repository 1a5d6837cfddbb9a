"""The codec transformer's ring window (shoal.kernels.window_attention): the kernel against the
PyTorch form (Triton interpreter; GPU at the real codec's sizes) and the ring's slot arithmetic
against an ordered window. The ``ring`` window state through whole decoders is checked in
test_codec_streaming.py (streams against one-shot decodes) and test_codec_serving.py (a serving
decoder over its slot pool, with row groups)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

if __name__ != "__main__":
    from interpreter_worker import assert_case, run_worker

from shoal.kernels import window_attention as wa


def _ordered_attention(q, keys, values, pos, window):
    """Queries at pos..pos+t-1 over an ordered history of keys at positions 0..pos+t-1."""
    B, H, t, D = q.shape
    out = torch.empty_like(q)
    for b in range(B):
        p = int(pos[b])
        qp = p + torch.arange(t)
        kp = torch.arange(p + t)
        mask = (kp[None] <= qp[:, None]) & (kp[None] > qp[:, None] - window)
        out[b] = F.scaled_dot_product_attention(q[b:b + 1].float(), keys[b:b + 1, :, :p + t].float(),
                                                values[b:b + 1, :, :p + t].float(), attn_mask=mask)[0].to(q.dtype)
    return out


def _history(B, H, L, D, dt, g):
    return (torch.randn(B, H, L, D, generator=g) * 1.5).to(dt), torch.randn(B, H, L, D, generator=g).to(dt)


def _stream_case(dt: torch.dtype, D: int, window: int, schedule: list[int], pooled: bool) -> dict:
    """Streams fed by ``schedule`` (new positions per call) through the ring (kernel + ring_write)
    equal attention over the whole ordered history, call by call; with ``pooled`` the rings sit
    in a larger pool at scattered rows."""
    g = torch.Generator().manual_seed(D + window + len(schedule))
    B, H, P = 3, 2, window - 1
    total = sum(schedule)
    keys, values = _history(B, H, total, D, dt, g)
    queries = torch.randn(B, H, total, D, generator=g).to(dt)
    R = 7 if pooled else B
    rows = torch.tensor([5, 0, 3]) if pooled else None
    kring = torch.full((R, H, P, D), float("nan")).to(dt)  # never-written slots must stay masked
    vring = torch.full((R, H, P, D), float("nan")).to(dt)
    kring[rows if pooled else slice(None)] = 0  # a fresh state is zeros (NaNs only in other rows)
    vring[rows if pooled else slice(None)] = 0
    pos = torch.zeros(B, dtype=torch.long)
    worst, worst_ref = 0.0, 0.0
    for t in schedule:
        sl = slice(int(pos[0]), int(pos[0]) + t)
        q, k, v = queries[:, :, sl], keys[:, :, sl], values[:, :, sl]
        got = wa.window_attention(q, kring, vring, k, v, pos, window, rows)
        want = _ordered_attention(q, keys, values, pos, window)
        kr = kring if rows is None else kring.index_select(0, rows)
        vr = vring if rows is None else vring.index_select(0, rows)
        ref = wa.window_attention_ref(q, kr, vr, k, v, pos, window)
        worst = max(worst, (got.float() - want.float()).abs().max().item())
        worst_ref = max(worst_ref, (ref.float() - want.float()).abs().max().item())
        slots = wa.ring_slots(pos, t, P)
        wa.ring_write(kring, k, slots, rows)
        wa.ring_write(vring, v, slots, rows)
        pos = pos + t
    tol = 2e-5 if dt == torch.float32 else 2e-2
    untouched = True
    if pooled:
        others = [r for r in range(R) if r not in rows.tolist()]
        untouched = bool(torch.isnan(kring[others].float()).all() and torch.isnan(vring[others].float()).all())
    return {"checks": {"kernel_vs_history": (worst, tol), "ref_vs_history": (worst_ref, tol)},
            "flags": {"other_pool_rows_untouched": untouched}}


CASES = {
    # young streams (pos < P), a chunk past the 16-query block, a wrap of the ring, t > P
    "fp32_d32": lambda: _stream_case(torch.float32, 32, 24, [1, 5, 20, 3, 40], False),
    "bf16_d64": lambda: _stream_case(torch.bfloat16, 64, 24, [4, 17, 9, 33], False),
    "fp32_d64_pooled": lambda: _stream_case(torch.float32, 64, 20, [2, 30, 7], True),
    "bf16_d32_pooled": lambda: _stream_case(torch.bfloat16, 32, 20, [19, 1, 25], True),
}

if __name__ == "__main__":  # child process: TRITON_INTERPRET=1
    from interpreter_worker import report_cases

    report_cases(CASES, lambda name: CASES[name]())
    sys.exit(0)


@pytest.fixture(scope="module")
def interpreted():
    if not wa.HAS_TRITON:
        pytest.skip("triton not installed")
    return run_worker(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_under_the_interpreter(interpreted, name):
    assert_case(interpreted[name], need_any=True)


@pytest.mark.parametrize("pooled", [False, True])
def test_ring_reference_equals_ordered_history(pooled):
    """The PyTorch form and ring_write (what CPUs run) over many calls, the ring wrapping."""
    res = _stream_case(torch.float32, 16, 12, [1, 3, 11, 2, 30, 5], pooled)
    assert res["checks"]["ref_vs_history"][0] <= 2e-5
    assert all(res["flags"].values())


def test_ring_positions_cover_the_last_window():
    pos = torch.tensor([0, 3, 7, 8, 100])
    got = wa.ring_positions(pos, 7)
    for b, p in enumerate(pos.tolist()):
        assert sorted(got[b].tolist()) == list(range(p - 7, p))
        assert all(int(x) % 7 == s for s, x in enumerate(got[b].tolist()) if x >= 0)


def test_rejects_bad_shapes():
    q = torch.zeros(2, 2, 3, 16)
    ring = torch.zeros(2, 2, 5, 16)
    pos = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="ring"):
        wa.window_attention(q, ring[:, :1], ring, q, q, pos, 6)
    with pytest.raises(ValueError, match="new keys"):
        wa.window_attention(q, ring, ring, q[:, :, :2], q, pos, 6)
    with pytest.raises(ValueError, match="rows"):
        wa.window_attention(q, ring, ring, q, q, pos, 6, torch.zeros(3, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 8, 32])
def test_gpu_kernel_at_codec_sizes(t):
    """64 streams, 16 heads x 64, window 128 (the real codec's post-quantizer transformer), bf16:
    the kernel equals the PyTorch form to bf16 rounding, with streams at different ages."""
    g = torch.Generator().manual_seed(t)
    B, H, P, D = 64, 16, 127, 64
    dev = "cuda"
    q, k, v = (torch.randn(B, H, t, D, generator=g).to(torch.bfloat16).to(dev) for _ in range(3))
    kr, vr = (torch.randn(B, H, P, D, generator=g).to(torch.bfloat16).to(dev) for _ in range(2))
    pos = torch.randint(0, 400, (B,), generator=g).to(dev)
    pos[:4] = torch.tensor([0, 1, 126, 127])
    got = wa.window_attention(q, kr, vr, k, v, pos, P + 1)
    want = wa.window_attention_ref(q.float(), kr.float(), vr.float(), k.float(), v.float(), pos, P + 1)
    assert (got.float() - want).abs().max().item() <= 2e-2
    rows = torch.randperm(B, generator=g).to(dev)
    pool_k, pool_v = torch.empty_like(kr), torch.empty_like(vr)
    pool_k[rows], pool_v[rows] = kr, vr
    got_rows = wa.window_attention(q, pool_k, pool_v, k, v, pos, P + 1, rows)
    assert torch.equal(got_rows, got)
