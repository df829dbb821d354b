"""Linear layers that read their weights at the memory-bandwidth limit.

A decode step multiplies a few rows by every weight matrix once, so its speed is how fast the
weights stream from memory. On CPU each weight gets a packed copy at load time (packed_matmul_cpu.py)
that small batches multiply against, much faster than `F.linear` over the row-major weight, and the
row-major weight is then dropped: one copy of the weights. Prefill, compute-bound, multiplies by the packed
tiles as a batched matmul (about as fast as `F.linear`), and a tied embedding reads its rows out of the
lm_head's tiles (docs/speed.md#packed-matmul). CUDA keeps
the row-major weight: plain `F.linear` is at the limit there.

A quantized weight (GGUF blocks, or `--quantization` at load) lives only as the integer tiles of
quant_matmul_cpu.py: small batches stream those bytes, prefill dequantizes one weight at a time into a
float32 scratch for the compute-bound GEMM; on integer dot products (--quantized-activations int8) every batch
runs quant_dot_cpu's kernel, prefill's included.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from engine.model.quant_matmul_cpu import QuantTiles

# steps of up to this many rows use the packed weight: the default max_num_seqs, and faster than F.linear up to
# there (docs/speed.md#packed-matmul)
MAX_PACKED_ROWS = 32


class Linear(nn.Linear):
    """nn.Linear (same parameter names, so checkpoints load as they are) that can pack its weight, or hold
    it quantized."""

    packed: torch.Tensor | None = None
    quant: QuantTiles | None = None
    # a fused weight's last rows in a layout of their own (quant_formats.StackedRows: v in Q6_K beside Q4_K q and
    # k); `quant` then holds the rows before them, a whole number of tiles
    quant_tail: QuantTiles | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            if self.quant_tail is None:
                return _quantized(x, self.quant, self.bias)
            head = self.quant.out_features
            bias = (None, None) if self.bias is None else (self.bias[:head], self.bias[head:])
            return torch.cat([_quantized(x, self.quant, bias[0]), _quantized(x, self.quant_tail, bias[1])], dim=-1)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        from engine.model import packed_matmul_cpu  # (numba: only once weights were packed)
        if x.shape[0] <= MAX_PACKED_ROWS:
            return packed_matmul_cpu.linear(x, self.packed, self.bias, self.out_features)
        return packed_matmul_cpu.linear_batched(x, self.packed, self.bias, self.out_features)

    def pack(self) -> None:
        """Packs the weight for the CPU kernels and drops the row-major copy."""
        from engine.model import packed_matmul_cpu
        self.packed = packed_matmul_cpu.pack(self.weight.detach())
        self.weight = None


def _quantized(x: torch.Tensor, weight: QuantTiles, bias: torch.Tensor | None) -> torch.Tensor:
    from engine.model import quant_matmul_cpu
    # integer dot products run every batch (large ones 1.6-2x as fast on AVX2 as a float GEMM over dequantized
    # rows, each output the same floats as in a batch of one); float arithmetic up to its KERNEL_ROWS
    if x.shape[0] <= quant_matmul_cpu.KERNEL_ROWS[weight.bits] or weight.integer:
        return quant_matmul_cpu.linear(x, weight, bias)
    return quant_matmul_cpu.prefill_linear(x.float(), weight, bias).to(x.dtype)


class Embedding(nn.Embedding):
    """nn.Embedding whose rows may live in a tied lm_head's packed tiles instead of a weight of their own."""

    tiles: torch.Tensor | None = None  # the lm_head's packed weight: row t is tiles[t // TILE, :, t % TILE]
    quant: QuantTiles | None = None  # the rows quantized (its own, or a tied lm_head's)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            from engine.model import quant_matmul_cpu
            return quant_matmul_cpu.embedding_rows(self.quant, ids)
        if self.tiles is None:
            return super().forward(ids)
        tile = self.tiles.shape[2]
        return self.tiles[ids // tile, :, ids % tile]

    def row_tiles(self) -> torch.Tensor:
        """The rows as [ceil(V / T), H, T] tiles (T = 1 for a weight of its own), for the compiled step."""
        return self.tiles if self.tiles is not None else self.weight.detach().unsqueeze(-1)


def matmul_weight(linear: Linear):
    """What the compiled decode step multiplies by: the packed float tiles, or the quantized (data, scales,
    mins, group)."""
    from engine.model.bfloat16_bits import numpy_view  # (numba: only where the compiled step runs)
    return linear.quant.arrays() if linear.quant is not None else numpy_view(linear.packed)


def matmul_tail(linear: Linear):
    """matmul_weight of the Linear's tail rows (quant_tail), or of none: no tiles, of the type the step expects."""
    if linear.quant_tail is not None:
        return linear.quant_tail.arrays()
    weight = matmul_weight(linear)
    return weight[:0] if not isinstance(weight, tuple) else (*(a[:0] for a in weight[:3]), weight[3])


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def uniform_linears(model: nn.Module) -> bool:
    """Whether the compiled decode step can run the model: every Linear packed or quantized, and each
    projection the same kind in every layer (the step keeps one typed list of them per projection; quantized
    weights in the quad layout are a type of their own)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if any(m.packed is None and m.quant is None for m in linears):
        return False
    kinds: dict[str, set[tuple[bool, bool]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            for quant in (module.quant, module.quant_tail) if module.quant_tail is not None else (module.quant,):
                kinds.setdefault(name.rsplit(".", 1)[-1], set()).add((quant is not None, quant is not None and
                                                                       quant.integer))
    return all(len(kind) == 1 for kind in kinds.values())
