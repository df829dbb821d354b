"""Eviction order of free blocks: plain LRU, or adaptive segmented LRU (scan-resistant). O(1) per operation.

A policy holds the free blocks (ref count 0) only; cached ones keep their hash there until they
are popped (lazy eviction). Worthless blocks (no hash, or a duplicate of a cached hash) go in
front, so they are reused before any cached block is evicted. The pool tells the policy of each
ghost hit (an evicted hash asked for again), which SLRU learns its segment sizes from.
"""
from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from engine.config import EvictionPolicy

# SLRU: share of the pool the protected segment starts with (ghost hits move it between 0 and the whole pool)
PROTECTED_START = 0.5


class _End:
    __slots__ = ("prev", "next")

    def __init__(self) -> None:
        self.prev = self.next = None


class FreeBlockQueue:
    """Doubly linked list of free blocks, LRU first; prev/next live on the block (O(1) remove)."""

    def __init__(self, blocks=()) -> None:
        self._head = _End()  # dummy ends: no special cases
        self._tail = _End()
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self):
        block = self._head.next
        if block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def append(self, block) -> None:
        self._link(self._tail.prev, block)

    def appendleft(self, block) -> None:
        self._link(self._head, block)

    def _link(self, after, block) -> None:
        block.prev, block.next = after, after.next
        after.next.prev = block
        after.next = block
        self.num_free += 1

    def remove(self, block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def __contains__(self, block) -> bool:
        return block.prev is not None

    def __iter__(self) -> Iterator:
        block = self._head.next
        while block is not self._tail:
            yield block
            block = block.next


class LRUEviction:
    """One queue: the least recently freed cached block is evicted first."""

    def __init__(self, blocks: list) -> None:
        self.queue = FreeBlockQueue(blocks)

    @property
    def num_free(self) -> int:
        return self.queue.num_free

    def push(self, block, worthless: bool) -> None:
        if worthless:
            self.queue.appendleft(block)
        else:
            self.queue.append(block)

    def remove(self, block) -> None:
        self.queue.remove(block)

    def pop(self):
        return self.queue.popleft()

    def on_ghost_hit(self, reused: bool) -> None:
        """LRU has nothing to learn."""

    def __contains__(self, block) -> bool:
        return block.prev is not None

    def __iter__(self) -> Iterator:
        return iter(self.queue)


class SLRUEviction:
    """Segmented LRU: a block hit since it was cached (or cached again while still a ghost) is freed
    into the protected segment, which one-off prompts cannot flush; victims come from the probation
    segment first.

    The protected segment's bound adapts as ARC's target does: a ghost hit on a block evicted
    unused says probation was too small (the bound shrinks by one), one on a block that had been
    protected says protected was (it grows by one). At bound 0 this is exactly LRU.
    """

    def __init__(self, blocks: list) -> None:
        self.probation = FreeBlockQueue(blocks)
        self.protected = FreeBlockQueue()
        self.num_blocks = len(blocks)
        # NOTE: protected.num_free <= max_protected <= num_blocks after every operation
        self.max_protected = int(self.num_blocks * PROTECTED_START)

    @property
    def num_free(self) -> int:
        return self.probation.num_free + self.protected.num_free

    def push(self, block, worthless: bool) -> None:
        if worthless:
            self.probation.appendleft(block)
        elif block.reused:
            block.protected = True
            self.protected.append(block)
            self._fit()
        else:
            self.probation.append(block)

    def on_ghost_hit(self, reused: bool) -> None:
        if reused:
            self.max_protected = min(self.num_blocks, self.max_protected + 1)
        else:
            self.max_protected = max(0, self.max_protected - 1)
            self._fit()

    def _fit(self) -> None:
        if self.protected.num_free > self.max_protected:
            demoted = self.protected.popleft()  # keeps its hash; evicted after every probation block
            demoted.protected = False
            self.probation.append(demoted)

    def remove(self, block) -> None:
        (self.protected if block.protected else self.probation).remove(block)
        block.protected = False

    def pop(self):
        block = self.probation.popleft() if self.probation.num_free else self.protected.popleft()
        block.protected = False
        return block

    def __contains__(self, block) -> bool:
        return block.prev is not None

    def __iter__(self) -> Iterator:
        return chain(self.probation, self.protected)


def make_eviction(policy: EvictionPolicy, blocks: list) -> LRUEviction | SLRUEviction:
    return SLRUEviction(blocks) if policy is EvictionPolicy.SLRU else LRUEviction(blocks)
