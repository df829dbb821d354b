"""Paged attention for CUDA steps with a prefill chunk, in Triton: every row of the step in one launch, K/V read
where they sit in the block pool through each row's block table (no gather copy, no score matrix in memory).

FlashAttention-2's tiling over a varlen batch (the design of vLLM's triton_unified_attention): a row is one
request's queries in the step, a prefill chunk or a decode's one token, its queries contiguous in the flat
batch; the chunk's first query sits at context position context_len - queries, mid-block after a cache hit.
A program takes one tile of a row's queries for one kv head, every query head of that kv head's group stacked
as the rows of its dots (GQA: each K/V tile is loaded once for the group), and walks the row's key tiles
through the block table up to the tile's last query, causal within the chunk, with an online softmax in
float32. The programs are numbered over all rows' tiles from the row offsets alone, so the launch needs no
host sync: a program finds its row by binary search and exits if it falls past its row's queries. The key tiles
that every query of a program sees whole are walked without a mask, then the diagonal ones with the causal mask
(FlashAttention-2's split); the programs run last tile first, so the longest walks do not start last.

A step too small to fill the GPU with such programs (a cached prompt's last block: 16 queries over 4,096 keys are
8 programs for 1B shapes) splits each walk's keys over more programs (flash-decoding's split, as the decode
kernel's partitions): each writes its partial output and log-sum-exp, and a second kernel merges a query's
splits. The split count comes from the block tables' width, a bound known without a sync, so the launch shapes
stay fixed for CUDA graphs; splits past a query's position hold nothing and weigh nothing in the merge.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.model.paged_decode_cuda import online_softmax, online_softmax_start, tile_scores
from engine.model.paged_decode_cuda import supports  # noqa: F401 (the same head sizes: the runner asks each kernel)

LOG2E = 1.4426950408889634  # scores are scaled by log2(e) once so that the softmax runs on exp2
MIN_SPLIT_TILES = 4  # key tiles of one program where a small step's keys are split (split_keys)
MAX_SPLITS = 32


def tile_shapes(device: torch.device, group: int) -> tuple[int, int, int, int]:
    """(rows of a program's dots, keys scored at once, warps, pipeline stages). A GPU wants large tiles for its
    tensor cores; Triton's interpreter (CPU tensors, the tests) gets small ones, so tiny test contexts cross several
    query and key tiles. On an H200, 64 x 64 tiles with two stages took 0.235 ms for a 1B layer's 4,096-token
    attention, three stages (Triton's default) 0.264 ms, and larger tiles 0.25-0.30 ms (bench.prefill
    --kernel-sweep, docs/results/cuda-h200-2026-11-28b.md)."""
    rows, keys, warps, stages = (64, 64, 4, 2) if device.type == "cuda" else (16, 16, 4, 3)
    return max(rows, triton.next_power_of_2(group)), keys, warps, stages


@triton.jit
def _find_row(query_starts_ptr, tile, num_rows, TILE_Q: tl.constexpr):
    """The row whose tiles hold global tile `tile`: row r's tiles are numbered from query_starts[r] // TILE_Q + r,
    enough for its cdiv(queries, TILE_Q) tiles whatever its start's alignment."""
    low: tl.int32 = 0  # (typed: a loop-carried variable keeps one type, whatever num_rows specialises to)
    high: tl.int32 = num_rows
    while low < high:  # the last row whose first tile number is <= tile
        mid = (low + high) // 2
        if tl.load(query_starts_ptr + mid) // TILE_Q + mid <= tile:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, query_starts_ptr, context_lens_ptr,
                    part_out_ptr, part_lse_ptr, qk_scale, num_rows, num_heads, stride_q_token, stride_q_head,
                    stride_out_token, stride_out_head, stride_kv_slot, stride_kv_head, stride_bt_row,
                    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    TILE_M: tl.constexpr, TILE_Q: tl.constexpr, TILE_N: tl.constexpr, HALF_DOTS: tl.constexpr,
                    SPLIT_KEYS: tl.constexpr):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the last tiles, the longest walks, start first
    kv_head = tl.program_id(1)
    split = tl.program_id(2)  # SPLIT_KEYS > 0: this program's keys are [split * SPLIT_KEYS, + SPLIT_KEYS)
    row = _find_row(query_starts_ptr, tile, num_rows, TILE_Q)
    first_query = tl.load(query_starts_ptr + row)
    num_queries = tl.load(query_starts_ptr + row + 1) - first_query
    tile_start = (tile - (first_query // TILE_Q + row)) * TILE_Q  # within the row's queries
    if tile_start < num_queries:
        context = tl.load(context_lens_ptr + row)
        m = tl.arange(0, TILE_M)
        query = tile_start + m // GROUP  # the dot's row m: query m // GROUP of the tile, head m % GROUP of the group
        head = kv_head * GROUP + m % GROUP
        live = (m // GROUP < TILE_Q) & (query < num_queries)  # TILE_M may hold more rows than TILE_Q * GROUP
        position = context - num_queries + query  # the query's place in its context: it sees keys <= position
        dims = tl.arange(0, HEAD_DIM)
        tokens = (first_query + query).to(tl.int64)
        q = tl.load(q_ptr + tokens[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                    mask=live[:, None], other=0.0)
        if not HALF_DOTS:
            q = q.to(tl.float32)
        acc, total, best = online_softmax_start(TILE_M, HEAD_DIM)
        table = block_tables_ptr + row.to(tl.int64) * stride_bt_row
        # key tiles every query of the tile sees whole (up to its first query's position): no mask to apply
        first_position = context - num_queries + tile_start
        full_end = (first_position + 1) // TILE_N * TILE_N
        end = context - num_queries + tl.minimum(tile_start + TILE_Q, num_queries)  # past the tile's last query
        low, high = 0, end
        if SPLIT_KEYS > 0:
            low = split * SPLIT_KEYS
            high = tl.minimum(low + SPLIT_KEYS, end)
        for key_start in range(low, tl.minimum(full_end, high), TILE_N):
            keys_at = key_start + tl.arange(0, TILE_N)
            blocks = tl.load(table + keys_at // BLOCK_SIZE)
            slots = blocks.to(tl.int64) * BLOCK_SIZE + keys_at % BLOCK_SIZE
            kv_offsets = slots[:, None] * stride_kv_slot + kv_head * stride_kv_head + dims[None, :]
            scores = tile_scores(q, tl.load(k_ptr + kv_offsets), HALF_DOTS) * qk_scale
            acc, total, best = online_softmax(scores, tl.load(v_ptr + kv_offsets), acc, total, best, HALF_DOTS,
                                              True)
        # then the diagonal: keys up to the tile's last query, causal; key 0 is seen by every row, so no row's
        # maximum stays -inf (unless the keys are split: a split past a row's position leaves it empty)
        for key_start in range(tl.maximum(full_end, low), high, TILE_N):
            keys_at = key_start + tl.arange(0, TILE_N)
            in_context = keys_at < end
            blocks = tl.load(table + keys_at // BLOCK_SIZE, mask=in_context, other=0)
            slots = blocks.to(tl.int64) * BLOCK_SIZE + keys_at % BLOCK_SIZE
            kv_offsets = slots[:, None] * stride_kv_slot + kv_head * stride_kv_head + dims[None, :]
            keys = tl.load(k_ptr + kv_offsets, mask=in_context[:, None], other=0.0)
            seen = in_context[None, :] & (keys_at[None, :] <= position[:, None])
            scores = tl.where(seen, tile_scores(q, keys, HALF_DOTS) * qk_scale, float("-inf"))
            values = tl.load(v_ptr + kv_offsets, mask=in_context[:, None], other=0.0)
            acc, total, best = online_softmax(scores, values, acc, total, best, HALF_DOTS, True)
        if SPLIT_KEYS > 0:  # every split writes its partial, an empty one too (weight 0): _merge_kernel sums them
            seen = total > 0
            total = tl.where(seen, total, 1.0)  # (an empty row: acc is 0)
            part = (tokens * num_heads + head) * tl.num_programs(2) + split
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc / total[:, None],
                     mask=live[:, None])
            tl.store(part_lse_ptr + part, tl.where(seen, best + tl.log2(total), float("-inf")), mask=live)
        else:
            out = acc / total[:, None]
            tl.store(out_ptr + tokens[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_out_token, stride_out_head,
                  HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    """One query head of one token: its splits' partial outputs weighted by their sums (log2 units)."""
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    present = splits < num_splits
    base = (token * tl.num_programs(1) + head) * num_splits
    lse = tl.load(part_lse_ptr + base + splits, mask=present, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 holds key 0, which every query sees: a finite max
    dims = tl.arange(0, HEAD_DIM)
    outs = tl.load(part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :], mask=present[:, None],
                   other=0.0)
    merged = tl.sum(weights[:, None] * outs, axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims, merged.to(out_ptr.dtype.element_ty))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Programs a launch runs at once, roughly: the GPU's multiprocessors; a small number for Triton's
    interpreter (CPU tensors, the tests), so that tiny test steps split their keys as a GPU's small steps do."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def split_keys(programs: int, max_context: int, tile_n: int, device: torch.device) -> int:
    """Keys a program walks when a step's working programs (at most: query tiles x kv heads) are too few to fill
    the GPU, 0 when they are not: a cached prompt's last block over 4,096 tokens is 8 programs for 1B shapes,
    each walking the whole context alone (flash-decoding's split, as the decode kernel's partitions). At least
    MIN_SPLIT_TILES key tiles a program, at most MAX_SPLITS splits of the longest context a block table holds."""
    if programs >= _multiprocessors(device):
        return 0
    keys = max(MIN_SPLIT_TILES * tile_n, triton.next_power_of_2(triton.cdiv(max_context, MAX_SPLITS)))
    return keys if keys < max_context else 0


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_starts: torch.Tensor, context_lens: torch.Tensor, scale: float,
                  block_size: int, tiles: tuple[int, int, int, int] | None = None,
                  keys_per_split: int | None = None) -> torch.Tensor:
    """q: [T, H, D], the flat batch; caches: [num_slots, KVH, D] (the slots of the block pool, any float dtype);
    block_tables: [R, max_blocks] int32; query_starts: [R + 1] int32, row r's queries are
    q[query_starts[r]:query_starts[r + 1]]; context_lens: [R] int32, row r's tokens up to its last query.
    Returns [T, H, D] in q's dtype. No host sync. tiles: (query rows of a program's dots, keys at once, warps,
    pipeline stages) instead of tile_shapes' (bench.prefill --kernel-sweep tries several); keys_per_split: a
    multiple of the key tile (0: no split) instead of split_keys'."""
    tokens, num_heads, dim = q.shape
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride() == k_cache.stride()
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    tile_m, tile_n, warps, stages = tile_shapes(q.device, group) if tiles is None else tiles
    tile_q = tile_m // group
    rows = context_lens.shape[0]
    # every row's tiles fit in tokens // tile_q + rows numbers (see _find_row); the surplus programs exit at once
    num_tiles = tokens // tile_q + rows
    max_context = block_tables.shape[1] * block_size  # (a bound known without a sync: the tables' width)
    if keys_per_split is None:  # (a tile that works holds a query: at most `tokens` of the numbers do, whatever
        # the rows; a prefill graph's bucket of 16 tokens has 17 rows at the default max_num_seqs)
        keys_per_split = split_keys(min(num_tiles, tokens) * kv_heads, max_context, tile_n, q.device)
    assert keys_per_split % tile_n == 0
    splits = triton.cdiv(max_context, keys_per_split) if keys_per_split else 1
    out = torch.empty_like(q)
    part_out = part_lse = out  # (unused without splits)
    if keys_per_split:
        part_out = torch.empty(tokens, num_heads, splits, dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(tokens, num_heads, splits, dtype=torch.float32, device=q.device)
    # (on CPU tensors the kernel runs in Triton's interpreter, the tests' way, whose 16-bit dots are wrong)
    half_dots = q.is_cuda and q.dtype == k_cache.dtype and q.element_size() == 2
    _prefill_kernel[(num_tiles, kv_heads, splits)](
        q, k_cache, v_cache, out, block_tables, query_starts, context_lens, part_out, part_lse, scale * LOG2E,
        rows, num_heads, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), block_tables.stride(0), BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=dim, TILE_M=tile_m,
        TILE_Q=tile_q, TILE_N=tile_n, HALF_DOTS=half_dots, SPLIT_KEYS=keys_per_split, num_warps=warps,
        num_stages=stages)
    if keys_per_split:
        _merge_kernel[(tokens, num_heads)](part_out, part_lse, out, splits, out.stride(0), out.stride(1),
                                           HEAD_DIM=dim, SPLITS=triton.next_power_of_2(splits))
    return out
