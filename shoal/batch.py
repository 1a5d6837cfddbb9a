"""``shoal batch``: synthesize every line of a JSONL file through the continuous-batching engine.

    shoal batch requests.jsonl --out OUT [--checkpoint DIR] [--max-running N] [--no-audio]

Each line is one request (``{"id": "ch01-0001", "text": "...", "references": [...], ...}``,
see docs/batch.md). Every line is validated before anything is loaded; then all lines stream
through one :class:`~shoal.engine.engine.Engine`, which batches them. As each request finishes
its outputs are written atomically: ``OUT/<id>.npy`` (int64 codes ``[10, frames]``),
``OUT/<id>.wav`` (unless ``--no-audio``) and a line in ``OUT/manifest.jsonl``. A rerun skips
the lines whose outputs exist, so an interrupted job resumes where it stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------- request lines

LINE_KEYS = ("id", "text", "references", "seed", "temperature", "top_p", "top_k", "greedy",
             "repetition_penalty", "max_new_tokens", "chunk_length", "priority")
REFERENCE_KEYS = ("audio", "codes", "text")
SAMPLING_KEYS = ("temperature", "top_p", "top_k")
ID_RE = re.compile(r"[A-Za-z0-9_.\-]+")
MAX_ID_LENGTH = 200  # leaves room for ".npy" / temp-file affixes within a 255-byte file name
MANIFEST = "manifest.jsonl"
SEED_PREFIX = "shoal-batch:"
MAX_ERRORS_SHOWN = 50
NUM_CODEBOOKS = 10  # both model families
DEFAULT_FRAME_SECONDS = 2048 / 44100  # the real codec: hop 2048 at 44.1 kHz


class BatchError(ValueError):
    """A bad request file, reference or output folder (``shoal: error: ...``, exit code 2)."""


def derive_seed(request_id: str) -> int:
    """The seed of a line without one: the first 4 bytes (big-endian) of
    ``sha256("shoal-batch:" + id)``, masked to 31 bits. Stable across runs, machines and
    versions, so a rerun reproduces the same audio."""
    digest = hashlib.sha256((SEED_PREFIX + request_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass(frozen=True)
class ReferenceSpec:
    kind: str  # "audio" | "codes"
    path: Path  # resolved against the JSONL file's folder
    text: str


@dataclass
class RequestLine:
    lineno: int  # 1-based physical line in the JSONL file
    id: str
    text: str
    references: list[ReferenceSpec] = field(default_factory=list)
    seed: int = 0
    seed_given: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature / top_p / top_k overrides
    greedy: bool = False
    repetition_penalty: float | None = None  # None: the family default (S1 1.1, S2 1.0)
    max_new_tokens: int | None = None  # None: --max-new-tokens
    chunk_length: int | None = None  # None: --chunk-length
    priority: str = "batch"

    def params(self, family: str):
        from .engine.sampling import SamplingParams

        penalty = self.repetition_penalty
        if penalty is None:
            penalty = 1.1 if family == "s1" else 1.0
        return SamplingParams(greedy=self.greedy, repetition_penalty=penalty, **self.sampling)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and v == v and abs(v) != float("inf")


def check_id(request_id: str) -> str | None:
    """Why ``request_id`` is not a safe file stem, or None when it is."""
    if not request_id:
        return "is empty"
    if len(request_id) > MAX_ID_LENGTH:
        return f"is longer than {MAX_ID_LENGTH} characters"
    if not ID_RE.fullmatch(request_id):
        bad = sorted({c for c in request_id if not ID_RE.fullmatch(c)})
        return f"may only use letters, digits, '-', '_' and '.' (found {''.join(bad)!r})"
    if request_id.startswith("."):
        return "may not start with '.'"
    return None


class _CodesCache:
    """Reference ``.npy`` files, each read once and checked to be int ``[10, T]``."""

    def __init__(self) -> None:
        self.codes: dict[Path, np.ndarray] = {}
        self.errors: dict[Path, str] = {}

    def check(self, path: Path) -> str | None:
        if path in self.codes:
            return None
        if path in self.errors:
            return self.errors[path]
        err = None
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            why = "not a NumPy .npy file" if "pickle" in str(e) else str(e)
            err = f"cannot read codes {path}: {why}"
        else:
            if not isinstance(arr, np.ndarray) or arr.ndim != 2 or arr.shape[0] != NUM_CODEBOOKS:
                err = f"codes {path} must be int [{NUM_CODEBOOKS}, T], got shape {getattr(arr, 'shape', '?')}"
            elif arr.size and not np.issubdtype(arr.dtype, np.integer):
                err = f"codes {path} must be integers, got {arr.dtype}"
            elif arr.size and (arr.min() < 0 or arr[0].max() >= 4096):
                err = f"codes {path} are out of range (semantic row must be 0..4095, all codes >= 0)"
            else:
                self.codes[path] = arr.astype(np.int64, copy=False)
        if err:
            self.errors[path] = err
        return err


def _check_audio_file(path: Path, seen: dict[Path, str | None]) -> str | None:
    if path not in seen:
        err = None
        if not path.is_file():
            err = f"audio file not found: {path}"
        else:
            import soundfile as sf

            try:
                info = sf.info(str(path))
                if info.frames == 0:
                    err = f"audio file {path} has no samples"
            except Exception as e:  # libsndfile raises several types for unreadable files
                err = f"cannot read audio {path}: {e}"
        seen[path] = err
    return seen[path]


def _parse_references(value: Any, base: Path, codes: _CodesCache,
                      audio_seen: dict) -> tuple[list[ReferenceSpec], list[str]]:
    if value is None:
        return [], []
    if not isinstance(value, list):
        return [], [f"'references' must be a list, got {type(value).__name__}"]
    refs, errors = [], []
    for i, item in enumerate(value):
        where = f"references[{i}]"
        if not isinstance(item, dict):
            errors.append(f"{where} must be an object with 'audio' or 'codes' and 'text'")
            continue
        unknown = sorted(set(item) - set(REFERENCE_KEYS))
        if unknown:
            errors.append(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} "
                          f"(allowed: {', '.join(REFERENCE_KEYS)})")
        kinds = [k for k in ("audio", "codes") if k in item]
        if len(kinds) != 1:
            errors.append(f"{where} needs exactly one of 'audio' or 'codes'")
            continue
        kind = kinds[0]
        text = item.get("text")
        if not isinstance(text, str):
            errors.append(f"{where}.text (the reference transcript) must be a string")
        raw = item[kind]
        if not isinstance(raw, str) or not raw:
            errors.append(f"{where}.{kind} must be a file path")
            continue
        path = Path(raw).expanduser()
        if not path.is_absolute():
            path = base / path
        path = Path(os.path.normpath(path))
        err = _check_audio_file(path, audio_seen) if kind == "audio" else codes.check(path)
        if err:
            errors.append(f"{where}: {err}")
        if isinstance(text, str) and not err:
            refs.append(ReferenceSpec(kind, path, text))
    return refs, errors


def _parse_line(obj: Any, lineno: int, base: Path, codes: _CodesCache,
                audio_seen: dict) -> tuple[RequestLine | None, list[str]]:
    if not isinstance(obj, dict):
        return None, [f"expected a JSON object, got {type(obj).__name__}"]
    errors: list[str] = []
    unknown = [k for k in obj if k not in LINE_KEYS]
    if unknown:
        errors.append(f"unknown key(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(LINE_KEYS)})")
    opt = {k: v for k, v in obj.items() if v is not None}  # null = absent

    text = obj.get("text")
    if "text" not in obj:
        errors.append("missing required key 'text'")
    elif not isinstance(text, str):
        errors.append(f"'text' must be a string, got {type(text).__name__}")
    elif not text.strip():
        errors.append("'text' is empty")

    rid = opt.get("id", f"{lineno:06d}")
    if _is_int(rid):
        rid = str(rid)
    if not isinstance(rid, str):
        errors.append(f"'id' must be a string, got {type(rid).__name__}")
        rid = None
    elif (why := check_id(rid)) is not None:
        errors.append(f"id {rid!r} {why}")
        rid = None

    line = RequestLine(lineno=lineno, id=rid or "", text=text if isinstance(text, str) else "")
    refs, ref_errors = _parse_references(obj.get("references"), base, codes, audio_seen)
    line.references = refs
    errors += ref_errors

    if "seed" in opt:
        s = opt["seed"]
        if not _is_int(s) or not 0 <= s < 2 ** 63:
            errors.append(f"'seed' must be an integer in [0, 2^63), got {s!r}")
        else:
            line.seed, line.seed_given = int(s), True
    for key in ("temperature", "top_p", "repetition_penalty"):
        if key in opt and not _is_number(opt[key]):
            errors.append(f"'{key}' must be a number, got {opt[key]!r}")
    if "top_k" in opt and not _is_int(opt["top_k"]):
        errors.append(f"'top_k' must be an integer, got {opt['top_k']!r}")
    if "greedy" in opt and not isinstance(opt["greedy"], bool):
        errors.append(f"'greedy' must be true or false, got {opt['greedy']!r}")
    if "max_new_tokens" in opt and (not _is_int(opt["max_new_tokens"]) or opt["max_new_tokens"] < 0):
        errors.append(f"'max_new_tokens' must be an integer >= 0 (0 = up to the context), "
                      f"got {opt['max_new_tokens']!r}")
    if "chunk_length" in opt and (not _is_int(opt["chunk_length"]) or opt["chunk_length"] < 1):
        errors.append(f"'chunk_length' must be an integer >= 1, got {opt['chunk_length']!r}")
    if "priority" in opt:
        p = opt["priority"]
        if not isinstance(p, str) or p.lower() not in ("realtime", "interactive", "batch"):
            errors.append(f"'priority' must be realtime, interactive or batch, got {p!r}")
        else:
            line.priority = p.lower()
    line.sampling = {k: opt[k] for k in SAMPLING_KEYS if k in opt}
    line.greedy = opt.get("greedy") is True
    line.repetition_penalty = opt.get("repetition_penalty")
    line.max_new_tokens = opt.get("max_new_tokens")
    line.chunk_length = opt.get("chunk_length")
    if not any(k in e for e in errors for k in (*SAMPLING_KEYS, "greedy", "repetition_penalty")):
        try:
            line.params("s2").validate()  # the family default penalties are both valid
        except ValueError as e:
            errors.append(str(e))
    if errors:
        return None, errors
    if not line.seed_given:
        line.seed = derive_seed(line.id)
    return line, []


def _format_errors(path: Path, errors: list[tuple[int, str]]) -> str:
    lines = sorted({n for n, _ in errors})
    head = f"{path}: {len(lines)} bad line{'s' if len(lines) != 1 else ''}, nothing generated"
    shown = [f"  line {n}: {msg}" for n, msg in errors[:MAX_ERRORS_SHOWN]]
    if len(errors) > MAX_ERRORS_SHOWN:
        shown.append(f"  ... and {len(errors) - MAX_ERRORS_SHOWN} more")
    return "\n".join([head, *shown])


def read_requests(path: str | Path) -> tuple[list[RequestLine], dict[Path, np.ndarray]]:
    """Parse and validate every line of a JSONL request file.

    Returns the request lines (blank lines skipped) and the reference codes read from
    ``.npy`` files. Raises :class:`BatchError` listing every bad line.
    """
    path = Path(path)
    if not path.is_file():
        raise BatchError(f"requests file not found: {path}" if not path.exists()
                         else f"requests file is not a file: {path}")
    try:
        raw = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BatchError(f"{path}: not UTF-8 text ({e})") from None
    base = path.resolve().parent
    codes = _CodesCache()
    audio_seen: dict[Path, str | None] = {}
    lines: list[RequestLine] = []
    errors: list[tuple[int, str]] = []
    first_seen: dict[str, tuple[int, str]] = {}
    for lineno, text in enumerate(raw.splitlines(), start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            errors.append((lineno, f"invalid JSON: {e.msg} (column {e.colno})"))
            continue
        line, errs = _parse_line(obj, lineno, base, codes, audio_seen)
        errors += [(lineno, e) for e in errs]
        rid = line.id if line else (obj.get("id") if isinstance(obj, dict) else None)
        if rid is None and isinstance(obj, dict):
            rid = f"{lineno:06d}"
        if _is_int(rid):
            rid = str(rid)
        if isinstance(rid, str) and not check_id(rid):
            key = rid.casefold()  # ids differing only in case collide on some file systems
            if key in first_seen:
                n, first = first_seen[key]
                why = "" if first == rid else (" (ids that differ only in case name the same files on "
                                               "case-insensitive file systems)")
                errors.append((lineno, f"duplicate id {rid!r}: line {n} has {first!r}{why}"))
                continue
            first_seen[key] = (lineno, rid)
        if line is not None:
            lines.append(line)
    if errors:
        raise BatchError(_format_errors(path, errors))
    if not lines:
        raise BatchError(f"{path}: no requests (the file is empty)")
    return lines, codes.codes


# ---------------------------------------------------------------------------- outputs

def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """``write(f)`` into a temp file beside ``path``, fsync, then rename over ``path``: readers
    (and a resumed job) see either no file or the whole file, never a truncated one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def is_done(out: Path, request_id: str, audio: bool) -> bool:
    return (out / f"{request_id}.npy").is_file() and (not audio or (out / f"{request_id}.wav").is_file())


def _read_manifest(path: Path) -> list[dict]:
    entries = []
    if path.is_file():
        for text in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                e = json.loads(text)
            except json.JSONDecodeError:
                continue  # a line cut short by a hard kill
            if isinstance(e, dict) and isinstance(e.get("id"), str):
                entries.append(e)
    return entries


def _write_manifest(path: Path, entries: list[dict]) -> None:
    body = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries).encode("utf-8")
    atomic_write(path, lambda f: f.write(body))


@contextlib.contextmanager
def _out_lock(out: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(out / ".shoal-batch.lock", "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise BatchError(f"another shoal batch is writing to {out}") from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class _Interrupt:
    """First Ctrl-C: finish the current engine step, write what finished in it, stop.
    A second Ctrl-C raises KeyboardInterrupt at once (outputs are still never truncated)."""

    def __init__(self) -> None:
        self.requested = False
        self.previous = None

    def __enter__(self) -> "_Interrupt":
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nshoal: interrupt: stopping after the current step (Ctrl-C again to stop now)",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


# ---------------------------------------------------------------------------- the job

@dataclass
class BatchSummary:
    total: int = 0  # lines in the file
    skipped: int = 0  # already done before this run
    done: int = 0  # finished in this run
    failed: list[tuple[str, str]] = field(default_factory=list)  # (id, error)
    frames: int = 0  # frames written in this run
    audio_seconds: float = 0.0
    wall_s: float = 0.0  # generation: first request submitted -> last output written
    load_s: float = 0.0  # model, codec and reference encoding before that
    interrupted: bool = False

    @property
    def frames_per_s(self) -> float:
        return self.frames / self.wall_s if self.wall_s > 0 else 0.0

    def describe(self) -> str:
        parts = [f"{self.done} done"]
        if self.skipped:
            parts.append(f"{self.skipped} skipped")
        if self.failed:
            parts.append(f"{len(self.failed)} failed")
        remaining = self.total - self.skipped - self.done - len(self.failed)
        if remaining:
            parts.append(f"{remaining} not finished")
        rt = ""
        if self.wall_s > 0 and self.audio_seconds:
            rt = f", {self.audio_seconds / self.wall_s:.2f}x real time"
        return (f"{', '.join(parts)} of {self.total}: {self.frames} frames "
                f"({self.audio_seconds:.1f} s of audio) in {self.wall_s:.1f} s "
                f"(+{self.load_s:.1f} s loading), "
                f"{self.frames_per_s:.1f} frames/s{rt}")


def _frame_seconds(checkpoint: Path, codec) -> float:
    if codec is not None:
        return codec.frame_length / codec.sample_rate
    try:
        from .checkpoint import codec_path
        from .codec import config_for_checkpoint

        cfg = config_for_checkpoint(codec_path(checkpoint))
        return cfg.frame_length / cfg.sample_rate
    except Exception:  # no codec beside the model: the real codec's rate
        return DEFAULT_FRAME_SECONDS


def run_batch(requests: str | Path, out: str | Path, checkpoint: str | Path | None = None, *,
              device: str | None = "auto", dtype: str | None = "auto", max_running: int | None = None,
              max_new_tokens: int = 1024, chunk_length: int | None = None, audio: bool = True,
              progress: bool = True, log: Callable[[str], None] | None = None,
              quantization: str | None = None, codec_dtype: str | None = "auto",
              kv_cache_dtype: str | None = None, kv_block_size: int | None = None) -> BatchSummary:
    """Run a JSONL batch job; see the module docstring and docs/batch.md."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    requests = Path(requests)
    if max_running is not None and max_running < 1:
        raise BatchError("--max-running must be >= 1")
    if max_new_tokens < 0:
        raise BatchError("--max-new-tokens must be >= 0")
    if chunk_length is not None and chunk_length < 1:
        raise BatchError("--chunk-length must be >= 1")
    if kv_block_size is not None and kv_block_size < 1:
        raise BatchError("--kv-block-size must be >= 1")
    lines, npy_codes = read_requests(requests)

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise BatchError(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    summary = BatchSummary(total=len(lines))
    with _out_lock(out):
        pending = [ln for ln in lines if not is_done(out, ln.id, audio)]
        summary.skipped = len(lines) - len(pending)
        _reconcile_manifest(out / MANIFEST, lines, pending)
        if summary.skipped:
            say(f"shoal batch: skipped {summary.skipped} of {len(lines)} requests already in {out}")
        if not pending:
            say(f"shoal batch: all {len(lines)} requests are done; nothing to generate")
            return summary
        _generate(requests, pending, npy_codes, out, checkpoint, summary, device=device, dtype=dtype,
                  max_running=max_running, max_new_tokens=max_new_tokens, chunk_length=chunk_length,
                  audio=audio, progress=progress, say=say, quantization=quantization,
                  codec_dtype=codec_dtype, kv_cache_dtype=kv_cache_dtype, kv_block_size=kv_block_size)
    return summary


def _reconcile_manifest(path: Path, lines: list[RequestLine], pending: list[RequestLine]) -> None:
    """Drop manifest entries of lines about to be regenerated; add entries (stop "unknown")
    for finished outputs whose manifest line was lost to a hard kill."""
    entries = _read_manifest(path)
    redo = {ln.id for ln in pending}
    kept = [e for e in entries if e["id"] not in redo]
    have = {e["id"] for e in kept}
    for ln in lines:
        if ln.id in redo or ln.id in have:
            continue
        try:
            frames = int(np.load(path.parent / f"{ln.id}.npy", mmap_mode="r").shape[1])
        except (OSError, ValueError, IndexError):
            continue
        kept.append({"id": ln.id, "line": ln.lineno, "frames": frames, "seconds": None,
                     "stop": "unknown", "seed": ln.seed})
    if kept != entries or (entries and not path.read_bytes().endswith(b"\n")):
        _write_manifest(path, kept)


def _generate(requests: Path, pending: list[RequestLine], npy_codes: dict[Path, np.ndarray], out: Path,
              checkpoint, summary: BatchSummary, *, device, dtype, max_running, max_new_tokens,
              chunk_length, audio, progress, say, quantization=None, codec_dtype=None,
              kv_cache_dtype=None, kv_block_size=None) -> None:
    from tqdm import tqdm

    from .checkpoint import codec_path, load_dualar, resolve_codec_dtypes, resolve_device, resolve_dtype
    from .codec import load_codec, write_wav
    from .engine.engine import Engine, EngineConfig
    from .engine.request import EngineRequest, FinishEvent, Priority
    from .text import Reference, build_session
    from .tts import TTS

    if checkpoint is None:
        from .demo import default_checkpoint

        checkpoint = default_checkpoint()
    checkpoint = Path(checkpoint)
    t_load = time.perf_counter()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    model, tokenizer = load_dualar(checkpoint, device=dev, dtype=dt, quantization=quantization)
    family = model.config.family
    audio_refs = sorted({r.path for ln in pending for r in ln.references if r.kind == "audio"})
    codec = None
    if audio or audio_refs:
        enc_dt, dec_dt = resolve_codec_dtypes(codec_dtype, dev)  # auto: bf16 decode + fp32 encode on CUDA
        codec = load_codec(codec_path(checkpoint), device=dev, dtype=enc_dt, decode_dtype=dec_dt)
    tts = TTS(model, tokenizer, codec)
    frame_s = _frame_seconds(checkpoint, codec)

    # Reference audio: encoded once per distinct file, before anything is generated.
    ref_codes: dict[Path, np.ndarray] = dict(npy_codes)
    bad: list[tuple[int, str]] = []
    bad_audio: dict[Path, str] = {}
    for p in tqdm(audio_refs, desc="encoding references", unit="clip", file=sys.stderr,
                  disable=not progress or len(audio_refs) < 2):
        try:
            ref_codes[p] = tts.encode_reference(p)
        except (OSError, ValueError, RuntimeError) as e:
            bad_audio[p] = f"cannot encode reference audio {p}: {e}"

    engine = Engine(model, tokenizer.im_end_id, codec=None,
                    config=EngineConfig(max_running=max_running, kv_cache_dtype=kv_cache_dtype,
                                                        **({"block_size": kv_block_size} if kv_block_size else {})))

    def session(ln: RequestLine):
        refs = [Reference(r.text, ref_codes[r.path]) for r in ln.references]
        cl = ln.chunk_length if ln.chunk_length is not None else chunk_length
        return build_session(family, tokenizer, ln.text, refs, cl)

    # Every pending line must build a prompt that fits the context before generation starts.
    for ln in pending:
        errs = [bad_audio[r.path] for r in ln.references if r.path in bad_audio]
        if not errs:
            try:
                T = session(ln).grid().shape[1]
                if T >= engine.max_seq_len:
                    errs.append(f"the prompt has {T} tokens but the model's context is {engine.max_seq_len}")
            except (ValueError, TypeError) as e:
                errs.append(str(e))
        bad += [(ln.lineno, e) for e in errs]
    if bad:
        raise BatchError(_format_errors(requests, bad))
    if dev.type == "cuda":
        engine.warmup(show_progress=progress)
    summary.load_s = time.perf_counter() - t_load
    say(f"shoal batch: {len(pending)} requests, {family} model from {checkpoint} on {dev} "
        f"(max {engine.max_running} running, ready in {summary.load_s:.1f} s)")

    # Most urgent priority first, then file order; a bounded window is in the engine at a time
    # so the scheduler always has work queued while prompts are built lazily.
    queue = deque(sorted(pending, key=lambda ln: (Priority.parse(ln.priority), ln.lineno)))
    window = 2 * engine.max_running
    inflight: dict[str, RequestLine] = {}
    manifest = out / MANIFEST
    frames0 = engine.stats["frames"]
    t0 = time.perf_counter()
    bar = tqdm(total=summary.total, initial=summary.skipped, desc="shoal batch", unit="req",
               file=sys.stderr, disable=not progress, dynamic_ncols=True, mininterval=0.5)
    last_postfix = t0

    def finish(ln: RequestLine, ev) -> None:
        codes = np.ascontiguousarray(ev.codes, dtype=np.int64)
        seconds = codes.shape[1] * frame_s
        atomic_write(out / f"{ln.id}.npy", lambda f: np.save(f, codes))
        if audio:
            pcm = tts.decode(codes)
            seconds = len(pcm) / codec.sample_rate
            atomic_write(out / f"{ln.id}.wav", lambda f: write_wav(f, pcm, codec.sample_rate))
        entry = {"id": ln.id, "line": ln.lineno, "frames": int(codes.shape[1]),
                 "seconds": round(seconds, 4), "stop": ev.reason, "seed": ln.seed}
        with open(manifest, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
        summary.done += 1
        summary.frames += int(codes.shape[1])
        summary.audio_seconds += seconds

    try:
        with _Interrupt() as interrupt:
            while (queue or inflight) and not interrupt.requested:
                while queue and len(inflight) < window:
                    ln = queue.popleft()
                    cap = ln.max_new_tokens if ln.max_new_tokens is not None else max_new_tokens
                    engine.add_request(EngineRequest(
                        session=session(ln), params=ln.params(family), seed=ln.seed,
                        max_new_tokens=cap, priority=Priority.parse(ln.priority), request_id=ln.id))
                    inflight[ln.id] = ln
                for ev in engine.step():
                    if not isinstance(ev, FinishEvent) or ev.request_id not in inflight:
                        continue
                    ln = inflight.pop(ev.request_id)
                    if ev.reason in ("eos", "length"):
                        finish(ln, ev)
                    elif ev.reason != "cancelled":
                        summary.failed.append((ln.id, ev.error or ev.reason))
                        bar.write(f"shoal batch: line {ln.lineno} ({ln.id}) failed: {ev.error or ev.reason}",
                                  file=sys.stderr)
                    bar.update(1)
                now = time.perf_counter()
                if now - last_postfix >= 0.5 or not (queue or inflight):
                    fps = (engine.stats["frames"] - frames0) / max(now - t0, 1e-9)
                    bar.set_postfix_str(f"{fps:.0f} frames/s, {len(inflight)} running+queued",
                                        refresh=False)
                    last_postfix = now
            summary.interrupted = interrupt.requested and bool(queue or inflight)
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:  # unfinished requests are dropped with the engine: nothing of them is written
        bar.close()
        summary.wall_s = time.perf_counter() - t0


# ---------------------------------------------------------------------------- the command

def cmd_batch(args: argparse.Namespace) -> int:
    from .quant.kv import kv_cache_dtype_arg

    try:
        summary = run_batch(args.requests, args.out, args.checkpoint, device=args.device,
                            dtype=args.dtype, max_running=args.max_running,
                            max_new_tokens=args.max_new_tokens, chunk_length=args.chunk_length,
                            audio=not args.no_audio, quantization=args.quantization,
                            codec_dtype=args.codec_dtype,
                            kv_cache_dtype=kv_cache_dtype_arg(args.kv_cache_dtype),
                            kv_block_size=args.kv_block_size)
    except KeyboardInterrupt:  # before generation started (loading, encoding references)
        print("\nshoal batch: interrupted before generation started; no outputs were written",
              file=sys.stderr)
        return 130
    if summary.done or summary.failed or summary.interrupted:
        print(f"shoal batch: {summary.describe()}", file=sys.stderr)
    for rid, err in summary.failed[:MAX_ERRORS_SHOWN]:
        print(f"shoal batch: failed {rid}: {err}", file=sys.stderr)
    if summary.interrupted:
        print(f"shoal batch: interrupted; finished outputs are in {args.out}; rerun the same "
              "command to resume", file=sys.stderr)
        return 130
    return 1 if summary.failed else 0


def add_batch_parser(subparsers) -> argparse.ArgumentParser:
    from .cli import add_codec_dtype_arg
    from .quant.kv import add_kv_block_size_arg

    p = subparsers.add_parser(
        "batch", help="synthesize every line of a JSONL file (offline bulk jobs, resumable)",
        description="Synthesize every request of a JSONL file through the batching engine. "
                    "Writes OUT/<id>.npy, OUT/<id>.wav and OUT/manifest.jsonl; a rerun skips "
                    "finished lines. Line format: docs/batch.md.")
    p.add_argument("requests", metavar="requests.jsonl",
                   help="one JSON object per line: text, optional id, references, seed, sampling settings")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created if missing)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="checkpoint directory (default: the embedded tiny demo model)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="model precision (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"],
                   help="fp8: quantize a bf16 checkpoint to block-scaled FP8 at load")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"],
                   help="slow KV cache storage: auto (the model's dtype) or fp8 (docs/quantization.md); "
                        "default: env SHOAL_KV_CACHE_DTYPE, else auto")
    add_codec_dtype_arg(p)
    add_kv_block_size_arg(p)
    p.add_argument("--max-running", type=int, default=None, metavar="N",
                   help="requests decoded together (default: 128 on CUDA, 16 on CPU)")
    p.add_argument("--max-new-tokens", type=int, default=1024, metavar="N",
                   help="frames per text batch for lines without max_new_tokens (0 = up to the context)")
    p.add_argument("--chunk-length", type=int, default=None, metavar="BYTES",
                   help="UTF-8 byte budget per text batch for <|speaker:N|> dialogue, for lines "
                        "without chunk_length (default 300)")
    p.add_argument("--no-audio", action="store_true", help="write codes only (no codec decode, no .wav)")
    p.set_defaults(func=cmd_batch)
    return p


def main_for_tests(argv: list[str]) -> int:
    """``shoal batch ARGV...`` with the CLI's error handling, without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="shoal")
    add_batch_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["batch", *argv])
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"shoal: error: {e}", file=sys.stderr)
        return 2
