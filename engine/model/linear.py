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
# steps of up to this many rows use the packed weight (the default max_num_seqs). Measured here (AVX-512 EPYC,
# the 121 SmolLM2 matmuls of a step): packed 20-33 ms vs F.linear 34-83 ms at 1-32 rows, in fp32 and bf16 alike
MAX_PACKED_ROWS = 32


class Linear(nn.Linear):
    """nn.Linear (same parameter names, so checkpoints load as they are) that can pack its weight."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # oneDNN keeps a primitive per input shape: only decode-sized batches go there, so its cache stays
        # small (every prefill length of its own grew RSS by ~100 MB in the soak test); prefill is compute-bound
        if self.packed is not None and x.shape[0] <= MAX_PACKED_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def pack(self) -> None:
        """Adds a copy of the weight in oneDNN's layout for small batches (the row-major one serves prefill)."""
        # the batch-size hint picks the layout: decode steps (a few rows) are where bandwidth matters.
        # Measured here (interleaved, medians): the layout for 8 rows beat the one for 1 row at 1 and 8 rows
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), DECODE_ROWS_HINT)


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
    """Packs every Linear (a packed copy beside the row-major weight)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
