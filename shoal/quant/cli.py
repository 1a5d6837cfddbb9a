"""``shoal quantize CHECKPOINT OUT [--include-heads]`` (and the gate parser re-export)."""

from __future__ import annotations

import argparse
import sys

from .gate import add_gate_parser  # noqa: F401  (wired by shoal/cli.py)


def cmd_quantize(args: argparse.Namespace) -> int:
    from .convert import quantize_checkpoint

    out = quantize_checkpoint(args.checkpoint, args.out, include_heads=args.include_heads,
                              overwrite=args.overwrite)
    print(f"wrote FP8 checkpoint {out}", file=sys.stderr)
    return 0


def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    q = subparsers.add_parser(
        "quantize", help="bf16 S2/S1 checkpoint -> block-FP8 (e4m3, 128x128 scales) checkpoint")
    q.add_argument("checkpoint", help="bf16 checkpoint directory (S2 safetensors or S1 model.pth)")
    q.add_argument("out", help="output directory")
    q.add_argument("--include-heads", action="store_true",
                   help="also quantize the untied slow head (output.weight) and the fast head")
    q.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT")
    q.set_defaults(func=cmd_quantize)
    return q
