"""Read and verify a ``shoal-fp8-block`` checkpoint (written by :mod:`shoal.quant.convert`).

Verification (every failure is a :class:`CheckpointError` naming file, tensor, expected, found):

1. every safetensors file carries the ``__metadata__`` header with the right format, version,
   block size and scale layout, and a parseable fingerprint table;
2. every ``<name>.weight_scale`` is fp32, contiguous, of shape exactly
   ``[ceil(N/128), ceil(K/128)]`` for its float8_e4m3fn ``<name>.weight [N, K]``, and every
   e4m3 weight has a scale (and vice versa);
3. the fingerprint of ``dequant(W_q, W_s)`` re-computed here equals the one the writer
   recorded. Shapes cannot tell a transposed *square* scale grid (or two swapped rows) from the
   real one; the fingerprint can.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from ..model.config import ModelConfig
from ..model.dualar import DualAR
from ..model.loader import CheckpointError, _weight_files, remap_s2_key
from .convert import (
    BLOCK_STR,
    FORMAT,
    SCALE_LAYOUT,
    SCALE_SUFFIX,
    VERSION,
    quantize_model,
)
from .fp8 import (
    FP8_DTYPE,
    dequantize_weight_block,
    fingerprint,
    fingerprints_match,
    scale_shape,
)


def is_fp8_checkpoint(ckpt: str | Path) -> bool:
    """True when the checkpoint's weight files carry the ``shoal-fp8-block`` header."""
    try:
        kind, files = _weight_files(Path(ckpt))
    except CheckpointError:
        return False
    if kind != "safetensors":
        return False
    from safetensors import safe_open

    with safe_open(str(files[0]), framework="pt") as h:
        return (h.metadata() or {}).get("format") == FORMAT


def _check_metadata(f: Path, meta: dict[str, str] | None) -> dict[str, list[float]]:
    if not meta:
        raise CheckpointError(f"{f}: no safetensors __metadata__ header; expected format "
                              f"{FORMAT!r} (not an FP8 checkpoint written by `shoal quantize`?)")
    want = {"format": FORMAT, "version": VERSION, "block": BLOCK_STR, "scale_layout": SCALE_LAYOUT}
    for key, expected in want.items():
        found = meta.get(key)
        if found != expected:
            raise CheckpointError(f"{f}: metadata {key!r}: expected {expected!r}, found {found!r}")
    try:
        fps = json.loads(meta["fingerprints"])
        if not isinstance(fps, dict):
            raise TypeError("not an object")
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: metadata 'fingerprints' missing or invalid ({e})") from e
    return fps


def read_fp8_tensors(ckpt: str | Path, verify: bool = True
                     ) -> tuple[dict[str, Tensor], dict[str, tuple[Tensor, Tensor]], dict[str, str]]:
    """Read an FP8 checkpoint into native names: ``(plain, pairs, meta)`` where ``pairs[name] =
    (W_q, W_s)`` and ``plain`` holds the unquantized tensors as stored. ``verify=False`` skips
    the metadata and fingerprint checks (debugging only: this is how a corrupt scale layout gets
    past the loader)."""
    from safetensors import safe_open

    ckpt = Path(ckpt)
    kind, files = _weight_files(ckpt)
    if kind != "safetensors":
        raise CheckpointError(f"{files[0]}: FP8 checkpoints are safetensors; found {kind}")
    plain: dict[str, Tensor] = {}
    pairs: dict[str, tuple[Tensor, Tensor]] = {}
    meta0: dict[str, str] = {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:
            raise CheckpointError(f"{f}: cannot read safetensors file ({e})") from e
        with handle:
            meta = handle.metadata() or {}
            fps = _check_metadata(f, meta) if verify else {}
            meta0 = meta0 or dict(meta)
            raw = {k: handle.get_tensor(k) for k in handle.keys()}
        scales = {k[: -len(SCALE_SUFFIX)]: v for k, v in raw.items() if k.endswith(SCALE_SUFFIX)}
        for key, t in raw.items():
            if key.endswith(SCALE_SUFFIX):
                if key[: -len(SCALE_SUFFIX)] not in raw:
                    raise CheckpointError(f"{f}: scale {key!r} has no weight "
                                          f"{key[: -len(SCALE_SUFFIX)]!r}")
                continue
            native = remap_s2_key(key)
            if t.dtype != FP8_DTYPE:
                if key in scales:
                    raise CheckpointError(f"{f}: {key!r} has a scale but dtype {t.dtype}, "
                                          f"expected {FP8_DTYPE}")
                plain[native] = t
                continue
            if key not in scales:
                raise CheckpointError(f"{f}: {FP8_DTYPE} weight {key!r} has no {key + SCALE_SUFFIX!r}")
            s = scales[key]
            n, k = t.shape
            exp = scale_shape(n, k)
            if s.dtype != torch.float32:
                raise CheckpointError(f"{f}: {key + SCALE_SUFFIX!r}: expected dtype float32, "
                                      f"found {s.dtype}")
            if tuple(s.shape) != exp:
                raise CheckpointError(
                    f"{f}: {key + SCALE_SUFFIX!r}: expected scale shape {list(exp)} "
                    f"(row-major [ceil(N/128), ceil(K/128)] for weight [{n}, {k}]), found "
                    f"{list(s.shape)}" + (" (transposed?)" if tuple(s.shape) == exp[::-1] else ""))
            if not s.is_contiguous():
                raise CheckpointError(f"{f}: {key + SCALE_SUFFIX!r}: scale is not contiguous "
                                      f"(strides {s.stride()})")
            if verify:
                if key not in fps:
                    raise CheckpointError(f"{f}: {key!r}: no fingerprint in the metadata")
                found = fingerprint(t, s)
                if not fingerprints_match(fps[key], found):
                    raise CheckpointError(
                        f"{f}: {key + SCALE_SUFFIX!r}: fingerprint mismatch (scale grid transposed, "
                        f"permuted or rescaled?): expected {fps[key][:3]}, found {found[:3]}")
            pairs[native] = (t, s)
    return plain, pairs, meta0


def read_fp8_state_dict(ckpt: str | Path, config: ModelConfig, verify: bool = True,
                        dequantize: bool = True, dtype: torch.dtype = torch.bfloat16,
                        ) -> dict[str, Tensor | tuple[Tensor, Tensor]]:
    """Native-name state dict of an FP8 checkpoint, checked against ``config``'s shapes.
    ``dequantize=True``: quantized weights become ``dtype`` tensors; else ``(W_q, W_s)``."""
    plain, pairs, _ = read_fp8_tensors(ckpt, verify)
    expected = config.expected_shapes()
    out: dict[str, Tensor | tuple[Tensor, Tensor]] = {}
    for name, t in plain.items():
        out[name] = t.to(dtype)
    for name, (q, s) in pairs.items():
        out[name] = dequantize_weight_block(q, s, dtype) if dequantize else (q, s)
    for name in out:
        if name not in expected:
            raise CheckpointError(f"{ckpt}: unexpected key {name!r} for a {config.family} model")
    missing = [k for k in expected if k not in out]
    if missing:
        raise CheckpointError(f"{ckpt}: missing weights: {', '.join(missing[:5])}")
    for name, v in out.items():
        shape = tuple((v[0] if isinstance(v, tuple) else v).shape)
        if shape != expected[name]:
            raise CheckpointError(f"{ckpt}: shape mismatch for {name!r}: expected "
                                  f"{list(expected[name])}, found {list(shape)}")
    return out


def load_fp8_model(ckpt: str | Path, config: ModelConfig, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.bfloat16, verify: bool = True) -> DualAR:
    """A DualAR whose quantized Linears are :class:`~shoal.quant.fp8.FP8Linear` modules holding
    the checkpoint's ``(W_q, W_s)``; everything else in ``dtype``."""
    state = read_fp8_state_dict(ckpt, config, verify=verify, dequantize=False, dtype=dtype)
    pairs = {k: v for k, v in state.items() if isinstance(v, tuple)}
    dense = {k: (dequantize_weight_block(*v, dtype) if isinstance(v, tuple) else v).to(device)
             for k, v in state.items()}
    with torch.device("meta"):
        model = DualAR(config)
    model.load_state_dict(dense, strict=True, assign=True)
    model.init_buffers(device)
    model = model.eval().requires_grad_(False)
    quantize_model(model, pairs={k: (q.to(device), s.to(device)) for k, (q, s) in pairs.items()},
                   only_pairs=True)
    return model


def load_fp8_dualar(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.bfloat16, verify: bool = True):
    """Like :func:`shoal.checkpoint.load_dualar` for an FP8 checkpoint directory."""
    from ..checkpoint import read_config
    from ..text import load_tokenizer

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    tok = load_tokenizer(path)
    config = read_config(path, tok)
    return load_fp8_model(path, config, device=device, dtype=dtype, verify=verify), tok
