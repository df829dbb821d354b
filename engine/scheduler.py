"""Continuous batching: each step fills a token budget with decodes first, then prefill chunks.

A short prefill shares the step with a long one ahead of it: a running prefill with a prefill after it shorter than
half of what it has left (a later running prefill, or a waiting request that may be admitted, by its whole length)
takes at most half of the room left; while it does, only such short requests are admitted; and whatever they leave
goes back to it in the same step. A short prompt that arrives behind a long one is then answered after a step or
two, not after the whole long prefill (an 8,000-token prompt is 16 steps of 512 tokens), and the long one keeps at
least half of each step, so is never starved. Half is the bound where sharing pays: two prefills sharing equally
finish, on average, sooner than one after the other only when the shorter has less than half of the longer's
tokens left."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv.hashing import BlockHash
from engine.kv.kv_cache_manager import KVCacheManager
from engine.policy import AdmissionOrder
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at its first uncomputed token."""

    request: Request
    num_tokens: int


@dataclass(slots=True)
class _StepBudget:
    """Tokens one step may still schedule: in all, and of prefill (the rest of the step-time target)."""

    tokens: int
    prefill_tokens: int

    def room(self, request: Request) -> int:
        return min(self.tokens, self.prefill_tokens) if request.is_catching_up else self.tokens

    def take(self, request: Request, num_tokens: int) -> None:
        if request.is_catching_up:
            self.prefill_tokens -= num_tokens
        self.tokens -= num_tokens

    def give_back(self, num_tokens: int, prefill: bool) -> None:
        """What a chunk took, for a request preempted after it was scheduled."""
        if prefill:
            self.prefill_tokens += num_tokens
        self.tokens += num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.clock = clock
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.order = AdmissionOrder(config.scheduling_policy, config.max_reorder_wait_s,
                                    config.lpm_max_queue, kv)
        self.waiting: list[Request] = []  # arrival order; preempted requests go back to the front
        self.running: list[Request] = []  # admission order; the newest is preempted first
        self.num_preemptions = 0
        # step-time target: decode context tokens -> prefill tokens that fit beside them (None: no target)
        self.prefill_cap: Callable[[int], int] | None = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drop a finished or aborted request from the queues and release its blocks."""
        # both queues: after a failed step a request may sit in either, or in both
        self.running = [r for r in self.running if r is not request]
        self.waiting = [r for r in self.waiting if r is not request]
        self.kv.free(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _StepBudget(self.max_num_batched_tokens, self._prefill_cap())
        shortened = self._schedule_running(out, budget)
        if not out.preempted:
            # while a prefill makes room, it is for requests shorter than half of what any such prefill has left
            self._schedule_waiting(out, budget, min((c.request.num_uncomputed_tokens for c in shortened), default=None))
        self._extend(shortened, budget)
        return out

    def _prefill_cap(self) -> int:
        if self.prefill_cap is None:
            return self.max_num_batched_tokens
        return self.prefill_cap(sum(r.num_tokens for r in self.running if not r.is_catching_up))

    def _schedule_running(self, out: SchedulerOutput, budget: _StepBudget) -> list[ScheduledChunk]:
        """Schedules the running requests; returns the chunks of prefills halved to leave room to shorter ones."""
        shortened = []
        order = sorted(self.running, key=lambda r: r.is_prefilling)  # decodes first
        shortest_after = self._shortest_after([r for r in order if r.is_catching_up])
        for request in order:
            if budget.room(request) <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            left = request.num_uncomputed_tokens
            num_tokens = min(left, budget.room(request))
            halved = 2 * shortest_after.get(request.request_id, left) < left and num_tokens > budget.room(request) // 2
            if halved:
                num_tokens = max(1, budget.room(request) // 2)
            while not self.kv.allocate(request, num_tokens):
                if self.kv.release_pin_for_room():
                    continue  # pins give way before any running request does: a pin ranks a prefix, it reserves no room
                victim = self.running.pop()  # the newest running request gives way
                budget.give_back(*self._preempt(victim, out))
                if victim is request:
                    break
            else:
                out.chunks.append(ScheduledChunk(request, num_tokens))
                budget.take(request, num_tokens)
                if halved:
                    shortened.append(out.chunks[-1])
        return shortened

    def _shortest_after(self, prefills: list[Request]) -> dict[str, int]:
        """For each running prefill, the fewest tokens left to any prefill after it: a later one, or a waiting
        request that may be admitted (its whole length: a cached prefix would only make it shorter)."""
        shortest = float("inf")
        if len(self.running) < self.max_num_seqs:
            shortest = min((r.num_tokens for r in self.waiting), default=shortest)
        after = {}
        for request in reversed(prefills):
            after[request.request_id] = shortest
            shortest = min(shortest, request.num_uncomputed_tokens)
        return after

    def _extend(self, shortened: list[ScheduledChunk], budget: _StepBudget) -> None:
        """Gives the room the shorter prefills left (a newcomer that could not start takes none) back to the
        prefills that made it for them, in their order: as much as the free blocks hold, pins giving way first."""
        for chunk in shortened:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted for a later running request's room
            more = min(request.num_uncomputed_tokens - chunk.num_tokens, budget.room(request))
            while more > 0 and not self.kv.allocate(request, chunk.num_tokens + more):
                if not self.kv.release_pin_for_room():
                    more //= 2
            if more > 0:
                chunk.num_tokens += more
                budget.take(request, more)

    def _schedule_waiting(self, out: SchedulerOutput, budget: _StepBudget, short_below: int | None) -> None:
        """Admits waiting requests in the policy's order; with `short_below`, only those with fewer than half as
        many tokens (a longer one, not passed once overdue, waits for the next step)."""
        if not self.waiting:  # (the usual decode step: no hashes to gather, no queue to order)
            return
        pending = self._pending_block_hashes()
        admitted = []
        now = self.clock()
        for request in self.order(self.waiting, now):
            if budget.room(request) <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if short_below is not None and 2 * request.num_tokens >= short_below:
                if self.order.is_overdue(request, now):
                    break
                continue
            prefix = self.kv.find_cached_prefix(request)
            num_hit_blocks = len(prefix.blocks)
            if (num_hit_blocks < min(len(request.block_hashes), self.kv.num_hittable_blocks(request))
                    and request.block_hashes[num_hit_blocks] in pending):
                # a running prefill is computing this prefix now: wait and hit it next step; nobody may
                # pass a request that is overdue, so then nobody else is admitted this step either
                if self.order.is_overdue(request, now):
                    break
                continue
            num_tokens = min(request.num_tokens - prefix.num_tokens, budget.room(request))
            if not self._allocate_waiting(request, num_tokens, prefix):
                break
            request.num_computed_tokens = prefix.num_tokens
            if request.num_cached_tokens is None:  # first admission; a resumed request was counted already
                self.kv.record_lookup(request, prefix)
                request.num_cached_tokens = prefix.num_tokens
                request.num_disk_cached_tokens = prefix.num_disk_blocks * self.kv.block_size
                request.first_scheduled_time = now
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(request)
            pending.update(request.block_hashes[num_hit_blocks:])
            out.chunks.append(ScheduledChunk(request, num_tokens))
            budget.take(request, num_tokens)
        if admitted:
            admitted_ids = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in admitted_ids]

    def _allocate_waiting(self, request: Request, num_tokens: int, prefix) -> bool:
        while not self.kv.allocate(request, num_tokens, prefix):
            # nothing runs that would free blocks: pins give way (while requests run, this one waits for their
            # blocks, as without pins; a released pin's blocks stay cached and the hit found stays valid)
            if self.running or not self.kv.release_pin_for_room():
                return False
        return True

    def _pending_block_hashes(self) -> set[BlockHash]:
        """Hashes of prompt blocks that running prefills have not computed yet."""
        if not self.kv.enable_caching:
            return set()
        bs = self.kv.block_size
        return {h for r in self.running if r.is_prefilling
                for h in r.block_hashes[r.num_computed_tokens // bs:r.num_prompt_tokens // bs]}

    def _preempt(self, request: Request, out: SchedulerOutput) -> tuple[int, bool]:
        """Returns the budget a chunk already scheduled for `request` this step gave back, and whether it was
        taken as prefill."""
        # NOTE: preemption is by recompute; the request's full blocks stay cached for its return
        was_catching_up = request.is_catching_up
        self.kv.free(request, preempted=True)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.insert(0, request)
        self.num_preemptions += 1
        out.preempted.append(request)
        refund = sum(c.num_tokens for c in out.chunks if c.request is request)
        out.chunks = [c for c in out.chunks if c.request is not request]
        return refund, was_catching_up
