"""The codec transformer's RoPE on its fused ``wqkv`` output, one launch (Triton, with a PyTorch
reference).

``WindowLimitedTransformer``'s attention (``shoal.codec.layers.Attention.qkv``) splits the
``wqkv`` output ``[B, t, 3 * H * D]`` into q, k and v, and rotates q and k by the bf16
interleaved-pair RoPE table at each query's position: ``apply_rotary_emb`` widens both to fp32,
forms ``a * cos - b * sin`` and ``b * cos + a * sin`` for each pair ``(a, b)`` (two rounded fp32
products and a rounded sum or difference) and rounds the result to the input's dtype. In
PyTorch eager that is about fourteen elementwise kernels per layer, plus the gather of the
table's rows. :func:`rope_qkv` does the gather and both rotations in one kernel, one program per
(stream, position) row, with the same operations in the same order (FMA contraction off), so q
and k are bit-identical to the module's; v is returned as a view of the input.

Layouts: ``qkv`` ``[B, t, 3 * H * D]`` with a contiguous last dim; ``table`` ``[L, D / 2, 2]``
(``shoal.codec.layers.rope_table``); ``pos`` ``[B]`` int64, the position of each stream's first
new row. Row ``j`` of stream ``b`` is rotated at ``pos[b] + j``, clamped to ``L - 1`` when
``clamp`` (a fixed table under CUDA-graph capture, as ``_forward_stream`` does). Returns
``(q, k, v)``, each ``[B, H, t, D]``: q and k views of one new ``[B, t, 2, H, D]`` buffer, v a
view of ``qkv``. Launches depend on shapes only (CUDA-graph capture).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fused import _DT_CODE, _apply_rope_ref, _launch_opts, _next_pow2, _require_kernel, use_triton
from .paged_attention import HAS_TRITON, tl, triton

__all__ = ["rope_qkv", "rope_qkv_ref", "rope_qkv_triton"]


def _positions(pos: Tensor, t: int, length: int, clamp: bool) -> Tensor:
    p = pos[:, None] + torch.arange(t, device=pos.device)
    return p.clamp(max=length - 1) if clamp else p


def rope_qkv_ref(qkv: Tensor, table: Tensor, pos: Tensor, n_head: int, head_dim: int,
                 clamp: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch form (``Attention.qkv`` after its ``wqkv``): ``(q, k, v)`` ``[B, H, t, D]``."""
    B, t, _ = qkv.shape
    q, k, v = qkv.view(B, t, 3, n_head, head_dim).unbind(2)
    cs = table[_positions(pos, t, table.shape[0], clamp)].reshape(B * t, head_dim // 2, 2)

    def rot(x: Tensor) -> Tensor:  # the same fp32 arithmetic as the LLM's RoPE reference
        return _apply_rope_ref(x.reshape(B * t, n_head, head_dim), cs).view(B, t, n_head, head_dim).transpose(1, 2)

    return rot(q), rot(k), v.transpose(1, 2)


if HAS_TRITON:
    from .fused import _round  # noqa: F401 - called by name from the kernel

    @triton.jit
    def _rope_qkv_kernel(qkv_ptr, tab_ptr, pos_ptr, out_ptr, stride_row, stride_tab, t, last,
                         HD: tl.constexpr, HALF_D: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr,
                         CLAMP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # stream b = row // t, position pos[b] + row % t
        p = tl.load(pos_ptr + row // t) + row % t
        if CLAMP:
            p = tl.minimum(p, last)
        i = tl.arange(0, BLOCK)  # pair i of q (and of k): head i // HALF_D, pair i % HALF_D
        m = i < HD // 2
        cs = tab_ptr + p * stride_tab + (i % HALF_D) * 2
        c = tl.load(cs, mask=m, other=0.0).to(tl.float32)
        s = tl.load(cs + 1, mask=m, other=0.0).to(tl.float32)
        src = qkv_ptr + row * stride_row + 2 * i
        qa = tl.load(src, mask=m, other=0.0).to(tl.float32)
        qb = tl.load(src + 1, mask=m, other=0.0).to(tl.float32)
        ka = tl.load(src + HD, mask=m, other=0.0).to(tl.float32)
        kb = tl.load(src + HD + 1, mask=m, other=0.0).to(tl.float32)
        dst = out_ptr + row * (2 * HD) + 2 * i
        ty = out_ptr.dtype.element_ty
        tl.store(dst, _round(qa * c - qb * s, DT).to(ty), mask=m)
        tl.store(dst + 1, _round(qb * c + qa * s, DT).to(ty), mask=m)
        tl.store(dst + HD, _round(ka * c - kb * s, DT).to(ty), mask=m)
        tl.store(dst + HD + 1, _round(kb * c + ka * s, DT).to(ty), mask=m)


def rope_qkv_triton(qkv: Tensor, table: Tensor, pos: Tensor, n_head: int, head_dim: int,
                    clamp: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Kernel version of :func:`rope_qkv_ref` (same bits)."""
    _require_kernel(qkv)
    B, t, width = qkv.shape
    H, D = n_head, head_dim
    HD = H * D
    if width != 3 * HD or D % 2:
        raise ValueError(f"qkv must be [B, t, {3 * HD}] with an even head_dim, got {tuple(qkv.shape)}")
    if qkv.dtype not in _DT_CODE:
        raise ValueError(f"qkv: unsupported dtype {qkv.dtype}")
    if table.dim() != 3 or table.shape[1:] != (D // 2, 2) or table.stride(2) != 1 or table.stride(1) != 2:
        raise ValueError(f"table must be a [L, {D // 2}, 2] table with contiguous rows, got {tuple(table.shape)}")
    if tuple(pos.shape) != (B,):
        raise ValueError(f"pos must be [{B}], got {tuple(pos.shape)}")
    if qkv.stride(2) != 1 or (t > 1 and qkv.stride(1) != width) or (B > 1 and t > 0 and qkv.stride(0) != t * width):
        qkv = qkv.contiguous()  # rows of one stride
    out = torch.empty(B, t, 2, H, D, dtype=qkv.dtype, device=qkv.device)
    v = qkv.view(B, t, 3, H, D)[:, :, 2].transpose(1, 2)
    if B * t:
        _rope_qkv_kernel[(B * t,)](
            qkv, table, pos.contiguous(), out, width, table.stride(0), t, table.shape[0] - 1,
            HD=HD, HALF_D=D // 2, BLOCK=_next_pow2(HD // 2), DT=_DT_CODE[qkv.dtype], CLAMP=bool(clamp),
            # a normal launch (no tensor: no PDL keywords; the kernel has no PDL constexpr and
            # must not read qkv before the wqkv GEMM's writes are visible)
            **_launch_opts(4 if HD >= 1024 else 2))
    return out[:, :, 0].transpose(1, 2), out[:, :, 1].transpose(1, 2), v


def rope_qkv(qkv: Tensor, table: Tensor, pos: Tensor, n_head: int, head_dim: int,
             clamp: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, k, v)`` of a ``wqkv`` output, q and k rotated (see the module docstring): the kernel
    on CUDA tensors (or under Triton's interpreter), else :func:`rope_qkv_ref`."""
    if use_triton(qkv) and qkv.dtype in _DT_CODE and table.is_contiguous():
        return rope_qkv_triton(qkv, table, pos, n_head, head_dim, clamp)
    return rope_qkv_ref(qkv, table, pos, n_head, head_dim, clamp)
