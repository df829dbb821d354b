"""Paged decode attention for CUDA in Triton: each query reads its K/V where they sit in the block pool.

The CPU kernel's design (paged_decode_cpu.py) with block tables instead of slot lists, so its inputs
have fixed shapes and a whole decode step can be captured as a CUDA graph (decode_graph_cuda.py):
`block_tables` [rows, max blocks] and `context_lens` [rows] are device tensors the graph reads at
replay. The context is cut into partitions (64 tokens for contexts up to 8,192) that run as separate
programs (flash-decoding): at batch 1 one program per kv head would walk the whole context alone.
Each program scores one kv head's group of query heads (padded to the 16 rows a dot needs) against
its partition with an online softmax (tensor-core dots where q and K/V are both 16-bit, IEEE float32
dots otherwise) and writes a partial output and its log-sum-exp; a second kernel merges a row's
partials. Programs past a row's context exit at once, so one grid serves every context length.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# tokens of one program: short partitions shorten each program's serial chain of tiles, which is what a decode
# at batch 1 waits for; they grow past MIN_PARTITION only to keep a row's partials within MAX_PARTS
MIN_PARTITION = 64
MAX_PARTS = 128
TILE = 32  # keys scored at once
MERGE_PARTS = 16  # partitions the merge reads at once


def supports(head_dim: int) -> bool:
    """Triton's block shapes are powers of two: the head size must be one (64 and 128 are)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


@triton.jit
def tile_scores(q, keys, HALF_DOTS: tl.constexpr):
    """q @ keys.T for a tile of keys, float32 sums. (One return after the branch: Triton's compiler, unlike its
    interpreter, goes on past a `return` inside a constexpr `if` and compiles the other branch too.)"""
    if HALF_DOTS:  # tensor cores on 16-bit operands, float32 sums (as FlashAttention)
        scores = tl.dot(q, tl.trans(keys))
    else:  # Triton's float32 default is TF32
        scores = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="ieee")
    return scores


@triton.jit
def online_softmax_start(ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(acc, total, best) before the first key tile: nothing summed, the running maximum -inf."""
    return (tl.zeros([ROWS, HEAD_DIM], tl.float32), tl.zeros([ROWS], tl.float32),
            tl.full([ROWS], float("-inf"), tl.float32))


@triton.jit
def online_softmax(scores, values, acc, total, best, HALF_DOTS: tl.constexpr, BASE2: tl.constexpr):
    """One key tile of FlashAttention's online softmax: the running maximum `best` rises to the tile's, the sums
    so far (`acc` of weighted values, `total` of weights) are rescaled to it, and the tile's are added. BASE2:
    the scores are in log2 units (exp2, as a scale folded with log2(e) gives). Returns (acc, total, best)."""
    new_best = tl.maximum(best, tl.max(scores, axis=1))
    # a row that has seen no key yet (all -inf so far: a split of the keys past its position) keeps zero weights,
    # not exp(-inf - -inf) = NaN; every other row subtracts its maximum, as before
    shift = tl.where(new_best == float("-inf"), 0.0, new_best)
    if BASE2:
        weights = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(best - shift)
    else:
        weights = tl.exp(scores - shift[:, None])
        rescale = tl.exp(best - shift)
    if HALF_DOTS:  # the weights rounded to the values' dtype for the dot, as FlashAttention does
        acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values)
    else:
        acc = acc * rescale[:, None] + tl.dot(weights, values.to(tl.float32), input_precision="ieee")
    return acc, total * rescale + tl.sum(weights, axis=1), new_best


@triton.jit
def _partition_kernel(q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, part_out_ptr, part_lse_ptr,
                      scale, stride_q_row, stride_q_head, stride_kv_slot, stride_kv_head, stride_bt_row,
                      max_parts, num_heads,
                      BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      HEAD_DIM: tl.constexpr, PARTITION: tl.constexpr, TILE: tl.constexpr,
                      HALF_DOTS: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context = tl.load(context_lens_ptr + row)
    start = part * PARTITION
    if start < context:
        group = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + group
        in_group = group < GROUP
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + dims[None, :],
                    mask=in_group[:, None], other=0.0)
        if not HALF_DOTS:
            q = q.to(tl.float32)
        acc, total, best = online_softmax_start(GROUP_PAD, HEAD_DIM)
        end = tl.minimum(start + PARTITION, context)
        for first in range(start, end, TILE):
            positions = first + tl.arange(0, TILE)
            valid = positions < end
            blocks = tl.load(block_tables_ptr + row * stride_bt_row + positions // BLOCK_SIZE, mask=valid, other=0)
            slots = blocks.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
            kv_offsets = slots[:, None] * stride_kv_slot + kv_head * stride_kv_head + dims[None, :]
            keys = tl.load(k_ptr + kv_offsets, mask=valid[:, None], other=0.0)
            scores = tl.where(valid[None, :], tile_scores(q, keys, HALF_DOTS) * scale, float("-inf"))
            values = tl.load(v_ptr + kv_offsets, mask=valid[:, None], other=0.0)
            acc, total, best = online_softmax(scores, values, acc, total, best, HALF_DOTS, False)
        # partials: [rows, heads, max_parts, HEAD_DIM] and [rows, heads, max_parts]
        part_index = (row * num_heads + heads) * max_parts + part
        tl.store(part_out_ptr + part_index[:, None] * HEAD_DIM + dims[None, :], acc / total[:, None],
                 mask=in_group[:, None])
        tl.store(part_lse_ptr + part_index, best + tl.log(total), mask=in_group)


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, context_lens_ptr, out_ptr, stride_out_row, stride_out_head,
                  max_parts, num_heads, HEAD_DIM: tl.constexpr, PARTITION: tl.constexpr, PARTS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    num_parts = tl.cdiv(tl.load(context_lens_ptr + row), PARTITION)
    base = (row * num_heads + head) * max_parts
    parts = tl.arange(0, PARTS)
    dims = tl.arange(0, HEAD_DIM)
    best = tl.full([PARTS], float("-inf"), tl.float32)
    for first in range(0, num_parts, PARTS):
        lse = tl.load(part_lse_ptr + base + first + parts, mask=first + parts < num_parts, other=float("-inf"))
        best = tl.maximum(best, lse)
    top = tl.max(best, axis=0)
    total = tl.zeros([PARTS], tl.float32)
    acc = tl.zeros([PARTS, HEAD_DIM], tl.float32)
    for first in range(0, num_parts, PARTS):
        present = first + parts < num_parts
        weights = tl.exp(tl.load(part_lse_ptr + base + first + parts, mask=present, other=float("-inf")) - top)
        outs = tl.load(part_out_ptr + (base + first + parts)[:, None] * HEAD_DIM + dims[None, :],
                       mask=present[:, None], other=0.0)
        acc += weights[:, None] * outs
        total += weights
    norm = tl.sum(total, axis=0)
    # a row with no context (never sent by the runner) gets zeros rather than NaN
    merged = tl.where(norm > 0, tl.sum(acc, axis=0) / tl.maximum(norm, 1e-30), 0.0)
    tl.store(out_ptr + row * stride_out_row + head * stride_out_head + dims, merged.to(out_ptr.dtype.element_ty))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """q: [B, H, D]; caches: [num_slots, KVH, D] (the slots of the block pool, any float dtype);
    block_tables: [B, max_blocks] int32; context_lens: [B] int32 (each row's tokens, its newest included).
    Returns [B, H, D] in q's dtype. No host sync: safe inside a CUDA graph capture."""
    rows, num_heads, dim = q.shape
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride() == k_cache.stride()
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    max_context = block_tables.shape[1] * block_size
    partition = max(MIN_PARTITION, triton.next_power_of_2(triton.cdiv(max_context, MAX_PARTS)))
    max_parts = triton.cdiv(max_context, partition)
    part_out = torch.empty(rows, num_heads, max_parts, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(rows, num_heads, max_parts, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    # (on CPU tensors the kernel runs in Triton's interpreter, the tests' way, whose 16-bit dots are wrong)
    half_dots = q.is_cuda and q.dtype == k_cache.dtype and q.element_size() == 2
    _partition_kernel[(rows, kv_heads, max_parts)](
        q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), max_parts, num_heads,
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim,
        PARTITION=partition, TILE=TILE, HALF_DOTS=half_dots)
    _merge_kernel[(rows, num_heads)](part_out, part_lse, context_lens, out, out.stride(0), out.stride(1), max_parts,
                                     num_heads, HEAD_DIM=dim, PARTITION=partition, PARTS=MERGE_PARTS)
    return out
