"""Building blocks of the modded-DAC codec.

Every block with temporal context implements ``forward(x, state=None)``:

* ``state is None``: one-shot over the whole sequence, numerically the
  reference computation (zero left padding of causal convs, right trim of
  transposed convs, positions 0..T-1 in the transformers).
* ``state`` a :class:`StreamState`: the block reads its carried context from
  ``state[self.state_key]`` (plus derived keys), processes the new chunk only
  and writes the new context back.  Zero initial context is exactly the
  one-shot zero padding, so one-shot output == concatenated chunk outputs.

Module and parameter names mirror the reference (``conv.weight``,
``block.N``, ``layers.N.attention.wqkv`` ...) with weight norm folded, so a
reference state dict maps onto ours key by key (see ``loader.py``).
"""

from __future__ import annotations

import math
import threading
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.codec_conv import conv1d_cl_triton, pack_conv_weight
from ..kernels.fused import use_triton
from ..kernels.snake import snake as snake_op
from .config import TransformerConfig

__all__ = [
    "StreamState",
    "IndexedState",
    "StreamingModule",
    "Seq",
    "Snake",
    "CausalConv1d",
    "CausalConvTranspose1d",
    "ConvNeXtBlock",
    "ResidualUnit",
    "RMSNorm",
    "WindowLimitedTransformer",
    "rope_table",
    "apply_rotary_emb",
    "window_mask",
    "assign_state_keys",
]


# --------------------------------------------------------------------------- state
class StreamState:
    """Carried state of a batch of independent streams.

    ``tensors`` maps a key (module path inside the codec, plus a suffix for
    transformer caches) to a tensor whose **dim 0 is the stream index**.
    ``bounds`` holds host-side integers (an upper bound of the position any
    stream reached, per transformer) so no device sync is needed to size the
    RoPE table.  All batch operations are plain per-key tensor ops, so a
    state can be split, stacked and partially reset for slot-based batching.
    """

    def __init__(self, tensors: dict[str, Tensor] | None = None, bounds: dict[str, int] | None = None):
        self.tensors: dict[str, Tensor] = dict(tensors or {})
        self.bounds: dict[str, int] = dict(bounds or {})
        # packed (see :meth:`packed`): per dtype one [B, n] buffer of which every tensor is a
        # view, so a whole row moves in one gather / scatter per dtype; else None
        self.flat: dict[torch.dtype, Tensor] | None = None
        self.layout: tuple | None = None

    @staticmethod
    def packed(tensors: dict[str, Tensor], bounds: dict[str, int] | None = None) -> "StreamState":
        """A state with the values of ``tensors`` whose tensors are views into one contiguous
        ``[B, n]`` buffer per dtype (row r of every tensor lies in row r of its buffer)."""
        dev = next(iter(tensors.values())).device if tensors else None
        out = StreamState.packed_zeros(tensors, bounds, dev)
        for k, v in tensors.items():
            out.tensors[k].copy_(v)
        return out

    @staticmethod
    def packed_zeros(shapes: dict[str, Tensor], bounds: dict[str, int] | None = None,
                     device: torch.device | str | None = None) -> "StreamState":
        """A packed state (see :meth:`packed`) of all zeros with the keys, shapes and dtypes
        of ``shapes`` (meta tensors will do), allocated once on ``device``: no per-tensor
        buffers allocated and freed first (their freed blocks would stay reserved between
        later long-lived allocations: ~the state's size again, measured on an H200)."""
        B = next(iter(shapes.values())).shape[0] if shapes else 0
        sizes: dict[torch.dtype, int] = {}
        layout = []
        for k, v in shapes.items():
            n = int(torch.Size(v.shape[1:]).numel())
            layout.append((k, v.dtype, tuple(v.shape[1:]), sizes.get(v.dtype, 0)))
            sizes[v.dtype] = sizes.get(v.dtype, 0) + n
        return StreamState._over(tuple(layout), {dt: torch.zeros(B, n, dtype=dt, device=device)
                                                 for dt, n in sizes.items()}, bounds)

    @staticmethod
    def _over(layout: tuple, flat: dict[torch.dtype, Tensor], bounds: dict[str, int] | None) -> "StreamState":
        """The packed state of ``layout`` ((key, dtype, shape, offset) per tensor) over ``flat``."""
        B = next(iter(flat.values())).shape[0] if flat else 0
        views = {k: flat[dt][:, off:off + int(torch.Size(shape).numel())].view(B, *shape)
                 for k, dt, shape, off in layout}
        out = StreamState(views, bounds)
        out.flat, out.layout = flat, layout
        return out

    def same_packing(self, other: "StreamState") -> bool:
        return self.flat is not None and other.flat is not None and self.layout == other.layout

    # mapping access used by the layers
    def __getitem__(self, key: str) -> Tensor:
        return self.tensors[key]

    def store(self, key: str, value: Tensor) -> None:
        """Write a stream module's new carried state for ``key`` (every row, in place)."""
        self.tensors[key].copy_(value)

    def rows(self, key: str) -> tuple[Tensor, Tensor | None]:
        """``(buffer, rows)``: the tensor holding ``key`` and the row of each stream in it (None:
        row b is stream b), for modules that read and write a few entries in place."""
        return self.tensors[key], None

    def __setitem__(self, key: str, value: Tensor) -> None:
        self.tensors[key] = value
        self.flat = self.layout = None  # a replaced tensor is no view of the buffers any more

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    @property
    def batch_size(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        return 0

    # batch manipulation
    def select(self, index: Tensor | Sequence[int] | slice) -> "StreamState":
        """A new state holding the rows ``index`` (copies for tensor/list indices)."""
        if not isinstance(index, slice):
            index = _as_index(index, self)
        if self.flat is not None:
            return StreamState._over(self.layout, {dt: f[index] for dt, f in self.flat.items()}, self.bounds)
        return StreamState({k: v[index] for k, v in self.tensors.items()}, self.bounds)

    def update_(self, index: Tensor | Sequence[int], other: "StreamState") -> "StreamState":
        """Write the rows of ``other`` into rows ``index`` of this state, in place."""
        index = _as_index(index, self)
        if set(other.tensors) != set(self.tensors):
            raise ValueError("stream states have different layouts")
        if self.same_packing(other) and index.dtype != torch.bool:
            for dt, f in self.flat.items():
                f.index_copy_(0, index, other.flat[dt].to(f.device))
        else:
            for k, v in self.tensors.items():
                v[index] = other.tensors[k].to(device=v.device, dtype=v.dtype)
        for k, b in other.bounds.items():
            self.bounds[k] = max(self.bounds.get(k, 0), b)
        return self

    def reset_(self, index: Tensor | Sequence[int] | None = None) -> "StreamState":
        """Make rows ``index`` (all if None) fresh streams, in place."""
        if index is None:
            for v in self.tensors.values():
                v.zero_()
            self.bounds = {k: 0 for k in self.bounds}
            return self
        if not isinstance(index, Tensor) and len(index) <= 4:
            for row in index:  # a few rows: views, no index upload (no host sync)
                for v in (self.flat.values() if self.flat is not None else self.tensors.values()):
                    v[int(row)].zero_()
            return self
        index = _as_index(index, self)
        for v in self.tensors.values():
            v[index] = 0
        return self

    @staticmethod
    def cat(states: Iterable["StreamState"]) -> "StreamState":
        states = list(states)
        if not states:
            raise ValueError("nothing to concatenate")
        keys = set(states[0].tensors)
        for s in states[1:]:
            if set(s.tensors) != keys:
                raise ValueError("stream states have different layouts")
        bounds: dict[str, int] = {}
        for s in states:
            for k, b in s.bounds.items():
                bounds[k] = max(bounds.get(k, 0), b)
        return StreamState({k: torch.cat([s.tensors[k] for s in states], 0) for k in states[0].tensors}, bounds)

    def to(self, device=None, dtype=None) -> "StreamState":
        """Move (floating tensors also cast when ``dtype`` is given)."""
        out = {}
        for k, v in self.tensors.items():
            if dtype is not None and v.is_floating_point():
                out[k] = v.to(device=device, dtype=dtype)
            else:
                out[k] = v.to(device=device)
        return StreamState(out, self.bounds)

    def clone(self) -> "StreamState":
        return StreamState({k: v.clone() for k, v in self.tensors.items()}, self.bounds)

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.tensors.values())

    def __repr__(self) -> str:
        return f"StreamState(batch={self.batch_size}, tensors={len(self.tensors)}, bytes={self.nbytes()})"


class IndexedState(StreamState):
    """Rows ``index`` of a state ``pool``, read and written in place: a module's read gathers
    its key's rows (a temporary of that key alone), its write scatters them back. What a CUDA
    graph of the serving decoder records over the streamer's slot pool, so no second copy of
    the streams' state (the codec transformer's KV windows: 4.2 MB per stream) is kept for the
    graphs. ``bounds`` is this view's own (host-side) dict; the caller updates the pool's.
    Rows of ``index`` must be distinct, except rows whose results nobody reads (padding rows
    pointing at a scratch row)."""

    def __init__(self, pool: StreamState, index: Tensor, bounds: dict[str, int] | None = None):
        super().__init__({}, dict(pool.bounds if bounds is None else bounds))
        self.pool = pool
        self.index = index

    def __getitem__(self, key: str) -> Tensor:
        return self.pool.tensors[key].index_select(0, self.index)

    def store(self, key: str, value: Tensor) -> None:
        dst = self.pool.tensors[key]
        dst.index_copy_(0, self.index, value.to(dst.dtype))

    def rows(self, key: str) -> tuple[Tensor, Tensor | None]:
        return self.pool.tensors[key], self.index

    def __setitem__(self, key: str, value: Tensor) -> None:
        raise TypeError("an IndexedState is written through store()")

    def __contains__(self, key: str) -> bool:
        return key in self.pool.tensors

    @property
    def batch_size(self) -> int:
        return int(self.index.shape[0])

    def select(self, index) -> "IndexedState":
        """The view of rows ``index`` of this view (slices of the index: no copy of state)."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long, device=self.index.device)
        return IndexedState(self.pool, self.index[index], self.bounds)

    def nbytes(self) -> int:
        return 0  # holds no state of its own

    def __repr__(self) -> str:
        return f"IndexedState(rows={self.batch_size}, pool={self.pool!r})"


def _as_index(index, state: StreamState) -> Tensor:
    dev = next(iter(state.tensors.values())).device if state.tensors else None
    if isinstance(index, Tensor):
        return index.to(device=dev) if index.dtype == torch.bool else index.to(device=dev, dtype=torch.long)
    return torch.as_tensor(list(index), dtype=torch.long, device=dev)


class StreamingModule(nn.Module):
    """A block with ``forward(x, state=None)``; stateful ones set ``state_key``."""

    state_key: str = ""

    def init_stream_state(self, batch_size: int, device, dtype) -> dict[str, Tensor]:
        """A fresh stream's state tensors: all zeros (``StreamingDecoder.new_state`` asks for
        them on the meta device and allocates the packed zeros itself)."""
        return {}


class Seq(nn.Sequential, StreamingModule):
    """``nn.Sequential`` that threads the stream state through its children."""

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:  # type: ignore[override]
        for m in self:
            x = m(x, state) if isinstance(m, StreamingModule) else m(x)
        return x


def assign_state_keys(root: nn.Module, prefix: str = "") -> None:
    """Give every streaming module its path inside ``root`` as state key."""
    for name, m in root.named_modules(prefix=prefix.rstrip(".")):
        if isinstance(m, StreamingModule):
            m.state_key = name


# --------------------------------------------------------------------------- conv blocks
class Snake(StreamingModule):
    """``x + sin²(αx) / (α + 1e-9)`` with per-channel α of shape [1, C, 1] (dac.nn.layers.snake)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        # one fused kernel on CUDA; on CPU exactly x + (α + 1e-9)⁻¹ · sin(αx)²
        return snake_op(x, self.alpha)[0]


def extra_padding_for_conv1d(length: int, kernel_size: int, stride: int, padding_total: int) -> int:
    """Right padding that makes the last window complete (reference ``get_extra_padding_for_conv1d``)."""
    n_frames = (length - kernel_size + padding_total) / stride + 1
    ideal_length = (math.ceil(n_frames) - 1) * stride + (kernel_size - padding_total)
    return ideal_length - length


def _sole_tensor_of_storage(t: Tensor) -> bool:
    """Whether ``t`` is the only tensor PyTorch counts on its storage (no view, alias or
    ``.data`` of it alive). False where PyTorch does not tell. Memory shared outside PyTorch's
    count (NumPy or DLPack exports, a storage object held on its own, a shared file mapping) is
    not seen: the codec's weights, copied at load, have none."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return False
    try:
        # the storage wrapper made here holds one reference of its own
        return count(t.untyped_storage()._cdata) == 2
    except Exception:  # noqa: BLE001 - an internal API: anything unexpected means "do not know"
        return False


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive slots of its storage (any order)."""
    expected = 1
    for i in sorted(range(t.dim()), key=t.stride):
        if t.shape[i] != 1 and t.stride(i) != expected:
            return False
        expected *= t.shape[i]
    return True


def rewrite_in_own_storage(old: Tensor, new: Tensor) -> Tensor:
    """``new``'s values in ``new``'s shape and strides, written over ``old``'s storage when
    ``old`` is the only tensor on a storage of exactly its elements and ``new`` is a dense layout
    of as many elements of the same dtype and device; else ``new`` itself. A weight moved to
    another layout (channels-last, the Triton convs' packed form) this way leaves no freed
    block behind: freed blocks between live weights stay reserved by the allocator (20-40 MiB
    for the real codec's decode side, docs/benchmarks.md 2026-12-07). Pass the tensor itself
    (a parameter), not ``.data``: an alias makes the storage shared, and nothing is rewritten.
    Once rewritten, ``old``'s own view reads the new layout's bytes: point it at the result
    (``param.data = rewrite_in_own_storage(param, new)``)."""
    fits = (old.storage_offset() == 0 and old.numel() == new.numel() and old.dtype == new.dtype
            and old.device == new.device and _dense(new)
            and old.untyped_storage().nbytes() == old.numel() * old.element_size()
            and old.untyped_storage().data_ptr() != new.untyped_storage().data_ptr()
            and _sole_tensor_of_storage(old))
    if not fits:
        return new
    with torch.no_grad():
        own = torch.empty(0, dtype=old.dtype, device=old.device).set_(old.untyped_storage(), 0, new.shape, new.stride())
        own.copy_(new)
    return own


class CausalConv1d(StreamingModule):
    """Causal conv: left pad ``(k-1)·dilation + 1 − stride`` zeros plus right pad to whole frames.

    ``weight_norm`` only records the reference checkpoint format (parametrized
    weight norm); the weights are always plain (folded at load).
    Streaming (stride 1 only): the carried context is the last
    ``(k-1)·dilation`` input samples, shape [B, C_in, pad].
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, stride: int = 1,
                 dilation: int = 1, groups: int = 1, weight_norm: bool = True):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride=stride, dilation=dilation, groups=groups)
        self.weight_norm = weight_norm
        self.stride = stride
        self.dilation = dilation
        self.groups = groups
        self.kernel_size_eff = (kernel_size - 1) * dilation + 1
        self.padding = self.kernel_size_eff - stride
        self.channels_last = False  # set by Codec.configure_serving (decoder only)
        self.triton_conv = False  # set by Codec.configure_serving (decoder, channels-last only)
        self._packed: tuple[tuple, Tensor] | None = None

    def packed_weight(self) -> Tensor:
        """The weight as the Triton conv reads it ([K, C_in, C_out]), repacked when the weight
        changes (load, dtype or device moves); warm-up fills it before any graph capture."""
        w = self.conv.weight
        key = (w.data_ptr(), w.dtype, w.device, w._version)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, pack_conv_weight(w.detach()))
        return self._packed[1]

    def share_packed_weight(self) -> Tensor:
        """Pack the weight and make ``conv.weight`` a view of the packed tensor (its permutation
        back to [C_out, C_in, K]): one copy of the weight in memory instead of two. The values
        are unchanged; other readers of ``conv.weight`` see a non-contiguous tensor (so does
        ``state_dict()``: make it contiguous before saving it with safetensors).
        ``Codec.configure_serving(channels_last=...)`` leaves a shared weight where it is while
        the Triton conv is on; ``triton_conv=False`` undoes the sharing."""
        w = self.conv.weight
        if self.shares_packed_weight:
            return self._packed[1]
        packed = rewrite_in_own_storage(w, self.packed_weight())  # no freed block left
        w.data = packed.permute(2, 1, 0)
        self._packed = ((w.data_ptr(), w.dtype, w.device, w._version), packed)
        return packed

    @property
    def shares_packed_weight(self) -> bool:
        return self._packed is not None and self.conv.weight.data_ptr() == self._packed[1].data_ptr()

    def unshare_packed_weight(self) -> None:
        """``conv.weight`` in its own storage again (contiguous, or channels-last when the
        conv runs channels-last), the packed copy dropped."""
        if not self.shares_packed_weight:
            return
        w = self.conv.weight
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        w.data = w.data.unsqueeze(2).contiguous(memory_format=fmt).squeeze(2)
        self._packed = None

    def _conv(self, x: Tensor) -> Tensor:
        if self.triton_conv and self.stride == 1 and self.groups == 1 and use_triton(x):
            return conv1d_cl_triton(x, self.packed_weight(), self.conv.bias, self.dilation)
        if self.channels_last:
            # conv1d as a channels-last conv2d over [B, C, 1, L] (activations stored [B, L, C])
            y = F.conv2d(x.unsqueeze(2), self.conv.weight.unsqueeze(2), self.conv.bias, (1, self.stride), 0,
                         (1, self.dilation), self.groups)
            return y.squeeze(2)
        return F.conv1d(x, self.conv.weight, self.conv.bias, self.stride, 0, self.dilation, self.groups)

    def _buffer(self, x: Tensor, length: int) -> Tensor:
        """Uninitialized conv input [B, C_in, length] in this conv's activation layout."""
        B, C = x.shape[0], x.shape[1]
        if self.channels_last:
            return torch.empty(B, length, C, device=x.device, dtype=x.dtype).transpose(1, 2)
        return torch.empty(B, C, length, device=x.device, dtype=x.dtype)

    def _with_context(self, buf: Tensor, state: StreamState | None) -> None:
        """Fill buf[..., :pad] with the carried context (zeros one-shot)."""
        if self.padding:
            if state is None:
                buf[..., : self.padding].zero_()
            else:
                buf[..., : self.padding].copy_(state[self.state_key])

    def _save_context(self, buf: Tensor, state: StreamState | None) -> None:
        if state is not None and self.padding:
            state.store(self.state_key, buf[..., buf.shape[-1] - self.padding:])

    def snake_conv(self, x: Tensor, alpha: Tensor, state: StreamState | None = None, y: Tensor | None = None,
                   bias: Tensor | None = None, h_out: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """``conv(Snake_α(h))`` with ``h = x (+ y) (+ bias)``, stride 1, one-shot or streaming.

        Snake writes straight into the conv input buffer after the left context (no pad or
        cat pass); ``h`` is written to ``h_out`` when given. Returns ``(conv output, h)``.
        """
        if self.stride != 1:
            raise NotImplementedError("snake_conv needs a stride-1 conv")
        L = x.shape[-1]
        buf = self._buffer(x, self.padding + L)
        self._with_context(buf, state)
        _, h = snake_op(x, alpha, y, bias, out=buf[..., self.padding:], h_out=h_out)
        self._save_context(buf, state)
        return self._conv(buf), h

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        if state is None:
            extra = extra_padding_for_conv1d(x.shape[-1], self.kernel_size_eff, self.stride, self.padding)
            if self.padding or extra:
                x = F.pad(x, (self.padding, extra))
            return self._conv(x)
        if self.stride != 1:
            raise NotImplementedError("streaming is only implemented for stride-1 causal convs")
        if self.padding == 0:
            return self._conv(x)
        buf = self._buffer(x, self.padding + x.shape[-1])
        self._with_context(buf, state)
        buf[..., self.padding:].copy_(x)
        self._save_context(buf, state)  # in place: state tensors are static buffers (CUDA graphs)
        return self._conv(buf)

    def init_stream_state(self, batch_size, device, dtype):
        if self.stride != 1 or self.padding == 0:
            return {}
        return {self.state_key: torch.zeros(batch_size, self.conv.in_channels, self.padding, device=device, dtype=dtype)}


class CausalConvTranspose1d(StreamingModule):
    """Transposed conv with the last ``k − stride`` output samples trimmed (causal).

    Streaming: the carried state is the bias-free overlap tail, [B, C_out, k − stride],
    added to the first outputs of the next chunk.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, stride: int = 1,
                 weight_norm: bool = True):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.weight_norm = weight_norm
        self.stride = stride
        self.kernel_size = kernel_size
        self.trim = kernel_size - stride
        if self.trim < 0:
            raise ValueError("transposed conv kernel must be >= stride")
        self.channels_last = False  # set by Codec.configure_serving (decoder only)
        # Codec.configure_serving(triton_conv=True): run as a 2-tap implicit GEMM (needs
        # kernel_size == 2 * stride); the carried state is then the last input sample [B, C_in, 1]
        self.triton_conv = False
        self._packed: tuple[tuple, Tensor] | None = None
        # share_packed_weight: the weight held only in its packed form (a buffer, so module
        # moves and casts carry it); conv.weight is then an empty placeholder
        self.register_buffer("_packed_w", None, persistent=False)
        self._register_state_dict_hook(_full_transposed_weight_in_state_dict)
        self._register_load_state_dict_pre_hook(_unshare_before_load, with_module=True)

    @property
    def as_gemm(self) -> bool:
        return self.triton_conv and self.kernel_size == 2 * self.stride

    @property
    def shares_packed_weight(self) -> bool:
        return self._packed_w is not None

    def share_packed_weight(self) -> Tensor:
        """Keep the weight only in the packed form the GEMM reads: one copy in memory instead
        of two. The 2-tap packing reorders the taps, so (unlike the stride-1 conv's) it cannot
        be a view of ``conv.weight``; instead the packed values are written over the weight's
        own storage (no allocation left behind) and ``conv.weight`` becomes an empty
        placeholder. :meth:`full_weight` rebuilds the reference layout for the other paths,
        ``state_dict()`` holds it, ``load_state_dict`` unshares first and
        :meth:`unshare_packed_weight` (``configure_serving(triton_conv=False)``) restores it."""
        if self.shares_packed_weight:
            return self._packed_w
        if self.kernel_size != 2 * self.stride:
            raise ValueError(f"only a 2-tap transposed conv (kernel_size == 2 * stride) has a packed form, "
                             f"got kernel_size {self.kernel_size}, stride {self.stride}")
        w = self.conv.weight
        self._full_shape = tuple(w.shape)
        packed = self.packed_weight()
        # the packed values into the weight's own storage, the temporary freed
        packed = rewrite_in_own_storage(w, packed)
        self._packed_w = packed
        self._packed = None
        w.data = packed.new_empty(0)
        return packed

    def full_weight(self) -> Tensor:
        """The weight in the reference layout [C_in, C_out, k] (a rebuilt copy while only the
        packed form is kept)."""
        if not self.shares_packed_weight:
            return self.conv.weight
        ci, co, k = self._full_shape
        s = k // 2
        p = self._packed_w.view(2, ci, s, co)  # tap 0 = weight[..., s:], tap 1 = weight[..., :s]
        return torch.cat([p[1], p[0]], dim=1).permute(0, 2, 1).contiguous()

    def unshare_packed_weight(self) -> None:
        """``conv.weight`` in its own storage and layout again, the packed form dropped."""
        if not self.shares_packed_weight:
            return
        w = self.full_weight()
        if self.channels_last:
            w = w.unsqueeze(2).contiguous(memory_format=torch.channels_last).squeeze(2)
        self.conv.weight.data = w
        self._packed_w = None
        self._packed = None

    def packed_weight(self) -> Tensor:
        """[2, C_in, stride * C_out]: tap 0 multiplies input sample i-1, tap 1 sample i; column
        r * C_out + n is output channel n of output sample stride * i + r."""
        if self.shares_packed_weight:
            return self._packed_w
        w = self.conv.weight  # [C_in, C_out, k]
        key = (w.data_ptr(), w.dtype, w.device, w._version)
        if self._packed is None or self._packed[0] != key:
            s = self.stride
            wd = w.detach()
            taps = [wd[:, :, s: 2 * s], wd[:, :, :s]]
            packed = torch.stack([t.permute(0, 2, 1).reshape(wd.shape[0], s * wd.shape[1]) for t in taps])
            self._packed = (key, packed.contiguous())
        return self._packed[1]

    # the GEMM form's input buffer: [B, C_in, 1 + L] = [previous input sample | new input]
    def input_buffer(self, like: Tensor, length: int) -> Tensor:
        B = like.shape[0]
        return torch.empty(B, 1 + length, self.conv.in_channels, device=like.device, dtype=like.dtype).transpose(1, 2)

    def fill_context(self, buf: Tensor, state: StreamState | None) -> None:
        if state is None:
            buf[..., :1].zero_()
        else:
            buf[..., :1].copy_(state[self.state_key])

    def save_context(self, buf: Tensor, state: StreamState | None) -> None:
        if state is not None:
            state.store(self.state_key, buf[..., buf.shape[-1] - 1:])

    def gemm_forward(self, buf: Tensor) -> Tensor:
        """The causal output without bias, [B, C_out, stride * L] (channels-last memory), from a
        buffer filled as :meth:`input_buffer` describes."""
        B, L = buf.shape[0], buf.shape[-1] - 1
        y = conv1d_cl_triton(buf, self.packed_weight(), None, 1)  # [B, s*C_out, L], memory [B, L, s*C_out]
        return y.transpose(1, 2).reshape(B, L * self.stride, self.conv.out_channels).transpose(1, 2)

    def gemm_forward_snake(self, buf: Tensor, alpha: Tensor, h: Tensor, s: Tensor) -> None:
        """:meth:`gemm_forward` with the bias and the Snake that follows in the GEMM's
        epilogue: ``h = round(round(conv) + bias)`` into ``h`` and ``Snake_alpha(h)`` into ``s``
        (both ``[B, C_out, stride * L]`` in channels-last memory, e.g. ``s`` the next conv's
        buffer after its context), the bits of :meth:`gemm_forward` followed by the Snake
        kernel with ``bias`` -- without the bias-free output ever being stored."""
        B, L = buf.shape[0], buf.shape[-1] - 1
        st, C = self.stride, self.conv.out_channels

        def as_gemm(t: Tensor) -> Tensor:  # [B, C, st*L] -> [B, st*C, L], same memory
            return t.transpose(1, 2).view(B, L, st * C).transpose(1, 2)

        bias = self.conv.bias
        conv1d_cl_triton(buf, self.packed_weight(), None if bias is None else self._tiled(bias), 1,
                         out=as_gemm(h), snake_alpha=self._tiled(alpha), snake_out=as_gemm(s),
                         bias_after_rounding=True)

    def _tiled(self, v: Tensor) -> Tensor:
        """A per-output-channel vector repeated for the ``stride`` output samples of each GEMM
        row (column ``r * C_out + n`` is channel ``n``); cached until ``v`` changes."""
        cache = self.__dict__.setdefault("_tiled_cache", {})
        key = (v.data_ptr(), v._version, v.dtype, v.device)
        hit = cache.get(id(v))
        if hit is None or hit[0] != key:
            hit = (key, v.detach().reshape(-1).repeat(self.stride).contiguous())
            cache[id(v)] = hit
        return hit[1]

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        if state is None:
            y = F.conv_transpose1d(x, self.full_weight(), self.conv.bias, self.stride)
            return y[..., : y.shape[-1] - self.trim].contiguous()
        y = self.forward_nobias(x, state)
        if self.conv.bias is not None:
            y = y + self.conv.bias[:, None]
        return y

    def forward_nobias(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        """The causal output without the bias (a view [B, C_out, stride·L]); the caller adds
        ``conv.bias`` (the fused decoder does it inside the next Snake). Streaming adds the
        carried overlap tail and saves the new one in place."""
        if self.as_gemm and use_triton(x):
            buf = self.input_buffer(x, x.shape[-1])
            self.fill_context(buf, state)
            buf[..., 1:].copy_(x)
            self.save_context(buf, state)
            return self.gemm_forward(buf)
        n = x.shape[-1] * self.stride
        if self.channels_last:
            y = F.conv_transpose2d(x.unsqueeze(2), self.full_weight().unsqueeze(2), None, (1, self.stride)).squeeze(2)
        else:
            y = F.conv_transpose1d(x, self.full_weight(), None, self.stride)
        if self.trim and state is not None:
            y[..., : self.trim] += state[self.state_key]
            state.store(self.state_key, y[..., n:])
        return y[..., :n]

    def init_stream_state(self, batch_size, device, dtype):
        if self.as_gemm:
            return {self.state_key: torch.zeros(batch_size, self.conv.in_channels, 1, device=device, dtype=dtype)}
        if self.trim == 0:
            return {}
        return {self.state_key: torch.zeros(batch_size, self.conv.out_channels, self.trim, device=device, dtype=dtype)}


def _full_transposed_weight_in_state_dict(module: CausalConvTranspose1d, state_dict, prefix, local_metadata):
    """``state_dict()`` of a transposed conv that keeps only its packed weight: the reference
    layout under ``conv.weight``, as the checkpoint format has it."""
    if module.shares_packed_weight:
        state_dict[prefix + "conv.weight"] = module.full_weight().detach()


def _unshare_before_load(module: CausalConvTranspose1d, state_dict, prefix, *args) -> None:
    """``load_state_dict`` writes ``conv.weight`` in the reference layout: give it its shape
    back first (the packed form is rebuilt from the loaded weight when next needed)."""
    module.unshare_packed_weight()


class ResidualUnit(StreamingModule):
    """Snake → causal conv k7 (dilated) → Snake → causal conv k1, plus the input."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.block = Seq(
            Snake(dim),
            CausalConv1d(dim, dim, 7, dilation=dilation),
            Snake(dim),
            CausalConv1d(dim, dim, 1),
        )

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        return x + self.block(x, state)


class ConvNeXtBlock(StreamingModule):
    """Causal depthwise conv → LayerNorm → Linear(d→r·d) → GELU → Linear → γ → residual."""

    def __init__(self, dim: int, mlp_ratio: float = 4.0, kernel_size: int = 7, eps: float = 1e-6):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))  # registered first: reference key order
        self.dwconv = CausalConv1d(dim, dim, kernel_size, groups=dim, weight_norm=False)
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.pwconv1 = nn.Linear(dim, int(mlp_ratio * dim))
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(int(mlp_ratio * dim), dim)

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        y = self.dwconv(x, state).permute(0, 2, 1)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        y = (self.gamma * y).permute(0, 2, 1)
        return x + y


# --------------------------------------------------------------------------- transformer
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 1e-2))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def _w13_current(self, buf: Tensor) -> bool:
        w1, w3 = self.w1.weight, self.w3.weight
        return (buf.dtype == w1.dtype and buf.device == w1.device and w1.data_ptr() == buf.data_ptr()
                and w3.data_ptr() == buf[w1.shape[0]:].data_ptr() and w1.shape[0] + w3.shape[0] == buf.shape[0])

    def _apply(self, fn, recurse: bool = True):
        # a move that gave w1 / w3 new storage leaves the stacked buffer stale: drop it (a move
        # that changed nothing keeps it, and the weights stay views of it)
        out = super()._apply(fn, recurse)
        buf = self.__dict__.get("_w13")
        if buf is not None and not self._w13_current(buf):
            del self.__dict__["_w13"]
        return out

    def place_w13(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """Put ``w1`` and ``w3`` on ``device`` in ``dtype`` as views of one stacked buffer (what
        :meth:`stacked_w13` makes), stacked where they are and moved once: a stacking done
        after the move would free the two moved weights' blocks, and such freed blocks stay
        reserved between live ones (for the real codec's decode side 0.09 GiB of w1 / w3)."""
        w1, w3 = self.w1.weight, self.w3.weight
        with torch.no_grad():
            buf = torch.cat([w1.detach().to(dtype), w3.detach().to(dtype)], dim=0).to(device)
        # new parameters (a parameter's .data cannot change device type in place)
        self.w1.weight = nn.Parameter(buf[: w1.shape[0]], requires_grad=w1.requires_grad)
        self.w3.weight = nn.Parameter(buf[w1.shape[0]:], requires_grad=w3.requires_grad)
        self.__dict__["_w13"] = buf
        return buf

    def stacked_w13(self) -> Tensor:
        """``cat(w1, w3)`` [2 * hidden, dim] for one GEMM, with no second copy: the first call
        moves both weights into one buffer and leaves ``w1`` / ``w3`` as views of it; called again
        after anything replaced them (a dtype or device move), it stacks them anew."""
        w1, w3 = self.w1.weight, self.w3.weight
        buf = self.__dict__.get("_w13")
        if buf is not None and self._w13_current(buf):
            return buf
        with torch.no_grad():
            buf = torch.cat([w1.detach(), w3.detach()], dim=0)
            self.w1.weight.data = buf[: w1.shape[0]]
            self.w3.weight.data = buf[w1.shape[0]:]
        self.__dict__["_w13"] = buf
        return buf


_ROPE_LOCK = threading.Lock()
_ROPE_CPU: dict[tuple[int, float], Tensor] = {}
_ROPE_DEV: dict[tuple[int, float, str], Tensor] = {}


def _rope_cpu(n: int, head_dim: int, base: float) -> Tensor:
    # Same ops as the reference precompute_freqs_cis (values do not depend on n).
    b = int(base) if float(base).is_integer() else float(base)
    freqs = 1.0 / (b ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    t = torch.arange(n)
    ang = torch.outer(t, freqs)
    cis = torch.polar(torch.ones_like(ang), ang)
    return torch.stack([cis.real, cis.imag], dim=-1).to(torch.bfloat16)


def rope_table(n: int, head_dim: int, base: float, device: torch.device | str = "cpu") -> Tensor:
    """bf16 table [L ≥ n, head_dim/2, 2] of (cos, sin), built on CPU like the reference and cached."""
    device = torch.device(device)
    key = (head_dim, float(base), str(device))
    tab = _ROPE_DEV.get(key)
    if tab is not None and tab.shape[0] >= n:
        return tab
    with _ROPE_LOCK:
        length = max(4096, 1 << max(0, (n - 1)).bit_length())
        cpu = _ROPE_CPU.get(key[:2])
        if cpu is None or cpu.shape[0] < length:
            cpu = _rope_cpu(length, head_dim, base)
            _ROPE_CPU[key[:2]] = cpu
        tab = cpu.to(device)
        _ROPE_DEV[key] = tab
        return tab


def apply_rotary_emb(x: Tensor, cos_sin: Tensor) -> Tensor:
    """Interleaved-pair RoPE in fp32. x [B, T, H, D]; cos_sin bf16 [T, D/2, 2] or [B, T, D/2, 2]."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    if cos_sin.dim() == 3:
        cos_sin = cos_sin[None]
    fc = cos_sin[:, :, None]  # [B|1, T, 1, D/2, 2]
    out = torch.stack(
        [
            xs[..., 0] * fc[..., 0] - xs[..., 1] * fc[..., 1],
            xs[..., 1] * fc[..., 0] + xs[..., 0] * fc[..., 1],
        ],
        dim=-1,
    )
    return out.flatten(3).type_as(x)


def window_mask(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """Bool mask [..., Tq, Tk]: key allowed iff q − window < k ≤ q and k ≥ 0."""
    q = q_pos[..., :, None]
    k = k_pos[..., None, :]
    return (k <= q) & (k > q - window) & (k >= 0)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.n_head * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.dim, bias=False)

    def qkv(self, x: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, self.n_head, self.head_dim).unbind(2)
        q = apply_rotary_emb(q, cos_sin)
        k = apply_rotary_emb(k, cos_sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]

    def qkv_window(self, x: Tensor, window: Tensor, cos_q: Tensor, cos_k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries of the new positions ``x`` [B, t, C]; keys and values of ``window``
        [B, T, C] (the carried positions then ``x``'s): the rows of ``wqkv`` apart, each
        rotated by its own table rows. [B, H, *, D] each."""
        b, t, _ = x.shape
        T = window.shape[1]
        hd = self.n_head * self.head_dim
        w = self.wqkv.weight
        q = F.linear(x, w[:hd]).view(b, t, self.n_head, self.head_dim)
        k, v = F.linear(window, w[hd:]).view(b, T, 2, self.n_head, self.head_dim).unbind(2)
        q = apply_rotary_emb(q, cos_q)
        k = apply_rotary_emb(k, cos_k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def out(self, y: Tensor) -> Tensor:
        b, _, t, _ = y.shape
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        # Registration order matches the reference state-dict order.
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg.dim, cfg.intermediate_size)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention_layer_scale = LayerScale(cfg.dim)
        self.ffn_layer_scale = LayerScale(cfg.dim)

    def ffn(self, h: Tensor) -> Tensor:
        return h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h)))


# one-shot attention is computed in query blocks of this many rows (bounded memory, no T×T mask)
ATTN_QUERY_BLOCK = 1024


class WindowLimitedTransformer(StreamingModule):
    """Causal transformer whose query i sees keys i−window < j ≤ i; channels-first I/O.

    Masks are built on the fly per query block; nothing T×T is registered.
    Streaming state (key = ``state_key``):

    * ``{key}.pos``: int64 [B], frames already consumed by each stream;
    * ``{key}.layers.{i}.k`` / ``.v``: [B, H, window−1, head_dim], the rotated
      keys / values of the last window−1 positions (older slots of a young
      stream are masked by position), when ``window_state == "kv"`` (default);
    * ``{key}.layers.{i}.h``: [B, window−1, dim], the layer's normed inputs of the
      last window−1 positions instead, when ``window_state == "hidden"``: half the
      bytes per stream; each call recomputes those positions' keys and values
      (one GEMM over window−1 + t rows per layer instead of t) -- the same
      function, not the same bits;
    * ``{key}.layers.{i}.k`` / ``.v`` in ring order when ``window_state == "ring"``:
      position p's key in slot p mod (window−1), read in place by
      :func:`~shoal.kernels.window_attention.window_attention` (no concatenation,
      no mask tensor) and written only at the new positions' slots -- the same
      function as ``kv``, not the same bits (the softmax sums in another order).

    With ``kernels`` (``Codec.configure_serving(transformer_kernels=True)``) a streaming call with
    the ``kv`` or ``ring`` state runs :meth:`_forward_stream_kernels`: each residual add with its
    LayerScale and the RMSNorm after it is one kernel, RoPE one kernel, SiLU*mul one kernel, and
    w1 / w3 one GEMM -- the module's roundings in the module's order (see
    :mod:`shoal.kernels.fused` for where reductions differ).
    """

    WINDOW_STATES = ("kv", "hidden", "ring")

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.window = cfg.window_size
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.window_state = "kv"  # Codec.configure_serving(window_state=...), before new_state
        self.kernels = False  # Codec.configure_serving(transformer_kernels=...)
        # set by StreamingDecoder.new_state once a real state is laid out in the current
        # window_state (the serving defaults do not change the window state under it)
        self.states_made = False

    def _rope(self, n: int, device) -> Tensor:
        return rope_table(n, self.cfg.head_dim, self.cfg.rope_base, device)

    def forward(self, x: Tensor, state: StreamState | None = None, rope: Tensor | None = None) -> Tensor:
        """``rope``: a preallocated RoPE table covering every position of this call
        (CUDA-graph capture); by default the shared table is grown as needed."""
        x = x.transpose(1, 2)  # [B, T, C]
        if state is None:
            x = self.norm(self._forward_full(x))
        elif self._use_kernels(x):
            x = self._forward_stream_kernels(x, state, rope)  # ends with the final norm
        else:
            x = self.norm(self._forward_stream(x, state, rope))
        return x.transpose(1, 2)

    def _use_kernels(self, x: Tensor) -> bool:
        """Whether a streaming call on ``x`` runs :meth:`_forward_stream_kernels`: ``kernels`` set,
        the ``kv`` or ``ring`` state, new rows, the kernels can run (CUDA or the interpreter) and
        every parameter has x's dtype (the kernels round to one dtype, as the module does then)."""
        return (self.kernels and self.window_state in ("kv", "ring") and x.shape[1] > 0
                and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and use_triton(x)
                and x.shape[-1] <= 8192 and self.norm.weight.dtype == x.dtype)

    def _forward_full(self, x: Tensor) -> Tensor:
        T = x.shape[1]
        dev = x.device
        cos_sin = self._rope(T, dev)[:T]
        pos = torch.arange(T, device=dev)
        W = self.window
        QB = ATTN_QUERY_BLOCK
        blocks = [(s, min(T, s + QB)) for s in range(0, T, QB)] or [(0, 0)]
        masks = []
        for s, e in blocks:
            ks = max(0, s - W + 1)
            masks.append((ks, window_mask(pos[s:e], pos[ks:e], W)))
        for layer in self.layers:
            q, k, v = layer.attention.qkv(layer.attention_norm(x), cos_sin)
            if len(blocks) == 1:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[0][1])
            else:
                y = torch.cat(
                    [
                        F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e], attn_mask=m)
                        for (s, e), (ks, m) in zip(blocks, masks)
                    ],
                    dim=2,
                )
            h = x + layer.attention_layer_scale(layer.attention.out(y))
            x = layer.ffn(h)
        return x

    def _forward_stream(self, x: Tensor, state: StreamState, rope: Tensor | None = None) -> Tensor:
        """Queries of the new t frames over [last window−1 cached | new] keys (never T×T).

        State tensors are updated in place (static buffers for CUDA graphs)."""
        key = self.state_key
        B, t, _ = x.shape
        if t == 0:
            return x
        dev = x.device
        P = self.window - 1
        pos = state[f"{key}.pos"]  # [B]
        bound = state.bounds.get(key, 0) + t
        table = rope if rope is not None else self._rope(bound, dev)
        ar = torch.arange(t, device=dev)
        q_pos = pos[:, None] + ar  # [B, t]
        # a fixed table (graphs) cannot grow: positions past it are clamped (documented limit)
        cos_sin = table[q_pos if rope is None else q_pos.clamp(max=table.shape[0] - 1)]  # [B, t, D/2, 2]
        if self.window_state == "ring":
            return self._forward_ring(x, state, cos_sin, pos, bound)
        hidden = self.window_state == "hidden"
        k_pos, mask = self._window_keys(pos, q_pos)
        if hidden:  # the window's keys are rotated again: negative (masked) positions read row 0
            k_cs = table[k_pos.clamp(min=0, max=table.shape[0] - 1)]  # [B, P + t, D/2, 2]
        for i, layer in enumerate(self.layers):
            if hidden:
                hn = layer.attention_norm(x)
                hk = f"{key}.layers.{i}.h"
                hh = torch.cat([state[hk].to(hn.dtype), hn], dim=1)  # [B, P + t, C]
                state.store(hk, hh[:, hh.shape[1] - P:])
                q, k, v = layer.attention.qkv_window(hn, hh, cos_sin, k_cs)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                q, k, v = layer.attention.qkv(layer.attention_norm(x), cos_sin)
                y = self._attend_kv(i, q, k, v, state, mask)
            h = x + layer.attention_layer_scale(layer.attention.out(y))
            x = layer.ffn(h)
        state.store(f"{key}.pos", pos + t)
        state.bounds[key] = bound
        return x

    def _window_keys(self, pos: Tensor, q_pos: Tensor) -> tuple[Tensor, Tensor]:
        """The ``kv`` window's key positions [B, P + t] (carried, then new) and the attention
        mask [B, 1, t, P + t] of queries at ``q_pos`` [B, t]."""
        P = self.window - 1
        k_pos = torch.cat([pos[:, None] - P + torch.arange(P, device=pos.device), q_pos], dim=1)
        return k_pos, window_mask(q_pos, k_pos, self.window)[:, None]

    def _attend_kv(self, i: int, q: Tensor, k: Tensor, v: Tensor, state: StreamState, mask: Tensor) -> Tensor:
        """Layer ``i``'s attention with the ``kv`` state: the new keys / values after the carried
        window, whose last window−1 become the new state."""
        P, key = self.window - 1, self.state_key
        kk, vk = f"{key}.layers.{i}.k", f"{key}.layers.{i}.v"
        k = torch.cat([state[kk].to(k.dtype), k], dim=2)
        v = torch.cat([state[vk].to(v.dtype), v], dim=2)
        state.store(kk, k[:, :, k.shape[2] - P:])
        state.store(vk, v[:, :, v.shape[2] - P:])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _attend_ring(self, i: int, q: Tensor, k: Tensor, v: Tensor, state: StreamState, pos: Tensor,
                     slots: Tensor) -> Tensor:
        """Layer ``i``'s attention with the ``ring`` state: over the ring in place, then the new
        positions' ``slots`` (``ring_slots``) written."""
        from ..kernels.window_attention import ring_write, window_attention

        kbuf, rows = state.rows(f"{self.state_key}.layers.{i}.k")
        vbuf, _ = state.rows(f"{self.state_key}.layers.{i}.v")
        y = window_attention(q, kbuf, vbuf, k, v, pos, self.window, rows)
        ring_write(kbuf, k, slots, rows)  # after the attention read the ring (stream order)
        ring_write(vbuf, v, slots, rows)
        return y

    def _forward_ring(self, x: Tensor, state: StreamState, cos_sin: Tensor, pos: Tensor, bound: int) -> Tensor:
        """The ``ring`` window: each layer attends over its ring of carried keys and the new
        ones in place, then writes the new positions' slots (see the class docstring)."""
        from ..kernels.window_attention import ring_slots

        key = self.state_key
        t = x.shape[1]
        slots = ring_slots(pos, t, self.window - 1)  # every layer writes the same slots
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attention.qkv(layer.attention_norm(x), cos_sin)
            y = self._attend_ring(i, q, k, v, state, pos, slots)
            h = x + layer.attention_layer_scale(layer.attention.out(y))
            x = layer.ffn(h)
        state.store(f"{key}.pos", pos + t)
        state.bounds[key] = bound
        return x

    def _forward_stream_kernels(self, x: Tensor, state: StreamState, rope: Tensor | None = None) -> Tensor:
        """:meth:`_forward_stream` (``kv`` or ``ring`` state) through the fused kernels, the final
        norm included: per layer wqkv, RoPE, attention, wo, add+LayerScale+RMSNorm, w1|w3,
        SiLU*mul, w2, add+LayerScale+RMSNorm (the next layer's norm, or the final one)."""
        from ..kernels.paged_attention import pdl_suppressed

        # the fused kernels launch normally here (their PDL waits become no-ops): the codec's
        # calls are prefill-like, many rows per launch, where PDL measured slower in the LLM's
        # prefill, and the codec's other kernels launch without it
        with pdl_suppressed():
            return self._forward_stream_kernels_body(x, state, rope)

    def _forward_stream_kernels_body(self, x: Tensor, state: StreamState, rope: Tensor | None) -> Tensor:
        from ..kernels.codec_rope import rope_qkv
        from ..kernels.fused import add_rmsnorm, silu_mul

        key = self.state_key
        t = x.shape[1]
        pos = state[f"{key}.pos"]  # [B]
        bound = state.bounds.get(key, 0) + t
        table = rope if rope is not None else self._rope(bound, x.device)
        ring = self.window_state == "ring"
        if ring:
            from ..kernels.window_attention import ring_slots

            slots = ring_slots(pos, t, self.window - 1)
        else:
            _, mask = self._window_keys(pos, pos[:, None] + torch.arange(t, device=x.device))
        layers = list(self.layers)
        n, h = add_rmsnorm(x.contiguous(), None, layers[0].attention_norm.weight, layers[0].attention_norm.eps)
        for i, layer in enumerate(layers):
            att = layer.attention
            q, k, v = rope_qkv(F.linear(n, att.wqkv.weight), table, pos, self.cfg.n_head, self.cfg.head_dim,
                               clamp=rope is not None)
            if ring:
                y = self._attend_ring(i, q, k, v, state, pos, slots)
            else:
                y = self._attend_kv(i, q, k, v, state, mask)
            n, h = add_rmsnorm(h, att.out(y), layer.ffn_norm.weight, layer.ffn_norm.eps,
                               residual_scale=layer.attention_layer_scale.gamma)
            ff = layer.feed_forward
            f = F.linear(silu_mul(F.linear(n, ff.stacked_w13())), ff.w2.weight)
            nxt = layers[i + 1].attention_norm if i + 1 < len(layers) else self.norm
            n, h = add_rmsnorm(h, f, nxt.weight, nxt.eps, residual_scale=layer.ffn_layer_scale.gamma)
        state.store(f"{key}.pos", pos + t)
        state.bounds[key] = bound
        return n

    def init_stream_state(self, batch_size, device, dtype):
        key = self.state_key
        P = self.window - 1
        out = {f"{key}.pos": torch.zeros(batch_size, dtype=torch.long, device=device)}
        if self.window_state == "hidden":
            for i in range(self.cfg.n_layer):
                out[f"{key}.layers.{i}.h"] = torch.zeros(batch_size, P, self.cfg.dim, device=device, dtype=dtype)
            return out
        shape = (batch_size, self.cfg.n_head, P, self.cfg.head_dim)
        for i in range(self.cfg.n_layer):
            out[f"{key}.layers.{i}.k"] = torch.zeros(shape, device=device, dtype=dtype)
            out[f"{key}.layers.{i}.v"] = torch.zeros(shape, device=device, dtype=dtype)
        return out
