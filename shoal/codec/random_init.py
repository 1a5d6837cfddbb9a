"""Deterministic random codec checkpoints in the real reference ``codec.pth`` format.

Used by test fixtures and demo checkpoints.  The key set, order and shapes are
exactly those of ``torch.save(DAC.state_dict())`` of the reference for the
given config: parametrized weight norm (``original0`` = g, ``original1`` = v)
on the causal convs, old-style ``weight_g`` / ``weight_v`` on the VQ
projections, plain weights on the quantizer down/upsample convs and ConvNeXt
blocks, Snake ``alpha`` [1, C, 1], and so on.

Values follow the random-init recipe of ``golden/codec_tiny/README.md``
(every entry drawn in state-dict order from one ``torch.Generator``), which
keeps the decoded audio well inside [-1, 1].
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from torch import Tensor

from .config import CodecConfig
from .layers import CausalConv1d, CausalConvTranspose1d
from .model import Codec, VectorQuantize

__all__ = ["reference_key_shapes", "random_codec_state_dict", "write_random_codec"]

_PARAM = ".parametrizations.weight.original"


def reference_key_shapes(config: CodecConfig) -> dict[str, tuple[int, ...]]:
    """Ordered ``{key: shape}`` of the reference ``codec.pth`` for ``config``."""
    with torch.device("meta"):
        model = Codec(config)
    wn_param: set[str] = set()  # prefixes "X.conv" with parametrized weight norm
    wn_old: set[str] = set()  # prefixes with old-style weight norm
    for name, m in model.named_modules():
        if isinstance(m, (CausalConv1d, CausalConvTranspose1d)) and m.weight_norm:
            wn_param.add(name + ".conv")
        elif isinstance(m, VectorQuantize):
            wn_old.update((name + ".in_proj", name + ".out_proj"))
    sd = model.state_dict()
    out: dict[str, tuple[int, ...]] = {}
    for key, t in sd.items():
        prefix, leaf = key.rsplit(".", 1)
        shape = tuple(t.shape)
        if prefix in wn_param or prefix in wn_old:
            if leaf == "bias":
                continue  # emitted together with the weight
            g_shape = (shape[0],) + (1,) * (len(shape) - 1)
            if prefix + ".bias" in sd:
                out[prefix + ".bias"] = tuple(sd[prefix + ".bias"].shape)
            if prefix in wn_param:
                out[prefix + _PARAM + "0"] = g_shape
                out[prefix + _PARAM + "1"] = shape
            else:
                out[prefix + ".weight_g"] = g_shape
                out[prefix + ".weight_v"] = shape
        else:
            out[key] = shape
    return out


def _value(key: str, shape: tuple[int, ...], gen: torch.Generator, last_decoder_conv: str) -> Tensor:
    def randn() -> Tensor:
        return torch.randn(shape, generator=gen)

    if key.endswith(_PARAM + "0") or key.endswith(".weight_g"):
        if re.search(r"\.block\.3\.conv" + re.escape(_PARAM) + "0$", key):
            return 0.25 * torch.exp(0.25 * randn())
        if key.startswith(last_decoder_conv + "."):
            return 0.3 * torch.exp(0.25 * randn())
        return torch.exp(0.25 * randn())
    if key.endswith(_PARAM + "1") or key.endswith(".weight_v"):
        return randn()
    if key.endswith(".alpha"):
        return torch.exp(0.4 * randn())
    if key.endswith("codebook.weight"):
        return randn()
    if key.endswith(".gamma"):
        return 0.3 + 0.1 * randn()
    leaf_module = key.rsplit(".", 2)[-2]
    if leaf_module.endswith("norm"):
        if key.endswith(".weight"):
            return 1 + 0.1 * randn()
        return 0.05 * randn()
    if key.endswith(".bias"):
        return 0.02 * randn()
    fan_in = math.prod(shape[1:])
    return randn() / math.sqrt(fan_in)


def random_codec_state_dict(config: CodecConfig, seed: int) -> dict[str, Tensor]:
    """The reference-format state dict (fp32), drawn deterministically from ``seed``."""
    gen = torch.Generator().manual_seed(int(seed))
    last = f"decoder.model.{len(config.decoder_rates) + 2}"
    return {k: _value(k, s, gen, last).float().contiguous() for k, s in reference_key_shapes(config).items()}


def write_random_codec(out_dir: str | Path, config: CodecConfig, seed: int) -> Path:
    """Write ``codec.pth`` + ``codec_config.json`` into ``out_dir``; returns the ``codec.pth`` path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "codec.pth"
    torch.save(random_codec_state_dict(config, seed), path)
    config.to_json(out / "codec_config.json")
    return path
