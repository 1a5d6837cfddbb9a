"""Prefill-sized FP8 GEMMs through cuBLAS's block-scaled ``torch._scaled_mm``
(shoal.kernels.fp8_cublas): the scale layouts it is given, when it is used, and (GPU) its
product against the reference."""

from __future__ import annotations

import os

import pytest
import torch

from shoal.kernels import fp8, fp8_cublas


def _operands(M: int, N: int, K: int, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device=device, dtype=torch.bfloat16)
    return (*fp8.quantize_act_ref(x), *fp8.quantize_weight_ref(w))


def _fake_scaled_mm(calls: list):
    """torch._scaled_mm's block-scaled (1x128 x 128x128) branch as torch checks and reads it:
    mat_b [K, N] column-major, scale_a [M, K/128] strides (1, M), scale_b [K/128, N/128]
    strides (1, K/128); computes the dequantized product in fp32."""

    def fake(a, b, *, scale_a, scale_b, out_dtype, out=None):
        M, K = a.shape
        N = b.shape[1]
        KB = K // 128
        assert b.shape == (K, N) and b.stride() == (1, K), "mat_b must be the column-major [K, N] weight"
        assert scale_a.shape == (M, KB) and scale_a.stride() == (1, M), f"scale_a {scale_a.stride()}"
        assert scale_b.shape == (KB, N // 128) and scale_b.stride() == (1, KB), f"scale_b {scale_b.stride()}"
        A = a.float() * scale_a.repeat_interleave(128, dim=1)
        B = b.float() * scale_b.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
        y = (A @ B).to(out_dtype)
        calls.append(out is not None)
        if out is not None:
            out.copy_(y)
            return out
        return y

    return fake


def test_gemm_hands_cublas_its_scale_layouts(monkeypatch):
    calls: list = []
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm(calls))
    xq, xs, Wq, Ws = _operands(48, 256, 2560)  # K/128 = 20 scale columns, as at S2-Pro's dim
    ref = fp8.fp8_gemm_ref(xq, xs, Wq, Ws).float()
    y = fp8_cublas.gemm(xq, xs, Wq, Ws).float()
    assert (y - ref).abs().max() <= 2.0 ** -7 * ref.abs().max()
    # a contiguous out is written by cuBLAS; a strided one receives a copy
    out = torch.empty(48, 256, dtype=torch.bfloat16)
    assert fp8_cublas.gemm(xq, xs, Wq, Ws, out=out) is out
    big = torch.zeros(48, 300, dtype=torch.bfloat16)
    view = big[:, :256]
    fp8_cublas.gemm(xq, xs, Wq, Ws, out=view)
    assert torch.equal(view, out) and torch.equal(out.float(), y)
    assert calls == [False, True, False]


def test_row_major_scales_would_be_misread(monkeypatch):
    """The fake checks what cuBLAS checks: our row-major activation scales, passed as they are,
    are refused (so a layout slip cannot silently mis-scale)."""
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm([]))
    xq, xs, Wq, Ws = _operands(48, 256, 512)
    with pytest.raises(AssertionError, match="scale_a"):
        torch._scaled_mm(xq, Wq.t(), scale_a=xs, scale_b=Ws.t(), out_dtype=torch.bfloat16)


class _Routed(Exception):
    pass


def test_launch_gemm_routes_to_cublas_only_without_an_explicit_config(monkeypatch):
    xq, xs, Wq, Ws = _operands(256, 256, 512)
    seen = []
    monkeypatch.setattr(fp8_cublas, "usable", lambda *a: True)
    monkeypatch.setattr(fp8_cublas, "gemm", lambda x_q, x_s, W_q, W_s, out: seen.append(out) or "cublas")
    assert fp8._launch_gemm(xq, xs, Wq, Ws, None, 256, 256, 512, None, False) == "cublas"
    assert seen == [None]

    def past_the_branch(*a, **k):
        raise _Routed

    monkeypatch.setattr(fp8, "_gemm_config", past_the_branch)
    with pytest.raises(_Routed):  # a tuner's explicit config always times the Triton kernel
        fp8._launch_gemm(xq, xs, Wq, Ws, None, 256, 256, 512, {"BLOCK_M": 64}, False)
    with pytest.raises(_Routed):  # the interpreter never calls cuBLAS
        fp8._launch_gemm(xq, xs, Wq, Ws, None, 256, 256, 512, None, True)
    assert seen == [None]


def test_min_m_reads_the_environment(monkeypatch):
    try:
        for raw, want in (("", 256), ("0", 0), ("1024", 1024)):
            monkeypatch.setenv(fp8_cublas.MIN_M_ENV, raw)
            fp8_cublas.min_m.cache_clear()
            assert fp8_cublas.min_m() == want
        monkeypatch.setenv(fp8_cublas.MIN_M_ENV, "many")
        fp8_cublas.min_m.cache_clear()
        with pytest.raises(ValueError, match=fp8_cublas.MIN_M_ENV):
            fp8_cublas.min_m()
    finally:
        monkeypatch.delenv(fp8_cublas.MIN_M_ENV)
        fp8_cublas.min_m.cache_clear()


def test_not_used_off_gpu_or_for_decode_shapes():
    xq, xs, Wq, Ws = _operands(512, 256, 512)
    assert not fp8_cublas.usable(xq, xs, Wq, Ws)  # CPU tensors
    assert not fp8_cublas.prepare(torch.device("cpu"))


needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="cuBLAS block-scaled FP8 needs an sm_90 GPU")


@needs_sm90
@pytest.mark.skipif(fp8_cublas.MIN_M_ENV in os.environ, reason="routing set by the environment")
def test_gpu_prefill_gemm_goes_through_cublas_and_matches_reference(monkeypatch):
    assert fp8_cublas.prepare(torch.device("cuda")), "the probe failed on this sm_90 GPU"
    calls = []
    real = fp8_cublas.gemm
    monkeypatch.setattr(fp8_cublas, "gemm", lambda *a: calls.append(a[0].shape) or real(*a))
    for M, N, K in ((1024, 2560, 9728), (256, 6144, 2560), (512, 19456, 2560)):
        xq, xs, Wq, Ws = _operands(M, N, K, device="cuda")
        ref = fp8.fp8_gemm_ref(xq, xs, Wq, Ws).float()
        tol = 2.0 ** -7 * ref.abs().max()
        y = fp8.fp8_gemm(xq, xs, Wq, Ws).float()  # the dispatcher routes it
        assert calls[-1] == (M, K)
        assert (y - ref).abs().max() <= tol
        triton_y = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, config={"BLOCK_M": 64, "BLOCK_N": 64}).float()
        assert (triton_y - y).abs().max() <= tol
        # a strided out (row stride != N) and partials=True: a bf16 result written into out
        big = torch.zeros(M, N + 128, dtype=torch.bfloat16, device="cuda")
        r = fp8.fp8_gemm_triton(xq, xs, Wq, Ws, out=big[:, :N], partials=True)
        assert isinstance(r, torch.Tensor) and torch.equal(big[:, :N].float(), y)
    # the w1 / w3 halves of a stacked w13 (row slices, as DualAR.enable_fused_kernels makes)
    xq, xs, Wq, Ws = _operands(512, 2 * 1024, 2560, device="cuda")
    half_q, half_s = Wq[1024:], Ws[1024 // 128:]
    n = len(calls)
    y = fp8.fp8_gemm(xq, xs, half_q, half_s).float()
    assert len(calls) == n + 1
    ref = fp8.fp8_gemm_ref(xq, xs, half_q, half_s).float()
    assert (y - ref).abs().max() <= 2.0 ** -7 * ref.abs().max()
    xq, xs, Wq, Ws = _operands(64, 2560, 9728, device="cuda")
    assert not fp8_cublas.usable(xq, xs, Wq, Ws)  # decode sizes stay on the Triton kernels
