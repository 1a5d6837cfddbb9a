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
    """16 hex digits identifying the codec's weights (shape, dtype, head, tail and sum of every
    tensor of its state dict; one device transfer)."""
    import torch

    h = hashlib.sha256(f"{type(codec).__name__}:{getattr(codec, 'sample_rate', '')}".encode())
    stats = []
    with torch.no_grad():
        for name, t in codec.state_dict().items():
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
        x = torch.as_tensor(np.asarray(samples, dtype=np.float32), device=param.device)[None, None]
        with lock or nullcontext(), torch.inference_mode():
            codes, lengths = codec.encode(x.to(param.dtype))
        return codes[0, :, : int(lengths[0])].cpu().numpy().astype(np.int64)

    return encode
