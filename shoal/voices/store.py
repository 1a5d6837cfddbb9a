"""VoiceStore: the voice library behind ``/model``, ``reference_id`` and ``shoal voices``.

Layout of ``root``::

    voices.db                 SQLite (WAL): voices + samples metadata, schema in PRAGMA user_version
    blobs/<storage_key>/      one folder per voice, named by a random key (never by the voice id)
        <sample_id>.<fmt>                 the uploaded audio, as uploaded (format sniffed)
        <sample_id>.codes-<codec>.npy     its codec codes, encoded once per codec fingerprint
        cover-<token>.<fmt>               the cover image, if any

Guarantees:

* **Ids are never paths.** A voice id is 32 generated hex digits or a given id matching
  :data:`VOICE_ID_RE` (letters, digits, ``_``, ``-``; no ``/``, ``.``, ``..``); the blob folder
  is named by a separate random key, so an id cannot reach the file system at all.
* **Nothing stored is lost when a request fails midway.** Blobs are written first (temp file,
  fsync, atomic rename) into a fresh folder; the rows are then inserted in one transaction.
  A failure before the commit removes the new folder; delete removes the rows first, then the
  folder. Folders without a row (a crash in between) are collected when the store is opened.
* **Codes are encoded once.** ``create`` encodes every sample with the ``encoder`` callable and
  stores the codes beside the audio; :meth:`VoiceStore.references` serves them from an in-RAM
  LRU (bounded in bytes) that is keyed by the voice's revision, so an update or delete, by this
  process or another one, invalidates it. A store whose codec fingerprint (``codec_key``) has no
  codes yet encodes each sample lazily, once, from the stored audio.
* **Threads and processes.** One SQLite connection per thread, ``BEGIN IMMEDIATE`` for writes,
  a 30 s busy timeout; the server and ``shoal voices`` may use one folder at the same time.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import sqlite3
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from ..codec.audio import AudioLimitError
from .codec import Encoder
from .errors import InvalidVoice, TooLarge, UnsupportedMedia, VoiceExists, VoiceNotFound, VoiceStoreError
from .media import AUDIO_TYPES, IMAGE_TYPES, decode_audio, sniff_audio, sniff_image

__all__ = [
    "LOCAL_AUTHOR", "SCHEMA_VERSION", "VISIBILITIES", "VOICE_ID_RE", "Sample", "SampleInput", "StoreLimits",
    "Voice", "VoiceStore", "default_voices_dir", "guess_language", "validate_voice_id",
]

SCHEMA_VERSION = 1
DB_NAME = "voices.db"
VOICE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_CODEC_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
VISIBILITIES = ("public", "unlist", "private")
SORT_KEYS = {
    # no likes or ratings here: "score" ranks by use, like task_count
    "score": "task_count DESC, created_at DESC, id",
    "task_count": "task_count DESC, created_at DESC, id",
    "created_at": "created_at DESC, id",
}
LOCAL_AUTHOR = "local"  # voices added with `shoal voices add`, or through an open server
_TMP_PREFIX = ".tmp-"


def _reserved_ids() -> frozenset[str]:
    # OpenAI's built-in voice names mean "the default voice" on /v1/audio/speech: a voice with
    # such an id could never be selected there
    from ..server.schemas import BUILTIN_OPENAI_VOICES

    return BUILTIN_OPENAI_VOICES


def default_voices_dir() -> Path:
    """``$SHOAL_VOICES``, else ``$XDG_DATA_HOME/shoal/voices``, else ``~/.local/share/shoal/voices``."""
    env = os.environ.get("SHOAL_VOICES")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "shoal" / "voices"


def validate_voice_id(voice_id: object) -> str:
    """A given voice id, or :class:`InvalidVoice` (never a path: no ``/``, ``\\``, ``.``)."""
    if not isinstance(voice_id, str) or not VOICE_ID_RE.fullmatch(voice_id):
        raise InvalidVoice(f"invalid voice id {voice_id!r}: use 1-64 letters, digits, '_' or '-', "
                           "starting with a letter or digit")
    if voice_id.lower() in _reserved_ids():
        raise InvalidVoice(f"voice id {voice_id!r} is reserved (an OpenAI built-in voice name)")
    return voice_id


def guess_language(text: str) -> str:
    """A script-based language guess (``en`` for Latin script); ``""`` when there is no letter."""
    counts = dict.fromkeys(("ja", "zh", "ko", "ru", "ar", "en"), 0)
    for ch in text:
        o = ord(ch)
        if 0x3040 <= o <= 0x30FF:
            counts["ja"] += 1
        elif 0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF:
            counts["zh"] += 1
        elif 0xAC00 <= o <= 0xD7AF or 0x1100 <= o <= 0x11FF:
            counts["ko"] += 1
        elif 0x0400 <= o <= 0x04FF:
            counts["ru"] += 1
        elif 0x0600 <= o <= 0x06FF:
            counts["ar"] += 1
        elif ch.isalpha() and o < 0x250:
            counts["en"] += 1
    if counts["ja"] and counts["ja"] + counts["zh"] >= counts["en"]:
        return "ja"  # kana with kanji
    best = max(counts, key=lambda k: counts[k])
    return best if counts[best] else ""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class StoreLimits:
    max_samples: int = 20
    max_sample_bytes: int = 20 << 20
    max_total_bytes: int = 64 << 20  # all samples + cover of one request
    max_cover_bytes: int = 5 << 20
    min_sample_seconds: float = 0.25
    max_sample_seconds: float = 120.0
    max_title_chars: int = 256
    max_description_chars: int = 4000
    max_text_chars: int = 4000
    max_tags: int = 32
    max_tag_chars: int = 64


@dataclass(frozen=True)
class SampleInput:
    """One uploaded sample: audio file bytes and its transcript."""

    audio: bytes
    text: str
    title: str = ""


@dataclass(frozen=True)
class Sample:
    id: str
    index: int
    title: str
    text: str
    format: str
    file: str
    size: int
    duration: float
    sha256: str

    @property
    def media_type(self) -> str:
        return AUDIO_TYPES.get(self.format, "application/octet-stream")


@dataclass(frozen=True)
class Voice:
    id: str
    title: str
    description: str
    visibility: str
    tags: tuple[str, ...]
    languages: tuple[str, ...]
    title_language: str
    cover: str | None  # file name in the voice's blob folder
    author_id: str
    author_name: str
    enhance_audio_quality: bool
    created_at: str
    updated_at: str
    rev: int
    task_count: int
    storage_key: str
    samples: tuple[Sample, ...]

    @property
    def cover_media_type(self) -> str | None:
        if not self.cover:
            return None
        return IMAGE_TYPES.get(self.cover.rsplit(".", 1)[-1], "application/octet-stream")


_MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE voices (
            id TEXT PRIMARY KEY COLLATE NOCASE,
            storage_key TEXT NOT NULL UNIQUE,
            title TEXT NOT NULL,
            description TEXT NOT NULL DEFAULT '',
            visibility TEXT NOT NULL,
            tags TEXT NOT NULL DEFAULT '[]',
            languages TEXT NOT NULL DEFAULT '[]',
            title_language TEXT NOT NULL DEFAULT '',
            cover TEXT,
            author_id TEXT NOT NULL,
            author_name TEXT NOT NULL,
            enhance_audio_quality INTEGER NOT NULL DEFAULT 1,
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL,
            rev INTEGER NOT NULL DEFAULT 1,
            task_count INTEGER NOT NULL DEFAULT 0
        )""",
        "CREATE INDEX voices_created ON voices (created_at)",
        "CREATE INDEX voices_author ON voices (author_id)",
        """CREATE TABLE samples (
            id TEXT PRIMARY KEY,
            voice_id TEXT NOT NULL COLLATE NOCASE REFERENCES voices (id) ON DELETE CASCADE,
            idx INTEGER NOT NULL,
            title TEXT NOT NULL,
            text TEXT NOT NULL,
            format TEXT NOT NULL,
            file TEXT NOT NULL,
            size INTEGER NOT NULL,
            duration REAL NOT NULL,
            sha256 TEXT NOT NULL,
            UNIQUE (voice_id, idx)
        )""",
    ],
}


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{_TMP_PREFIX}{uuid.uuid4().hex}-{path.name}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _npy_bytes(codes: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, codes, allow_pickle=False)
    return buf.getvalue()


class VoiceStore:
    """See the module docstring. ``encoder`` maps float32 mono samples at ``sample_rate`` to int
    codes ``[codebooks, frames]`` (e.g. :meth:`shoal.tts.TTS.encode_reference`); ``codec_key``
    names the codec that produces them (:func:`~shoal.voices.codec.codec_fingerprint`). A store
    without an encoder can list, show, update and delete, but not create."""

    def __init__(self, root: str | os.PathLike, *, encoder: Encoder | None = None,
                 codec_key: str | None = None, sample_rate: int = 44100,
                 limits: StoreLimits | None = None, cache_bytes: int = 256 << 20,
                 collect_garbage: bool = True) -> None:
        if codec_key is not None and not _CODEC_KEY_RE.fullmatch(codec_key):
            raise ValueError(f"invalid codec_key {codec_key!r}")
        if encoder is not None and codec_key is None:
            raise ValueError("an encoder needs a codec_key naming its codec")
        self.root = Path(root).expanduser()
        self.blobs = self.root / "blobs"
        self.encoder = encoder
        self.codec_key = codec_key
        self.sample_rate = int(sample_rate)
        self.limits = limits or StoreLimits()
        self.cache_bytes = int(cache_bytes)
        self.cache_hits = 0
        self.cache_misses = 0
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[int, tuple[tuple[str, np.ndarray], ...], int]] = OrderedDict()
        self._cache_size = 0
        self._cache_lock = threading.Lock()
        self._encode_lock = threading.Lock()
        self._closed = False
        try:
            self.blobs.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise VoiceStoreError(f"cannot create the voice store at {self.root}: {e.strerror or e}") from None
        conn = self._conn()
        try:
            conn.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError as e:
            raise VoiceStoreError(f"cannot open the voice store database in {self.root}: {e}") from None
        self._migrate()
        if collect_garbage:
            self.collect_garbage()

    # ------------------------------------------------------------------ database plumbing
    def _conn(self) -> sqlite3.Connection:
        if self._closed:
            raise VoiceStoreError("the voice store is closed")
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.root / DB_NAME, timeout=30.0, isolation_level=None,
                                   check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA busy_timeout=30000")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` (writes) or a deferred read snapshot; rolled back on any error."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _migrate(self) -> None:
        with self._transaction(write=True) as c:
            version = c.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise VoiceStoreError(f"the voice store {self.root} has schema version {version}, newer than "
                                      f"this shoal supports ({SCHEMA_VERSION}); upgrade shoal")
            for target in range(version + 1, SCHEMA_VERSION + 1):
                for stmt in _MIGRATIONS[target]:
                    c.execute(stmt)
            if version != SCHEMA_VERSION:
                c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @property
    def schema_version(self) -> int:
        return int(self._conn().execute("PRAGMA user_version").fetchone()[0])

    def close(self) -> None:
        self._closed = True
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.close()
            except sqlite3.Error:  # pragma: no cover
                pass

    def __enter__(self) -> VoiceStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ validation
    def _text(self, value: object, what: str, limit: int, *, required: bool = False) -> str:
        if not isinstance(value, str):
            raise InvalidVoice(f"{what} must be text")
        value = value.strip()
        if required and not value:
            raise InvalidVoice(f"{what} is required and must not be empty")
        if len(value) > limit:
            raise InvalidVoice(f"{what} is {len(value)} characters; the limit is {limit}")
        return value

    def _tags(self, tags: Sequence[str]) -> tuple[str, ...]:
        if isinstance(tags, str):
            tags = [tags]
        out: list[str] = []
        for t in tags:
            t = self._text(t, "a tag", self.limits.max_tag_chars)
            if t and t not in out:
                out.append(t)
        if len(out) > self.limits.max_tags:
            raise InvalidVoice(f"{len(out)} tags; the limit is {self.limits.max_tags}")
        return tuple(out)

    @staticmethod
    def _visibility(value: str) -> str:
        v = value.strip().lower() if isinstance(value, str) else value
        if v == "unlisted":  # fish-audio-sdk 1.2.0 spelled it so
            v = "unlist"
        if v not in VISIBILITIES:
            raise InvalidVoice(f"visibility must be one of {', '.join(VISIBILITIES)}, got {value!r}")
        return v

    def _cover(self, data: bytes | None) -> str | None:
        if data is None:
            return None
        if len(data) > self.limits.max_cover_bytes:
            raise TooLarge(f"cover_image is {len(data)} bytes; the limit is {self.limits.max_cover_bytes}")
        fmt = sniff_image(data)
        if fmt is None:
            raise UnsupportedMedia("cover_image is not a png, jpeg, gif or webp image")
        return fmt

    def _encode(self, samples: np.ndarray, where: str) -> np.ndarray:
        if self.encoder is None:
            raise VoiceStoreError("this voice store has no codec encoder (open it with a checkpoint's codec)")
        codes = np.asarray(self.encoder(samples))
        if codes.ndim != 2 or not np.issubdtype(codes.dtype, np.integer) or codes.shape[1] == 0:
            raise InvalidVoice(f"{where}: the codec produced no usable codes (shape {codes.shape})")
        return np.ascontiguousarray(codes)

    # ------------------------------------------------------------------ rows -> objects
    @staticmethod
    def _sample(row: sqlite3.Row) -> Sample:
        return Sample(id=row["id"], index=row["idx"], title=row["title"], text=row["text"], format=row["format"],
                      file=row["file"], size=row["size"], duration=row["duration"], sha256=row["sha256"])

    @staticmethod
    def _voice(row: sqlite3.Row, samples: Sequence[Sample]) -> Voice:
        return Voice(id=row["id"], title=row["title"], description=row["description"],
                     visibility=row["visibility"], tags=tuple(json.loads(row["tags"])),
                     languages=tuple(json.loads(row["languages"])), title_language=row["title_language"],
                     cover=row["cover"], author_id=row["author_id"], author_name=row["author_name"],
                     enhance_audio_quality=bool(row["enhance_audio_quality"]), created_at=row["created_at"],
                     updated_at=row["updated_at"], rev=row["rev"], task_count=row["task_count"],
                     storage_key=row["storage_key"], samples=tuple(samples))

    def _load(self, c: sqlite3.Connection, voice_id: str) -> Voice | None:
        row = c.execute("SELECT * FROM voices WHERE id = ?", (voice_id,)).fetchone()
        if row is None:
            return None
        rows = c.execute("SELECT * FROM samples WHERE voice_id = ? ORDER BY idx", (row["id"],)).fetchall()
        return self._voice(row, [self._sample(r) for r in rows])

    # ------------------------------------------------------------------ CRUD
    def create(self, *, title: str, samples: Sequence[SampleInput], voice_id: str | None = None,
               description: str = "", visibility: str = "public", tags: Sequence[str] = (),
               cover_image: bytes | None = None, author_id: str = LOCAL_AUTHOR,
               author_name: str | None = None, enhance_audio_quality: bool = True) -> Voice:
        """Validate, decode and encode every sample, write the blobs, then insert the rows."""
        lim = self.limits
        title = self._text(title, "title", lim.max_title_chars, required=True)
        description = self._text(description or "", "description", lim.max_description_chars)
        visibility = self._visibility(visibility)
        tags = self._tags(tags)
        vid = uuid.uuid4().hex if voice_id is None else validate_voice_id(voice_id)
        if not samples:
            raise InvalidVoice("a voice needs at least one audio sample")
        if len(samples) > lim.max_samples:
            raise InvalidVoice(f"{len(samples)} audio samples; the limit is {lim.max_samples}")
        total = len(cover_image or b"")
        texts = []
        for i, s in enumerate(samples):
            if len(s.audio) > lim.max_sample_bytes:
                raise TooLarge(f"voices[{i}] is {len(s.audio)} bytes; the limit is {lim.max_sample_bytes}")
            total += len(s.audio)
            texts.append(self._text(s.text, f"texts[{i}] (the transcript of voices[{i}])", lim.max_text_chars,
                                    required=True))
        if total > lim.max_total_bytes:
            raise TooLarge(f"the upload is {total} bytes; the limit is {lim.max_total_bytes}")
        cover_fmt = self._cover(cover_image)
        if self.get_optional(vid) is not None:
            raise VoiceExists(f"a voice with id {vid!r} already exists")
        if self.encoder is None:
            raise VoiceStoreError("this voice store has no codec encoder (open it with a checkpoint's codec)")

        for i, s in enumerate(samples):  # fail fast on what is plainly not audio
            if sniff_audio(s.audio) is None:
                raise UnsupportedMedia(f"voices[{i}]: not a supported audio file (the content is not wav, "
                                       "flac, ogg, mp3 or m4a; the file name is not trusted)")
        decoded = []  # (format, seconds); one sample's PCM in memory at a time
        codes = []
        for i, s in enumerate(samples):
            try:
                fmt, pcm = decode_audio(s.audio, self.sample_rate, max_seconds=lim.max_sample_seconds)
            except UnsupportedMedia as e:
                raise UnsupportedMedia(f"voices[{i}]: {e}") from None
            except AudioLimitError as e:
                raise InvalidVoice(f"voices[{i}]: {e}") from None
            seconds = pcm.size / self.sample_rate
            if seconds < lim.min_sample_seconds:
                raise InvalidVoice(f"voices[{i}] is {seconds:.2f} s long; samples need at least "
                                   f"{lim.min_sample_seconds:g} s")
            if seconds > lim.max_sample_seconds:
                raise InvalidVoice(f"voices[{i}] is {seconds:.1f} s long; the limit is {lim.max_sample_seconds:g} s")
            decoded.append((fmt, seconds))
            codes.append(self._encode(pcm, f"voices[{i}]"))
            del pcm

        storage_key = uuid.uuid4().hex
        folder = self.blobs / storage_key
        folder.mkdir()
        try:
            rows = []
            for i, (s, (fmt, seconds), c) in enumerate(zip(samples, decoded, codes)):
                sid = uuid.uuid4().hex
                name = f"{sid}.{fmt}"
                _atomic_write(folder / name, bytes(s.audio))
                _atomic_write(folder / f"{sid}.codes-{self.codec_key}.npy", _npy_bytes(c))
                rows.append((sid, i, (s.title or "").strip()[:lim.max_title_chars], texts[i], fmt, name,
                             len(s.audio), round(seconds, 3), hashlib.sha256(s.audio).hexdigest()))
            cover = None
            if cover_image is not None:
                cover = f"cover-{uuid.uuid4().hex[:12]}.{cover_fmt}"
                _atomic_write(folder / cover, bytes(cover_image))
            _fsync_dir(folder)
            languages = sorted({lang for lang in map(guess_language, texts) if lang})
            now = _now()
            with self._transaction(write=True) as c:
                c.execute(
                    "INSERT INTO voices (id, storage_key, title, description, visibility, tags, languages, "
                    "title_language, cover, author_id, author_name, enhance_audio_quality, created_at, "
                    "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (vid, storage_key, title, description, visibility, json.dumps(list(tags)),
                     json.dumps(languages), guess_language(title), cover, author_id,
                     author_name or author_id, int(bool(enhance_audio_quality)), now, now))
                c.executemany(
                    "INSERT INTO samples (id, voice_id, idx, title, text, format, file, size, duration, sha256) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", [(r[0], vid, *r[1:]) for r in rows])
        except sqlite3.IntegrityError:
            shutil.rmtree(folder, ignore_errors=True)
            raise VoiceExists(f"a voice with id {vid!r} already exists") from None
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return self.get(vid)

    def get_optional(self, voice_id: str) -> Voice | None:
        if not isinstance(voice_id, str) or not VOICE_ID_RE.fullmatch(voice_id):
            return None
        with self._transaction(write=False) as c:
            return self._load(c, voice_id)

    def get(self, voice_id: str) -> Voice:
        voice = self.get_optional(voice_id)
        if voice is None:
            raise VoiceNotFound(f"unknown voice {voice_id!r}")
        return voice

    def __contains__(self, voice_id: object) -> bool:
        return isinstance(voice_id, str) and self.get_optional(voice_id) is not None

    def __len__(self) -> int:
        return int(self._conn().execute("SELECT COUNT(*) FROM voices").fetchone()[0])

    def list(self, *, page_size: int = 10, page_number: int = 1, title: str | None = None,
             tags: Sequence[str] = (), author_id: str | None = None, languages: Sequence[str] = (),
             title_languages: Sequence[str] = (), sort_by: str = "score",
             viewer: str | None = None) -> tuple[int, list[Voice]]:
        """``(total, page)``. Filters combine with AND; several tags (or languages) match any of
        them; ``title`` is a case-insensitive substring. ``viewer`` (an author id) hides the
        ``private`` and ``unlist`` voices of other authors; None shows everything."""
        if sort_by not in SORT_KEYS:
            raise InvalidVoice(f"sort_by must be one of {', '.join(SORT_KEYS)}, got {sort_by!r}")
        if page_size < 1 or page_number < 1:
            raise InvalidVoice("page_size and page_number must be >= 1")
        where, args = [], []
        if title:
            escaped = title.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            where.append("title LIKE ? ESCAPE '\\'")
            args.append(f"%{escaped}%")
        for column, values in (("tags", tags), ("languages", languages)):
            values = [v.lower() for v in values if v]
            if values:
                marks = ", ".join("?" * len(values))
                where.append(f"EXISTS (SELECT 1 FROM json_each(voices.{column}) WHERE lower(json_each.value) "
                             f"IN ({marks}))")
                args += values
        title_languages = [v.lower() for v in title_languages if v]
        if title_languages:
            where.append(f"title_language IN ({', '.join('?' * len(title_languages))})")
            args += title_languages
        if author_id is not None:
            where.append("author_id = ?")
            args.append(author_id)
        if viewer is not None:
            where.append("(visibility = 'public' OR author_id = ?)")
            args.append(viewer)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        with self._transaction(write=False) as c:
            total = int(c.execute(f"SELECT COUNT(*) FROM voices {clause}", args).fetchone()[0])
            rows = c.execute(f"SELECT * FROM voices {clause} ORDER BY {SORT_KEYS[sort_by]} LIMIT ? OFFSET ?",
                             [*args, page_size, (page_number - 1) * page_size]).fetchall()
            by_voice: dict[str, list[Sample]] = {r["id"]: [] for r in rows}
            if rows:
                marks = ", ".join("?" * len(rows))
                for s in c.execute(f"SELECT * FROM samples WHERE voice_id IN ({marks}) ORDER BY voice_id, idx",
                                   [r["id"] for r in rows]):
                    by_voice[s["voice_id"]].append(self._sample(s))  # stored with the parent's spelling
        return total, [self._voice(r, by_voice[r["id"]]) for r in rows]

    def update(self, voice_id: str, *, title: str | None = None, description: str | None = None,
               visibility: str | None = None, tags: Sequence[str] | None = None,
               cover_image: bytes | None = None) -> Voice:
        """Change metadata (samples are immutable); bumps the revision, so cached codes of the
        voice are dropped here and in every other process on its next use."""
        lim = self.limits
        fields: dict[str, object] = {}
        if title is not None:
            fields["title"] = self._text(title, "title", lim.max_title_chars, required=True)
            fields["title_language"] = guess_language(str(fields["title"]))
        if description is not None:
            fields["description"] = self._text(description, "description", lim.max_description_chars)
        if visibility is not None:
            fields["visibility"] = self._visibility(visibility)
        if tags is not None:
            fields["tags"] = json.dumps(list(self._tags(tags)))
        cover_fmt = self._cover(cover_image)
        current = self.get(voice_id)
        folder = self.blobs / current.storage_key
        new_cover = None
        if cover_image is not None:
            new_cover = f"cover-{uuid.uuid4().hex[:12]}.{cover_fmt}"
            try:
                _atomic_write(folder / new_cover, bytes(cover_image))
            except FileNotFoundError:  # deleted meanwhile
                raise VoiceNotFound(f"unknown voice {voice_id!r}") from None
            fields["cover"] = new_cover
        old_cover = None
        try:
            with self._transaction(write=True) as c:
                row = c.execute("SELECT id, cover FROM voices WHERE id = ?", (voice_id,)).fetchone()
                if row is None:
                    raise VoiceNotFound(f"unknown voice {voice_id!r}")
                old_cover = row["cover"]
                sets = ", ".join(f"{k} = ?" for k in fields)
                c.execute(f"UPDATE voices SET {sets}{', ' if sets else ''}rev = rev + 1, updated_at = ? "
                          "WHERE id = ?", [*fields.values(), _now(), row["id"]])
        except BaseException:
            if new_cover:
                (folder / new_cover).unlink(missing_ok=True)
            raise
        self._invalidate(current.id)
        if new_cover and old_cover and old_cover != new_cover:
            (folder / old_cover).unlink(missing_ok=True)
        return self.get(voice_id)

    def delete(self, voice_id: str) -> Voice:
        """Remove the rows (one transaction), then the blobs; returns what was deleted."""
        with self._transaction(write=True) as c:
            voice = self._load(c, voice_id) if VOICE_ID_RE.fullmatch(voice_id or "") else None
            if voice is None:
                raise VoiceNotFound(f"unknown voice {voice_id!r}")
            c.execute("DELETE FROM samples WHERE voice_id = ?", (voice.id,))
            c.execute("DELETE FROM voices WHERE id = ?", (voice.id,))
        self._invalidate(voice.id)
        shutil.rmtree(self.blobs / voice.storage_key, ignore_errors=True)
        return voice

    def record_use(self, voice_id: str) -> None:
        """Count one synthesis with the voice (``task_count``)."""
        conn = self._conn()
        conn.execute("UPDATE voices SET task_count = task_count + 1 WHERE id = ?", (voice_id,))

    # ------------------------------------------------------------------ files
    def sample_path(self, voice: Voice, sample_id: str) -> tuple[Path, Sample]:
        for s in voice.samples:
            if s.id == sample_id:
                return self.blobs / voice.storage_key / s.file, s
        raise VoiceNotFound(f"voice {voice.id!r} has no sample {sample_id!r}")

    def cover_path(self, voice: Voice) -> Path:
        if not voice.cover:
            raise VoiceNotFound(f"voice {voice.id!r} has no cover image")
        return self.blobs / voice.storage_key / voice.cover

    # ------------------------------------------------------------------ codes
    def _invalidate(self, voice_id: str) -> None:
        with self._cache_lock:
            hit = self._cache.pop(voice_id.lower(), None)
            if hit is not None:
                self._cache_size -= hit[2]

    def _codes(self, folder: Path, sample: sqlite3.Row, voice_id: str) -> np.ndarray:
        path = folder / f"{sample['id']}.codes-{self.codec_key}.npy"
        try:
            return np.load(path, allow_pickle=False)
        except FileNotFoundError:
            pass
        with self._encode_lock:  # encode once, even with several threads missing at once
            if path.exists():
                return np.load(path, allow_pickle=False)
            try:
                data = (folder / sample["file"]).read_bytes()
            except FileNotFoundError:
                raise VoiceNotFound(f"unknown voice {voice_id!r}") from None
            _, pcm = decode_audio(data, self.sample_rate)
            codes = self._encode(pcm, f"voice {voice_id!r} sample {sample['idx']}")
            _atomic_write(path, _npy_bytes(codes))
            return codes

    def references(self, voice_id: str) -> list[tuple[str, np.ndarray]]:
        """``[(transcript, codes)]`` of every sample, in upload order. Codes come from the LRU
        (same arrays, read-only, while the voice's revision is unchanged), else from disk, else
        (a new codec) they are encoded once and stored."""
        if self.codec_key is None:
            raise VoiceStoreError("this voice store has no codec: it cannot serve codes")
        if not isinstance(voice_id, str) or not VOICE_ID_RE.fullmatch(voice_id):
            raise VoiceNotFound(f"unknown voice {voice_id!r}")
        conn = self._conn()
        row = conn.execute("SELECT id, rev, storage_key FROM voices WHERE id = ?", (voice_id,)).fetchone()
        if row is None:
            self._invalidate(voice_id)  # deleted by another process
            raise VoiceNotFound(f"unknown voice {voice_id!r}")
        key = row["id"].lower()
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] == row["rev"]:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return list(hit[1])
            self.cache_misses += 1
        rows = conn.execute("SELECT * FROM samples WHERE voice_id = ? ORDER BY idx", (row["id"],)).fetchall()
        if not rows:
            raise VoiceNotFound(f"unknown voice {voice_id!r}")
        folder = self.blobs / row["storage_key"]
        refs = []
        for s in rows:
            codes = self._codes(folder, s, row["id"])
            codes.setflags(write=False)
            refs.append((s["text"], codes))
        entry = tuple(refs)
        size = sum(c.nbytes for _, c in refs)
        with self._cache_lock:
            old = self._cache.pop(key, None)
            if old is not None:
                self._cache_size -= old[2]
            if size <= self.cache_bytes:
                self._cache[key] = (row["rev"], entry, size)
                self._cache_size += size
                while self._cache_size > self.cache_bytes:
                    _, (_, _, n) = self._cache.popitem(last=False)
                    self._cache_size -= n
        return refs

    @property
    def cached_bytes(self) -> int:
        return self._cache_size

    # ------------------------------------------------------------------ housekeeping
    def collect_garbage(self, min_age_s: float = 3600.0) -> int:
        """Remove blob folders without a voice row, and stray temp files, older than
        ``min_age_s`` (younger ones may belong to a create in progress). Returns the count."""
        keys = {r[0] for r in self._conn().execute("SELECT storage_key FROM voices")}
        cutoff = time.time() - min_age_s
        removed = 0
        try:
            entries = list(self.blobs.iterdir())
        except OSError:
            return 0
        for entry in entries:
            try:
                if entry.is_dir() and entry.name not in keys:
                    if entry.stat().st_mtime < cutoff:
                        shutil.rmtree(entry, ignore_errors=True)
                        removed += 1
                elif entry.is_dir():
                    for f in entry.iterdir():
                        if f.name.startswith(_TMP_PREFIX) and f.stat().st_mtime < cutoff:
                            f.unlink(missing_ok=True)
                            removed += 1
            except OSError:
                continue
        return removed
