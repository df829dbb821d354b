"""ggml's block formats, decoded into one shape the kernels run: integers with a scale (and min) per group.

Every format the engine runs natively is `w[n, k] = q[n, k] * scale[n, g] + min[n, g]` for g = k // group,
with q 4-bit (0..15), 6-bit (-32..31) or 8-bit (-128..127) and scale / min in float32:

| file format | bits | group | scale        | min             |
|-------------|------|-------|--------------|-----------------|
| Q8_0        | 8    | 32    | d            | none            |
| Q4_0        | 4    | 32    | d            | -8 d            |
| Q4_1        | 4    | 32    | d            | m               |
| Q4_K        | 4    | 32    | d * sc[j]    | -dmin * m[j]    |
| Q6_K        | 6    | 16    | d * sc[j]    | none (q - 32)   |

Each product of an fp16 and a 6- or 8-bit integer is exact in float32, so the decoded weight equals the
file's dequantized weight bit for bit (tests compare with the gguf library's own dequantizer). The K-quants
also keep their two levels (SuperBlocks: an fp16 per 256 weights, a small integer per group), which the kernels
can hold in a third of the bytes of float32 products. Formats outside this table are dequantized once at load
by the caller.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QType

QK_K = 256  # weights of a K-quant super-block
DEQUANTIZE_WEIGHTS = 1 << 20  # weights dequantized at a time: 16 MB of float64 temporaries


@dataclass(frozen=True)
class SuperBlocks:
    """Scales (and mins) in two levels, as the K-quants hold them: scales[n, g] = d[n, g // per_super] *
    sub_scales[n, g], mins likewise with dmin and sub_mins, per_super = size // group. Each product of an fp16
    and an int8 is exact in float32, so these are the float32 values, bit for bit."""
    size: int  # weights of a super-block: a multiple of the group
    d: np.ndarray  # [N, K // size] float32, each an fp16 value
    sub_scales: np.ndarray  # [N, K // group] int8
    dmin: np.ndarray | None  # [N, K // size] float32 (fp16 values), or None: no mins
    sub_mins: np.ndarray | None  # [N, K // group] int8


@dataclass(frozen=True)
class QuantRows:
    """A weight [N, K] as w[n, k] = q[n, k] * scales[n, k // group] (+ mins[n, k // group])."""
    q: np.ndarray  # [N, K]: uint8 0..15 (bits 4) or int8 (-32..31 for bits 6, bits 8)
    scales: np.ndarray  # [N, K // group] float32
    mins: np.ndarray | None  # [N, K // group] float32, or None: no offset
    group: int
    bits: int
    levels: SuperBlocks | None = None  # the K-quants' scales and mins as their file has them

    def super_blocks(self) -> SuperBlocks | None:
        """The scales and mins in two levels: the K-quants' own, or for fp16 scales (half_exact) one group per
        super-block with sub-scales of 1; None where neither holds."""
        if self.levels is not None:
            return self.levels
        if not self.half_exact:
            return None
        ones = np.ones(self.scales.shape, np.int8)
        return SuperBlocks(self.group, self.scales, ones, self.mins, None if self.mins is None else ones)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def half_exact(self) -> bool:
        """Whether every scale and min is an fp16 value: so for the Q8_0, Q4_0 and Q4_1 blocks of a file or of
        quantize-at-load (their d and m are fp16), not for the K-quants' products of an fp16 and a 6-bit scale."""
        return all(v is None or np.array_equal(v.astype(np.float16).astype(np.float32), v)
                   for v in (self.scales, self.mins))

    def dequantize(self) -> np.ndarray:
        """The weight [N, K] in float32 (float64 products rounded once: exact where the format is), a run of rows
        at a time: whole, the float64 temporaries took 4x the result's bytes (a large vocabulary's embedding)."""
        out = np.empty(self.shape, np.float32)
        step = max(1, DEQUANTIZE_WEIGHTS // self.shape[1])
        for start in range(0, self.shape[0], step):
            rows = slice(start, start + step)
            w = self.q[rows].astype(np.float64) * np.repeat(self.scales[rows].astype(np.float64), self.group, axis=1)
            if self.mins is not None:
                w += np.repeat(self.mins[rows].astype(np.float64), self.group, axis=1)
            out[rows] = w
        return out


def _fp16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from its two bytes (the last axis) as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-weight nibble run: byte j holds weight j (low) and weight j + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(blocks):
    return blocks[..., 2:].view(np.int8), _fp16(blocks[..., 0:2]), None, 32, 8, None


def _q4_0(blocks):
    d = _fp16(blocks[..., 0:2])
    return _nibbles(blocks[..., 2:]), d, -8 * d, 32, 4, None


def _q4_1(blocks):
    return _nibbles(blocks[..., 4:]), _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4]), 32, 4, None


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of eight 6-bit scales and eight 6-bit mins: bytes 0-3 hold scales 0-3 (low 6 bits) and
    the top 2 bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of scales 4-7
    (low nibble) and of mins 4-7 (high nibble)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k(blocks):
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    sc, m = _k_scale_min(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 1, 32)
    # each 32-byte run holds two sub-blocks: the low nibbles, then the high ones
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(*blocks.shape[:-1], QK_K)
    # the min's sign goes to its super-block factor: (-dmin) * m is -(dmin * m) exactly
    levels = (d, sc.astype(np.int8), -dmin, m.astype(np.int8))
    return q, d[..., None] * sc, -(dmin[..., None] * m), 32, 4, levels


def _q6_k(blocks):
    lead = blocks.shape[:-1]
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    d = _fp16(blocks[..., 208:210])
    # 4 low bits: 2 runs of 64 bytes, low then high nibbles; 2 high bits: 2 runs of 32 bytes, 4 shifts each
    low = (ql.reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
    high = (qh.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03
    q = (low.reshape(*lead, QK_K) | (high.reshape(*lead, QK_K) << 4)).astype(np.int8) - np.int8(32)
    return q, d[..., None] * sc, None, 16, 6, (d, sc.astype(np.int8), None, None)


# format -> (weights per block, bytes per block, decoder)
FORMATS = {
    QType.Q8_0: (32, 34, _q8_0),
    QType.Q4_0: (32, 18, _q4_0),
    QType.Q4_1: (32, 20, _q4_1),
    QType.Q4_K: (QK_K, 144, _q4_k),
    QType.Q6_K: (QK_K, 210, _q6_k),
}


def supported(qtype: QType) -> bool:
    return qtype in FORMATS


def decode(raw: np.ndarray, qtype: QType, k: int) -> QuantRows:
    """The [N, bytes per row] blocks of a GGUF tensor of row length k as QuantRows."""
    per_block, block_bytes, decoder = FORMATS[qtype]
    if k % per_block:
        raise ValueError(f"{qtype.name} rows of {k} weights are not whole blocks of {per_block}")
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // per_block, block_bytes)
    q, scales, mins, group, bits, levels = decoder(blocks)
    q = np.ascontiguousarray(q.reshape(n, k))
    scales = np.ascontiguousarray(scales.reshape(n, k // group), dtype=np.float32)
    if mins is not None:
        mins = np.ascontiguousarray(mins.reshape(n, k // group), dtype=np.float32)
    if levels is not None:
        d, sub_scales, dmin, sub_mins = (None if a is None else np.ascontiguousarray(a.reshape(n, -1))
                                         for a in levels)
        levels = SuperBlocks(per_block, d, sub_scales, dmin, sub_mins)
    return QuantRows(q, scales, mins, group, bits, levels)


def concat(parts: list[QuantRows]) -> QuantRows:
    """Rows of several weights of one K stacked (q, k and v into qkv): promoted to the widest bits and the
    finest group among them, which changes no weight (4-bit values fit 6 and 8 bits; a scale repeats per
    subgroup, a super-block's factor per smaller super-block)."""
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    if any(p.group % group for p in parts):
        raise ValueError(f"groups {[p.group for p in parts]} do not nest")
    with_mins = any(p.mins is not None for p in parts)
    qs = [p.q.astype(np.int8) if bits > 4 else p.q for p in parts]
    groups = [p.group for p in parts]
    scales = _stacked(parts, [p.scales for p in parts], groups, group, np.float32)
    mins = _stacked(parts, [p.mins for p in parts], groups, group, np.float32) if with_mins else None
    return QuantRows(np.concatenate(qs), scales, mins, group, bits, _concat_levels(parts, group, with_mins))


@dataclass(frozen=True)
class StackedRows:
    """A fused weight kept as two runs of rows, each in a layout of its own: where q and k are Q4_K and v is Q6_K
    (llama-quantize's Q4_K_M, in about half the layers), one layout would widen q and k to v's 6 bits and
    16-weight groups, 2.5 bits a weight more than their file holds, read at every decode step."""
    head: QuantRows
    tail: QuantRows

    @property
    def shape(self) -> tuple[int, int]:
        return self.head.shape[0] + self.tail.shape[0], self.head.shape[1]

    def dequantize(self) -> np.ndarray:
        return np.concatenate([self.head.dequantize(), self.tail.dequantize()])


def stack(parts: list[QuantRows]) -> QuantRows | StackedRows:
    """The parts' rows as one weight: concat() where they share bits and group, else the two runs (split between
    parts) that hold them in the fewest bytes, where those are fewer than one layout's."""
    if len({(p.bits, p.group) for p in parts}) == 1:
        return concat(parts)
    cost, at = min((_layout_bits(parts[:i]) + _layout_bits(parts[i:]), i) for i in range(1, len(parts)))
    if cost >= _layout_bits(parts):
        return concat(parts)
    return StackedRows(concat(parts[:at]), concat(parts[at:]))


def _layout_bits(parts: list[QuantRows]) -> int:
    """About the bits concat(parts) takes: its integers and an 8-bit sub-scale (and sub-min) a group."""
    bits, group = max(p.bits for p in parts), min(p.group for p in parts)
    per_group = 8 * (1 + any(p.mins is not None for p in parts))
    return sum(p.shape[0] for p in parts) * parts[0].shape[1] * (bits * group + per_group) // group


def _stacked(parts: list[QuantRows], values: list[np.ndarray | None], widths: list[int], width: int,
             dtype) -> np.ndarray:
    """The parts' values stacked by rows, each part's one per `widths[i]` weights repeated to one per `width`
    (zeros for a part without them)."""
    return np.concatenate([np.repeat(v, w // width, axis=1) if v is not None else
                           np.zeros((p.shape[0], p.shape[1] // width), dtype)
                           for p, v, w in zip(parts, values, widths)])


def _concat_levels(parts: list[QuantRows], group: int, with_mins: bool) -> SuperBlocks | None:
    """The parts' super-blocks stacked at the smallest size among them (a larger one's factor repeated), or None
    where a part has none or the sizes do not nest."""
    levels = [p.super_blocks() for p in parts]
    if any(level is None for level in levels):
        return None
    size = min(level.size for level in levels)
    if any(level.size % size for level in levels) or size % group:
        return None

    sizes, groups = [level.size for level in levels], [p.group for p in parts]
    d = _stacked(parts, [level.d for level in levels], sizes, size, np.float32)
    sub_scales = _stacked(parts, [level.sub_scales for level in levels], groups, group, np.int8)
    if not with_mins:
        return SuperBlocks(size, d, sub_scales, None, None)
    return SuperBlocks(size, d, sub_scales, _stacked(parts, [level.dmin for level in levels], sizes, size, np.float32),
                       _stacked(parts, [level.sub_mins for level in levels], groups, group, np.int8))


def take_rows(rows: QuantRows, order: np.ndarray) -> QuantRows:
    """The rows in `order` (a row permutation: llama.cpp's q/k head layout undone)."""
    pick = lambda a: None if a is None else a[order]  # noqa: E731
    levels = rows.levels and SuperBlocks(rows.levels.size, *map(pick, (rows.levels.d, rows.levels.sub_scales,
                                                                       rows.levels.dmin, rows.levels.sub_mins)))
    return QuantRows(rows.q[order], rows.scales[order], pick(rows.mins), rows.group, rows.bits, levels)


def quantize(weight: np.ndarray, qtype: QType) -> QuantRows:
    """A float weight [N, K] quantized to a ggml format by the gguf library's reference quantizer (as
    llama.cpp's), then decoded: `--quantization` for float checkpoints (HF, or a GGUF file of float tensors)."""
    from gguf.quants import quantize as ggml_quantize
    return decode(ggml_quantize(np.ascontiguousarray(weight, dtype=np.float32), qtype), qtype, weight.shape[1])


def block_size(qtype: QType) -> int:
    """Weights per block of a format: a row's length is a whole number of them."""
    return FORMATS[qtype][0]
