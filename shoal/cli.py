"""``shoal`` command line: a thin layer over the library.

    shoal say "TEXT" -o out.wav [--reference clip.wav --reference-text "..."]... [--checkpoint DIR]
    shoal prompt "TEXT" [--checkpoint DIR] [--reference-text T --reference-codes ref.npy]... --out grid.npy
    shoal codec encode in.wav --codec codec.pth --out codes.npy
    shoal codec decode codes.npy --codec codec.pth -o out.wav

Without ``--checkpoint`` the embedded default model is used: a tiny random model in the real
S2 format, generated on first use. It produces non-speech audio; point ``--checkpoint`` at a
downloaded S2-Pro or openaudio-s1-mini directory for speech.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def _checkpoint(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from .demo import default_checkpoint

    return default_checkpoint()


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", help="checkpoint directory (default: the embedded tiny demo model)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="model precision (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"],
                   help="fp8: quantize a bf16 checkpoint to block-scaled FP8 at load (FP8 "
                        "checkpoints from `shoal quantize` are detected and need no flag)")


CODEC_DTYPE_HELP = ("codec precision (auto, the default: on CUDA decode in bf16, ~33 dB SNR against fp32, "
                    "and encode reference audio in fp32; fp32 on CPU. fp32 / bf16: the whole codec; "
                    "docs/codec.md)")


def add_codec_dtype_arg(p: argparse.ArgumentParser) -> None:
    """``--codec-dtype auto|fp32|bf16`` (shoal say, shoal batch, shoal serve)."""
    from .checkpoint import CODEC_DTYPE_CHOICES

    p.add_argument("--codec-dtype", default="auto", choices=list(CODEC_DTYPE_CHOICES), help=CODEC_DTYPE_HELP)


def _add_reference_args(p: argparse.ArgumentParser, audio: bool) -> None:
    if audio:
        p.add_argument("--reference", action="append", default=[], metavar="CLIP",
                       help="reference audio clip for voice cloning (repeatable)")
    p.add_argument("--reference-text", action="append", default=[], metavar="TEXT",
                   help="transcript of each reference, in the same order (repeatable)")
    p.add_argument("--reference-codes", action="append", default=[], metavar="NPY",
                   help="pre-encoded reference codes, int [10, T] .npy (repeatable)")
    p.add_argument("--chunk-length", type=int, default=None,
                   help="UTF-8 byte budget per text batch for <|speaker:N|> dialogue (default 300)")


def _references(args: argparse.Namespace, tts=None):
    from .text import Reference

    clips = list(getattr(args, "reference", []) or [])
    code_files = list(args.reference_codes or [])
    texts = list(args.reference_text or [])
    if len(clips) + len(code_files) != len(texts):
        raise ValueError(
            f"got {len(clips) + len(code_files)} reference clips/codes but {len(texts)} "
            "--reference-text values; give one transcript per reference")
    refs = []
    for clip, text in zip(clips, texts):
        refs.append(Reference(text, tts.encode_reference(clip)))
    for f, text in zip(code_files, texts[len(clips):]):
        codes = np.load(f)
        refs.append(Reference(text, codes))
    return refs


def _sampling(args: argparse.Namespace, family: str):
    from .engine.sampling import SamplingParams

    penalty = args.repetition_penalty
    if penalty is None:
        penalty = 1.1 if family == "s1" else 1.0
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            greedy=args.greedy, repetition_penalty=penalty)
    params.validate()
    return params


def cmd_say(args: argparse.Namespace) -> int:
    from .codec import write_wav
    from .engine.generate import Fidelity
    from .tts import TTS

    tts = TTS.load(_checkpoint(args.checkpoint), device=args.device, dtype=args.dtype,
                   quantization=args.quantization, codec_dtype=args.codec_dtype)
    refs = _references(args, tts)
    fidelity = Fidelity.reference(tts.family) if args.reference_mode else Fidelity()
    out = tts.synthesize(args.text, refs, _sampling(args, tts.family), seed=args.seed,
                         max_new_tokens=args.max_new_tokens, chunk_length=args.chunk_length,
                         fidelity=fidelity)
    write_wav(args.output, out.audio, out.sample_rate)
    if args.codes_out:
        np.save(args.codes_out, out.codes)
    frames = out.codes.shape[1]
    gen_s = out.timings["generate_s"]
    stops = ",".join(b.stop_reason for b in out.batches)
    print(f"wrote {args.output}: {len(out.audio) / out.sample_rate:.2f} s, {frames} frames "
          f"({len(out.batches)} batch(es), stop: {stops}), seed {out.seed}, "
          f"{frames / max(gen_s, 1e-9):.1f} frames/s generate, decode {out.timings['decode_s']:.2f} s",
          file=sys.stderr)
    return 0


def cmd_prompt(args: argparse.Namespace) -> int:
    from .checkpoint import read_config
    from .engine.generate import generate
    from .engine.sampling import SamplingParams
    from .text import build_session, format_grid, load_tokenizer

    ckpt = _checkpoint(args.checkpoint)
    tokenizer = load_tokenizer(ckpt)
    config = read_config(ckpt, tokenizer)
    refs = _references(args)
    session = build_session(config.family, tokenizer, args.text, refs, args.chunk_length)
    n = len(session.batches)
    out = Path(args.out)
    model = None
    index = 0
    while not session.done():
        grid = session.grid()
        path = out if n == 1 else out.with_name(f"{out.stem}_b{index}{out.suffix or '.npy'}")
        np.save(path, grid)
        print(f"# batch {index + 1} of {n}: {path}")
        print(format_grid(grid, tokenizer))
        if index + 1 < n:
            # Later batches carry the earlier batches' generated codes as context.
            if model is None:
                from .checkpoint import load_dualar

                model, _ = load_dualar(ckpt, device=args.device, dtype=args.dtype)
                print(f"# generating batch codes greedily (max {args.max_new_tokens} frames) "
                      "to build the next batch's prompt", file=sys.stderr)
            res = generate(model, grid, SamplingParams(greedy=True), tokenizer.im_end_id,
                           max_new_tokens=args.max_new_tokens)
            session.commit(res.codes)
        else:
            session.commit(np.zeros((config.num_codebooks, 0), dtype=np.int64))
        index += 1
    return 0


def cmd_codec(args: argparse.Namespace) -> int:
    from .checkpoint import resolve_device
    from .codec import decode_to_wav, encode_file, load_codec

    dev = resolve_device(args.device)
    codec = load_codec(args.codec, device=dev)
    if args.codec_cmd == "encode":
        codes = encode_file(codec, args.input)
        np.save(args.out, codes)
        print(f"wrote {args.out}: codes {list(codes.shape)}", file=sys.stderr)
    else:
        codes = np.load(args.input)
        if codes.ndim != 2 or codes.shape[0] != codec.num_codebooks:
            raise ValueError(f"{args.input}: expected codes [{codec.num_codebooks}, T], got {list(codes.shape)}")
        decode_to_wav(codec, codes, args.output)
        print(f"wrote {args.output}: {codes.shape[1]} frames", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    say = sub.add_parser("say", help="synthesize TEXT to a WAV file")
    say.add_argument("text")
    say.add_argument("-o", "--output", required=True, help="output .wav path")
    _add_model_args(say)
    add_codec_dtype_arg(say)
    _add_reference_args(say, audio=True)
    say.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    say.add_argument("--temperature", type=float, default=0.8)
    say.add_argument("--top-p", type=float, default=0.8)
    say.add_argument("--top-k", type=int, default=30)
    say.add_argument("--repetition-penalty", type=float, default=None,
                     help="S1 models only, default 1.1 (S2 uses repetition-aware sampling instead)")
    say.add_argument("--greedy", action="store_true", help="deterministic argmax decoding")
    say.add_argument("--max-new-tokens", type=int, default=1024,
                     help="frames per text batch (0 = up to the context limit)")
    say.add_argument("--codes-out", help="also save the generated codes, int [10, frames] .npy")
    say.add_argument("--reference-mode", action="store_true",
                     help="reproduce the reference implementation's quirks (docs/fidelity.md)")
    say.set_defaults(func=cmd_say)

    prompt = sub.add_parser("prompt", help="print and save the token grid(s) a request is prefilled with")
    prompt.add_argument("text")
    prompt.add_argument("--out", required=True, help="output .npy (batch i of several: NAME_b<i>.npy)")
    _add_model_args(prompt)
    _add_reference_args(prompt, audio=False)
    prompt.add_argument("--max-new-tokens", type=int, default=1024)
    prompt.set_defaults(func=cmd_prompt)

    codec = sub.add_parser("codec", help="encode audio to codes or decode codes to audio")
    csub = codec.add_subparsers(dest="codec_cmd", required=True)
    enc = csub.add_parser("encode", help="audio file -> codes .npy")
    enc.add_argument("input")
    enc.add_argument("--codec", required=True, help="codec.pth (codec_config.json beside it if not the real size)")
    enc.add_argument("--out", required=True)
    enc.add_argument("--device", default="auto")
    enc.set_defaults(func=cmd_codec)
    dec = csub.add_parser("decode", help="codes .npy -> WAV")
    dec.add_argument("input")
    dec.add_argument("--codec", required=True)
    dec.add_argument("-o", "--output", required=True)
    dec.add_argument("--device", default="auto")
    dec.set_defaults(func=cmd_codec)
    from .batch import add_batch_parser
    from .server.cli import add_serve_parser
    from .quant.cli import add_quantize_parser
    from .quant.gate import add_gate_parser
    from .voices.cli import add_voices_parser

    add_batch_parser(sub)
    add_serve_parser(sub)
    add_voices_parser(sub)
    add_quantize_parser(sub)
    add_gate_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks (engine sweep, kernels); writes JSON + PNG",
                           add_help=False)
    bench.add_argument("which", choices=["engine", "serve", "gate", "live", "attention", "fused", "fp8", "dense",
                                          "dense-step", "profile", "codec", "interference"],
                       help="engine: concurrency sweep; serve: HTTP load on a running server; gate: perf "
                            "regression gate; live: WebSocket TTFA sweep; attention/fused/profile: kernels; "
                            "dense: bf16 decode GEMM vs cuBLAS (tunes kernels/dense_tuned.json); "
                            "dense-step: the same configs timed inside the decode step; "
                            "codec: codec decode; interference: LLM step vs concurrent codec load")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="benchmark options (see shoal bench WHICH -h)")
    bench.set_defaults(func=cmd_bench)
    return parser


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = {"engine": "engine", "serve": "serve", "gate": "gate", "live": "live",
              "attention": "kernels_attention", "fused": "kernels_fused", "fp8": "kernels_fp8", "dense": "tune_dense",
              "dense-step": "tune_step", "profile": "profile_step", "codec": "codec",
              "interference": "interference"}[args.which]
    return importlib.import_module(f".bench.{module}", __package__).main(args.rest)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"shoal: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
