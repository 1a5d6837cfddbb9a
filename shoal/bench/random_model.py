"""Random-weight DualAR models at the real published shapes, for benchmarks.

Speed does not depend on weight values, so benchmarks build S2-Pro / S1-mini shapes directly on
the device with small random weights (no checkpoint, no download).
"""

from __future__ import annotations

import numpy as np
import torch

from ..model.config import ModelConfig, TransformerShape
from ..model.dualar import DualAR

S2_SEMANTIC_BEGIN = 151678
S2_IM_END = 151645


def s2_pro_config(max_seq_len: int = 32768) -> ModelConfig:
    slow = TransformerShape(dim=2560, n_layer=36, n_head=32, n_local_heads=8, head_dim=128,
                            intermediate_size=9728, qk_norm=True)
    fast = TransformerShape(dim=2560, n_layer=4, n_head=32, n_local_heads=8, head_dim=128,
                            intermediate_size=9728)
    return ModelConfig(family="s2", vocab_size=155776, slow=slow, fast=fast, max_seq_len=max_seq_len,
                       semantic_begin_id=S2_SEMANTIC_BEGIN, semantic_end_id=S2_SEMANTIC_BEGIN + 4095,
                       eos_token_id=S2_IM_END)


def tiny_config(max_seq_len: int = 4096) -> ModelConfig:
    """A small model with S2's vocabulary layout (CPU smoke runs of the benchmarks)."""
    slow = TransformerShape(dim=64, n_layer=2, n_head=4, n_local_heads=2, head_dim=32,
                            intermediate_size=128, qk_norm=True)
    fast = TransformerShape(dim=64, n_layer=2, n_head=4, n_local_heads=2, head_dim=32, intermediate_size=128)
    return ModelConfig(family="s2", vocab_size=155776, slow=slow, fast=fast, max_seq_len=max_seq_len,
                       semantic_begin_id=S2_SEMANTIC_BEGIN, semantic_end_id=S2_SEMANTIC_BEGIN + 4095,
                       eos_token_id=S2_IM_END)


@torch.no_grad()
def random_dualar(config: ModelConfig, device: str | torch.device = "cuda",
                  dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                  quantization: str | None = None) -> DualAR:
    """``quantization="fp8"``: the transformer Linears (and both heads) become block-scaled FP8
    (:func:`shoal.quant.quantize_model`), as ``shoal serve --quantization fp8`` does at load."""
    model = _random_dualar(config, device, dtype, seed)
    if quantization in (None, "none", "bf16"):
        return model
    if quantization != "fp8":
        raise ValueError(f"unknown quantization {quantization!r}")
    from ..quant.convert import quantize_model

    quantize_model(model, include_heads=True)
    return model


def _random_dualar(config: ModelConfig, device, dtype, seed) -> DualAR:
    with torch.device("meta"):
        model = DualAR(config)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    model.init_buffers(device)
    return model.eval().requires_grad_(False)


def random_prompt(config: ModelConfig, text_tokens: int, ref_frames: int, rng: np.random.Generator) -> np.ndarray:
    """A grid shaped like a cloning prompt: text tokens then a reference's VQ part then text."""
    C = config.num_codebooks
    head = text_tokens // 2
    grid = np.zeros((C + 1, text_tokens + ref_frames), dtype=np.int64)
    grid[0, :head] = rng.integers(0, 151643, head)
    codes = np.concatenate([rng.integers(0, 4096, (1, ref_frames)), rng.integers(0, 1024, (C - 1, ref_frames))])
    grid[0, head: head + ref_frames] = config.semantic_begin_id + codes[0]
    grid[1:, head: head + ref_frames] = codes
    grid[0, head + ref_frames:] = rng.integers(0, 151643, text_tokens - head)
    return grid


def random_codec(device: str | torch.device = "cuda", dtype: torch.dtype = torch.float32, seed: int = 0,
                 config=None, decode_dtype: torch.dtype | None = None):
    """The real-size modded-DAC codec (391M parameters) with random weights (or the codec of
    ``config``, a :class:`~shoal.codec.config.CodecConfig`), in ``dtype``; ``decode_dtype``
    puts the decode-only modules in another precision (as ``load_codec``)."""
    from ..codec.config import CodecConfig
    from ..codec.loader import convert_state_dict
    from ..codec.model import Codec
    from ..codec.random_init import random_codec_state_dict

    cfg = config if config is not None else CodecConfig.real()
    with torch.device("meta"):
        codec = Codec(cfg)
    expected = {k: v.shape for k, v in codec.state_dict().items()}
    weights = convert_state_dict(random_codec_state_dict(cfg, seed), expected, source="random")
    codec.load_state_dict(weights, strict=True, assign=True)
    return codec.place(device, dtype, decode_dtype).eval().requires_grad_(False)
