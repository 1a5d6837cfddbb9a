"""Load a reference ``codec.pth`` into :class:`~shoal.codec.model.Codec`.

Accepted layouts (all those the reference ``load_codec_model`` accepts):

* a plain state dict, or one wrapped in ``{"state_dict": ...}``;
* keys prefixed ``generator.`` (training checkpoints): when any key contains
  ``generator.``, only those keys are kept and the prefix is removed;
* weight norm stored as parametrizations (``X.parametrizations.weight.original0``
  = g, ``original1`` = v) or old style (``X.weight_g`` / ``X.weight_v``) on any
  conv, including transposed convs (g is [in, 1, 1], norm over (out, k));
  plain ``X.weight`` is accepted as well;
* stale ``freqs_cis`` / ``causal_mask`` buffers are ignored.

Weight norm is folded once at load (``w = g · v / ‖v‖`` over all dims but 0,
computed in fp32 with ``torch._weight_norm``, the op the reference runs every
forward).  Anything else that does not match raises :class:`CodecLoadError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor

from .config import CodecConfig, config_for_checkpoint
from .model import Codec

__all__ = ["CodecLoadError", "CodecFileNotFoundError", "load_codec", "convert_state_dict", "read_checkpoint"]

_PARAM_G = ".parametrizations.weight.original0"
_PARAM_V = ".parametrizations.weight.original1"
_OLD_G = ".weight_g"
_OLD_V = ".weight_v"
_STALE_SUFFIXES = ("freqs_cis", "causal_mask")


class CodecLoadError(ValueError):
    """The codec checkpoint does not match the codec configuration."""


class CodecFileNotFoundError(CodecLoadError, FileNotFoundError):
    """The codec checkpoint file does not exist."""


def resolve_codec_path(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "codec.pth"
    if not p.is_file():
        raise CodecFileNotFoundError(f"codec checkpoint not found: {p}")
    return p


def read_checkpoint(path: str | Path) -> dict[str, Tensor]:
    """``torch.load`` (weights only) + ``state_dict`` / ``generator.`` unwrapping."""
    p = resolve_codec_path(path)
    try:
        try:
            obj = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            # mmap needs the zipfile format; fall back for legacy files
            obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling problem is a bad file
        raise CodecLoadError(f"{p}: cannot read codec checkpoint ({type(e).__name__}: {e})") from e
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise CodecLoadError(f"{p}: expected a state dict, found {type(obj).__name__}")
    sd = dict(obj)
    if any("generator." in k for k in sd):
        sd = {k.replace("generator.", ""): v for k, v in sd.items() if "generator." in k}
    bad = [k for k, v in sd.items() if not isinstance(v, Tensor)]
    if bad:
        raise CodecLoadError(f"{p}: entry {bad[0]!r} is not a tensor")
    return sd


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape)


def convert_state_dict(
    sd: Mapping[str, Tensor], expected: Mapping[str, torch.Size | tuple[int, ...]], source: str = "<state dict>"
) -> dict[str, Tensor]:
    """Map a reference state dict onto plain keys with folded weight norm (fp32).

    ``expected`` maps every key of the target module to its shape.  Raises
    :class:`CodecLoadError` naming ``source``, the key, and the expected and
    found shapes on any mismatch.
    """
    out: dict[str, Tensor] = {}
    origin: dict[str, str] = {}
    pairs: dict[str, dict] = {}

    def put(key: str, value: Tensor, from_key: str) -> None:
        if key in out:
            raise CodecLoadError(f"{source}: {from_key!r} and {origin[key]!r} both give {key!r}")
        out[key] = value
        origin[key] = from_key

    for k, v in sd.items():
        if k.rsplit(".", 1)[-1] in _STALE_SUFFIXES and k not in expected:
            continue
        for gs, vs in ((_PARAM_G, _PARAM_V), (_OLD_G, _OLD_V)):
            if k.endswith(gs) or k.endswith(vs):
                part, suffix = ("g", gs) if k.endswith(gs) else ("v", vs)
                base = k[: -len(suffix)]
                entry = pairs.setdefault(base + ".weight", {"base": base, "suffix": {"g": gs, "v": vs}})
                entry[part] = (k, v)
                break
        else:
            put(k, v, k)

    for wkey, gv in pairs.items():
        for part, partner in (("g", "v"), ("v", "g")):
            if part not in gv:
                miss = gv["base"] + gv["suffix"][part]
                raise CodecLoadError(f"{source}: missing key {miss!r} (weight-norm partner of {gv[partner][0]!r})")
        (gk, g), (vk, v) = gv["g"], gv["v"]
        if wkey not in expected:
            raise CodecLoadError(f"{source}: unexpected keys {gk!r} / {vk!r} (no parameter {wkey!r} in the codec)")
        exp = tuple(expected[wkey])
        if _shape(v) != exp:
            raise CodecLoadError(f"{source}: shape mismatch for {vk!r}: expected {exp}, found {_shape(v)}")
        g_exp = (exp[0],) + (1,) * (len(exp) - 1)
        if _shape(g) != g_exp:
            raise CodecLoadError(f"{source}: shape mismatch for {gk!r}: expected {g_exp}, found {_shape(g)}")
        w = torch._weight_norm(v.float(), g.float(), 0)
        put(wkey, w, vk)

    missing = [k for k in expected if k not in out]
    if missing:
        k = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        hint = ""
        if k.endswith(".weight") and len(tuple(expected[k])) == 3:
            b = k[: -len(".weight")]
            hint = f", nor weight-norm keys {b + _PARAM_G!r}/{b + _PARAM_V!r} or {b + _OLD_G!r}/{b + _OLD_V!r}"
        raise CodecLoadError(
            f"{source}: missing key {k!r} (expected shape {tuple(expected[k])}, found nothing{hint}){more}"
        )
    unexpected = [k for k in out if k not in expected]
    if unexpected:
        k = unexpected[0]
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CodecLoadError(
            f"{source}: unexpected key {origin[k]!r} with shape {_shape(out[k])} "
            f"(not part of this codec configuration){more}"
        )
    for k, v in out.items():
        if _shape(v) != tuple(expected[k]):
            raise CodecLoadError(
                f"{source}: shape mismatch for {origin[k]!r}: expected {tuple(expected[k])}, found {_shape(v)}"
            )
        if not v.is_floating_point():
            raise CodecLoadError(f"{source}: {origin[k]!r} has dtype {v.dtype}, expected a floating tensor")
        out[k] = v.to(torch.float32, copy=True)
    return out


def load_codec(
    path: str | Path,
    config: CodecConfig | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    decode_dtype: torch.dtype | None = None,
) -> Codec:
    """Load ``codec.pth`` (or a directory holding it) into an eval-mode :class:`Codec`.

    ``config=None`` follows the shoal convention: ``codec_config.json`` beside
    the file if present, else :meth:`CodecConfig.real`. The codec is in ``dtype``;
    ``decode_dtype`` (default: ``dtype``) puts its decode-only modules in another
    precision (:meth:`Codec.set_decode_dtype`; both cast from the fp32 weights).
    """
    p = resolve_codec_path(path)
    if config is None:
        config = config_for_checkpoint(p)
    sd = read_checkpoint(p)
    with torch.device("meta"):
        model = Codec(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    weights = convert_state_dict(sd, expected, source=str(p))
    model.load_state_dict(weights, strict=True, assign=True)
    model = model.place(device, dtype, decode_dtype)  # each side cast once from the fp32 weights
    model.eval()
    model.requires_grad_(False)
    return model
