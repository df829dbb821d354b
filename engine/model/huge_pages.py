"""Weights in 2 MB pages where Linux gives them (transparent huge pages, which most distributions grant on
madvise): a decode step streams every weight once, and in 4 KB pages each 4 KB of it is a TLB miss of its own.
The step's 120 Q4_1 matmuls of the default model took 2.96 ms from one advised mapping against 3.27 ms in 4 KB
pages (docs/speed.md#quantized-weights).

`copy_into_huge_pages` lays tensors one after the other in one anonymous mapping advised MADV_HUGEPAGE (one
mapping: a mapping per tensor would round each up to 2 MB, and a page is counted whole once touched). Elsewhere
(no MADV_HUGEPAGE, or not Linux) the mapping is plain memory and nothing else changes.
"""
from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line


def copy_into_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU `tensors` in one mapping advised for huge pages, in order; the mapping lives as long as any
    of them."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // ALIGN) * ALIGN)
    mapping = _mapping(starts[-1])
    copies = []
    for tensor, start, size in zip(tensors, starts, sizes):
        # (torch.frombuffer holds the mapping: it is unmapped when the last copy goes)
        copy = torch.frombuffer(mapping, dtype=torch.uint8, count=size, offset=start) if size else torch.empty(0)
        copies.append(copy.view(tensor.dtype).view(tensor.shape).copy_(tensor))
    return copies


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros on CPU in a mapping of its own advised for huge pages (the KV pool, which decode attention
    streams), every page written as torch.zeros writes them: the memory is taken at once, not on first use."""
    size = math.prod(shape) * dtype.itemsize
    if not size:
        return torch.zeros(*shape, dtype=dtype)
    return torch.frombuffer(_mapping(size), dtype=torch.uint8, count=size).view(dtype).view(*shape).zero_()


def _mapping(size: int) -> mmap.mmap:
    # private: Linux gives huge pages to anonymous shared memory only where shmem_enabled says so (mostly never)
    mapping = mmap.mmap(-1, max(-(-size // HUGE_PAGE) * HUGE_PAGE, HUGE_PAGE),
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping
