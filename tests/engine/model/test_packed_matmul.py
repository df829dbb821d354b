"""The packed-weight matmul (engine/model/packed_matmul_cpu.py) against plain torch, over the shapes that
exercise its edges: outputs that do not fill a tile, row counts past one row group, bfloat16 weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model import packed_matmul_cpu
from engine.model.bfloat16_bits import numpy_view
from engine.model.packed_matmul_cpu import ROW_GROUP, TILE, linear, matmul, pack


def test_pack_puts_output_columns_side_by_side_and_pads_with_zeros():
    weight = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    packed = pack(weight)
    assert packed.shape == (2, 3, TILE)
    assert torch.equal(packed[0, :, 5], weight[5])
    assert torch.equal(packed[1, :, 7], weight[TILE + 7])
    assert torch.equal(packed[1, :, 40 - TILE:], torch.zeros(3, 2 * TILE - 40))


@pytest.mark.parametrize("rows", [1, 3, ROW_GROUP, ROW_GROUP + 1, 2 * ROW_GROUP + 5])
@pytest.mark.parametrize("out_features, in_features", [(TILE, 16), (70, 37), (5, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch(rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    torch.testing.assert_close(linear(x, pack(weight), b, out_features), torch.nn.functional.linear(x, weight, b),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bfloat16_weights_are_widened_exactly():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=gen).bfloat16()
    bias = torch.randn(48, generator=gen).bfloat16()
    x = torch.randn(6, 40, generator=gen).bfloat16()
    got = linear(x, pack(weight), bias, 48)
    assert got.dtype == torch.bfloat16
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)  # only the bfloat16 rounding of the output


@pytest.mark.parametrize("rows, out_features", [(10, 45), (3, 2 * TILE), (ROW_GROUP + 2, 3 * TILE)])
def test_accumulate_adds_into_out_and_leaves_nothing_past_it(rows, out_features):
    # whole tiles go straight from the microkernel into out, a tile's last columns through its scratch
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(out_features, 24, generator=gen), torch.randn(rows, 24, generator=gen)
    residual = torch.randn(rows, out_features, generator=gen)
    out = residual.clone().numpy()
    matmul(x.numpy(), numpy_view(pack(weight)), np.zeros(0, np.float32), out, True,
           packed_matmul_cpu.use_threads())
    torch.testing.assert_close(torch.from_numpy(out), residual + x @ weight.T, rtol=1e-5, atol=1e-5)


def test_packed_linear_layer_serves_small_batches_and_the_batched_matmul_the_rest():
    from engine.model.linear import MAX_PACKED_ROWS, Linear
    layer = Linear(20, 33)
    weight = layer.weight.detach().clone()
    layer.pack()
    assert layer.weight is None  # the packed tiles are the only copy
    for rows in (1, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 300):
        x = torch.randn(rows, 20)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)
