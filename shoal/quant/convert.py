"""bf16 checkpoint / state dict / model -> block-FP8 (see docs/quantization.md)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from ..model.loader import CheckpointError, read_state_dict, s2_disk_key
from .fp8 import (
    BLOCK,
    FP8Linear,
    dequantize_weight_block,
    fingerprint,
    quantize_weight_block,
)

FORMAT = "shoal-fp8-block"
VERSION = "1"
BLOCK_STR = f"{BLOCK}x{BLOCK}"
SCALE_LAYOUT = "row-major [N/128, K/128]"
SCALE_SUFFIX = "_scale"  # "<name>.weight" -> "<name>.weight_scale"

_BODY_RE = re.compile(r"^(layers|fast_layers)\.\d+\.(attention\.(wqkv|wo)|feed_forward\.(w1|w2|w3))\.weight$")
HEAD_NAMES = ("output.weight", "fast_output.weight")
# Per-tensor bound on ||dequant(W) - W|| / ||W|| checked by the writer: e4m3 gives ~2-3 %.
MAX_WRITE_REL_ERROR = 0.08


def is_quantizable(native_name: str, include_heads: bool = False) -> bool:
    """Linear weights of the slow and fast transformers (wqkv, wo, w1, w3, w2); with
    ``include_heads`` also the untied slow head ``output.weight`` and ``fast_output.weight``.
    Embeddings (and therefore a tied slow head) stay bf16."""
    return bool(_BODY_RE.match(native_name)) or (include_heads and native_name in HEAD_NAMES)


def quantize_state_dict(state: dict[str, Tensor], include_heads: bool = False
                        ) -> tuple[dict[str, Tensor], dict[str, tuple[Tensor, Tensor]]]:
    """Quantize-at-load (``--quantization fp8``): native-name bf16 state ->
    ``(rest, fp8)`` where ``fp8[name] = (W_q, W_s)`` for every quantizable weight and ``rest``
    holds every other tensor unchanged."""
    rest: dict[str, Tensor] = {}
    fp8: dict[str, tuple[Tensor, Tensor]] = {}
    for name, t in state.items():
        if is_quantizable(name, include_heads):
            fp8[name] = quantize_weight_block(t)
        else:
            rest[name] = t
    return rest, fp8


def _module_path(native_weight_name: str) -> str:
    assert native_weight_name.endswith(".weight"), native_weight_name
    return native_weight_name[: -len(".weight")]


def quantize_model(model: nn.Module, include_heads: bool = False,
                   pairs: dict[str, tuple[Tensor, Tensor]] | None = None,
                   quantize_activations: bool = True, only_pairs: bool = False) -> list[str]:
    """Swap the quantizable ``nn.Linear`` modules of a DualAR in place for :class:`FP8Linear`.

    ``pairs`` (native weight name -> ``(W_q, W_s)``, e.g. from an FP8 checkpoint) supplies the
    quantized weights; modules without a pair are quantized from their current weight.
    ``only_pairs`` swaps exactly the modules named in ``pairs``. Returns the swapped names."""
    if getattr(model, "fused", False):
        raise ValueError("quantize_model: disable fused kernels first (FP8 + fused is GPU-only)")
    pairs = pairs or {}
    swapped = []
    for name, _ in list(model.named_parameters()):
        wanted = name in pairs or (not only_pairs and is_quantizable(name, include_heads))
        if not wanted:
            continue
        path = _module_path(name)
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        lin = getattr(parent, attr)
        if not isinstance(lin, nn.Linear):
            continue
        if name in pairs:
            q, s = pairs[name]
            new = FP8Linear(q.to(lin.weight.device), s.to(lin.weight.device), lin.bias,
                            quantize_activations, dtype=lin.weight.dtype)
        else:
            new = FP8Linear.from_linear(lin, quantize_activations)
        setattr(parent, attr, new)
        swapped.append(name)
    # set_allowed_tokens copies head rows; rebuild them from the (possibly quantized) head.
    if hasattr(model, "allowed_ids") and hasattr(model, "set_allowed_tokens"):
        c = model.config
        extra = model.allowed_ids[c.semantic_end_id - c.semantic_begin_id + 1:].tolist()
        model.set_allowed_tokens(extra)
    return swapped


# ------------------------------------------------------------------ checkpoint writer
def header_metadata(family: str, include_heads: bool, fps: dict[str, list[float]]) -> dict[str, str]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "block": BLOCK_STR,
        "scale_layout": SCALE_LAYOUT,
        "weight_dtype": "float8_e4m3fn",
        "scale_dtype": "float32",
        "scale_semantics": "dequant multiplier: W[n,k] ~= W_q[n,k] * W_s[n//128, k//128]",
        "scale_suffix": SCALE_SUFFIX,
        "family": family,
        "include_heads": "1" if include_heads else "0",
        "fingerprints": json.dumps(fps, sort_keys=True),
    }


def quantize_checkpoint(src: str | Path, out: str | Path, include_heads: bool = False,
                        overwrite: bool = False, progress: bool = True) -> Path:
    """Quantize a bf16 S2 (sharded safetensors) or S1 (``model.pth``) checkpoint directory into
    ``out`` (see docs/quantization.md for the layout). Non-weight files are copied."""
    from safetensors.torch import save_file

    from ..checkpoint import read_config
    from ..text import load_tokenizer

    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise CheckpointError(f"{src}: checkpoint directory not found")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: exists and is not empty (pass overwrite)")
    tok = load_tokenizer(src)
    config = read_config(src, tok)
    state = read_state_dict(src, config, device="cpu", dtype=torch.bfloat16)

    index = src / "model.safetensors.index.json"
    s2 = config.family == "s2" and ((src / "model.safetensors").is_file() or index.is_file())
    disk_name = s2_disk_key if s2 else (lambda n: n)
    # shard assignment: mirror the input's weight map where there is one
    shard_of: dict[str, str] = {}
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        first = min(wm.values())
        for native in state:
            d = disk_name(native)
            if d in wm:
                shard_of[native] = wm[d]
            else:  # e.g. legacy wq/wk/wv merged into wqkv: the shard of its wq part
                wq = d.replace(".wqkv.", ".wq.")
                shard_of[native] = wm.get(wq, first)
    else:
        shard_of = {n: "model.safetensors" for n in state}

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # config, tokenizer, codec, ...
        if f.is_file() and not (f.name.endswith(".safetensors") or f.name == "model.pth"
                                or f.name == "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)

    shards: dict[str, dict[str, Tensor]] = {}
    fps: dict[str, dict[str, list[float]]] = {}
    names = list(state)
    bar = tqdm(names, desc=f"quantizing {src.name}", unit="tensor", file=sys.stderr,
               disable=not progress)
    for native in bar:
        w = state.pop(native)
        shard = shard_of[native]
        d = disk_name(native)
        tensors = shards.setdefault(shard, {})
        if is_quantizable(native, include_heads):
            q, s = quantize_weight_block(w)
            ref = w.float()
            err = float((dequantize_weight_block(q, s) - ref).norm() / ref.norm().clamp_min(1e-30))
            if err > MAX_WRITE_REL_ERROR:
                raise CheckpointError(f"{src}: {native}: quantization error {err:.3g} exceeds "
                                      f"{MAX_WRITE_REL_ERROR} (non-finite or degenerate weight?)")
            tensors[d] = q
            tensors[d + SCALE_SUFFIX] = s
            fps.setdefault(shard, {})[d] = fingerprint(q, s)
        else:
            tensors[d] = w.contiguous()
    weight_map: dict[str, str] = {}
    for shard, tensors in sorted(shards.items()):
        save_file(tensors, str(out / shard),
                  metadata=header_metadata(config.family, include_heads, fps.get(shard, {})))
        weight_map.update({k: shard for k in tensors})
    if len(shards) > 1 or index.is_file():
        total = sum(t.numel() * t.element_size() for ts in shards.values() for t in ts.values())
        idx = {"metadata": {"format": FORMAT, "version": VERSION, "block": BLOCK_STR,
                            "scale_layout": SCALE_LAYOUT, "total_size": total},
               "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(idx, indent=2) + "\n")
    return out
