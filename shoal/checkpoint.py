"""Open a checkpoint directory as users download it: config, tokenizer, DualAR weights, codec.

``codec.pth`` sits beside the model weights in both S2-Pro and S1-mini downloads; a
``codec_config.json`` beside it describes a non-default codec (tiny test checkpoints).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .model.config import ModelConfig
from .model.dualar import DualAR
from .model.loader import CheckpointError, load_model
from .text import TextTokenizer, load_tokenizer

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
          "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of bf16, fp32, fp16")
    return DTYPES[dtype]


CODEC_DTYPE_CHOICES = ("auto", "fp32", "bf16")  # --codec-dtype


def resolve_codec_dtypes(choice: str | torch.dtype | None, device: torch.device | str) -> tuple[torch.dtype, torch.dtype]:
    """``--codec-dtype`` -> (encode-side dtype, decode-side dtype) of the codec.

    ``auto`` (or None): on CUDA the decode side in bf16 (the Triton conv + fused Snake serving
    path, ~2.5x the fp32 decode's speed) and the encode side in fp32 (reference audio gives the
    reference's codes), as the reference server runs them; fp32 everywhere on any other
    device. Any other choice (``fp32``, ``bf16``, a dtype name or a ``torch.dtype``) puts the
    whole codec in that precision.
    """
    if choice in (None, "auto"):
        dev_type = device if isinstance(device, str) else device.type
        dev_type = dev_type.split(":", 1)[0]
        return (torch.float32, torch.bfloat16) if dev_type == "cuda" else (torch.float32, torch.float32)
    dt = resolve_dtype(choice, torch.device("cpu"))
    return dt, dt


def dtype_name(dtype: torch.dtype) -> str:
    """bf16 / fp32 / fp16 (else the torch name)."""
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(
        dtype, str(dtype).removeprefix("torch."))


def read_config(path: str | Path, tokenizer: TextTokenizer) -> ModelConfig:
    """config.json reconciled with the tokenizer's semantic id range."""
    path = Path(path)
    config = ModelConfig.from_file(path / "config.json")
    begin, end = tokenizer.semantic_begin_id, tokenizer.semantic_end_id
    if config.semantic_begin_id is not None and (config.semantic_begin_id, config.semantic_end_id) != (begin, end):
        raise CheckpointError(
            f"{path / 'config.json'}: semantic ids {config.semantic_begin_id}..{config.semantic_end_id} "
            f"disagree with the tokenizer's <|semantic:0..4095|> ids {begin}..{end}")
    if end >= config.vocab_size:
        raise CheckpointError(f"{path}: tokenizer ids reach {end} but vocab_size is {config.vocab_size}")
    if end - begin + 1 != config.codebook_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {end - begin + 1} semantic tokens, the model "
            f"{config.codebook_size} semantic codes")
    return config.with_semantic_ids(begin, end)


QUANTIZATIONS = ("none", "fp8")


def load_dualar(path: str | Path, device: str | torch.device | None = "cpu",
                dtype: str | torch.dtype | None = None,
                max_seq_len: int | None = None,
                quantization: str | None = None) -> tuple[DualAR, TextTokenizer]:
    """Load the DualAR model and its tokenizer from a checkpoint directory.

    An FP8 checkpoint written by ``shoal quantize`` is recognized by its header and loaded with
    its block-scaled weights (layout verified). ``quantization="fp8"`` quantizes a bf16
    checkpoint at load (the transformer Linears and both heads, as ``shoal quantize`` does);
    ``"none"`` / None keeps the checkpoint's weights as stored."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
    dev = resolve_device(device if isinstance(device, str) or device is None else str(device))
    dt = resolve_dtype(dtype, dev)
    tokenizer = load_tokenizer(path)
    config = read_config(path, tokenizer)
    if max_seq_len:
        config = config.with_max_seq_len(max_seq_len)
    from .quant.loader import is_fp8_checkpoint, load_fp8_model

    if is_fp8_checkpoint(path):
        return load_fp8_model(path, config, device=dev, dtype=dt), tokenizer
    model = load_model(path, config, device=dev, dtype=dt)
    if quantization == "fp8":
        from .quant.convert import quantize_model

        quantize_model(model, include_heads=True)
    return model, tokenizer


def codec_path(path: str | Path) -> Path:
    p = Path(path)
    return p if p.suffix == ".pth" else p / "codec.pth"
