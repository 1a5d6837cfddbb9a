"""FP8 KV cache: the slow transformer's keys and values stored as e4m3 with one fp32 scale per
(token, KV head).

Scheme (docs/quantization.md, "FP8 KV cache"): for the ``head_dim`` values ``x`` of one token
and one KV head -- the key after qk-norm and RoPE, rounded to the model dtype; the value as
the ``wqkv`` GEMM gave it -- ``amax = max(|x|)`` floored at 1e-10, ``qs = 448 / amax`` (IEEE
fp32 division), stored scale ``1 / qs`` (the multiplicative dequant scale, ~``amax / 448``),
``x_q = e4m3_rn(clamp(x * qs, -448, 448))``: the 1x128 activation rule of the FP8 GEMMs
(:mod:`shoal.kernels.fp8`), applied per head. Dequantization: ``x ~ x_q * scale``.

Dynamic per-token scales need no calibration and cannot overflow (every token's largest value
maps to 448); the scales cost 4 bytes per 128 values (3%). Attention kernels read the e4m3
values, widen them exactly to the query's dtype for the tensor-core products, and apply the
key scale to the scores and the value scale to the probabilities.

This module is the PyTorch definition every path shares: the paged cache's reference write,
the contiguous cache of the reference generation loop (so the correctness gate decodes with the
same numerics the engine serves) and the tests of the Triton write kernel, which matches it
byte for byte.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_KV_DTYPE = torch.float8_e4m3fn
KV_CACHE_DTYPES = ("auto", "fp8")


def parse_kv_cache_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"auto"`` / None -> None (the model's dtype), ``"fp8"`` -> ``torch.float8_e4m3fn``."""
    if name is None or name == FP8_KV_DTYPE:
        return name
    key = str(name).strip().lower()
    if key in ("auto", "", "none", "model"):
        return None
    if key in ("fp8", "fp8_e4m3", "e4m3", "float8_e4m3fn", "torch.float8_e4m3fn"):
        return FP8_KV_DTYPE
    raise ValueError(f"unknown KV cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")


def kv_cache_dtype_arg(value: str | None) -> str:
    """A CLI's ``--kv-cache-dtype`` value: the flag, else env ``SHOAL_KV_CACHE_DTYPE``, else
    "auto". Only command-line entry points read the environment; ``EngineConfig`` never does, so
    tests and benchmark harnesses are not switched behind their back."""
    import os

    value = value if value is not None else os.environ.get("SHOAL_KV_CACHE_DTYPE", "auto")
    parse_kv_cache_dtype(value)  # an unknown name fails here, with the accepted ones
    return value


def kv_cache_dtype_name(dtype: torch.dtype | None) -> str:
    return "fp8" if dtype == FP8_KV_DTYPE else "auto"


def quantize_kv(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x [..., D]`` -> ``(x_q [..., D] e4m3, scale [...] fp32)``: one scale per vector of
    the last dimension (a token's head)."""
    from ..kernels.fp8 import _quant_from_amax

    xf = x.float()
    q, scale = _quant_from_amax(xf, xf.abs().amax(dim=-1, keepdim=True))
    # stored e4m3 is always finite (as the fused write kernel's clamp makes it): the token-minor
    # readers load whole pages, and 0 * NaN past a context would leak into other requests
    q = torch.nan_to_num(q.float(), nan=0.0).to(q.dtype)
    return q, scale[..., 0]


def dequantize_kv(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q [..., D]`` e4m3, ``scale [...]`` -> ``q * scale`` (computed in fp32) as ``dtype``."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def add_kv_block_size_arg(p) -> None:
    """``--kv-block-size N`` for the CLIs that build an engine."""
    p.add_argument("--kv-block-size", type=int, default=None, metavar="N",
                   help="KV-cache page size in tokens (default 64 on CUDA, 16 on CPU). At 64 the FP8 "
                        "decode attention (--kv-cache-dtype fp8) reads a page per tile through TMA: "
                        "+4.5%% frames/s at 64 streams on an H200 (docs/benchmarks.md); prefix hits "
                        "are to the token at any page size (a partially shared page is copied)")
