"""Large-M block-scaled FP8 GEMMs through cuBLAS (prefill).

Our Triton FP8 GEMM is built for decode (M <= 128: split-K and swap-AB tiles that stream the
weights). At prefill sizes it is compute-bound and slower than bf16 cuBLAS. cuBLASLt >= 12.9
has the same block-scaled scheme on sm_90 (1x128 activation groups x 128x128 weight blocks,
fp32 scales, fp32 accumulation), which ``torch._scaled_mm`` reaches when the scales come in
its layouts:

* ``scale_a`` ``[M, K/128]`` outer-dim-major (strides ``(1, M)``): our row-major activation
  scales copied transposed (a few hundred KB at prefill sizes);
* ``scale_b`` ``[K/128, N/128]`` with strides ``(1, K/128)``: exactly our row-major
  ``[N/128, K/128]`` weight scales viewed transposed (no copy);
* ``mat_b`` ``[K, N]`` column-major: the ``[N, K]`` weight viewed transposed.

Measured on an H100 (2026-12-07, ``benchmarks/scripts/scaled_mm_block_probe.py``) at M = 1,024:
gate_up 91.6 us against 175.1 for ours (bf16 cuBLAS 147.1), down 59.5 against 131.3, wqkv
31.5 against 53.7, wo 28.3 against 47.8, with the same error against the exact product. At
M = 64 ours is faster. So GEMMs with at least :func:`min_m` rows (``SHOAL_FP8_CUBLAS_MIN_M``,
default 256; 0 turns this off) go to cuBLAS, on a device where a probe product matched the
reference (:func:`prepare`, run once per device outside CUDA-graph capture).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

from ..envutil import env_int

__all__ = ["MIN_M_ENV", "gemm", "gemm_col_scales", "min_m", "prepare", "routes", "usable"]

log = logging.getLogger(__name__)

MIN_M_ENV = "SHOAL_FP8_CUBLAS_MIN_M"
DEFAULT_MIN_M = 256

_verified: dict[int, bool] = {}  # device index -> the probe's verdict


@functools.cache
def min_m() -> int:
    """The smallest M sent to cuBLAS (``SHOAL_FP8_CUBLAS_MIN_M``; 0: never; a bad value raises)."""
    return env_int(MIN_M_ENV, DEFAULT_MIN_M)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def gemm(x_q: Tensor, x_s: Tensor, W_q: Tensor, W_s: Tensor, out: Tensor | None = None) -> Tensor:
    """``dequant(x_q, x_s) @ dequant(W_q, W_s)^T`` in bf16 through ``torch._scaled_mm``
    (layouts as in the module docstring; the caller checked :func:`usable`)."""
    return gemm_col_scales(x_q, x_s.t().contiguous().t(), W_q, W_s, out)


def gemm_col_scales(x_q: Tensor, x_s_col: Tensor, W_q: Tensor, W_s: Tensor, out: Tensor | None = None) -> Tensor:
    """:func:`gemm` with the activation scales already outer-dim-major (``[M, K/128]``, strides
    ``(1, M)``)."""
    if out is not None and out.is_contiguous():
        return torch._scaled_mm(x_q, W_q.t(), scale_a=x_s_col, scale_b=W_s.t(), out_dtype=torch.bfloat16, out=out)
    y = torch._scaled_mm(x_q, W_q.t(), scale_a=x_s_col, scale_b=W_s.t(), out_dtype=torch.bfloat16)
    if out is None:
        return y
    out.copy_(y)
    return out


def prepare(device: torch.device) -> bool:
    """Probe cuBLAS's block-scaled FP8 GEMM once on ``device`` (a 256 x 256 x 512 product
    against :func:`shoal.kernels.fp8.fp8_gemm_ref`); returns and caches whether it may be used.
    Call outside CUDA-graph capture (the engine's runner does, for FP8 models)."""
    if device.type != "cuda" or min_m() == 0:
        return False
    idx = _index(device)
    if idx in _verified:
        return _verified[idx]
    ok = False
    why = ""
    if torch.cuda.get_device_capability(idx)[0] != 9 or not hasattr(torch, "_scaled_mm"):
        why = "needs an sm_90 GPU and torch._scaled_mm"
    else:
        from .fp8 import fp8_gemm_ref, quantize_act_ref, quantize_weight_ref

        try:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(256, 512, generator=g).to(device=device, dtype=torch.bfloat16)
            w = (torch.randn(256, 512, generator=g) / 512 ** 0.5).to(device=device, dtype=torch.bfloat16)
            W_q, W_s = quantize_weight_ref(w)
            x_q, x_s = quantize_act_ref(x)
            y = gemm(x_q, x_s, W_q, W_s).float()
            ref = fp8_gemm_ref(x_q, x_s, W_q, W_s).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            ok = err <= 2.0 ** -7
            why = f"probe error {err:.2e}"
        except Exception as e:  # noqa: BLE001 (torch raises RuntimeError / ValueError / ...: any means "not here")
            why = f"{type(e).__name__}: {str(e)[:200]}"
    _verified[idx] = ok
    log.info("FP8 GEMMs with >= %d rows %s cuBLAS block-scaled (%s)", min_m(),
             "through" if ok else "not through", why)
    return ok


def routes(M: int, N: int, K: int, device: torch.device) -> bool:
    """Whether an ``M x N x K`` product on ``device`` goes to cuBLAS, by shape and device alone
    (:func:`usable` adds the operands' contiguity and alignment): CUDA, at least :func:`min_m`
    rows, M a multiple of 16, N a multiple of 128 and K of 512 (K/128 a multiple of 4: cuBLAS's
    scale tiles), and a verified device (probed here if not yet, unless a CUDA graph is being
    captured)."""
    lo = min_m()
    if not (lo and M >= lo and device.type == "cuda" and M % 16 == 0 and N % 128 == 0 and K % 512 == 0):
        return False
    idx = _index(device)
    if idx not in _verified:
        if torch.cuda.is_current_stream_capturing():
            return False
        prepare(device)
    return _verified[idx]


def usable(x_q: Tensor, x_s: Tensor, W_q: Tensor, W_s: Tensor) -> bool:
    """Whether this product goes to cuBLAS: :func:`routes` for its shape, and contiguous,
    16-byte aligned operands and scales."""
    M, K = x_q.shape
    if not routes(M, W_q.shape[0], K, x_q.device):
        return False
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (x_q, W_q, x_s, W_s))
