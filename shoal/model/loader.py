"""Load DualAR weights from the formats users download.

- S2-Pro: ``model.safetensors.index.json`` + shards (or one ``model.safetensors``) with
  ``text_model.model.*`` / ``audio_decoder.*`` names, remapped to native names.
- openaudio-s1-mini: ``model.pth``, a (possibly ``state_dict``-wrapped, ``model.``-prefixed)
  torch state dict with native names.

Every problem is reported with the file, the key, and the expected and found shapes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from .config import ModelConfig
from .dualar import DualAR


class CheckpointError(ValueError):
    """A checkpoint directory or weight file that cannot be loaded."""


# Buffers some exporters leave in the state dict; never weights.
_STALE_SUFFIXES = ("freqs_cis", "causal_mask")
_PROGRESS_BYTES = 256 << 20


def remap_s2_key(key: str) -> str:
    """On-disk S2 name -> native name (spec §3.2 step 5)."""
    if key.startswith("text_model.model."):
        return key[len("text_model.model."):]
    if key.startswith("audio_decoder.codebook_embeddings."):
        return key[len("audio_decoder."):]
    if key.startswith("audio_decoder."):
        return "fast_" + key[len("audio_decoder."):]
    return key


def s2_disk_key(native: str) -> str:
    """Native name -> S2 on-disk name (the inverse of :func:`remap_s2_key`)."""
    if native.startswith("codebook_embeddings."):
        return "audio_decoder." + native
    if native.startswith("fast_"):
        return "audio_decoder." + native[len("fast_"):]
    return "text_model.model." + native


def _weight_files(ckpt: Path) -> tuple[str, list[Path]]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted({ckpt / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {index.name} is missing")
        return "safetensors", files
    single = ckpt / "model.safetensors"
    if single.is_file():
        return "safetensors", [single]
    pth = ckpt / "model.pth"
    if pth.is_file():
        return "pth", [pth]
    raise CheckpointError(
        f"{ckpt}: no weights found (looked for model.safetensors.index.json, model.safetensors, "
        "model.pth)"
    )


def _iter_safetensors(files: list[Path], device: str) -> Iterator[tuple[str, torch.Tensor, Path]]:
    from safetensors import safe_open

    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device=device)
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{f}: cannot read safetensors file ({e})") from e
        with handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key), f


def _iter_pth(path: Path) -> Iterator[tuple[str, torch.Tensor, Path]]:
    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read torch checkpoint ({e})") from e
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise CheckpointError(f"{path}: expected a state dict, found {type(sd).__name__}")
    for key, value in sd.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key.startswith("model."):
            key = key[len("model."):]
        if "audio_" in key:  # the reference drops audio-feature projector weights
            continue
        yield key, value, path


def read_state_dict(ckpt: str | Path, config: ModelConfig, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Read, remap and validate weights into native names, cast to ``dtype`` on ``device``."""
    ckpt = Path(ckpt)
    kind, files = _weight_files(ckpt)
    expected = config.expected_shapes()
    total = sum(f.stat().st_size for f in files)
    it = _iter_safetensors(files, "cpu") if kind == "safetensors" else _iter_pth(files[0])
    out: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    legacy_qkv: dict[str, dict[str, torch.Tensor]] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {ckpt.name}", file=sys.stderr,
               disable=total < _PROGRESS_BYTES)
    with bar:
        for raw_key, tensor, f in it:
            bar.update(tensor.numel() * tensor.element_size())
            key = remap_s2_key(raw_key)
            if key.endswith(_STALE_SUFFIXES):
                continue
            for part in ("wq", "wk", "wv"):  # legacy separate projections
                suffix = f".attention.{part}.weight"
                if key.endswith(suffix):
                    legacy_qkv.setdefault(key[: -len(suffix)], {})[part] = tensor
                    where[key[: -len(suffix)] + ".attention.wqkv.weight"] = f
                    break
            else:
                if key not in expected:
                    raise CheckpointError(
                        f"{f}: unexpected key {raw_key!r} (native name {key!r}) for a "
                        f"{config.family} model with {config.slow.n_layer} slow / "
                        f"{config.fast.n_layer} fast layers"
                    )
                out[key] = tensor
                where[key] = f
    for prefix, parts in legacy_qkv.items():
        if set(parts) != {"wq", "wk", "wv"}:
            raise CheckpointError(f"{where[prefix + '.attention.wqkv.weight']}: {prefix}.attention "
                                  f"has only {sorted(parts)} of wq/wk/wv")
        out[prefix + ".attention.wqkv.weight"] = torch.cat([parts["wq"], parts["wk"], parts["wv"]])
    missing = [k for k in expected if k not in out]
    if missing:
        shown = ", ".join(f"{k} {list(expected[k])}" for k in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{ckpt}: missing weights: {shown}{more}")
    for key, tensor in out.items():
        if tuple(tensor.shape) != expected[key]:
            raise CheckpointError(
                f"{where[key]}: shape mismatch for {key!r}: expected {list(expected[key])}, "
                f"found {list(tensor.shape)}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"{where[key]}: {key!r} has non-float dtype {tensor.dtype}")
    return {k: v.to(device=device, dtype=dtype) for k, v in out.items()}


def load_model(ckpt: str | Path, config: ModelConfig, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.bfloat16) -> DualAR:
    """Build a :class:`DualAR` on ``device`` with weights from ``ckpt`` (no random init pass)."""
    state = read_state_dict(ckpt, config, device=device, dtype=dtype)
    with torch.device("meta"):
        model = DualAR(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.init_buffers(device)
    return model.eval().requires_grad_(False)
