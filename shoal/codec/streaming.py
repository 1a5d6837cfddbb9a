"""Streaming decode: a few frames at a time, with carried causal state.

Every operator of the decode path (codes → z_q → post_module → upsample →
decoder) is causal, so the output samples of frames [a, a+t) depend only on
frames < a+t.  :class:`StreamingDecoder` keeps exactly the context each
operator needs and never re-decodes a past frame; the concatenation of
chunk outputs equals the one-shot :meth:`Codec.decode` (up to fp rounding)
for any chunk schedule.

State layout (:class:`DecoderState`, one row per stream; all tensors have
the stream index as dim 0, so rows can be gathered, scattered, stacked and
reset independently, e.g. one row per engine request slot):

======================================================  ==============================  =====
key                                                     shape (per stream)              what
======================================================  ==============================  =====
``quantizer.post_module.pos``                           [] int64                        frames consumed (RoPE position of the next frame)
``quantizer.post_module.layers.{i}.k`` / ``.v``         [H, window−1, head_dim]         rotated keys / values of the last window−1 frames
``quantizer.upsample.{j}.0``                            [C, k − stride]                 transposed-conv overlap tail (absent when k == stride)
``quantizer.upsample.{j}.1.dwconv``                     [C, kernel − 1]                 ConvNeXt depthwise-conv input context
``decoder.model.0`` …                                   [C_in, (k−1)·dilation]          causal-conv input context (k = 1 convs carry none)
``decoder.model.{b}.block.1``                           [C_out, k − stride]             decoder transposed-conv overlap tail
======================================================  ==============================  =====

Fresh streams are all-zero rows (zero context == the one-shot zero padding;
cache slots at negative positions are masked).  ``state.bounds`` holds a
host-side upper bound of positions so the RoPE table is sized without a
device sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .layers import StreamState
from .model import Codec

__all__ = ["DecoderState", "StreamingDecoder"]

DecoderState = StreamState


class StreamingDecoder:
    """Batched streaming decoder over a loaded :class:`Codec`.

    >>> dec = StreamingDecoder(codec)
    >>> state = dec.new_state(batch_size=2)
    >>> audio = dec.decode_chunk(codes[:, :, :3], state)   # [2, 1, 3·2048], state advanced
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self.frame_length = codec.frame_length
        self.num_codebooks = codec.num_codebooks
        self._stateful = [
            m
            for root in (codec.quantizer.post_module, codec.quantizer.upsample, codec.decoder)
            for m in root.modules()
            if hasattr(m, "init_stream_state")
        ]

    def new_state(self, batch_size: int = 1, device=None, dtype=None) -> DecoderState:
        """Fresh state for ``batch_size`` independent streams."""
        device = self.codec.device if device is None else device
        dtype = self.codec.dtype if dtype is None else dtype
        tensors: dict[str, Tensor] = {}
        for m in self._stateful:
            tensors.update(m.init_stream_state(batch_size, device, dtype))
        bounds = {self.codec.quantizer.post_module.state_key: 0}
        return DecoderState(tensors, bounds)

    def state_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-stream shape and dtype of every state tensor (for preallocating slot pools)."""
        st = self.new_state(1, device="meta")
        return {k: (tuple(v.shape[1:]), v.dtype) for k, v in st.tensors.items()}

    def state_nbytes_per_stream(self) -> int:
        return self.new_state(1, device="meta").nbytes()

    @torch.no_grad()
    def decode_chunk(self, codes: Tensor, state: DecoderState) -> Tensor:
        """codes [B, 10, t] (next t frames of each stream) → audio [B, 1, 2048·t]; advances ``state``.

        Out-of-range codes are clamped like :meth:`Codec.decode` (on a copy).
        """
        if codes.dim() == 2:
            codes = codes[None]
        if codes.dim() != 3 or codes.shape[1] != self.num_codebooks:
            raise ValueError(f"codes must be [B, {self.num_codebooks}, t], got shape {tuple(codes.shape)}")
        B, _, t = codes.shape
        if B != state.batch_size:
            raise ValueError(f"codes have batch {B} but the state holds {state.batch_size} streams")
        if t == 0:
            return torch.zeros(B, 1, 0, device=self.codec.device, dtype=self.codec.dtype)
        z = self.codec.decode_latent(codes, state)
        return self.codec.decoder(z, state)
