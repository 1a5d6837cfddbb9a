"""Prompt (token grid) builders for the S2-Pro and S1-mini prompt layouts.

A prompt is a list of parts: :class:`TextPart` (tokenized on its own; BPE never merges
across part boundaries) and :class:`VQPart` (codec codes ``[C, T]``). ``encode_parts``
turns them into the int64 grid ``[1 + C, L]`` the model consumes: row 0 holds the token
ids (``semantic_begin_id + code0`` at audio positions), rows 1..C hold the codes at audio
positions and 0 elsewhere (row 1 duplicates code0).

``build_session`` returns a :class:`PromptSession` that yields one grid per generation
batch. See ``docs/prompt.md`` for both layouts.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from .tokenizer import (
    IM_END_TOKEN,
    IM_START_TOKEN,
    INTERLEAVE_TOKEN,
    NUM_SEMANTIC_TOKENS,
    VOICE_TOKEN,
    TextTokenizer,
)

__all__ = [
    "DEFAULT_CHUNK_LENGTH",
    "MAX_SPEAKERS_PER_BATCH",
    "NUM_CODEBOOKS",
    "Part",
    "PromptSession",
    "Reference",
    "S1PromptSession",
    "S2PromptSession",
    "SPEAKER_TAG_RE",
    "TextPart",
    "VQPart",
    "build_session",
    "encode_part",
    "encode_parts",
    "format_grid",
    "format_parts",
    "group_turns_into_batches",
    "split_batches",
    "split_text_by_speaker",
]

NUM_CODEBOOKS = 10
MAX_SPEAKERS_PER_BATCH = 5
# Used when a caller passes chunk_length=None (the fish-speech CLI default).
DEFAULT_CHUNK_LENGTH = 300

SPEAKER_TAG_RE = re.compile(r"<\|speaker:\d+\|>")

S2_SYSTEM_NO_REF = "convert the provided text to speech"
S2_SYSTEM_REF = "convert the provided text to speech reference to the following:\n\nText:\n"
S2_SPEECH_SEP = "\n\nSpeech:\n"
S1_SPEAKER = "<|speaker:0|>"


# ---------------------------------------------------------------------- parts


@dataclass(frozen=True)
class TextPart:
    """Text tokenized on its own (special tokens written inline are recognised)."""

    text: str


def _as_codes(codes, what: str) -> np.ndarray:
    arr = np.asarray(codes)
    if arr.ndim != 2:
        raise ValueError(f"{what}: codes must be 2-D [codebooks, frames], got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: codes must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


@dataclass(eq=False)
class VQPart:
    """Codec codes ``[C, T]``: row 0 semantic code (0..4095), rows 1..C-1 residual codes."""

    codes: np.ndarray

    def __post_init__(self) -> None:
        self.codes = _as_codes(self.codes, "VQPart")

    @property
    def num_frames(self) -> int:
        return int(self.codes.shape[1])


Part = Union[TextPart, VQPart]


@dataclass(eq=False)
class Reference:
    """A voice reference: its transcript and its codec codes (int ``[10, T]``)."""

    text: str
    codes: np.ndarray

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Reference.text must be str, got {type(self.text).__name__}")
        self.codes = _as_codes(self.codes, "Reference")


def encode_part(tokenizer: TextTokenizer, part: Part, num_codebooks: int = NUM_CODEBOOKS) -> np.ndarray:
    """Grid columns ``[1 + num_codebooks, n]`` (int64) of one part."""
    if isinstance(part, TextPart):
        ids = tokenizer.encode(part.text)
        out = np.zeros((1 + num_codebooks, len(ids)), dtype=np.int64)
        out[0] = ids
        return out
    if isinstance(part, VQPart):
        codes = part.codes
        if codes.shape[0] != num_codebooks:
            raise ValueError(
                f"VQPart has {codes.shape[0]} codebooks, expected {num_codebooks} (shape {codes.shape})"
            )
        if codes.size:
            if codes.min() < 0:
                raise ValueError(f"VQPart has negative codes (min {codes.min()})")
            if codes[0].max() >= NUM_SEMANTIC_TOKENS:
                raise ValueError(
                    f"VQPart semantic codes (row 0) must be < {NUM_SEMANTIC_TOKENS}, got {codes[0].max()}"
                )
        out = np.empty((1 + num_codebooks, codes.shape[1]), dtype=np.int64)
        out[0] = tokenizer.semantic_begin_id + codes[0]
        out[1:] = codes
        return out
    raise TypeError(f"not a prompt part: {type(part).__name__}")


def encode_parts(
    tokenizer: TextTokenizer, parts: Sequence[Part], num_codebooks: int = NUM_CODEBOOKS
) -> np.ndarray:
    """Token grid ``int64 [1 + num_codebooks, L]`` of ``parts`` (each TextPart tokenized separately)."""
    cols = [encode_part(tokenizer, p, num_codebooks) for p in parts]
    if not cols:
        return np.zeros((1 + num_codebooks, 0), dtype=np.int64)
    return np.concatenate(cols, axis=1)


# ---------------------------------------------------------------------- text splitting


def split_text_by_speaker(text: str) -> list[str]:
    """Split ``text`` into turns at ``<|speaker:N|>`` tags (reference behaviour).

    Each turn is a tag plus the text up to the next tag, stripped of surrounding
    whitespace. Text before the first tag is dropped. No tag -> ``[]``.
    """
    pieces = re.split(f"({SPEAKER_TAG_RE.pattern})", text)
    # pieces = [before, tag1, after1, tag2, after2, ...]; tags sit at odd indices.
    return [(pieces[i] + pieces[i + 1]).strip() for i in range(1, len(pieces), 2)]


def group_turns_into_batches(
    turns: Sequence[str],
    max_speakers: int = MAX_SPEAKERS_PER_BATCH,
    max_bytes: int = DEFAULT_CHUNK_LENGTH,
) -> list[str]:
    """Greedily pack turns into batches joined by ``"\\n"`` (reference behaviour).

    A new batch starts when the current one already has ``max_speakers`` turns, or when
    adding the turn would push its UTF-8 size over ``max_bytes``. The ``"\\n"`` joiners are
    not counted (so a batch can exceed ``max_bytes`` by a few bytes), and a single turn
    larger than ``max_bytes`` forms its own batch.
    """
    batches: list[str] = []
    current: list[str] = []
    size = 0
    for turn in turns:
        n = len(turn.encode("utf-8"))
        if current and (len(current) >= max_speakers or size + n > max_bytes):
            batches.append("\n".join(current))
            current, size = [], 0
        current.append(turn)
        size += n
    if current:
        batches.append("\n".join(current))
    return batches


def split_batches(text: str, chunk_length: int | None = None) -> list[str]:
    """The S2 generation batches of ``text``.

    Text with ``<|speaker:N|>`` tags is split into turns and grouped (≤5 turns and about
    ``chunk_length`` bytes per batch); text with no tag is a single batch, unchanged, and
    ``chunk_length`` has no effect.
    """
    if chunk_length is None:
        chunk_length = DEFAULT_CHUNK_LENGTH
    if isinstance(chunk_length, bool) or not isinstance(chunk_length, (int, np.integer)) or chunk_length < 1:
        raise ValueError(f"chunk_length must be a positive integer, got {chunk_length!r}")
    if not SPEAKER_TAG_RE.search(text):
        return [text]
    turns = split_text_by_speaker(text)
    if not turns:  # pragma: no cover - a tag always yields a turn; kept as a guard
        raise ValueError(f"text has speaker tags but yields no turns: {text[:80]!r}")
    return group_turns_into_batches(turns, MAX_SPEAKERS_PER_BATCH, int(chunk_length))


# ---------------------------------------------------------------------- sessions


@dataclass(eq=False)
class _Encoded:
    part: Part
    cols: np.ndarray


class PromptSession(ABC):
    """The prompt of one request, one grid per generation batch.

    Use::

        while not session.done():
            grid = session.grid()           # int64 [1 + C, T]
            codes = generate(grid)          # int [C, t]
            session.commit(codes)
    """

    family: str
    batches: list[str]

    def __init__(self, tokenizer: TextTokenizer, batches: list[str], num_codebooks: int) -> None:
        self.tokenizer = tokenizer
        self.batches = batches
        self.num_codebooks = num_codebooks
        self.index = 0
        self.generated: list[np.ndarray] = []  # committed codes, one array per batch

    # -- to implement
    @abstractmethod
    def _current(self) -> list[_Encoded]:
        """Encoded parts of the current batch's grid."""

    @abstractmethod
    def _advance(self, codes: np.ndarray) -> None:
        """Record ``codes`` for the current batch (before ``index`` moves on)."""

    # -- public
    def done(self) -> bool:
        return self.index >= len(self.batches)

    @property
    def batch_text(self) -> str:
        self._check_not_done()
        return self.batches[self.index]

    def grid(self) -> np.ndarray:
        self._check_not_done()
        return np.concatenate([e.cols for e in self._current()], axis=1)

    def parts(self) -> list[Part]:
        self._check_not_done()
        return [e.part for e in self._current()]

    def commit(self, codes: np.ndarray) -> None:
        self._check_not_done()
        codes = _as_codes(codes, "commit")
        if codes.shape[0] != self.num_codebooks:
            raise ValueError(
                f"commit: codes must be [{self.num_codebooks}, t], got shape {codes.shape}"
            )
        self._advance(codes)
        self.generated.append(codes)
        self.index += 1

    # -- helpers
    def _check_not_done(self) -> None:
        if self.done():
            raise RuntimeError("prompt session is finished: every batch has been committed")

    def _enc(self, part: Part) -> _Encoded:
        return _Encoded(part, encode_part(self.tokenizer, part, self.num_codebooks))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(batch {self.index}/{len(self.batches)})"


def _message(role: str, parts: list[Part], modality: str = "", add_im_end: bool = True) -> list[Part]:
    out: list[Part] = [TextPart(f"{IM_START_TOKEN}{role}\n{modality}")]
    out += parts
    if add_im_end:
        out.append(TextPart(f"{IM_END_TOKEN}\n"))
    return out


class S2PromptSession(PromptSession):
    """S2-Pro (fish-speech HEAD) conversation layout.

    ``system`` (instruction [+ tagged reference transcripts + reference codes]) then, per
    batch, ``user`` (batch text) and an open ``assistant <|voice|>`` message. After a
    commit the real assistant message (codes + ``<|im_end|>\\n``) joins the persistent
    conversation, so later batches see every earlier batch as context.
    """

    family = "s2"

    def __init__(
        self,
        tokenizer: TextTokenizer,
        text: str,
        references: Sequence[Reference],
        chunk_length: int | None,
        num_codebooks: int = NUM_CODEBOOKS,
    ) -> None:
        if tokenizer.voice_id is None:
            raise ValueError("the S2 prompt needs a tokenizer with <|voice|>")
        super().__init__(tokenizer, split_batches(text, chunk_length), num_codebooks)
        if references:
            tagged = [
                r.text if SPEAKER_TAG_RE.search(r.text) else f"<|speaker:{i}|>{r.text}"
                for i, r in enumerate(references)
            ]
            system: list[Part] = [
                TextPart(S2_SYSTEM_REF),
                TextPart("\n".join(tagged)),
                TextPart(S2_SPEECH_SEP),
                VQPart(np.concatenate([r.codes for r in references], axis=1)),
            ]
        else:
            system = [TextPart(S2_SYSTEM_NO_REF)]
        self._context = [self._enc(p) for p in _message("system", system)]
        self._user: list[_Encoded] | None = None  # user message of the current batch
        self._assistant_open = self._enc(_message("assistant", [], VOICE_TOKEN, add_im_end=False)[0])
        self._im_end = self._enc(TextPart(f"{IM_END_TOKEN}\n"))

    def _user_message(self) -> list[_Encoded]:
        if self._user is None:
            self._user = [self._enc(p) for p in _message("user", [TextPart(self.batch_text)])]
        return self._user

    def _current(self) -> list[_Encoded]:
        return self._context + self._user_message() + [self._assistant_open]

    def _advance(self, codes: np.ndarray) -> None:
        vq = self._enc(VQPart(codes))
        self._context += self._user_message() + [self._assistant_open, vq, self._im_end]
        self._user = None


class S1PromptSession(PromptSession):
    """S1-mini (fish-speech ``d3df505``) interleave layout, one batch.

    ``<|interleave|>`` then, per reference, ``<|speaker:0|>`` ⟂ text ⟂ VQ ⟂ ``<|im_end|>``,
    then ``<|speaker:0|>`` ⟂ text. Every reference is speaker 0; no speaker splitting.
    """

    family = "s1"

    def __init__(
        self,
        tokenizer: TextTokenizer,
        text: str,
        references: Sequence[Reference],
        num_codebooks: int = NUM_CODEBOOKS,
    ) -> None:
        super().__init__(tokenizer, [text], num_codebooks)
        parts: list[Part] = [TextPart(INTERLEAVE_TOKEN)]
        for r in references:
            parts += [TextPart(S1_SPEAKER), TextPart(r.text), VQPart(r.codes), TextPart(IM_END_TOKEN)]
        parts += [TextPart(S1_SPEAKER), TextPart(text)]
        self._parts = [self._enc(p) for p in parts]

    def _current(self) -> list[_Encoded]:
        return self._parts

    def _advance(self, codes: np.ndarray) -> None:
        pass


def build_session(
    family: str,
    tokenizer: TextTokenizer,
    text: str,
    references: Sequence[Reference] | None = None,
    chunk_length: int | None = None,
    *,
    num_codebooks: int = NUM_CODEBOOKS,
) -> PromptSession:
    """The prompt session of one request.

    ``family`` "s2": HEAD conversation layout, split into batches at speaker tags
    (``chunk_length`` bytes, default 300; no effect on untagged text). ``family`` "s1":
    interleave layout, one batch, ``chunk_length`` ignored.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("text is empty")
    refs = list(references or [])
    for r in refs:
        if not isinstance(r, Reference):
            raise TypeError(f"references must be Reference objects, got {type(r).__name__}")
        if r.codes.shape[0] != num_codebooks:
            raise ValueError(
                f"reference codes must be [{num_codebooks}, T], got shape {r.codes.shape}"
            )
    if family == "s2":
        return S2PromptSession(tokenizer, text, refs, chunk_length, num_codebooks)
    if family == "s1":
        return S1PromptSession(tokenizer, text, refs, num_codebooks)
    raise ValueError(f"unknown model family {family!r} (expected 's2' or 's1')")


# ---------------------------------------------------------------------- printing


def _clip(s: str, n: int) -> str:
    r = repr(s)
    return r if len(r) <= n else r[: n - 1] + "…"


def format_grid(
    grid: np.ndarray, tokenizer: TextTokenizer, *, max_text_chars: int = 200, show_codes: int = 6
) -> str:
    """Readable rendering of a token grid for ``shoal prompt``.

    First line: shape, T and the text/VQ counts. Then one line per run, with its
    half-open column span: decoded text runs (a new run at each ``<|im_start|>``, or after
    each ``<|im_end|>`` in the S1 layout) and ``[VQ x N frames]`` spans showing their first
    code0 values and the full first frame (rows 1..C).
    """
    g = np.asarray(grid)
    if g.ndim != 2 or g.shape[0] < 1:
        raise ValueError(f"grid must be 2-D [1 + C, T], got shape {g.shape}")
    row0 = g[0]
    T = int(g.shape[1])
    is_vq = (row0 >= tokenizer.semantic_begin_id) & (row0 <= tokenizer.semantic_end_id)
    # Text runs break before each <|im_start|> (S2 messages), or after each <|im_end|>
    # when the grid has no <|im_start|> (S1 interleave layout).
    is_start = row0 == tokenizer.im_start_id
    breaks = is_start if is_start.any() else np.roll(row0 == tokenizer.im_end_id, 1)
    runs: list[tuple[int, int, bool]] = []
    start = 0
    for t in range(1, T + 1):
        boundary = t == T or is_vq[t] != is_vq[start] or (not is_vq[t] and bool(breaks[t]))
        if boundary:
            runs.append((start, t, bool(is_vq[start])))
            start = t
    n_vq = int(is_vq.sum())
    lines = [f"token grid {list(g.shape)}  T={T}  ({T - n_vq} text tokens, {n_vq} VQ frames)"]
    w = len(str(max(T - 1, 0)))
    for a, b, vq in runs:
        span = f"  [{a:>{w}}:{b:<{w}}] "
        if vq:
            first = ", ".join(str(int(c)) for c in g[1:, a]) if g.shape[0] > 1 else ""
            head = row0[a : min(b, a + show_codes)] - tokenizer.semantic_begin_id
            code0 = " ".join(str(int(c)) for c in head)
            more = " …" if b - a > show_codes else ""
            lines.append(f"{span}[VQ x {b - a} frames] code0: {code0}{more} | frame0: [{first}]")
        else:
            text = tokenizer.decode(int(i) for i in row0[a:b])
            lines.append(f"{span}{_clip(text, max_text_chars)} ({b - a} tokens)")
    return "\n".join(lines)


def format_parts(parts: Sequence[Part], tokenizer: TextTokenizer | None = None) -> str:
    """One line per part (TextPart text, token count when a tokenizer is given; VQ shape)."""
    lines = []
    for i, p in enumerate(parts):
        if isinstance(p, TextPart):
            n = f" ({len(tokenizer.encode(p.text))} tokens)" if tokenizer is not None else ""
            lines.append(f"  {i:>3} text {p.text!r}{n}")
        else:
            lines.append(f"  {i:>3} VQ {list(p.codes.shape)} code0[:5]={p.codes[0, :5].tolist()}")
    return "\n".join(lines)
