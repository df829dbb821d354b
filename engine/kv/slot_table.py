"""A running request's KV slots (slot = block id * block size + offset), kept as its block table grows.

The runner needs a request's slots at every step: the newest token's slot, and for decode attention every slot of
its context. Built afresh from the block table they cost a walk over its blocks and a few numpy temporaries per
row and step, in proportion to the context, right after a step has left the CPU caches cold; kept here they are a
slice. Block tables only grow while a request runs (kv_cache_manager.py), so slots once written never change:
a slice taken earlier stays valid after later appends, and a request that is freed and admitted again starts a
new table.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class SlotTable:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._slots = np.empty(0, np.int64)  # room for more blocks past `size`, grown by doubling
        self.size = 0

    def append_blocks(self, block_ids: Iterable[int]) -> None:
        """The slots of these blocks after those already there, in order."""
        ids = np.fromiter(block_ids, np.int64)
        end = self.size + len(ids) * self.block_size
        if end > len(self._slots):  # a new array: slices of the old one keep their (unchanged) slots
            grown = np.empty(max(end, 2 * len(self._slots)), np.int64)
            grown[:self.size] = self._slots[:self.size]
            self._slots = grown
        self._slots[self.size:end] = (ids[:, None] * self.block_size + np.arange(self.block_size)).ravel()
        self.size = end

    @property
    def slots(self) -> np.ndarray:
        """Every slot of the table: position p of the request lives in slots[p]."""
        return self._slots[:self.size]
