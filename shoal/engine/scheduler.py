"""Scheduler: who is admitted, who prefills how much, who decodes, who is preempted.

Every step:
1. admit waiting requests (most urgent priority first, then arrival) while a slot and KV
   blocks are free; a request that does not fit may preempt a running request of a *less*
   urgent class;
2. give the prefill token budget to admitted requests in admission order (chunked prefill, so
   a long prompt never stalls the decode batch for more than one chunk);
   A request whose prompt continues with pages that an admitted request is computing right
   now (a burst of requests cloning one voice) waits for them instead (``wait_for_prefix``):
   they are in the prefix cache one prefill step later, so it prefills only what is its own;
3. decode every request whose prompt is computed; when the pool cannot grow a sequence by one
   token, preempt the least urgent, most recent request (its KV is freed; it is recomputed
   from its prompt + generated columns later, with its sampling state intact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_cache import BlockPool, NoFreeBlocks
from .request import EngineRequest, Status


@dataclass
class StepPlan:
    prefill: list[tuple[EngineRequest, int, int]] = field(default_factory=list)  # (req, start, end)
    decode: list[EngineRequest] = field(default_factory=list)
    preempted: list[EngineRequest] = field(default_factory=list)


class Scheduler:
    # a waiting request defers to in-flight pages worth at least this many tokens, for at most
    # this many scheduling steps (a producer that is preempted or cancelled is forgotten at once)
    MIN_WAIT_TOKENS = 32
    MAX_WAIT_STEPS = 64

    def __init__(self, pool: BlockPool, max_running: int, prefill_chunk: int,
                 wait_for_prefix: bool = True) -> None:
        self.pool = pool
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.wait_for_prefix = wait_for_prefix and pool.enable_prefix_cache
        self._producing: dict[EngineRequest, list[bytes]] = {}  # prefilling -> its new pages' hashes
        self._inflight: dict[bytes, int] = {}  # page hash -> producers computing it
        self._waited: dict[EngineRequest, int] = {}  # steps a waiting request has deferred
        self._hashes: dict[EngineRequest, tuple[int, list[bytes]]] = {}  # (grid length, page hashes)
        self.deferred_admissions = 0  # stats: scheduling steps requests spent waiting for pages
        self.waiting: list[EngineRequest] = []
        self.running: list[EngineRequest] = []  # admitted (prefill or decode), admission order
        self.free_slots = list(range(max_running - 1, -1, -1))

    # ------------------------------------------------------------------ queues
    def add(self, req: EngineRequest) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def remove(self, req: EngineRequest) -> None:
        """Drop a request from the queues and release its slot and blocks."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._release(req)

    def _release(self, req: EngineRequest) -> None:
        self._stop_producing(req)
        self._waited.pop(req, None)
        self._hashes.pop(req, None)
        if req.request_id in self.pool:
            self.pool.free(req.request_id)
        if req.slot is not None:
            self.free_slots.append(req.slot)
            req.slot = None

    # ------------------------------------------------------------------ prefix-aware admission
    def _stop_producing(self, req: EngineRequest) -> None:
        for h in self._producing.pop(req, ()):
            n = self._inflight[h] - 1
            if n:
                self._inflight[h] = n
            else:
                del self._inflight[h]

    def _start_producing(self, req: EngineRequest, grid, num_cached: int,
                         known: tuple[int, list[bytes]] | None = None) -> None:
        prefix = known[1] if known is not None and known[0] == grid.shape[1] else None
        hashes = self.pool.page_hashes(grid, known=prefix)[num_cached // self.pool.block_size:]
        if hashes:
            self._producing[req] = hashes
            for h in hashes:
                self._inflight[h] = self._inflight.get(h, 0) + 1

    def _should_wait(self, req: EngineRequest, grid) -> bool:
        """Whether ``req``'s prompt continues (past what is cached) with pages being computed."""
        if not self._inflight or self._waited.get(req, 0) >= self.MAX_WAIT_STEPS:
            return False
        pool = self.pool
        T = grid.shape[1]
        cached = self._hashes.get(req)
        if cached is None or cached[0] != T:  # a waiting grid only changes by a preemption
            cached = (T, pool.page_hashes(grid, (T - 1) // pool.block_size))
            self._hashes[req] = cached
        inflight = 0
        for h in cached[1]:
            if pool.is_cached(h):
                continue
            if h not in self._inflight:
                break
            inflight += 1
        return inflight * pool.block_size >= self.MIN_WAIT_TOKENS

    @staticmethod
    def _urgency(req: EngineRequest) -> tuple[int, float]:
        return (int(req.priority), req.arrival)

    def preempt(self, req: EngineRequest) -> None:
        self.running.remove(req)
        self._release(req)
        req.invalidate_pending()  # a column in flight is recomputed after the resume
        req.status = Status.WAITING
        req.num_computed = 0
        req.preemptions += 1
        self.waiting.append(req)

    def _victim(self, worse_than: EngineRequest | None) -> EngineRequest | None:
        """The least urgent, most recently arrived running request (strictly less urgent than
        ``worse_than`` when given)."""
        cands = self.running
        if worse_than is not None:
            cands = [r for r in cands if int(r.priority) > int(worse_than.priority)]
        if not cands:
            return None
        return max(cands, key=lambda r: (int(r.priority), r.arrival))

    # ------------------------------------------------------------------ planning
    def schedule(self, sequence_of: Callable[[EngineRequest], "object"]) -> StepPlan:
        """``sequence_of(req)`` gives the grid columns to prefill (np.ndarray [11, T])."""
        plan = StepPlan()
        # pages of requests done prefilling are cached (or the request left): no longer in flight
        for req in [r for r in self._producing if r.status is not Status.PREFILL or r not in self.running]:
            self._stop_producing(req)
        # 1. admission
        self.waiting.sort(key=self._urgency)
        deferred: list[EngineRequest] = []
        while self.waiting:
            # a waiting request keeps its turn: each holds one of the free slots, so a later
            # (never more urgent) request cannot take it, and once they hold them all, stop
            if deferred and len(deferred) >= len(self.free_slots):
                break
            req = self.waiting[0]
            # (only with a slot free: without one it waits anyway, or preempts as before)
            if self.wait_for_prefix and self.free_slots and self._should_wait(req, sequence_of(req)):
                self._waited[req] = self._waited.get(req, 0) + 1
                self.deferred_admissions += 1
                deferred.append(self.waiting.pop(0))
                continue
            match = None
            if len(self.free_slots) > len(deferred):
                try:
                    match = self.pool.allocate_prompt(req.request_id, sequence_of(req))
                except NoFreeBlocks:
                    pass
            if match is None:  # no slot or no blocks: make room from a less urgent request
                victim = self._victim(req)
                if victim is None:
                    break
                self.preempt(victim)
                plan.preempted.append(victim)
                self.waiting.sort(key=self._urgency)
                continue
            self.waiting.pop(0)
            self._waited.pop(req, None)
            known = self._hashes.pop(req, None)
            req.slot = self.free_slots.pop()
            req.num_computed = match.num_cached_tokens
            req.status = Status.PREFILL
            self.running.append(req)
            if self.wait_for_prefix:
                self._start_producing(req, sequence_of(req), match.num_cached_tokens, known)
        self.waiting[:0] = deferred

        # 2. chunked prefill
        budget = self.prefill_chunk
        for req in self.running:
            if req.status is not Status.PREFILL or budget <= 0:
                continue
            target = sequence_of(req).shape[1]
            n = min(budget, target - req.num_computed)
            if n > 0:
                plan.prefill.append((req, req.num_computed, req.num_computed + n))
                budget -= n
            elif target == req.num_computed:
                plan.prefill.append((req, target, target))

        # 3. decode, making room for one more token per sequence (not for one whose last
        #    frame is already in flight: it only waits for the host to read it)
        decoding = [r for r in self.running if r.status is Status.DECODE and r.wants_frame()]
        for req in sorted(decoding, key=self._urgency):
            if req not in self.running:
                continue  # preempted below for an earlier request
            while not self.pool.can_append(req.request_id, 1):
                victim = self._victim(None)
                self.preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            if req in self.running:
                self.pool.append_slots(req.request_id, 1)
        plan.decode = [r for r in self.running if r.status is Status.DECODE and r.wants_frame()]
        plan.prefill = [p for p in plan.prefill if p[0] in self.running]
        return plan
