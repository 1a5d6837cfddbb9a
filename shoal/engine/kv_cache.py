"""Paged KV-cache block bookkeeping with prefix caching (host side only).

The runner owns the K/V tensors, shaped ``[num_blocks, block_size, H_kv, D]`` per layer and
indexed by block id; this module decides which block ids each sequence uses. One KV entry is
one column of a token grid (int64 ``[rows, T]``: row 0 the token id, rows 1.. the codebook
codes), so a block holds ``block_size`` consecutive grid columns.

Prefix caching. Once a block is full and its K/V written (reported through
:meth:`BlockPool.commit_tokens`), it gets a *chain hash*::

    h_0 = root(rows)                      # depends only on the grid's row count
    h_i = blake2b(h_{i-1} || columns of block i, column-major little-endian int64)

and is registered in ``hash -> block``. Because each hash covers the whole prefix, equal block
contents after different prefixes never collide. A later prompt walks its full blocks from the
start and reuses every block whose chain hash is registered, stopping at the first miss. The
hash is hashlib's, so behaviour does not depend on Python's hash randomization.

Block states. Every block is exactly one of:

* *free*: unreferenced, holds nothing reusable (FIFO ``deque``);
* *referenced*: ``ref > 0``; in the block tables of ``ref`` sequences;
* *cached-evictable*: unreferenced but registered in the prefix cache (or, with
  ``copy_partial``, a released sequence's partially filled last page, kept as a copy source
  only); kept in LRU order (``OrderedDict``, least recently released first) and reclaimed only
  when free blocks run out.

A registered block is full and immutable, so it may be shared. A block that a sequence is still
writing (its partially filled last block, or any block past what it has committed) is fresh
and owned by that sequence alone: shared prefix hits only ever cover full blocks.

Partial-block hits (``copy_partial=True``). Where the full-block walk stops, a prompt usually
still shares the first columns of some cached block that followed the same prefix (a voice
reference shared by many requests ends mid-block; the text after it differs). The pool keeps,
per registered block, its parent chain hash and its columns; the best such child (longest run
of equal leading columns, ``j``) is *copied*: the prompt's fresh block there gets the cached
block's K/V (the whole block; the slots past ``j`` are overwritten by the prefill before
anything reads them) and its first ``j`` columns count as cached. The copy is queued in the
pool (:meth:`BlockPool.take_copies`); the owner of the K/V tensors must execute the queued
copies, in order, before the next forward that reads or writes the cache. In order is enough:
a source block evicted and handed out again in the same step is written only by that step's
forward, after its queued copies. So with 64-token pages a prompt is cached to the token, not
to the page.

Hot path. ``append_slots`` / ``can_append`` are O(1) unless a block boundary is crossed;
``commit_tokens`` is O(columns) plus one hash per newly full block; ``allocate_prompt`` is
O(prompt blocks); ``free`` is O(sequence blocks). Nothing on those paths scans the pool.
``check_invariants`` and ``reset_prefix_cache`` are O(pool) and meant for tests / admin use.

Not thread-safe: one scheduler thread owns a pool.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Hashable

import numpy as np

__all__ = ["BlockPool", "NoFreeBlocks", "PrefixMatch", "chain_hash", "root_hash"]

_COL_DTYPE = np.dtype("<i8")  # canonical byte layout of a grid column for hashing
_DIGEST_SIZE = 16
_ROOT_TAG = b"shoal/kv-prefix/v1"


class NoFreeBlocks(RuntimeError):
    """Not enough allocatable blocks; the pool was left unchanged."""

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"need {needed} KV blocks, only {available} allocatable")
        self.needed = needed
        self.available = available


@dataclass(frozen=True)
class PrefixMatch:
    """Result of :meth:`BlockPool.allocate_prompt`.

    ``num_cached_tokens`` leading columns already have K/V in ``block_table`` (whole shared
    pages, plus ``copied_tokens`` columns of a partial-page copy; always < the prompt length);
    the caller prefills the rest.
    """

    num_cached_tokens: int
    block_table: list[int]
    copied_tokens: int = 0  # of num_cached_tokens, the columns of a partial-block copy


def root_hash(rows: int) -> bytes:
    """Chain seed for grids with ``rows`` rows (grids of different heights never share blocks)."""
    return hashlib.blake2b(_ROOT_TAG + struct.pack("<q", rows), digest_size=_DIGEST_SIZE).digest()


def chain_hash(prev: bytes, block: bytes | memoryview) -> bytes:
    """Hash of a full block given the previous block's hash and the block's column bytes."""
    h = hashlib.blake2b(prev, digest_size=_DIGEST_SIZE)
    h.update(block)
    return h.digest()


def _as_grid(columns) -> np.ndarray:
    """A 2-D integer array ``[rows, n]``; a 1-D input is one column."""
    a = np.asarray(columns)
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2:
        raise ValueError(f"grid columns must be [rows, T], got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"grid columns must be integers, got {a.dtype}")
    return a


def _column_bytes(grid: np.ndarray) -> bytes:
    """Column-major canonical bytes: column 0's rows, then column 1's, ..."""
    return np.ascontiguousarray(grid.T, dtype=_COL_DTYPE).tobytes()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Seq:
    __slots__ = ("table", "num_tokens", "num_committed", "rows", "last_hash", "pending")

    def __init__(self, table: list[int], num_tokens: int, num_committed: int, rows: int,
                 last_hash: bytes) -> None:
        self.table = table                  # block ids, len == cdiv(num_tokens, block_size)
        self.num_tokens = num_tokens        # KV slots reserved
        self.num_committed = num_committed  # leading columns whose K/V is written
        self.rows = rows
        self.last_hash = last_hash          # chain hash of the last committed full block
        self.pending = bytearray()          # committed column bytes of the unfinished block


class BlockPool:
    """Paged KV block allocator with refcounted, LRU-evicted prefix caching.

    Sequence lifecycle::

        m = pool.allocate_prompt(sid, grid)            # slots for the whole prompt
        ... prefill columns m.num_cached_tokens.. (maybe in chunks), then for each chunk:
        pool.commit_tokens(sid, grid[:, a:b])
        loop:                                          # decode
            pool.append_slots(sid, 1)                  # slot for the column fed this step
            ... forward writes its K/V ...
            pool.commit_tokens(sid, column)
        pool.free(sid)

    Commit only columns whose K/V is actually written, in order (a sampled column is written
    when it is fed back on the next step). Committed full blocks become reusable prefixes, so a
    re-submitted ``prompt + generated`` grid hits the cache.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True,
                 copy_partial: bool = False, max_partial_candidates: int = 32) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.enable_prefix_cache = bool(enable_prefix_cache)
        self.copy_partial = bool(copy_partial) and self.enable_prefix_cache
        self.max_partial_candidates = int(max_partial_candidates)
        self._ref = [0] * self.num_blocks
        self._block_hash: list[bytes | None] = [None] * self.num_blocks
        # partial-block hits: parent chain hash -> registered children (insertion order), and
        # each registered block's parent and columns [rows, block_size]
        self._children: dict[bytes, dict[int, None]] = {}
        self._block_parent: dict[int, bytes] = {}
        self._block_cols: dict[int, np.ndarray] = {}
        self._copies: list[tuple[int, int]] = []  # (src, dst) queued for the K/V owner
        self._hash_to_block: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(self.num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._seqs: dict[Hashable, _Seq] = {}
        # stats
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.evicted_blocks = 0
        self.copied_tokens = 0  # of hit_tokens, columns served by partial-block copies

    # ------------------------------------------------------------------ capacity / stats

    @property
    def num_free(self) -> int:
        """Blocks allocatable now: free plus cached-evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (referenced or evictable)."""
        return len(self._hash_to_block)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def usage(self) -> float:
        """Fraction of blocks referenced, in [0, 1]."""
        return self.num_used / self.num_blocks

    def reset_stats(self) -> None:
        self.hit_tokens = self.queried_tokens = self.evicted_blocks = self.copied_tokens = 0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` KV entries."""
        return _cdiv(num_tokens, self.block_size)

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= self.num_free

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # ------------------------------------------------------------------ internals

    def _take_block(self) -> int:
        """A block with ref 1: a free one if any, else the LRU evictable one (uncached)."""
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
            if self._block_hash[b] is not None:  # else a released partial page (copy source only)
                del self._hash_to_block[self._block_hash[b]]
                self._block_hash[b] = None
            self._forget_child(b)
            self.evicted_blocks += 1
        self._ref[b] = 1
        return b

    def _register(self, b: int, h: bytes, parent: bytes, cols_bytes, rows: int) -> None:
        self._hash_to_block[h] = b
        self._block_hash[b] = h
        if self.copy_partial:
            self._index_child(b, parent, cols_bytes, rows)

    def _index_child(self, b: int, parent: bytes, cols_bytes, rows: int) -> None:
        """Block ``b`` becomes a copy source after ``parent``: its leading columns (canonical
        column-major bytes of ``rows``-row columns) are kept for matching."""
        self._block_parent[b] = parent
        self._children.setdefault(parent, {})[b] = None
        self._block_cols[b] = np.frombuffer(bytes(cols_bytes), dtype=_COL_DTYPE).reshape(-1, rows).T

    def _forget_child(self, b: int) -> None:
        parent = self._block_parent.pop(b, None)
        if parent is None:
            return
        self._block_cols.pop(b, None)
        kids = self._children.get(parent)
        if kids is not None:
            kids.pop(b, None)
            if not kids:
                del self._children[parent]

    def _partial(self, grid: np.ndarray, start: int, parent: bytes) -> tuple[int, int]:
        """The cached child of ``parent`` sharing the most leading columns with ``grid[:, start:]``
        (at most ``T - 1 - start``: the last token is recomputed): (block, columns) or (-1, 0)."""
        kids = self._children.get(parent)
        limit = min(self.block_size, grid.shape[1] - 1 - start)
        if not kids or limit < 1:
            return -1, 0
        want = grid[:, start:start + limit]
        best, best_j = -1, 0
        for n, b in enumerate(reversed(kids)):  # most recently registered first
            if n >= self.max_partial_candidates:
                break
            cols = self._block_cols[b]  # [rows, block_size], or a released partial page's columns
            if cols.shape[0] != want.shape[0]:
                continue
            m = min(limit, cols.shape[1])
            eq = (cols[:, :m] == want[:, :m]).all(axis=0)
            j = m if eq.all() else int(np.argmin(eq))
            if j > best_j:
                best, best_j = b, j
                if j == limit:
                    break
        return best, best_j

    def _match(self, grid: np.ndarray) -> tuple[list[int], bytes]:
        """Cached full blocks of ``grid``'s prefix (capped to leave >= 1 token) and the last hash."""
        rows, T = grid.shape
        h = root_hash(rows)
        hits: list[int] = []
        if not self.enable_prefix_cache or not self._hash_to_block:
            return hits, h
        for nh in self._iter_page_hashes(grid, (T - 1) // self.block_size):
            b = self._hash_to_block.get(nh)
            if b is None:
                break
            hits.append(b)
            h = nh
        return hits, h

    def _iter_page_hashes(self, grid: np.ndarray, n: int, start: int = 0, h: bytes | None = None):
        """Chain hashes of pages ``start .. n-1`` of ``grid`` (``h``: the hash of page
        ``start - 1``, or the root when ``start`` is 0), lazily."""
        bs = self.block_size
        if h is None:
            h = root_hash(grid.shape[0])
        for i in range(start, n):
            h = chain_hash(h, _column_bytes(grid[:, i * bs:(i + 1) * bs]))
            yield h

    # ------------------------------------------------------------------ sequences

    def peek_prefix(self, grid_columns) -> int:
        """Tokens :meth:`allocate_prompt` would take from the cache now (no side effects, no stats)."""
        grid = _as_grid(grid_columns)
        if grid.shape[1] < 1:
            return 0
        hits, h = self._match(grid)
        n = len(hits) * self.block_size
        if self.copy_partial:
            n += self._partial(grid, n, h)[1]
        return n

    def page_hashes(self, grid_columns, limit: int | None = None,
                    known: list[bytes] | None = None) -> list[bytes]:
        """Chain hashes of the grid's leading full pages (at most ``limit``), the keys its pages
        are cached under once written; ``known``: this grid's first hashes, already computed.
        Pure (no side effects)."""
        grid = _as_grid(grid_columns)
        T = grid.shape[1]
        n = T // self.block_size if limit is None else min(limit, T // self.block_size)
        out = list(known[:n]) if known else []
        out.extend(self._iter_page_hashes(grid, n, len(out), out[-1] if out else None))
        return out

    def is_cached(self, page_hash: bytes) -> bool:
        """Whether a page with this chain hash is in the prefix cache now."""
        return page_hash in self._hash_to_block

    def take_copies(self) -> list[tuple[int, int]]:
        """The queued partial-block copies ``(src, dst)`` since the last call, in order; the
        K/V owner must copy every block ``src`` to ``dst`` (all layers, K, V and scales) in this
        order before the next forward."""
        if not self._copies:
            return []
        out, self._copies = self._copies, []
        return out

    def allocate_prompt(self, seq_id: Hashable, grid_columns) -> PrefixMatch:
        """Reserve KV for a prompt grid ``[rows, T]``, reusing its longest cached full-block prefix.

        At most ``block_size * ((T - 1) // block_size)`` tokens come from the cache, so the last
        token is always recomputed (its logits are needed) and the block holding it is fresh.
        Raises :class:`NoFreeBlocks` (pool unchanged) if the fresh blocks don't fit.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already allocated")
        grid = _as_grid(grid_columns)
        rows, T = grid.shape
        if T < 1:
            raise ValueError("prompt grid has no columns")
        hits, h = self._match(grid)
        n_fresh = self.blocks_for(T) - len(hits)
        # hit blocks sitting in the evictable set stop being allocatable once referenced
        revived = sum(1 for b in hits if self._ref[b] == 0)
        available = self.num_free - revived
        if n_fresh > available:
            raise NoFreeBlocks(n_fresh, available)
        for b in hits:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        n_cached = len(hits) * self.block_size
        src, j = self._partial(grid, n_cached, h) if self.copy_partial else (-1, 0)
        table = hits + [self._take_block() for _ in range(n_fresh)]
        seq = _Seq(table, T, n_cached + j, rows, h)
        if j:
            # queued before anything can write the fresh block (or a re-taken src: in order)
            self._copies.append((src, table[len(hits)]))
            seq.pending += _column_bytes(grid[:, n_cached:n_cached + j])
            self.copied_tokens += j
        self._seqs[seq_id] = seq
        self.queried_tokens += T
        self.hit_tokens += n_cached + j
        return PrefixMatch(n_cached + j, list(table), j)

    def can_append(self, seq_id: Hashable, n: int = 1) -> bool:
        s = self._seqs[seq_id]
        return self.blocks_for(s.num_tokens + n) - len(s.table) <= self.num_free

    def append_slots(self, seq_id: Hashable, n: int = 1) -> None:
        """Grow a sequence by ``n`` KV slots; raises :class:`NoFreeBlocks` (no side effects)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        s = self._seqs[seq_id]
        need = self.blocks_for(s.num_tokens + n) - len(s.table)
        if need > 0:
            if need > self.num_free:
                raise NoFreeBlocks(need, self.num_free)
            for _ in range(need):
                s.table.append(self._take_block())
        s.num_tokens += n

    def commit_tokens(self, seq_id: Hashable, columns) -> None:
        """Record the next columns (``[rows, n]`` or one ``[rows]`` column) whose K/V is written.

        Every block this completes is registered in the prefix cache (unless an identical chain
        is already registered, e.g. by a concurrent sequence with the same prompt).
        """
        s = self._seqs[seq_id]
        cols = _as_grid(columns)
        rows, n = cols.shape
        if rows != s.rows:
            raise ValueError(f"columns have {rows} rows, sequence has {s.rows}")
        if s.num_committed + n > s.num_tokens:
            raise ValueError(f"committing {n} columns past {s.num_committed} exceeds the "
                             f"{s.num_tokens} reserved slots")
        if n == 0:
            return
        if self.enable_prefix_cache:
            bs = self.block_size
            stride = rows * _COL_DTYPE.itemsize * bs
            s.pending += _column_bytes(cols)
            idx = s.num_committed // bs  # block the pending bytes belong to
            if len(s.pending) >= stride:
                buf = memoryview(bytes(s.pending))
                off = 0
                while len(buf) - off >= stride:
                    parent = s.last_hash
                    h = chain_hash(parent, buf[off:off + stride])
                    s.last_hash = h
                    b = s.table[idx]
                    if h not in self._hash_to_block and self._block_hash[b] is None:
                        self._register(b, h, parent, buf[off:off + stride], rows)
                    idx += 1
                    off += stride
                del s.pending[:off]
        s.num_committed += n

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block ids (token ``t`` lives in block ``t // block_size``)."""
        return list(self._seqs[seq_id].table)

    def num_tokens(self, seq_id: Hashable) -> int:
        """KV slots reserved for the sequence."""
        return self._seqs[seq_id].num_tokens

    def num_committed(self, seq_id: Hashable) -> int:
        """Leading columns reported written through :meth:`commit_tokens` (or cache hits)."""
        return self._seqs[seq_id].num_committed

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence (``KeyError`` if unknown). Cached blocks become evictable, tail first."""
        s = self._seqs.pop(seq_id)
        bs = self.block_size
        # the partially committed last page stays a copy source (copy_partial): a realtime voice
        # warm-up's tail, a finished turn that the next turn's prompt extends
        open_idx = s.num_committed // bs if self.copy_partial and s.num_committed % bs else -1
        # released tail-first so a prompt's later blocks are evicted before its shared prefix
        for i in range(len(s.table) - 1, -1, -1):
            b = s.table[i]
            r = self._ref[b] - 1
            self._ref[b] = r
            if r == 0:
                if self._block_hash[b] is not None:
                    self._evictable[b] = None
                elif i == open_idx:
                    self._index_child(b, s.last_hash, s.pending, s.rows)
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # ------------------------------------------------------------------ admin / tests

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (evictable blocks become free); returns the number dropped.

        Blocks still referenced keep their contents and owners; they just stop being shareable.
        """
        dropped = len(self._hash_to_block)
        for b in self._hash_to_block.values():
            self._block_hash[b] = None
        self._hash_to_block.clear()
        self._children.clear()
        self._block_parent.clear()
        self._block_cols.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
        return dropped

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (O(pool + tables))."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(msg)

        bs = self.block_size
        counts = [0] * self.num_blocks
        for sid, s in self._seqs.items():
            need(len(s.table) == self.blocks_for(s.num_tokens),
                 f"seq {sid!r}: {len(s.table)} blocks for {s.num_tokens} tokens")
            need(len(set(s.table)) == len(s.table), f"seq {sid!r}: duplicate block in table")
            need(0 <= s.num_committed <= s.num_tokens, f"seq {sid!r}: committed past reserved")
            if self.enable_prefix_cache:
                need(len(s.pending) == (s.num_committed % bs) * s.rows * _COL_DTYPE.itemsize,
                     f"seq {sid!r}: pending bytes out of step")
            for b in s.table:
                counts[b] += 1
            # blocks not yet fully committed are written by this sequence alone
            for b in s.table[s.num_committed // bs:]:
                need(self._block_hash[b] is None, f"seq {sid!r}: block {b} hashed before full")
                need(self._ref[b] == 1, f"seq {sid!r}: block {b} being written is shared")
        need(counts == self._ref, "refcounts do not match the block tables")
        free_set = set(self._free)
        need(len(free_set) == len(self._free), "duplicate block in free list")
        for b in range(self.num_blocks):
            states = (b in free_set) + (self._ref[b] > 0) + (b in self._evictable)
            need(states == 1, f"block {b} is in {states} states")
            need(self._ref[b] >= 0, f"block {b} has negative refcount")
            if b in free_set:
                need(self._block_hash[b] is None, f"free block {b} is hashed")
                need(b not in self._block_parent, f"free block {b} is a copy source")
            if b in self._evictable:
                need(self._block_hash[b] is not None or b in self._block_parent,
                     f"evictable block {b} is neither hashed nor a released partial page")
            if self._block_hash[b] is None and b in self._block_parent:
                need(b in self._evictable and 0 < self._block_cols[b].shape[1] < bs,
                     f"partial page {b} is not an evictable, partially filled copy source")
            h = self._block_hash[b]
            if h is not None:
                need(self._hash_to_block.get(h) == b, f"block {b} hash not registered to it")
        for h, b in self._hash_to_block.items():
            need(self._block_hash[b] == h, f"hash map points at block {b} with another hash")
        if self.copy_partial:
            need(set(self._hash_to_block.values()) <= set(self._block_parent) == set(self._block_cols),
                 "partial-hit index out of step with the registered blocks")
            for parent, kids in self._children.items():
                for b in kids:
                    need(self._block_parent.get(b) == parent, f"child {b} under the wrong parent")
            need(sum(len(k) for k in self._children.values()) == len(self._block_parent),
                 "a registered block is missing from its parent's children")
        if not self.enable_prefix_cache:
            need(not self._hash_to_block and not self._evictable, "prefix cache disabled but used")
