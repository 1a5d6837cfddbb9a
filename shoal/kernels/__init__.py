"""Custom kernels (Triton) with PyTorch reference implementations."""

from shoal.kernels.paged_attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    triton_interpreting,
)

__all__ = [
    "choose_num_splits",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_attention_triton",
    "triton_interpreting",
]
