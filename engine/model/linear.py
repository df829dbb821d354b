"""Linear layers that read their weights at the memory-bandwidth limit.

A decode step multiplies a few rows by every weight matrix once, so its speed is how fast the
weights stream from memory. On CPU, oneDNN with weights reordered once at load time into its own
blocked layout reads them markedly faster than `F.linear` over the row-major weight (measured in
bench/decode.py); elsewhere (CUDA) plain `F.linear` is already at the limit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


DECODE_ROWS_HINT = 8


class Linear(nn.Linear):
    """nn.Linear (same parameter names, so checkpoints load as they are) that can pack its weight."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def pack(self) -> None:
        """Reorder the weight into oneDNN's layout for small batches; the row-major copy is dropped."""
        # the batch-size hint picks the layout: decode steps (a few rows) are where bandwidth matters.
        # Measured here (interleaved, medians): the layout for 8 rows beat the one for 1 row at 1 and 8 rows
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), DECODE_ROWS_HINT)
        del self.weight
        self.register_parameter("weight", None)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packing: CPU only, and in bf16 only where the CPU has the instructions for it."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
        except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
            return False
        return True
    return False


def pack_linears(model: nn.Module) -> None:
    """Packs every Linear; a tied lm_head gets its own packed copy (the embedding keeps the original)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
