"""The text corpus of ``shoal bench serve``: original sentences and paragraphs in several languages.

One file per language (``<lang>.txt``, UTF-8): one text per line, ``#`` comment lines and blank
lines ignored. Every text is short (a sentence or two) or long (a paragraph); see
:attr:`CorpusText.long`. :class:`UniqueTexts` hands out texts so that no two requests of a run
read the same text (repeated prompts would inflate prefix-cache hits): first every corpus text
once, in a shuffled order, then joins of 2, 3, ... texts of one language, never repeated.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources

import numpy as np

# language -> how texts are joined when several are combined into one request
JOINERS = {"zh": "", "ja": ""}
REQUIRED_LANGUAGES = ("en", "zh", "ja", "es", "de")


def _is_cjk(ch: str) -> bool:
    o = ord(ch)
    return 0x3040 <= o <= 0x30FF or 0x3400 <= o <= 0x4DBF or 0x4E00 <= o <= 0x9FFF


@dataclass(frozen=True)
class CorpusText:
    lang: str
    text: str

    @property
    def long(self) -> bool:
        """A paragraph: >= 150 characters of alphabetic text, or >= 70 of Chinese / Japanese."""
        cjk = sum(map(_is_cjk, self.text))
        return cjk >= 70 or len(self.text) >= 150 and cjk < len(self.text) / 2


def languages() -> list[str]:
    return sorted(p.name[:-4] for p in resources.files(__name__).iterdir() if p.name.endswith(".txt"))


def load_corpus(langs: Sequence[str] | None = None) -> list[CorpusText]:
    """The bundled texts (of ``langs``, default all), in file order."""
    available = languages()
    wanted = list(langs) if langs else available
    unknown = sorted(set(wanted) - set(available))
    if unknown:
        raise ValueError(f"no corpus for language(s) {', '.join(unknown)}; available: {', '.join(available)}")
    out: list[CorpusText] = []
    for lang in wanted:
        raw = resources.files(__name__).joinpath(f"{lang}.txt").read_text(encoding="utf-8")
        for line in raw.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(CorpusText(lang, line))
    return out


def summary(texts: Sequence[CorpusText]) -> dict[str, dict[str, int]]:
    """Per language: how many texts, how many long, total characters."""
    out: dict[str, dict[str, int]] = {}
    for t in texts:
        d = out.setdefault(t.lang, {"texts": 0, "long": 0, "chars": 0})
        d["texts"] += 1
        d["long"] += int(t.long)
        d["chars"] += len(t.text)
    return out


class UniqueTexts:
    """An endless, deterministic (``seed``) stream of distinct texts drawn from ``texts``."""

    def __init__(self, texts: Sequence[CorpusText], seed: int = 0) -> None:
        if not texts:
            raise ValueError("empty corpus")
        self.texts = list(texts)
        self.rng = np.random.default_rng(seed)
        self.by_lang: dict[str, list[str]] = {}
        for t in self.texts:
            self.by_lang.setdefault(t.lang, []).append(t.text)
        self.seen: set[str] = set()
        self._it = self._generate()

    def __iter__(self) -> Iterator[CorpusText]:
        return self

    def __next__(self) -> CorpusText:
        return next(self._it)

    def _generate(self) -> Iterator[CorpusText]:
        for i in self.rng.permutation(len(self.texts)):
            t = self.texts[int(i)]
            if t.text not in self.seen:
                self.seen.add(t.text)
                yield t
        langs = sorted(self.by_lang)
        k = 2
        while k <= max(len(p) for p in self.by_lang.values()):
            for _ in range(200):
                lang = langs[int(self.rng.integers(len(langs)))]
                pool = self.by_lang[lang]
                if len(pool) < k:
                    continue
                picks = self.rng.choice(len(pool), size=k, replace=False)
                text = JOINERS.get(lang, " ").join(pool[int(j)] for j in picks)
                if text not in self.seen:
                    self.seen.add(text)
                    yield CorpusText(lang, text)
                    break
            else:  # joins of k are (nearly) used up: longer ones
                k += 1
