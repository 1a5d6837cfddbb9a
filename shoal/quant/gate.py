"""The FP8 correctness gate: greedy decoding with FP8 weights must reproduce the bf16 tokens
exactly on the first N frames of fixed reference prompts.

On failure it reports the first mismatching frame / codebook and, per transformer layer, the
relative error ``||y_fp8 - y_bf16|| / ||y_bf16||`` of the layer's output on the prompt (slow
layers: the prefill; fast layers: their first call), so a layout bug shows up as a layer whose
error jumps instead of a vague "tokens differ".
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

REFERENCE_PROMPTS = (
    "Hello, this is a quantization check.",
    "The old fisherman walked past the silver boat before sunrise, and nobody noticed.",
)


# Backstop: a layer whose output differs from bf16 by more than this (relative L2) fails the
# gate even when the tokens happen to agree (wrong scales hidden by large logit margins).
# e4m3 weights + activations give ~0.01-0.08 per layer on the tiny test models.
DEFAULT_MAX_LAYER_ERROR = 0.25


@dataclass
class PromptResult:
    text: str
    ref_columns: Tensor  # [1 + C, steps]
    fp8_columns: Tensor
    mismatch: tuple[int, int, int, int] | None  # (frame, row, bf16 token, fp8 token)
    layer_errors: dict[str, float] = field(default_factory=dict)
    max_layer_error: float = DEFAULT_MAX_LAYER_ERROR

    @property
    def bad_layers(self) -> list[str]:
        return [n for n, e in self.layer_errors.items() if not e <= self.max_layer_error]

    @property
    def passed(self) -> bool:
        return self.mismatch is None and not self.bad_layers


@dataclass
class GateResult:
    frames: int
    prompts: list[PromptResult]
    weights: str = "fp8"  # what the checked side quantizes: "fp8" weights, or "bf16" (KV only)
    kv_cache_dtype: str = "auto"  # "fp8": the checked side decodes with the FP8 KV cache
    reference: str = "bf16"  # the unquantized reference's dtype

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.prompts)

    def report(self) -> str:
        lines = [f"checked: {self.weights} weights" + (", FP8 KV cache" if self.kv_cache_dtype == "fp8" else "")
                 + f" against the {self.reference} model"]
        for p in self.prompts:
            status = "PASS" if p.passed else "FAIL"
            lines.append(f"[{status}] {p.text!r}: {self.frames} frames, "
                         f"max layer rel. error {max(p.layer_errors.values(), default=0):.4f}")
            if not p.passed:
                if p.mismatch is not None:
                    f, r, a, b = p.mismatch
                    what = "main token" if r == 0 else f"codebook {r - 1}"
                    lines.append(f"  first mismatch: frame {f}, {what}: bf16 {a} vs fp8 {b}")
                else:
                    lines.append(f"  tokens match, but layers {', '.join(p.bad_layers)} exceed "
                                 f"the relative error bound {p.max_layer_error}")
                lines.append("  per-layer relative error of the layer output (bf16 vs fp8):")
                for name, err in p.layer_errors.items():
                    lines.append(f"    {name:<24} {err:.5f}")
        lines.append("gate: " + ("PASS" if self.passed else "FAIL"))
        return "\n".join(lines)


def _first_mismatch(a: Tensor, b: Tensor, frames: int) -> tuple[int, int, int, int] | None:
    a, b = a[:, :frames].cpu(), b[:, :frames].cpu()
    n = min(a.shape[1], b.shape[1])
    for f in range(n):
        diff = (a[:, f] != b[:, f]).nonzero()
        if len(diff):
            r = int(diff[0, 0])
            return f, r, int(a[r, f]), int(b[r, f])
    if a.shape[1] != b.shape[1]:  # one stopped (im_end) earlier than the other
        return n, 0, (int(a[0, n]) if n < a.shape[1] else -1), (int(b[0, n]) if n < b.shape[1] else -1)
    return None


def _layer_modules(model: nn.Module) -> dict[str, nn.Module]:
    mods = {f"layers.{i}": m for i, m in enumerate(model.layers)}
    mods.update({f"fast_layers.{i}": m for i, m in enumerate(model.fast_layers)})
    return mods


def _decode_capturing(model: nn.Module, grid, im_end_id: int, frames: int
                      ) -> tuple[Tensor, dict[str, Tensor]]:
    from ..engine.generate import generate
    from ..engine.sampling import SamplingParams

    captured: dict[str, Tensor] = {}
    handles = []
    for name, mod in _layer_modules(model).items():
        def hook(_m, _inp, out, name=name):
            if name not in captured:
                captured[name] = out.detach().float().clone()
        handles.append(mod.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            res = generate(model, grid, SamplingParams(greedy=True), im_end_id, frames)
    finally:
        for h in handles:
            h.remove()
    return res.columns, captured


def run_gate(ref_model: nn.Module, fp8_model: nn.Module, tokenizer, frames: int = 5,
             prompts: tuple[str, ...] = REFERENCE_PROMPTS,
             max_layer_error: float = DEFAULT_MAX_LAYER_ERROR) -> GateResult:
    """``fp8_model`` decodes with its ``kv_cache_dtype`` (the FP8 KV cache when set), so the
    gate covers what the engine serves with ``kv_cache_dtype="fp8"``."""
    from ..text import build_session

    family = ref_model.config.family
    results = []
    for text in prompts:
        grid = build_session(family, tokenizer, text).grid()
        ref_cols, ref_act = _decode_capturing(ref_model, grid, tokenizer.im_end_id, frames)
        fp8_cols, fp8_act = _decode_capturing(fp8_model, grid, tokenizer.im_end_id, frames)
        errs = {}
        for name, a in ref_act.items():
            b = fp8_act.get(name)
            if b is None or b.shape != a.shape:
                errs[name] = float("inf")
            else:
                errs[name] = float((b - a).norm() / a.norm().clamp_min(1e-30))
        results.append(PromptResult(text, ref_cols, fp8_cols,
                                    _first_mismatch(ref_cols, fp8_cols, frames), errs,
                                    max_layer_error))
    from .kv import kv_cache_dtype_name

    return GateResult(frames, results, kv_cache_dtype=kv_cache_dtype_name(getattr(fp8_model, "kv_cache_dtype", None)))


def correctness_gate(checkpoint: str, fp8_checkpoint: str | None = None, *, frames: int = 5,
                     include_heads: bool = False, device: str = "cpu", dtype: str = "bf16",
                     verify: bool = True,
                     max_layer_error: float = DEFAULT_MAX_LAYER_ERROR, kv_cache_dtype: str | None = None,
                     quantize_weights: bool = True) -> GateResult:
    """Load the bf16 reference and the FP8 model (an FP8 checkpoint, or ``checkpoint``
    quantized at load when ``fp8_checkpoint`` is None) and run :func:`run_gate`.
    ``kv_cache_dtype="fp8"``: the FP8 side decodes with the FP8 KV cache; with
    ``quantize_weights=False`` (and no ``fp8_checkpoint``) only the KV cache is quantized."""
    from ..checkpoint import DTYPES, load_dualar
    from .convert import quantize_model
    from .kv import parse_kv_cache_dtype
    from .loader import load_fp8_dualar

    dt = DTYPES[dtype]
    ref, tok = load_dualar(checkpoint, device=device, dtype=dt)
    if fp8_checkpoint is None:
        fp8, _ = load_dualar(checkpoint, device=device, dtype=dt)
        if quantize_weights:
            quantize_model(fp8, include_heads=include_heads)
    else:
        fp8, _ = load_fp8_dualar(fp8_checkpoint, device=device, dtype=dt, verify=verify)
    fp8.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype)
    res = run_gate(ref, fp8, tok, frames, max_layer_error=max_layer_error)
    res.weights = "fp8" if fp8_checkpoint is not None or quantize_weights else dtype
    res.reference = dtype
    return res


def cmd_gate(args: argparse.Namespace) -> int:
    if args.gate_cmd != "correctness":
        raise ValueError(f"unknown gate {args.gate_cmd!r}")
    kv_fp8 = args.kv_cache_dtype == "fp8"
    if args.fp8_checkpoint is None and not args.quantize and not kv_fp8:
        raise ValueError("give --fp8-checkpoint DIR, --quantize or --kv-cache-dtype fp8")
    if args.include_heads and not args.quantize:
        raise ValueError("--include-heads applies to --quantize only")
    result = correctness_gate(args.checkpoint, args.fp8_checkpoint, frames=args.frames,
                              include_heads=args.include_heads, device=args.device,
                              dtype=args.dtype, verify=not args.skip_verify,
                              max_layer_error=args.max_layer_error, kv_cache_dtype=args.kv_cache_dtype,
                              quantize_weights=args.fp8_checkpoint is not None or args.quantize)
    print(result.report())
    return 0 if result.passed else 1


def add_gate_parser(subparsers) -> argparse.ArgumentParser:
    gate = subparsers.add_parser("gate", help="correctness gates (FP8 vs bf16 greedy tokens)")
    gsub = gate.add_subparsers(dest="gate_cmd", required=True)
    c = gsub.add_parser("correctness", help="FP8 greedy decode must match bf16 on the first frames")
    c.add_argument("--checkpoint", required=True, help="bf16 reference checkpoint directory")
    src = c.add_mutually_exclusive_group()
    src.add_argument("--fp8-checkpoint", help="FP8 checkpoint written by `shoal quantize`")
    src.add_argument("--quantize", action="store_true", help="quantize --checkpoint at load instead")
    c.add_argument("--frames", type=int, default=5)
    c.add_argument("--include-heads", action="store_true", help="with --quantize: heads too")
    c.add_argument("--max-layer-error", type=float, default=DEFAULT_MAX_LAYER_ERROR,
                   help="fail when a layer's output relative error exceeds this (inf: tokens only)")
    c.add_argument("--device", default="cpu")
    c.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    c.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: the checked side decodes with the FP8 KV cache (alone, without "
                        "--quantize / --fp8-checkpoint: bf16 weights, FP8 KV cache only)")
    c.add_argument("--skip-verify", action="store_true",
                   help="debugging: load the FP8 checkpoint without layout verification")
    c.set_defaults(func=cmd_gate)
    return c


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shoal")
    add_gate_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
