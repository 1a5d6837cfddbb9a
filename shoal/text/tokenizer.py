"""Text tokenizers for the two Fish Speech checkpoint formats.

* S2-Pro (fish-speech HEAD): a Hugging Face ``tokenizer.json`` (Qwen3-based BPE),
  read with the ``tokenizers`` library (no ``transformers``).
* S1-mini / fish-speech 1.5: ``tokenizer.tiktoken`` (``base64 rank`` per line) plus
  ``special_tokens.json``, read with ``tiktoken``.

Both expose the same :class:`TextTokenizer` interface. ``encode`` never adds BOS/EOS,
and special tokens written inline in the text (``<|im_end|>``, ``<|semantic:5|>``, ...)
are recognised as specials, like the reference's ``allowed_special="all"``.

``load_tokenizer(checkpoint_dir)`` picks the format from the files present.
"""

from __future__ import annotations

import base64
import binascii
import json
import warnings
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, Literal

__all__ = [
    "NUM_SEMANTIC_TOKENS",
    "S1_TIKTOKEN_PATTERN",
    "HFTokenizer",
    "TextTokenizer",
    "TiktokenTokenizer",
    "TokenizerLoadError",
    "load_tokenizer",
    "semantic_token",
]

NUM_SEMANTIC_TOKENS = 4096

IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
VOICE_TOKEN = "<|voice|>"
INTERLEAVE_TOKEN = "<|interleave|>"

HF_TOKENIZER_FILE = "tokenizer.json"
TIKTOKEN_FILE = "tokenizer.tiktoken"
TIKTOKEN_SPECIALS_FILE = "special_tokens.json"

# Pre-tokenizer of the S1 / 1.5 tiktoken tokenizer (fish-speech ``FISH_TIKTOKEN_PATTERN``).
# Alternatives, in order: English contractions; any single punctuation character;
# letters with at most one leading non-letter/non-digit; a single digit; other symbols;
# newlines; whitespace; whitespace.
# The seventh alternative is written in the reference with an *escaped* lookahead,
# ``\s+(\?!\S)``: it matches whitespace followed by a literal "?!" and is NOT the usual
# ``\s+(?!\S)``. As a consequence a run of spaces before a word is one piece and the word
# carries no leading space (``today?  I`` -> ``?``, ``  ``, ``I``). The S1 model was trained
# on this behaviour, so it is reproduced on purpose.
S1_TIKTOKEN_PATTERN = "|".join(
    [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
        r"\p{P}",
        r"[^\r\n\p{L}\p{N}]?\p{L}+",
        r"\p{N}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(\?!\S)",  # sic: escaped "?", see above
        r"\s+",
    ]
)


def semantic_token(i: int) -> str:
    """The text form of semantic token ``i`` (``<|semantic:i|>``)."""
    return f"<|semantic:{i}|>"


class TokenizerLoadError(ValueError):
    """A checkpoint's tokenizer files are missing or malformed."""


class TextTokenizer(ABC):
    """Common interface of the S2 (HF) and S1 (tiktoken) tokenizers.

    Subclasses call :meth:`_init_ids` once their vocabulary is loaded; it resolves and
    validates the ids every other module relies on.
    """

    kind: Literal["hf", "tiktoken"]
    source: Path

    # ------------------------------------------------------------------ abstract
    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: no BOS/EOS, inline special tokens recognised."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are rendered as their text."""

    @abstractmethod
    def token_to_id(self, tok: str) -> int | None:
        """Id of the token whose text is ``tok`` (None if there is none)."""

    @abstractmethod
    def id_to_token(self, id: int) -> str | None:  # noqa: A002 - public API name
        """Text form of token ``id`` (None if the id is not in the vocabulary)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (max id + 1; the model may pad)."""

    # ------------------------------------------------------------------ ids
    def _init_ids(self, where: Path) -> None:
        sem = [self.token_to_id(semantic_token(i)) for i in range(NUM_SEMANTIC_TOKENS)]
        missing = [i for i, t in enumerate(sem) if t is None]
        if missing:
            raise TokenizerLoadError(
                f"{where}: tokenizer lacks {len(missing)} semantic tokens "
                f"(first missing: {semantic_token(missing[0])})"
            )
        first = sem[0]
        bad = next((i for i, t in enumerate(sem) if t != first + i), None)
        if bad is not None:
            raise TokenizerLoadError(
                f"{where}: semantic token ids are not contiguous: "
                f"{semantic_token(0)}={first} but {semantic_token(bad)}={sem[bad]} "
                f"(expected {first + bad})"
            )
        self._semantic_begin_id: int = first  # type: ignore[assignment]
        self._semantic_end_id: int = first + NUM_SEMANTIC_TOKENS - 1  # type: ignore[operator]

        def required(tok: str) -> int:
            i = self.token_to_id(tok)
            if i is None:
                raise TokenizerLoadError(f"{where}: tokenizer lacks the special token {tok}")
            return i

        self._im_start_id = required(IM_START_TOKEN)
        self._im_end_id = required(IM_END_TOKEN)
        self._interleave_id = required(INTERLEAVE_TOKEN)
        self._voice_id = self.token_to_id(VOICE_TOKEN)

    @property
    def semantic_begin_id(self) -> int:
        """Id of ``<|semantic:0|>``."""
        return self._semantic_begin_id

    @property
    def semantic_end_id(self) -> int:
        """Id of ``<|semantic:4095|>`` (inclusive)."""
        return self._semantic_end_id

    @property
    def num_semantic_tokens(self) -> int:
        return NUM_SEMANTIC_TOKENS

    @property
    def im_start_id(self) -> int:
        return self._im_start_id

    @property
    def im_end_id(self) -> int:
        return self._im_end_id

    @property
    def voice_id(self) -> int | None:
        return self._voice_id

    @property
    def interleave_id(self) -> int:
        return self._interleave_id

    def is_semantic(self, id: int) -> bool:  # noqa: A002
        return self._semantic_begin_id <= id <= self._semantic_end_id

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.source)!r}, semantic="
            f"{self.semantic_begin_id}..{self.semantic_end_id}, im_end={self.im_end_id})"
        )


# ---------------------------------------------------------------------- HF (S2)


class HFTokenizer(TextTokenizer):
    """S2-Pro tokenizer: ``tokenizer.json`` through the ``tokenizers`` library."""

    kind = "hf"

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        if path.is_dir():
            path = path / HF_TOKENIZER_FILE
        self.source = path
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerLoadError(f"{path}: cannot load HF tokenizer: {e}") from e
        self._init_ids(path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, tok: str) -> int | None:
        return self._tok.token_to_id(tok)

    def id_to_token(self, id: int) -> str | None:  # noqa: A002
        if id < 0:
            return None
        return self._tok.id_to_token(int(id))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


# ---------------------------------------------------------------------- tiktoken (S1)


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerLoadError(f"{path}: cannot read: {e}") from e
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise TokenizerLoadError(f"{path}:{lineno}: expected 'base64 rank', got {line!r}")
        token_b64, rank_s = fields
        try:
            # The reference writes an empty token as "="; b64decode("=") fails, so map it.
            token = b"" if token_b64 == "=" else base64.b64decode(token_b64, validate=True)
            rank = int(rank_s)
        except (binascii.Error, ValueError) as e:
            raise TokenizerLoadError(f"{path}:{lineno}: malformed line {line!r}: {e}") from e
        if token in ranks:
            raise TokenizerLoadError(f"{path}:{lineno}: duplicate token {token!r}")
        ranks[token] = rank
    if not ranks:
        raise TokenizerLoadError(f"{path}: no BPE ranks found")
    if len(set(ranks.values())) != len(ranks):
        raise TokenizerLoadError(f"{path}: duplicate BPE ranks")
    return ranks


def _read_special_tokens(path: Path, n_ranks: int) -> dict[str, int]:
    """Special ids = ``n_ranks + position`` in the key order of ``special_tokens.json``.

    This is what the S1 reference does (it enumerates the dict, i.e. its keys); the stored
    values are ignored. A warning is emitted when they disagree with that rule.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerLoadError(f"{path}: cannot read special tokens: {e}") from e
    if isinstance(data, dict):
        names = list(data.keys())
        stored = list(data.values())
    elif isinstance(data, list) and all(isinstance(t, str) for t in data):
        names, stored = list(data), None
    else:
        raise TokenizerLoadError(f"{path}: expected a JSON object {{token: id}}")
    if not names:
        raise TokenizerLoadError(f"{path}: no special tokens")
    if len(set(names)) != len(names):
        raise TokenizerLoadError(f"{path}: duplicate special tokens")
    specials = {name: n_ranks + i for i, name in enumerate(names)}
    if stored is not None:
        disagree = [(n, v, specials[n]) for n, v in zip(names, stored) if v != specials[n]]
        if disagree:
            n, v, real = disagree[0]
            warnings.warn(
                f"{path}: {len(disagree)} stored special-token ids disagree with the S1 rule "
                f"(id = {n_ranks} BPE ranks + key position); using the rule, as the "
                f"reference does (e.g. {n}: stored {v}, used {real})",
                stacklevel=3,
            )
    return specials


class TiktokenTokenizer(TextTokenizer):
    """S1-mini / fish-speech 1.5 tokenizer: ``tokenizer.tiktoken`` + ``special_tokens.json``."""

    kind = "tiktoken"

    def __init__(self, path: str | Path, special_tokens_path: str | Path | None = None) -> None:
        import tiktoken

        path = Path(path)
        if path.is_dir():
            path = path / TIKTOKEN_FILE
        special_path = (
            Path(special_tokens_path)
            if special_tokens_path is not None
            else path.with_name(TIKTOKEN_SPECIALS_FILE)
        )
        self.source = path
        if not path.is_file():
            raise TokenizerLoadError(f"{path}: file not found")
        if not special_path.is_file():
            raise TokenizerLoadError(f"{special_path}: file not found (needed beside {path.name})")
        ranks = _read_tiktoken_ranks(path)
        specials = _read_special_tokens(special_path, len(ranks))
        rank_ids = set(ranks.values())
        clash = next((n for n, i in specials.items() if i in rank_ids), None)
        if clash is not None:  # only possible when the ranks are not dense 0..n-1
            raise TokenizerLoadError(
                f"{path}: special token {clash} gets id {specials[clash]}, which is also a BPE "
                f"rank (ranks must be dense 0..{len(ranks) - 1})"
            )
        try:
            self._enc = tiktoken.Encoding(
                name=f"fish-s1:{path}",
                pat_str=S1_TIKTOKEN_PATTERN,
                mergeable_ranks=ranks,
                special_tokens=specials,
            )
        except Exception as e:  # pragma: no cover - tiktoken validation
            raise TokenizerLoadError(f"{path}: cannot build tiktoken encoding: {e}") from e
        self._ranks = ranks
        self._specials = specials
        self._rank_ids = rank_ids
        self._special_by_id = {v: k for k, v in specials.items()}
        self._n_vocab = max(max(rank_ids), max(specials.values())) + 1
        self._init_ids(path)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all", disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if i not in self._rank_ids and i not in self._special_by_id]
        if bad:
            raise ValueError(f"token id {bad[0]} is not in the vocabulary")
        return self._enc.decode(ids, errors="replace")

    def token_to_id(self, tok: str) -> int | None:
        i = self._specials.get(tok)
        if i is not None:
            return i
        return self._ranks.get(tok.encode("utf-8"))

    def id_to_token(self, id: int) -> str | None:  # noqa: A002
        id = int(id)
        if id in self._special_by_id:
            return self._special_by_id[id]
        if id in self._rank_ids:
            return self._enc.decode_single_token_bytes(id).decode("utf-8", errors="replace")
        return None

    @property
    def vocab_size(self) -> int:
        return self._n_vocab


# ---------------------------------------------------------------------- loader


def load_tokenizer(checkpoint_dir: str | Path) -> TextTokenizer:
    """Load the tokenizer of a checkpoint directory.

    ``tokenizer.json`` -> :class:`HFTokenizer` (S2-Pro); ``tokenizer.tiktoken`` (+
    ``special_tokens.json``) -> :class:`TiktokenTokenizer` (S1-mini / 1.5). Raises
    :class:`TokenizerLoadError` when neither is present or a file is malformed.
    """
    d = Path(checkpoint_dir)
    if not d.is_dir():
        raise TokenizerLoadError(f"checkpoint directory not found: {d}")
    if (d / HF_TOKENIZER_FILE).is_file():
        return HFTokenizer(d / HF_TOKENIZER_FILE)
    if (d / TIKTOKEN_FILE).is_file():
        return TiktokenTokenizer(d / TIKTOKEN_FILE, d / TIKTOKEN_SPECIALS_FILE)
    raise TokenizerLoadError(
        f"no tokenizer in {d}: looked for {HF_TOKENIZER_FILE} (S2-Pro) and "
        f"{TIKTOKEN_FILE} + {TIKTOKEN_SPECIALS_FILE} (S1-mini / fish-speech 1.5)"
    )
