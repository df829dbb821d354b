"""Linear layers that read their weights at the memory-bandwidth limit.

A decode step multiplies a few rows by every weight matrix once, so its speed is how fast the
weights stream from memory. On CPU each weight gets a packed copy at load time (packed_matmul_cpu.py)
that small batches multiply against, much faster than `F.linear` over the row-major weight (measured in
bench/decode.py); prefill, compute-bound, keeps the row-major weight, and so does CUDA, where plain
`F.linear` is already at the limit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import packed_matmul_cpu

# steps of up to this many rows use the packed weight (the default max_num_seqs). Measured here (AVX-512 EPYC,
# python -m bench.matmul: the 121 SmolLM2 matmuls of a step): packed 12.4-13.1 ms at 1-8 rows and 29.6 ms at
# 32 against 33-74 ms with F.linear
MAX_PACKED_ROWS = 32


class Linear(nn.Linear):
    """nn.Linear (same parameter names, so checkpoints load as they are) that can pack its weight."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] <= MAX_PACKED_ROWS:
            return packed_matmul_cpu.linear(x, self.packed, self.bias, self.out_features)
        return F.linear(x, self.weight, self.bias)

    def pack(self) -> None:
        """Adds a packed copy of the weight for small batches (the row-major one serves prefill)."""
        self.packed = packed_matmul_cpu.pack(self.weight.detach())


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def pack_linears(model: nn.Module) -> None:
    """Packs every Linear (a packed copy beside the row-major weight)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
