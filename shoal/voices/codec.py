"""The codec side of the voice store: a fingerprint of the codec's weights and an encoder.

Stored codes are only valid for the codec that produced them, so the store keeps them per
:func:`codec_fingerprint`. A server (or ``shoal voices add``) whose codec has another
fingerprint re-encodes each sample once from the stored audio.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from contextlib import nullcontext

import numpy as np

Encoder = Callable[[np.ndarray], np.ndarray]


def codec_fingerprint(codec) -> str:
    """16 hex digits identifying the weights the codec's codes depend on (shape, dtype, head,
    tail and sum of every tensor of its state dict; one device transfer). The decode-only
    modules of a shoal :class:`~shoal.codec.Codec` (``decode_modules()``) are left out: they
    do not change the codes, so a codec decoding in bf16 and encoding in fp32 shares its
    stored codes with the all-fp32 codec."""
    import torch

    h = hashlib.sha256(f"{type(codec).__name__}:{getattr(codec, 'sample_rate', '')}".encode())
    decode_only: set[int] = set()
    if hasattr(codec, "decode_modules"):
        decode_only = {id(p) for m in codec.decode_modules() for p in m.parameters()}
    stats = []
    with torch.no_grad():
        for name, t in codec.state_dict(keep_vars=True).items():
            if id(t) in decode_only:
                continue
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
            if t.numel() == 0:
                continue
            flat = t.detach().reshape(-1).to(torch.float64)
            stats += [flat[:8], flat[-8:], flat.sum().reshape(1)]
        if stats:
            h.update(torch.cat(stats).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def codec_encoder(codec, lock: threading.Lock | None = None) -> Encoder:
    """Float32 mono samples at the codec rate -> int64 codes ``[codebooks, frames]``; ``lock``
    serialises codec use with other users (the server's inline-reference encoding)."""
    import torch

    def encode(samples: np.ndarray) -> np.ndarray:
        param = next(codec.parameters())
        # the encode side's precision (fp32 under --codec-dtype auto, whatever the decode side's)
        dtype = getattr(codec, "encode_dtype", param.dtype)
        x = torch.as_tensor(np.asarray(samples, dtype=np.float32), device=param.device)[None, None]
        with lock or nullcontext(), torch.inference_mode():
            codes, lengths = codec.encode(x.to(dtype))
        return codes[0, :, : int(lengths[0])].cpu().numpy().astype(np.int64)

    return encode
