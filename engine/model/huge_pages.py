"""Tensors in 2 MB pages where Linux gives them (transparent huge pages, which most distributions grant on
madvise): a decode step streams every weight once, and in 4 KB pages each 4 KB of it is a TLB miss of its own.
The step's 120 Q4_1 matmuls of the default model took 2.96 ms from one advised mapping against 3.27 ms in 4 KB
pages, its packed fp32 ones 13.5 against 16.9 ms (docs/speed.md#quantized-weights).

An `Arena` lays copies one after the other in one private anonymous mapping advised MADV_HUGEPAGE (one mapping:
a mapping per tensor would round each up to 2 MB, and a page is counted whole once touched): the loader moves
the tiles there. `zeros` gives the CPU KV pool (and bench.decode's bandwidth probe) a mapping of its own.
Elsewhere (no MADV_HUGEPAGE, or not Linux) a mapping is plain memory and nothing else changes.
"""
from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line


class Arena:
    """One mapping advised for huge pages that tensors are copied into one after the other (`place`), each on a
    cache line of its own; the mapping lives as long as any copy. A caller that drops each original as soon as
    its copy is placed holds little more than the weights at any moment."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        """Room for copies of `tensors`, placed later in any order."""
        self.size = sum(_aligned(t.nbytes) for t in tensors)
        self._mapping = _mapping(self.size)
        self._used = 0

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of CPU `tensor` in the mapping."""
        size = tensor.nbytes
        if self._used + size > self.size:
            raise ValueError(f"the arena holds {self.size} bytes; {self._used} used, {size} more asked")
        copy = _tensor_at(self._mapping, self._used, size, tensor.dtype, tensor.shape).copy_(tensor)
        self._used += _aligned(size)
        return copy


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros on CPU in a mapping of its own advised for huge pages (the KV pool, which decode attention
    streams), every page written as torch.zeros writes them: the memory is taken at once, not on first use."""
    size = math.prod(shape) * dtype.itemsize
    return _tensor_at(_mapping(size), 0, size, dtype, shape).zero_()


def _mapping(size: int) -> mmap.mmap:
    # private: Linux gives huge pages to anonymous shared memory only where shmem_enabled says so (mostly never)
    mapping = mmap.mmap(-1, max(-(-size // HUGE_PAGE) * HUGE_PAGE, HUGE_PAGE),
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


def _tensor_at(mapping: mmap.mmap, offset: int, size: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The `size` bytes at `offset` of the mapping as a tensor (torch.frombuffer holds the mapping: it is unmapped
    when the last such tensor goes; it refuses no bytes, so an empty tensor is its own)."""
    raw = torch.frombuffer(mapping, dtype=torch.uint8, count=size, offset=offset) if size else \
        torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).view(*shape)


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN
