"""ggml block formats decoded to integers and per-group scales: bit-exact against the gguf library's own
dequantizer, for the formats the kernels run natively."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize

from engine.model import quant_formats
from engine.model.quant_formats import QuantRows

ROWS, K = 24, 512


def _random_blocks(qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """Valid raw blocks of a K-quant (no quantizer in the gguf library): random bytes with sane fp16 scales."""
    per_block, block_bytes, _ = quant_formats.FORMATS[qtype]
    blocks = rng.integers(0, 256, (ROWS, K // per_block, block_bytes), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, (ROWS, K // per_block, 2)).astype(np.float16)
    # d (and Q4_K's dmin) are fp16 at the block's start; Q6_K's d is its last two bytes
    if qtype == QType.Q6_K:
        blocks[..., -2:] = scales[..., :1].view(np.uint8)
    else:
        blocks[..., 0:4] = scales.view(np.uint8).reshape(ROWS, K // per_block, 4)
    return blocks.reshape(ROWS, -1)


def _file_blocks(qtype: QType) -> np.ndarray:
    rng = np.random.default_rng(int(qtype))
    if qtype in (QType.Q4_K, QType.Q6_K):
        return _random_blocks(qtype, rng)
    weight = rng.standard_normal((ROWS, K)).astype(np.float32)
    weight[3, 40] = 25.0  # an outlier: its block's scale is far from the others'
    return quantize(weight, qtype)


@pytest.mark.parametrize("qtype", list(quant_formats.FORMATS))
def test_decoded_weight_equals_the_gguf_librarys_dequantization(qtype):
    raw = _file_blocks(qtype)
    rows = quant_formats.decode(raw, qtype, K)
    assert rows.shape == (ROWS, K)
    assert np.array_equal(rows.dequantize(), dequantize(raw, qtype).reshape(ROWS, K))


@pytest.mark.parametrize("qtype,bits,group,with_mins", [
    (QType.Q8_0, 8, 32, False), (QType.Q4_0, 4, 32, True), (QType.Q4_1, 4, 32, True),
    (QType.Q4_K, 4, 32, True), (QType.Q6_K, 6, 16, False)])
def test_each_format_decodes_to_its_bits_group_and_offset(qtype, bits, group, with_mins):
    rows = quant_formats.decode(_file_blocks(qtype), qtype, K)
    assert (rows.bits, rows.group, rows.mins is not None) == (bits, group, with_mins)
    assert rows.q.dtype == (np.uint8 if bits == 4 else np.int8)
    if bits < 8:
        assert rows.q.min() >= -(1 << (bits - 1)) * (bits == 6) and rows.q.max() < 1 << (4 if bits == 4 else 5)
    assert rows.scales.shape == (ROWS, K // group)


def test_a_row_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="not whole blocks of 256"):
        quant_formats.decode(np.zeros((2, 144), np.uint8), QType.Q4_K, 200)


def _two_levels_equal_the_scales(rows: QuantRows) -> bool:
    levels = rows.super_blocks()
    per = levels.size // rows.group
    exact = lambda d, sub: np.repeat(d, per, axis=1) * sub.astype(np.float32)  # noqa: E731
    return (np.array_equal(exact(levels.d, levels.sub_scales), rows.scales)
            and (rows.mins is None or np.array_equal(exact(levels.dmin, levels.sub_mins), rows.mins)))


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K])
def test_the_k_quants_keep_their_two_levels_and_they_are_the_scales_exactly(qtype):
    rows = quant_formats.decode(_file_blocks(qtype), qtype, K)
    assert rows.levels.size == 256 and rows.levels.sub_scales.dtype == np.int8
    assert (rows.levels.dmin is None) == (rows.mins is None)
    assert _two_levels_equal_the_scales(rows)


def test_stacking_formats_promotes_without_changing_a_weight():
    """q and k in Q4_K, v in Q6_K (as Q4_K_M files mix them): one 6-bit, 16-group weight, its two levels kept."""
    parts = [quant_formats.decode(_file_blocks(q), q, K) for q in (QType.Q4_K, QType.Q4_K, QType.Q6_K)]
    stacked = quant_formats.concat(parts)
    assert (stacked.bits, stacked.group, stacked.q.dtype, stacked.levels.size) == (6, 16, np.int8, 256)
    assert np.array_equal(stacked.dequantize(), np.concatenate([p.dequantize() for p in parts]))
    assert _two_levels_equal_the_scales(stacked)


def test_stacking_a_simple_block_with_a_k_quant_takes_the_smaller_super_block():
    """Q8_0's fp16 scale is a super-block of one group with a sub-scale of 1; Q4_K's factor repeats per 32."""
    parts = [quant_formats.decode(_file_blocks(q), q, K) for q in (QType.Q4_K, QType.Q8_0)]
    stacked = quant_formats.concat(parts)
    assert (stacked.bits, stacked.group, stacked.levels.size) == (8, 32, 32)
    assert _two_levels_equal_the_scales(stacked)
    float_scales = QuantRows(parts[0].q, parts[0].scales, parts[0].mins, 32, 4)  # levels dropped
    assert float_scales.super_blocks() is None and quant_formats.concat([float_scales, parts[1]]).levels is None


@pytest.mark.parametrize("formats, runs", [
    ((QType.Q4_K, QType.Q4_K, QType.Q6_K), (2, 1)),  # Q4_K_M's q, k and v: v's 6 bits in tiles of their own
    ((QType.Q6_K, QType.Q4_K, QType.Q4_K), (1, 2)),
    ((QType.Q4_0, QType.Q4_1, QType.Q8_0), (2, 1)),  # 4-bit q and k (one layout: Q4_0's min is -8 d), 8-bit v
    ((QType.Q4_K, QType.Q4_K, QType.Q4_K), None),  # one format: one layout
    ((QType.Q4_0, QType.Q4_1), None),
])
def test_stack_keeps_the_parts_of_other_bits_apart_where_that_holds_them_in_fewer_bytes(formats, runs):
    parts = [quant_formats.decode(_file_blocks(q), q, K) for q in formats]
    stacked = quant_formats.stack(parts)
    whole = np.concatenate([p.dequantize() for p in parts])
    assert np.array_equal(stacked.dequantize(), whole) and stacked.shape == whole.shape
    if runs is None:
        assert isinstance(stacked, QuantRows)
        return
    assert isinstance(stacked, quant_formats.StackedRows)
    assert (stacked.head.shape[0], stacked.tail.shape[0]) == (runs[0] * ROWS, runs[1] * ROWS)
    assert {stacked.head.bits, stacked.tail.bits} == {p.bits for p in parts}
    one_layout = quant_formats.concat(parts)  # every part at the widest bits
    assert sum(r.bits * r.shape[0] for r in (stacked.head, stacked.tail)) < one_layout.bits * whole.shape[0]


def test_take_rows_reorders_every_part():
    rows = quant_formats.decode(_file_blocks(QType.Q4_1), QType.Q4_1, K)
    order = np.arange(ROWS)[::-1].copy()
    assert np.array_equal(quant_formats.take_rows(rows, order).dequantize(), rows.dequantize()[order])
    k_rows = quant_formats.decode(_file_blocks(QType.Q4_K), QType.Q4_K, K)
    taken = quant_formats.take_rows(k_rows, order)
    assert np.array_equal(taken.dequantize(), k_rows.dequantize()[order]) and _two_levels_equal_the_scales(taken)


def test_quantize_at_load_is_the_reference_quantizer_then_decode():
    weight = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    rows = quant_formats.quantize(weight, QType.Q8_0)
    assert isinstance(rows, QuantRows)
    assert np.array_equal(rows.dequantize(), dequantize(quantize(weight, QType.Q8_0), QType.Q8_0).reshape(8, 64))
    assert np.abs(rows.dequantize() - weight).max() < np.abs(weight).max() / 100


@pytest.mark.parametrize("qtype,fp16", [(QType.Q8_0, True), (QType.Q4_0, True), (QType.Q4_1, True),
                                        (QType.Q4_K, False), (QType.Q6_K, False)])
def test_the_simple_blocks_scales_and_mins_are_fp16_values_and_the_k_quants_are_not(qtype, fp16):
    """A file's Q8_0 / Q4_0 / Q4_1 keep d (and m) in fp16, and Q4_0's min -8 d is one too: the kernels can hold
    them as fp16 bits. A K-quant's scale is an fp16 times a 6-bit integer: float32."""
    assert quant_formats.decode(_file_blocks(qtype), qtype, K).half_exact == fp16
