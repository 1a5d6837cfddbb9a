"""Paged KV block bookkeeping and prefix caching (shoal.engine.kv_cache)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from shoal.engine.kv_cache import BlockPool, NoFreeBlocks, PrefixMatch, chain_hash, root_hash

ROWS = 11
BS = 4


def grid(T: int, seed: int = 0) -> np.ndarray:
    """A random token grid [11, T]: audio-like columns with codes in rows 1..10."""
    rng = np.random.default_rng(seed)
    g = np.zeros((ROWS, T), dtype=np.int64)
    g[0] = rng.integers(0, 1000, T)
    g[1:] = rng.integers(0, 4096, (ROWS - 1, T))
    return g


def cat(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts, axis=1)


def prefill(pool: BlockPool, sid, g: np.ndarray) -> PrefixMatch:
    """Allocate a prompt and commit everything after the cached part (as a runner would)."""
    m = pool.allocate_prompt(sid, g)
    pool.take_copies()  # (a runner executes them here)
    pool.commit_tokens(sid, g[:, m.num_cached_tokens:])
    pool.check_invariants()
    return m


def state(pool: BlockPool):
    """Everything observable about a pool, for 'unchanged' checks."""
    return (list(pool._free), list(pool._evictable), dict(pool._hash_to_block), list(pool._ref),
            list(pool._block_hash),
            {k: (list(s.table), s.num_tokens, s.num_committed, bytes(s.pending), s.last_hash)
             for k, s in pool._seqs.items()},
            pool.hit_tokens, pool.queried_tokens, pool.evicted_blocks)


# ---------------------------------------------------------------------- accounting

def test_allocate_append_free_accounting():
    pool = BlockPool(10, BS)
    assert pool.num_free == 10 and pool.num_used == 0 and pool.usage() == 0.0
    m = pool.allocate_prompt("a", grid(10))
    assert m.num_cached_tokens == 0 and len(m.block_table) == 3
    assert pool.block_table("a") == m.block_table and pool.num_tokens("a") == 10
    assert pool.num_free == 7 and pool.num_used == 3 and pool.usage() == pytest.approx(0.3)
    pool.append_slots("a", 2)  # 12 tokens: still 3 blocks
    assert len(pool.block_table("a")) == 3 and pool.num_free == 7
    pool.append_slots("a")  # 13: crosses a boundary
    assert len(pool.block_table("a")) == 4 and pool.num_free == 6 and pool.num_tokens("a") == 13
    pool.append_slots("a", 0)
    assert pool.num_tokens("a") == 13
    pool.check_invariants()
    pool.allocate_prompt("b", grid(1, seed=1))
    assert pool.num_free == 5 and len(pool.block_table("b")) == 1
    assert set(pool.block_table("a")).isdisjoint(pool.block_table("b"))
    pool.free("a")
    assert pool.num_free == 9 and "a" not in pool and "b" in pool
    pool.free("b")
    assert pool.num_free == 10 and pool.num_used == 0 and pool.num_cached == 0  # nothing committed
    pool.check_invariants()
    with pytest.raises(KeyError):
        pool.free("b")
    with pytest.raises(KeyError):
        pool.free("nope")
    with pytest.raises(KeyError):
        pool.append_slots("nope")


def test_argument_errors():
    pool = BlockPool(8, BS)
    pool.allocate_prompt("a", grid(5))
    with pytest.raises(ValueError):
        pool.allocate_prompt("a", grid(5))  # duplicate id
    with pytest.raises(ValueError):
        pool.allocate_prompt("b", np.zeros((ROWS, 0), np.int64))
    with pytest.raises(ValueError):
        pool.commit_tokens("a", grid(6))  # more than reserved
    with pytest.raises(ValueError):
        pool.commit_tokens("a", np.zeros((3, 1), np.int64))  # wrong row count
    with pytest.raises(TypeError):
        pool.allocate_prompt("c", np.zeros((ROWS, 3), np.float32))
    with pytest.raises(ValueError):
        pool.append_slots("a", -1)
    with pytest.raises(ValueError):
        BlockPool(0, BS)
    with pytest.raises(ValueError):
        BlockPool(4, 0)
    pool.check_invariants()
    assert pool.num_seqs == 1 and pool.num_committed("a") == 0


# ---------------------------------------------------------------------- prefix hits

def test_identical_prompt_hits_full_blocks_and_shares_them():
    pool = BlockPool(16, BS)
    g = grid(10)
    a = prefill(pool, "a", g)
    assert pool.num_cached == 2  # blocks 0, 1 full; block 2 partial
    b = prefill(pool, "b", g)
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table  # partial last block is fresh
    assert [pool.ref_count(x) for x in b.block_table] == [2, 2, 1]
    assert pool.hit_tokens == 8 and pool.queried_tokens == 20 and pool.hit_rate == pytest.approx(0.4)
    pool.free("a")  # shared blocks stay referenced by b
    assert [pool.ref_count(x) for x in b.block_table] == [1, 1, 1]
    assert pool.num_used == 3 and pool.num_evictable == 0
    pool.check_invariants()
    pool.free("b")
    assert pool.num_evictable == 2 and pool.num_free == 16 and pool.num_used == 0
    pool.check_invariants()
    c = prefill(pool, "c", g)  # hits evictable blocks: they become referenced again
    assert c.num_cached_tokens == 8 and pool.num_evictable == 0 and pool.num_used == 3


def test_shared_long_prefix_hits_in_full_blocks_only():
    pool = BlockPool(32, BS)
    p = grid(23, seed=1)
    prefill(pool, "a", p)  # 5 full cached blocks
    q = cat(p[:, :11], grid(9, seed=2))  # shares 11 columns -> 2 full blocks
    assert pool.peek_prefix(q) == 8
    assert prefill(pool, "b", q).num_cached_tokens == 8
    r = cat(p[:, :20], grid(3, seed=3))  # shares exactly 5 blocks
    assert prefill(pool, "c", r).num_cached_tokens == 20
    s = p[:, :17]  # a prefix of the cached prompt: all 4 full blocks < T-1
    assert prefill(pool, "d", s).num_cached_tokens == 16


def test_any_differing_column_value_misses():
    pool = BlockPool(32, BS)
    g = grid(13, seed=4)
    prefill(pool, "a", g)
    code_diff = g.copy()
    code_diff[7, 2] += 1  # token row equal, one code differs in block 0
    assert (code_diff[0] == g[0]).all()
    assert prefill(pool, "b", code_diff).num_cached_tokens == 0
    later_diff = g.copy()
    later_diff[10, 6] += 1  # block 1 differs: only block 0 hits
    assert prefill(pool, "c", later_diff).num_cached_tokens == 4
    tok_diff = g.copy()
    tok_diff[0, 9] += 1  # block 2 token differs
    assert prefill(pool, "d", tok_diff).num_cached_tokens == 8
    assert prefill(pool, "e", g.astype(np.int32)).num_cached_tokens == 12  # dtype-independent


def test_chain_hash_same_block_after_different_prefix_misses():
    pool = BlockPool(32, BS)
    x = grid(BS, seed=5)
    a_pref, b_pref = grid(BS, seed=6), grid(BS, seed=7)
    tail = grid(3, seed=8)
    prefill(pool, "a", cat(a_pref, x, tail))
    assert pool.num_cached == 2
    # X is cached (as block 1 after a_pref) but must not hit as block 0 or after b_pref
    assert prefill(pool, "b", cat(x, tail)).num_cached_tokens == 0
    assert prefill(pool, "c", cat(b_pref, x, tail)).num_cached_tokens == 0
    assert prefill(pool, "d", cat(a_pref, x, tail)).num_cached_tokens == 8
    # the hash itself depends on the prefix
    bx = x.T.astype("<i8").tobytes()
    assert chain_hash(root_hash(ROWS), bx) != chain_hash(chain_hash(root_hash(ROWS), bx), bx)
    # grids of another height never share a chain with 11-row grids
    assert root_hash(ROWS) != root_hash(9)


def test_last_token_is_always_recomputed():
    pool = BlockPool(64, BS)
    g = grid(8, seed=9)  # exactly two full blocks
    a = prefill(pool, "a", g)
    assert pool.num_cached == 2
    b = prefill(pool, "b", g)
    assert b.num_cached_tokens == 4  # not 8: the last token needs its logits
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] not in a.block_table
    assert pool.num_cached == 2  # b's recomputed duplicate of block 1 is not registered twice
    assert prefill(pool, "c", cat(g, grid(1, seed=10))).num_cached_tokens == 8
    assert prefill(pool, "d", g[:, :1]).num_cached_tokens == 0
    assert prefill(pool, "e", g[:, :5]).num_cached_tokens == 4
    assert prefill(pool, "f", g[:, :4]).num_cached_tokens == 0  # T == block_size
    pool.check_invariants()


def test_prefix_cache_disabled():
    pool = BlockPool(16, BS, enable_prefix_cache=False)
    g = grid(10)
    prefill(pool, "a", g)
    assert prefill(pool, "b", g).num_cached_tokens == 0
    assert pool.num_cached == 0 and pool.queried_tokens == 20 and pool.hit_tokens == 0
    pool.free("a")
    pool.free("b")
    assert pool.num_free == 16 and pool.num_evictable == 0
    pool.check_invariants()


# ---------------------------------------------------------------------- eviction

def one_more(g: np.ndarray) -> np.ndarray:
    """``g`` plus one column, so all of ``g``'s full blocks are eligible for a hit."""
    return cat(g, grid(1, seed=99))


def test_eviction_is_lru_and_spares_referenced_blocks():
    pool = BlockPool(8, BS)
    a, b, r = grid(8, seed=20), grid(8, seed=21), grid(8, seed=22)
    ta = prefill(pool, "a", a).block_table
    tb = prefill(pool, "b", b).block_table
    tr = prefill(pool, "r", r).block_table  # stays referenced throughout
    pool.free("a")
    pool.free("b")
    assert pool.num_free == 6 and pool.num_evictable == 4 and pool.num_cached == 6
    # free blocks go first, then the least recently released cached block (a's tail)
    n1 = pool.allocate_prompt("n1", grid(12, seed=30)).block_table
    assert ta[1] in n1 and ta[0] not in n1 and pool.evicted_blocks == 1
    assert pool.peek_prefix(one_more(a)) == 4
    assert pool.peek_prefix(one_more(b)) == 8
    n2 = pool.allocate_prompt("n2", grid(8, seed=31)).block_table
    assert set(n2) == {ta[0], tb[1]} and pool.evicted_blocks == 3
    assert pool.peek_prefix(one_more(a)) == 0
    assert pool.peek_prefix(one_more(b)) == 4
    pool.check_invariants()
    # under pressure, referenced cached blocks are never reclaimed
    assert pool.num_free == 1 and not pool.can_allocate(2)
    before = state(pool)
    with pytest.raises(NoFreeBlocks):
        pool.allocate_prompt("n3", grid(8, seed=32))
    assert state(pool) == before
    assert [pool.ref_count(x) for x in tr] == [1, 1]
    assert pool.peek_prefix(one_more(r)) == 8
    assert pool.allocate_prompt("r2", one_more(r)).block_table[:2] == tr  # and still shareable
    pool.check_invariants()


def test_hit_refreshes_lru_position():
    pool = BlockPool(6, BS)
    a, b = grid(8, seed=40), grid(8, seed=41)
    prefill(pool, "a", a)
    prefill(pool, "b", b)
    pool.free("a")
    pool.free("b")  # LRU order: a's blocks, then b's
    assert pool.allocate_prompt("a2", one_more(a)).num_cached_tokens == 8
    pool.free("a2")  # a's blocks are now the most recently used
    pool.allocate_prompt("n", grid(12, seed=42))  # 2 free + 1 evicted
    assert pool.peek_prefix(one_more(a)) == 8
    assert pool.peek_prefix(one_more(b)) == 4
    pool.check_invariants()


def test_reset_prefix_cache():
    pool = BlockPool(8, BS)
    a, b = grid(8, seed=50), grid(9, seed=51)
    prefill(pool, "a", a)
    prefill(pool, "b", b)
    pool.free("a")
    assert pool.reset_prefix_cache() == 4
    assert pool.num_cached == 0 and pool.num_evictable == 0 and pool.num_free == 5
    assert pool.peek_prefix(one_more(b)) == 0
    pool.check_invariants()
    pool.free("b")  # b's blocks lost their hashes: straight to the free list
    assert pool.num_free == 8 and pool.num_evictable == 0
    pool.check_invariants()


# ---------------------------------------------------------------------- generated audio as prefix

def test_committed_generated_columns_become_a_prefix():
    pool = BlockPool(32, BS)
    prompt = grid(6, seed=60)
    gen = grid(10, seed=61)
    m = pool.allocate_prompt("a", prompt)
    pool.commit_tokens("a", prompt[:, :3])  # chunked prefill
    pool.commit_tokens("a", prompt[:, 3:])
    for t in range(gen.shape[1]):  # decode: one slot, one written column per step
        pool.append_slots("a", 1)
        pool.commit_tokens("a", gen[:, t])
        pool.check_invariants()
    assert pool.num_tokens("a") == pool.num_committed("a") == 16
    assert pool.num_cached == 4
    table = pool.block_table("a")
    pool.free("a")
    # next text batch of a multi-speaker request: prompt + generated + new text columns
    nxt = cat(prompt, gen, grid(5, seed=62))
    m = prefill(pool, "b", nxt)
    assert m.num_cached_tokens == 16 and m.block_table[:4] == table
    # different generated audio: only the all-prompt block is shared
    other = cat(prompt, grid(10, seed=63), grid(5, seed=62))
    assert prefill(pool, "c", other).num_cached_tokens == 4


def test_concurrent_identical_prompts_register_once():
    pool = BlockPool(16, BS)
    g = grid(9, seed=70)
    ma = pool.allocate_prompt("a", g)
    mb = pool.allocate_prompt("b", g)  # before a committed: no hit, own blocks
    assert mb.num_cached_tokens == 0 and set(ma.block_table).isdisjoint(mb.block_table)
    pool.commit_tokens("a", g)
    pool.commit_tokens("b", g)
    assert pool.num_cached == 2
    pool.check_invariants()
    pool.free("b")
    assert pool.num_evictable == 0 and pool.num_free == 13  # b's duplicates were never cached
    assert prefill(pool, "c", g).block_table[:2] == ma.block_table[:2]


# ---------------------------------------------------------------------- failure atomicity

def test_no_free_blocks_leaves_pool_unchanged():
    pool = BlockPool(4, BS)
    a = grid(8, seed=80)
    prefill(pool, "a", a)
    pool.free("a")  # 2 evictable + 2 free
    before = state(pool)
    # 17 tokens: 2 blocks hit (evictable -> referenced) + 3 fresh > 4 - 2 allocatable
    with pytest.raises(NoFreeBlocks) as e:
        pool.allocate_prompt("b", cat(a, grid(9, seed=81)))
    assert e.value.needed == 3 and e.value.available == 2
    assert state(pool) == before and "b" not in pool
    pool.check_invariants()
    # 16 tokens: 2 hit + 2 fresh fits exactly
    m = pool.allocate_prompt("b", cat(a, grid(8, seed=81)))
    assert m.num_cached_tokens == 8 and pool.num_free == 0
    pool.check_invariants()
    # appends: 16 tokens fill 4 blocks; the next slot needs a block
    assert pool.can_append("b", 0) and not pool.can_append("b", 1)
    before = state(pool)
    with pytest.raises(NoFreeBlocks):
        pool.append_slots("b", 1)
    assert state(pool) == before and pool.num_tokens("b") == 16
    pool.free("b")
    pool.allocate_prompt("c", grid(3, seed=82))
    assert pool.can_append("c", 13) and not pool.can_append("c", 14)
    before = state(pool)
    with pytest.raises(NoFreeBlocks):
        pool.append_slots("c", 14)
    assert state(pool) == before
    pool.append_slots("c", 13)
    assert pool.num_free == 0 and pool.num_tokens("c") == 16
    pool.check_invariants()


# ---------------------------------------------------------------------- determinism

_SCENARIO = """
import numpy as np
from shoal.engine.kv_cache import BlockPool
rng = np.random.default_rng(0)
base = rng.integers(0, 50, (11, 40))
pool = BlockPool(24, 4)
out = []
for i in range(12):
    T = int(rng.integers(5, 40))
    g = base[:, :T].copy()
    if i % 3 == 0:
        g[int(rng.integers(0, 11)), int(rng.integers(0, T))] += 1
    try:
        m = pool.allocate_prompt(i, g)
    except Exception:
        pool.free(min(pool._seqs)); continue
    pool.commit_tokens(i, g[:, m.num_cached_tokens:])
    out.append((m.num_cached_tokens, m.block_table))
    if i % 2:
        pool.free(i)
print(out, sorted(h.hex() for h in pool._hash_to_block))
"""


def test_behaviour_independent_of_python_hash_seed():
    outs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run([sys.executable, "-c", _SCENARIO], env=env, capture_output=True,
                           text=True, check=True)
        outs.add(r.stdout)
    assert len(outs) == 1
    # pin the hash format: cached prefixes stay valid across processes / versions
    blk = np.arange(ROWS * BS, dtype=np.int64).reshape(ROWS, BS)
    h = chain_hash(root_hash(ROWS), blk.T.astype("<i8").tobytes())
    assert h == chain_hash(root_hash(ROWS), np.ascontiguousarray(blk.T).tobytes())
    assert len(h) == 16


# ---------------------------------------------------------------------- randomized stress

@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("num_blocks,seed", [(24, 0), (48, 1), (1000, 2)])
def test_randomized_stress(num_blocks, seed, partial):
    """Random allocate / chunked prefill / decode / free / reset against invariants and a
    shadow KV store: a cache hit must hand out blocks whose written content equals the prompt,
    no sequence may write into a shared block, and (while nothing was evicted) every committed
    full-block prefix must hit. With partial-block copies, the queued copies are executed on the
    shadow in order, and every cached column (copied ones included) must hold the prompt's."""
    rng = np.random.default_rng(seed)
    bs = 4
    pool = BlockPool(num_blocks, bs, copy_partial=partial)
    shadow = np.full((num_blocks, ROWS, bs), -1, dtype=np.int64)  # "KV" written per slot
    bases = [rng.integers(0, 3, (ROWS, 64)) for _ in range(3)]  # tiny alphabet: many shared blocks
    seqs: dict[int, dict] = {}  # sid -> {"cols": full grid so far, "written": n}
    committed_prefixes: set[bytes] = set()  # column bytes of every committed full-block prefix
    next_id = 0
    hits = copied = 0

    def write(sid: int, upto: int) -> None:
        st = seqs[sid]
        table = pool.block_table(sid)
        for p in range(st["written"], upto):
            blk = table[p // bs]
            assert pool.ref_count(blk) == 1, "writing into a shared block"
            shadow[blk, :, p % bs] = st["cols"][:, p]
            if p % bs == bs - 1:
                committed_prefixes.add(st["cols"][:, :p + 1].T.tobytes())
        pool.commit_tokens(sid, st["cols"][:, st["written"]:upto])
        st["written"] = upto

    def expected_hit(g: np.ndarray) -> int:
        n = 0
        while n + bs <= g.shape[1] - 1 and np.ascontiguousarray(g[:, :n + bs].T).tobytes() in committed_prefixes:
            n += bs
        return n

    for _ in range(3000):
        op = rng.random()
        if op < 0.3 or not seqs:  # new prompt: a shared base prefix, maybe perturbed, + tail
            base = bases[int(rng.integers(0, len(bases)))]
            T = int(rng.integers(1, 40))
            g = base[:, :T].copy()
            if rng.random() < 0.3:
                g[int(rng.integers(0, ROWS)), int(rng.integers(0, T))] += 1
            if rng.random() < 0.3 and seqs:  # re-submit someone's prompt + generated columns
                other = seqs[int(rng.choice(list(seqs)))]
                g = cat(other["cols"][:, :other["written"]], g)
            g = np.ascontiguousarray(g)
            want = expected_hit(g)  # exact while nothing was evicted, an upper bound after
            before = state(pool)
            try:
                m = pool.allocate_prompt(next_id, g)
            except NoFreeBlocks:
                assert state(pool) == before
                victim = int(rng.choice(list(seqs)))
                pool.free(victim)
                del seqs[victim]
                continue
            c = m.num_cached_tokens
            for src, dst in pool.take_copies():  # what the runner does before the next forward
                assert partial and src != dst or src == dst
                shadow[dst] = shadow[src].copy()
            full = c - m.copied_tokens
            assert full % bs == 0 and c < g.shape[1] and 0 <= m.copied_tokens < bs
            assert full == want if pool.evicted_blocks == 0 else full <= want
            if not partial:
                assert m.copied_tokens == 0
            for i in range(c):  # cached columns hold exactly this prompt's columns
                assert (shadow[m.block_table[i // bs], :, i % bs] == g[:, i]).all()
            copied += m.copied_tokens
            hits += c
            seqs[next_id] = {"cols": g, "written": c}
            if rng.random() < 0.7:  # prefill some or all of it now
                write(next_id, int(rng.integers(c, g.shape[1] + 1)))
            next_id += 1
        elif op < 0.75:  # progress a sequence: finish prefill, or decode a few steps
            sid = int(rng.choice(list(seqs)))
            st = seqs[sid]
            if st["written"] < pool.num_tokens(sid):
                write(sid, pool.num_tokens(sid))
            else:
                for _ in range(int(rng.integers(1, 6))):
                    if not pool.can_append(sid):
                        with pytest.raises(NoFreeBlocks):
                            pool.append_slots(sid)
                        break
                    pool.append_slots(sid)
                    col = bases[0][:, int(rng.integers(0, 4)):][:, :1] if rng.random() < 0.5 \
                        else rng.integers(0, 3, (ROWS, 1))
                    st["cols"] = cat(st["cols"], col)
                    write(sid, st["written"] + 1)
        elif op < 0.98:
            sid = int(rng.choice(list(seqs)))
            pool.free(sid)
            del seqs[sid]
        else:
            pool.reset_prefix_cache()
            committed_prefixes.clear()
        pool.check_invariants()
        assert pool.num_free + pool.num_used == num_blocks
        assert 0.0 <= pool.usage() <= 1.0
    for sid in list(seqs):
        pool.free(sid)
    pool.check_invariants()
    assert pool.num_free == num_blocks and pool.num_used == 0
    assert pool.hit_tokens == hits and hits > 0
    assert pool.queried_tokens >= pool.hit_tokens
    assert pool.copied_tokens == copied and (copied > 0) == partial


# ---------------------------------------------------------------------- partial-block copies

def test_partial_block_hit_copies_the_cached_block():
    pool = BlockPool(32, BS, copy_partial=True)
    voice = grid(10, seed=20)  # a shared prompt ending mid-block (2 full blocks + 2 columns)
    a = prefill(pool, "a", cat(voice, grid(7, seed=21)))
    assert a.copied_tokens == 0  # nothing to copy from yet
    q = cat(voice, grid(6, seed=22))
    assert pool.peek_prefix(q) == 10
    b = pool.allocate_prompt("b", q)
    assert (b.num_cached_tokens, b.copied_tokens) == (10, 2)
    assert b.block_table[:2] == a.block_table[:2]  # full blocks shared
    assert b.block_table[2] not in a.block_table  # the partial block is b's own copy
    assert pool.take_copies() == [(a.block_table[2], b.block_table[2])]
    assert pool.take_copies() == []  # taken once
    assert pool.num_committed("b") == 10 and pool.copied_tokens == 2
    pool.check_invariants()
    pool.commit_tokens("b", q[:, 10:])
    pool.check_invariants()
    # b's copied block became full with b's own columns: it is a new child of the same parent
    c = pool.allocate_prompt("c", cat(q[:, :13], grid(2, seed=23)))
    assert (c.num_cached_tokens, c.copied_tokens) == (13, 1)
    assert pool.take_copies() == [(b.block_table[3], c.block_table[3])]
    pool.check_invariants()


def test_partial_hit_picks_the_longest_child_and_leaves_the_last_token():
    pool = BlockPool(64, BS, copy_partial=True)
    base = grid(4, seed=30)
    x = grid(BS, seed=31)
    one = x.copy(); one[3, 1] += 1  # shares 1 column with x
    three = x.copy(); three[0, 3] += 1  # shares 3 columns with x
    for sid, blk in (("one", one), ("three", three)):
        prefill(pool, sid, cat(base, blk, grid(1, seed=32)))
    m = pool.allocate_prompt("q", cat(base, x, grid(2, seed=33)))
    assert (m.num_cached_tokens, m.copied_tokens) == (7, 3)
    assert pool.take_copies() == [(pool.block_table("three")[1], m.block_table[1])]
    # the prompt's last column is never taken from the cache, copied or not
    m = pool.allocate_prompt("r", cat(base, three[:, :3]))
    assert (m.num_cached_tokens, m.copied_tokens) == (6, 2)
    pool.take_copies()
    # no shared leading column: no copy
    other = x.copy(); other[5, 0] += 1; other[0, 0] += 1
    m = pool.allocate_prompt("s", cat(base, other, grid(1, seed=34)))
    assert (m.num_cached_tokens, m.copied_tokens) == (4, 0) and pool.take_copies() == []
    pool.check_invariants()


def test_partial_copies_off_by_default_and_with_the_prefix_cache_off():
    for pool in (BlockPool(32, BS), BlockPool(32, BS, enable_prefix_cache=False, copy_partial=True)):
        voice = grid(10, seed=40)
        prefill(pool, "a", cat(voice, grid(3, seed=41)))
        m = pool.allocate_prompt("b", cat(voice, grid(3, seed=42)))
        assert m.copied_tokens == 0 and pool.take_copies() == [] and pool.copied_tokens == 0
        assert m.num_cached_tokens == (8 if pool.enable_prefix_cache else 0)


def test_partial_source_evicted_in_the_same_step_is_copied_first():
    """The source of a queued copy may be an evictable block that a later allocation reclaims;
    executing the copies in order (before the forward that writes it) still copies its old K/V."""
    pool = BlockPool(4, BS, copy_partial=True)
    voice = grid(6, seed=50)
    a = prefill(pool, "a", cat(voice, grid(3, seed=51)))  # blocks: 2 full (cached) + 1
    pool.free("a")  # everything evictable or free
    src = a.block_table[1]
    m = pool.allocate_prompt("b", cat(voice[:, :6], grid(1, seed=52)))  # shares block 0 + 2 columns
    assert (m.num_cached_tokens, m.copied_tokens) == (6, 2)
    # b holds block 0 and its fresh copy; c takes the 2 remaining blocks, evicting src
    pool.allocate_prompt("c", grid(8, seed=53))
    assert pool.evicted_blocks >= 1 and src in pool.block_table("c")
    copies = pool.take_copies()
    assert copies == [(src, m.block_table[1])]
    pool.check_invariants()


def test_partial_index_forgets_reset_and_evicted_blocks():
    pool = BlockPool(8, BS, copy_partial=True)
    voice = grid(6, seed=60)
    prefill(pool, "a", cat(voice, grid(3, seed=61)))
    pool.free("a")
    pool.reset_prefix_cache()
    pool.check_invariants()
    m = pool.allocate_prompt("b", cat(voice, grid(1, seed=62)))
    assert m.num_cached_tokens == 0 and pool.take_copies() == []


def test_released_partial_page_is_a_copy_source():
    """A sequence's partially committed last page (a realtime voice warm-up's tail) stays
    evictable as a copy source after it is freed; reclaiming it forgets it."""
    pool = BlockPool(6, BS, copy_partial=True)
    voice = grid(7, seed=70)  # one full page + 3 columns in the open page
    a = prefill(pool, "a", voice)
    pool.free("a")
    assert pool.num_evictable == 2 and pool.num_free == 6
    pool.check_invariants()
    m = pool.allocate_prompt("b", cat(voice, grid(3, seed=71)))
    assert (m.num_cached_tokens, m.copied_tokens) == (7, 3)
    assert pool.take_copies() == [(a.block_table[1], m.block_table[1])]
    pool.check_invariants()
    # a prompt sharing fewer of the open page's columns copies just those
    short = cat(voice[:, :6], grid(2, seed=72))
    m = pool.allocate_prompt("c", short)
    assert (m.num_cached_tokens, m.copied_tokens) == (6, 2)
    pool.take_copies()
    pool.free("b")
    pool.free("c")
    pool.check_invariants()
    # memory pressure reclaims the released partial pages like any cached block
    pool.allocate_prompt("d", grid(24, seed=73))
    assert pool.num_evictable == 0
    pool.check_invariants()
    pool.free("d")
    pool.reset_prefix_cache()
    pool.check_invariants()
    assert pool.num_free == 6 and pool.num_cached == 0
