"""``shoal serve``: the HTTP server on uvicorn.

    shoal serve [--checkpoint DIR | --random-model s2-pro|tiny] [--host 127.0.0.1] [--port 8080]
                [--api-key KEY ... | --api-keys-file FILE] [--max-concurrency-per-key N]
                [--device auto] [--dtype auto] [--max-running N] [--max-text-length N]

Without ``--checkpoint`` the embedded tiny demo model is served (noise, not speech).
``--random-model`` (benchmarks only) serves random weights at real shapes, built on the device.
"""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger("shoal.server")

RANDOM_MODEL_CHOICES = ("s2-pro", "tiny")  # shoal.bench.random_tts.RANDOM_MODELS (kept import-free)
RANDOM_MODEL_DEFAULT_CAP = 300  # frames per request when --random-model runs without a cap


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from ..cli import add_codec_dtype_arg
    from ..quant.kv import add_kv_block_size_arg

    p = subparsers.add_parser(
        "serve", help="run the HTTP server (Fish /v1/tts, OpenAI /v1/audio/speech)",
        description="Serve a Fish Speech model over the Fish Audio API (the official fish-audio-sdk "
                    "works with base_url=http://HOST:PORT) and OpenAI's /v1/audio/speech.")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--checkpoint", help="checkpoint directory (default: the embedded tiny demo model)")
    model.add_argument("--random-model", choices=RANDOM_MODEL_CHOICES, default=None,
                       help="BENCHMARK ONLY: serve random weights at the shapes of this model (s2-pro: "
                            "the real S2-Pro DualAR and codec, built on the device; tiny: CPU tests); "
                            "the audio is noise, <|im_end|> is ignored and every request yields its "
                            f"capped max_new_tokens frames (cap default {RANDOM_MODEL_DEFAULT_CAP})")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="model precision (auto: bf16 on CUDA, fp32 on CPU)")
    add_codec_dtype_arg(p)
    p.add_argument("--quantization", default="none", choices=["none", "fp8"],
                   help="fp8: quantize the DualAR to block-scaled FP8 at load (FP8 checkpoints from "
                        "`shoal quantize` are detected and need no flag); docs/quantization.md")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"],
                   help="slow KV cache storage: auto (the model's dtype) or fp8 (e4m3 with one scale per "
                        "token and KV head: half the bytes, twice the tokens per GiB; checked by "
                        "`shoal gate correctness --kv-cache-dtype fp8`); default: env "
                        "SHOAL_KV_CACHE_DTYPE, else auto; docs/quantization.md")
    add_kv_block_size_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accepted bearer key (repeatable); with no key at all the server is open")
    p.add_argument("--api-keys-file", metavar="FILE",
                   help="file with one accepted key per line (# comments and blank lines ignored)")
    p.add_argument("--max-concurrency-per-key", type=int, default=0, metavar="N",
                   help="in-flight synthesis requests per key; more get 429 + Retry-After (0 = no limit)")
    p.add_argument("--max-running", type=int, default=None, metavar="N",
                   help="engine slots: requests decoded together (default 128 on CUDA, 16 on CPU)")
    p.add_argument("--prefill-chunk", type=int, default=1024, metavar="N",
                   help="prompt tokens prefilled per engine step (default 1024; larger cuts first-audio "
                        "tails under bursts of new requests, smaller keeps running streams smoother; "
                        "docs/benchmarks.md)")
    p.add_argument("--max-pending", type=int, default=None, metavar="N",
                   help="waiting + running requests before new ones get 503 + Retry-After "
                        "(default 4 x max-running)")
    p.add_argument("--max-text-length", type=int, default=10_000, metavar="N",
                   help="characters of text per request (default 10000; longer gets 400)")
    p.add_argument("--max-body-size", type=int, default=32 << 20, metavar="BYTES",
                   help="request body limit incl. inline reference audio (default 32 MiB; larger gets 413)")
    p.add_argument("--max-new-tokens-cap", type=int, default=None, metavar="N",
                   help="clamp every request's max_new_tokens (frames per text batch) to N")
    p.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                   help="cap the model context (default: the model's)")
    p.add_argument("--voices-dir", default=None, metavar="DIR",  # voice library (shoal.server.voices_api)
                   help="voice library for /model and reference_id (default: $SHOAL_VOICES or "
                        "~/.local/share/shoal/voices, shared with `shoal voices`; 'none' disables it)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
    return p


def _voices_dir(arg: str | None) -> str | None:
    """--voices-dir: the default library when absent, None (disabled) for 'none' or ''."""
    if arg is None:
        from ..voices.store import default_voices_dir

        return str(default_voices_dir())
    return None if arg.strip().lower() in ("", "none") else arg


def _frames_cap(args: argparse.Namespace) -> int | None:
    """--max-new-tokens-cap; a random model (which never stops on its own) gets a default."""
    if args.max_new_tokens_cap is None and args.random_model:
        return RANDOM_MODEL_DEFAULT_CAP
    return args.max_new_tokens_cap


def _load_checkpoint_service(args: argparse.Namespace):
    from ..quant.kv import kv_cache_dtype_arg
    from .service import TTSService

    if args.checkpoint:
        checkpoint = args.checkpoint
    else:
        from ..demo import default_checkpoint

        checkpoint = default_checkpoint()
    return TTSService.load(checkpoint, device=args.device, dtype=args.dtype,
                           max_running=args.max_running, max_seq_len=args.max_seq_len,
                           quantization=args.quantization, codec_dtype=args.codec_dtype,
                           prefill_chunk=args.prefill_chunk,
                           kv_cache_dtype=kv_cache_dtype_arg(args.kv_cache_dtype),
                           kv_block_size=args.kv_block_size)


def _load_random_service(args: argparse.Namespace, frames_cap: int | None):
    """``--random-model``: random weights at real shapes (benchmarks); says so loudly."""
    import time

    from ..bench.random_tts import parameter_count, random_tts
    from ..quant.kv import kv_cache_dtype_arg
    from .service import TTSService

    t = time.perf_counter()
    tts = random_tts(args.random_model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                     codec_dtype=args.codec_dtype)
    slow, codec = parameter_count(tts)
    service = TTSService.from_tts(tts, max_running=args.max_running, max_seq_len=args.max_seq_len,
                                  model_name=f"random {args.random_model}", random_weights=True,
                                  prefill_chunk=args.prefill_chunk,
                                  kv_cache_dtype=kv_cache_dtype_arg(args.kv_cache_dtype),
                                  kv_block_size=args.kv_block_size)
    cdt = service.codec_dtype or {}
    log.warning("RANDOM WEIGHTS, BENCHMARK ONLY: %s shapes (DualAR %.2fB parameters %s, codec %.0fM "
                "parameters, decode %s / encode %s) built on %s in %.1f s; the audio is noise; "
                "<|im_end|> is ignored and every request yields exactly min(max_new_tokens, %s) frames "
                "per text batch", args.random_model, slow / 1e9, str(tts.model.dtype).removeprefix("torch."),
                codec / 1e6, cdt.get("decode"), cdt.get("encode"), tts.model.device,
                time.perf_counter() - t, frames_cap)
    return service


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .auth import load_api_keys
    from .config import ServerConfig

    frames_cap = _frames_cap(args)
    config = ServerConfig(
        api_keys=load_api_keys(args.api_key, args.api_keys_file),
        max_concurrency_per_key=args.max_concurrency_per_key,
        max_text_length=args.max_text_length,
        max_body_bytes=args.max_body_size,
        max_pending=args.max_pending,
        max_new_tokens_cap=frames_cap,
        voices_dir=_voices_dir(args.voices_dir),
    )
    config.validate()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.random_model:
        service = _load_random_service(args, frames_cap)
    else:
        service = _load_checkpoint_service(args)
    auth = f"{len(config.api_keys)} API key(s)" if config.api_keys else "open (no API key configured)"
    what = (f"RANDOM WEIGHTS at {args.random_model} shapes (benchmark only, noise)" if args.random_model
            else service.model_name)
    print(f"shoal: serving {what} ({service.family}, {service.tts.model.device}) on "
          f"http://{args.host}:{args.port}, auth: {auth}", file=sys.stderr, flush=True)
    app = create_app(service, config, owns_service=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
