"""Copies one block's K and V (every layer) out of the pool's KV tensor, and back in."""
from __future__ import annotations

import torch


class KVBlockIO:
    def __init__(self, kv_cache: torch.Tensor) -> None:
        # [2, layers, num_blocks, block_size, kv_heads, head_dim]: a block is index 2
        self.kv_cache = kv_cache

    @property
    def block_shape(self) -> tuple[int, ...]:
        two, layers, _, block_size, kv_heads, head_dim = self.kv_cache.shape
        return (two, layers, block_size, kv_heads, head_dim)

    def copy_out(self, block_id: int) -> torch.Tensor:
        """A CPU copy, taken before the block is handed out and overwritten."""
        return self.kv_cache[:, :, block_id].to("cpu", copy=True)

    def copy_in(self, block_id: int, kv: torch.Tensor) -> None:
        self.kv_cache[:, :, block_id].copy_(kv)
