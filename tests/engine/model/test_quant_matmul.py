"""The quantized matmul kernels against a float64 reference: every format, row groups of 1, 2 and 8 (and the
remainder past a group), output widths that are not whole tiles, planted outliers in scales and mins."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from engine.model import cpu_gemm, quant_matmul_cpu
from engine.model.quant_formats import QuantRows, SuperBlocks
from engine.model.quant_matmul_cpu import HALF_ROWS, ROW_GROUP, SIX_BIT, SUPER_HEAD, TILE

# (bits, group, with mins): Q4_0 / Q4_1 / Q4_K, Q8_0, Q6_K, a 6-bit stack with mins (Q4_K's q and k over Q6_K's
# v), 8-bit stacks of 16-weight groups
LAYOUTS = [(4, 32, True), (8, 32, False), (6, 16, False), (6, 16, True), (8, 16, False), (8, 16, True)]
# a whole tile's pass and one row past it; where passes go by halves, blocks of rows full and partial, a call and
# one row past it
ROW_COUNTS = sorted({1, 2, 8, ROW_GROUP, ROW_GROUP + 1}
                    | ({HALF_ROWS, HALF_ROWS + 1, 2 * HALF_ROWS + 1} if HALF_ROWS else set()))


def _integers(rng: np.random.Generator, n: int, k: int, bits: int) -> np.ndarray:
    if bits == 4:
        return rng.integers(0, 16, (n, k), dtype=np.uint8)
    return rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (n, k), dtype=np.int8)


def _rows(n: int, k: int, bits: int, group: int, with_mins: bool, seed: int = 0) -> QuantRows:
    rng = np.random.default_rng(seed)
    q = _integers(rng, n, k, bits)
    scales = rng.uniform(0.001, 0.02, (n, k // group)).astype(np.float32)
    scales[n // 2, 0] = 3.0  # planted outliers: one group's scale, one group's min, far from the rest
    mins = rng.uniform(-0.1, 0.1, (n, k // group)).astype(np.float32) if with_mins else None
    if mins is not None:
        mins[0, -1] = -40.0
    return QuantRows(q, scales, mins, group, bits)


def _reference(x: np.ndarray, rows: QuantRows) -> np.ndarray:
    w = rows.q.astype(np.float64) * np.repeat(rows.scales.astype(np.float64), rows.group, axis=1)
    if rows.mins is not None:
        w += np.repeat(rows.mins.astype(np.float64), rows.group, axis=1)
    return x.astype(np.float64) @ w.T


@pytest.mark.parametrize("bits,group,with_mins", LAYOUTS)
@pytest.mark.parametrize("n", [TILE, 3 * TILE + 5])
def test_product_matches_float64(bits, group, with_mins, n):
    k = 96 if group == 32 else 80
    rows = _rows(n, k, bits, group, with_mins)
    tiles = quant_matmul_cpu.pack(rows)
    assert tiles.bits == bits
    for m in ROW_COUNTS:
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        got = quant_matmul_cpu.linear(torch.from_numpy(x), tiles, None).numpy()
        expected = _reference(x, rows)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("bits,group,with_mins", LAYOUTS)
def test_a_rows_product_is_the_same_bits_at_every_row_count(bits, group, with_mins):
    """Each row's product alone and in a step of any row count the kernel serves, bit for bit: every pass sums a
    group in the same order (on AVX-512 its even and odd k's apart, in one loop for a few rows, in two for more),
    so an answer does not hang on how many requests share its step."""
    k = 96 if group == 32 else 80
    tiles = quant_matmul_cpu.pack(_rows(3 * TILE + 5, k, bits, group, with_mins))
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((max(ROW_COUNTS), k)).astype(np.float32))
    alone = torch.cat([quant_matmul_cpu.linear(x[r:r + 1], tiles, None) for r in range(len(x))])
    for m in ROW_COUNTS:
        assert torch.equal(quant_matmul_cpu.linear(x[:m], tiles, None), alone[:m]), m


@njit(fastmath=True)
def _sums_under_fastmath(x, group):
    return quant_matmul_cpu._group_sums(x, group, True)  # compiled here: x's layout 'A' is a new signature


def test_group_sums_add_in_order_whatever_compiles_them():
    """A numba callee without fastmath of its own compiles with its first caller's; the matmuls' group sums (what
    the mins multiply) must not, or each compiled caller reorders them its own way and results differ in their
    last bits by which process compiled what (fp16 and float32 scales did, after a cache filled elsewhere)."""
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)[:, ::2]  # non-contiguous: 'A'
    in_order = np.zeros((3, 4), np.float32)
    for r, g, k in np.ndindex(3, 4, 32):
        in_order[r, g] = np.float32(in_order[r, g] + x[r, g * 32 + k])
    assert np.array_equal(_sums_under_fastmath(x, 32), in_order)


def _two_level_rows(n: int, k: int, bits: int, group: int, with_mins: bool, size: int) -> QuantRows:
    """Rows whose scales and mins are a K-quant's: an fp16 factor per super-block of `size` weights times an int8
    per group (planted outliers among both), so that every kind of packed scales holds them exactly."""
    rng = np.random.default_rng(1)
    per = size // group

    def levels(low: float, high: float):
        d = rng.uniform(low, high, (n, k // size)).astype(np.float16).astype(np.float32)
        d[n // 2, 0] = 3.0
        sub = rng.integers(-128, 128, (n, k // group), dtype=np.int8)
        sub[0, -1] = -128
        return d, sub, np.repeat(d, per, axis=1) * sub.astype(np.float32)

    d, sub_scales, scales = levels(1e-4, 1e-3)
    dmin, sub_mins, mins = levels(-1e-3, 1e-3) if with_mins else (None, None, None)
    return QuantRows(_integers(rng, n, k, bits), scales, mins, group, bits,
                     SuperBlocks(size, d, sub_scales, dmin, sub_mins))


def _fp16_rows(bits: int, group: int, with_mins: bool) -> QuantRows:
    fp32 = _rows(3 * TILE + 5, 128, bits, group, with_mins)
    rows = QuantRows(fp32.q, fp32.scales.astype(np.float16).astype(np.float32),
                     None if fp32.mins is None else fp32.mins.astype(np.float16).astype(np.float32), group, bits)
    assert rows.half_exact and not fp32.half_exact
    return rows


@pytest.mark.parametrize("bits,group,with_mins", LAYOUTS)
@pytest.mark.parametrize("source,kind", [("fp16", "fp16"), ("fp16", "super-blocks"),
                                         ("two levels", "super-blocks")])
def test_every_kind_of_scales_gives_the_float32_scales_results_bit_for_bit(bits, group, with_mins, source, kind):
    """Scales and mins that are fp16 values (a file's Q8_0 / Q4_0 / Q4_1) packed as their fp16 bits, and the
    K-quants' two levels (an fp16 per super-block, an int8 per group) packed as super-block records, fewer
    bytes, widen exactly: the matmul at every row count, the dequantized rows and the embedding rows equal those
    of the float32 tiles bit for bit."""
    rows = _fp16_rows(bits, group, with_mins) if source == "fp16" else \
        _two_level_rows(3 * TILE + 5, 128, bits, group, with_mins, 4 * group)
    assert quant_matmul_cpu.scale_kind([rows]) == ("fp16" if source == "fp16" else "super-blocks")
    full, packed = quant_matmul_cpu.pack(rows), quant_matmul_cpu.pack(rows, scales=kind)
    assert packed.scales.dtype == packed.mins.dtype == (torch.int16 if kind == "fp16" else torch.int8)
    assert packed.nbytes() < full.nbytes() and packed.in_features == full.in_features == 128
    for m in ROW_COUNTS:
        x = torch.from_numpy(np.random.default_rng(m).standard_normal((m, 128)).astype(np.float32))
        assert torch.equal(quant_matmul_cpu.linear(x, packed, None), quant_matmul_cpu.linear(x, full, None))
    weight = rows.dequantize()
    assert np.array_equal(quant_matmul_cpu.dequantize_rows(packed, 0, torch.empty(weight.shape)).numpy(), weight)
    ids = torch.tensor([0, TILE // 2, 2 * TILE + 1, 3 * TILE + 4])
    assert torch.equal(quant_matmul_cpu.embedding_rows(packed, ids), quant_matmul_cpu.embedding_rows(full, ids))


def test_scale_kind_is_the_smallest_every_weight_holds_exactly():
    fp16, two_levels = _fp16_rows(4, 32, True), _two_level_rows(TILE, 128, 4, 32, True, 256 // 2)
    assert quant_matmul_cpu.scale_kind([fp16, fp16]) == "fp16"
    assert quant_matmul_cpu.scale_kind([fp16, two_levels]) == "super-blocks"
    assert quant_matmul_cpu.scale_kind([fp16, _rows(TILE, 64, 4, 32, True)]) == "float32"  # neither
    three_groups = _two_level_rows(TILE, 96, 4, 32, True, 96)  # super-blocks of 3 groups: no record layout
    assert quant_matmul_cpu.scale_kind([three_groups]) == "float32"
    with pytest.raises(ValueError, match="super-block records"):
        quant_matmul_cpu.pack(three_groups, scales="super-blocks")
    with pytest.raises(ValueError, match="scales must be one of"):  # a misspelt kind is no float32 silently
        quant_matmul_cpu.pack(fp16, scales="float16")


def test_bias_and_accumulate_add_onto_the_output():
    rows = _rows(TILE + 7, 64, 4, 32, True)
    tiles = quant_matmul_cpu.pack(rows)
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    bias = np.arange(TILE + 7, dtype=np.float32)
    out = np.full((3, TILE + 7), 2.0, np.float32)
    quant_matmul_cpu.quant_matmul(x, *tiles.arrays(), bias, out, True, 2)
    np.testing.assert_allclose(out, 2.0 + bias + _reference(x, rows), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("openblas", [True, False])
@pytest.mark.parametrize("bits,group,with_mins", LAYOUTS)
def test_prefill_products_dequantize_the_weight_a_block_of_rows_at_a_time(bits, group, with_mins, openblas,
                                                                          monkeypatch):
    """Many rows (prefill) against a weight dequantized 32 rows at a time into one reused scratch, its last
    block partial, with a bias, on either GEMM (cpu_gemm): the float64 product to float32 summation."""
    monkeypatch.setattr(quant_matmul_cpu, "PREFILL_BLOCK_BYTES", TILE * 64 * 4)
    monkeypatch.setattr(cpu_gemm, "OPENBLAS", openblas)
    rows = _rows(3 * TILE + 5, 64, bits, group, with_mins)
    rng = np.random.default_rng(2)
    x, bias = rng.standard_normal((40, 64)).astype(np.float32), rng.standard_normal(3 * TILE + 5).astype(np.float32)
    got = quant_matmul_cpu.prefill_linear(torch.from_numpy(x), quant_matmul_cpu.pack(rows), torch.from_numpy(bias))
    expected = bias + _reference(x, rows)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("bits,group,with_mins", [(4, 32, True), (6, 16, False), (8, 32, False)])
def test_linear_runs_the_float_kernel_up_to_its_rows_and_a_gemm_beyond(bits, group, with_mins):
    """A quantized Linear's steps of up to KERNEL_ROWS[bits] rows are the float kernel's products, bit for
    bit, and larger ones prefill_linear's; both the float64 product to float32 summation."""
    from engine.model.linear import Linear
    rows = _rows(3 * TILE + 5, 64, bits, group, with_mins)
    layer = Linear(64, 3 * TILE + 5, bias=False)
    layer.quant, layer.weight = quant_matmul_cpu.pack(rows), None
    limit = quant_matmul_cpu.KERNEL_ROWS[bits]
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((limit + 1, 64)).astype(np.float32))
    for m, path in ((limit, quant_matmul_cpu.linear), (limit + 1, quant_matmul_cpu.prefill_linear)):
        got = layer(x[:m]).detach()
        np.testing.assert_array_equal(got.numpy(), path(x[:m], layer.quant, None).numpy())
        expected = _reference(x[:m].numpy(), rows)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("bits,group,with_mins", LAYOUTS)
def test_dequantize_and_embedding_rows_are_exact(bits, group, with_mins):
    rows = _rows(2 * TILE + 3, 64, bits, group, with_mins)
    tiles = quant_matmul_cpu.pack(rows)
    weight = rows.dequantize()
    assert np.array_equal(quant_matmul_cpu.dequantize_rows(tiles, 0, torch.empty(weight.shape)).numpy(), weight)
    ids = torch.tensor([0, TILE // 2 - 1, TILE // 2, TILE + 1, 2 * TILE + 2])  # both nibbles, the last tile
    assert np.array_equal(quant_matmul_cpu.embedding_rows(tiles, ids).numpy(), weight[ids.numpy()])
    # whole tiles go by blocks of k's transposed in registers, the rest row by row: a start inside a tile, a run
    # from a tile's start that ends inside the last one
    for first, rows in ((5, 2 * TILE - 2), (TILE, TILE + 3)):
        got = quant_matmul_cpu.dequantize_rows(tiles, first, torch.empty(rows, weight.shape[1])).numpy()
        assert np.array_equal(got, weight[first:first + rows])


def test_four_bit_tiles_hold_half_a_byte_a_weight():
    tiles = quant_matmul_cpu.pack(_rows(TILE, 64, 4, 32, True))
    assert tiles.data.shape == (1, 64, TILE // 2)
    assert tiles.nbytes() == 64 * TILE // 2 + 2 * 2 * TILE * 4  # nibbles, then a scale and a min per group


def test_six_bit_tiles_hold_three_quarters_of_a_byte_a_weight():
    """Q6_K's integers as 6 bits, not widened to 8; its two-level scales as super-block records: 6.56 bits a
    weight, the file's own size."""
    rows = _two_level_rows(TILE, 512, 6, 16, False, 256)
    tiles = quant_matmul_cpu.pack(rows, scales="super-blocks")
    assert tiles.bits == 6 and tiles.data.shape == (1, 512, SIX_BIT)
    assert tiles.scales.shape == (1, 2, SUPER_HEAD + 16 * TILE) and tiles.mins.numel() == 0
    assert tiles.nbytes() * 8 / (TILE * 512) == 6.5625


@pytest.mark.parametrize("isa,rows", [("avx2", 2), ("avx512", 8), ("neon", 2)])
def test_row_group_keeps_each_rows_group_sums_in_registers(isa, rows):
    assert quant_matmul_cpu.row_group(isa) == rows
