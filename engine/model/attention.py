"""Paged attention over a flat batch: new K/V go to their slots, queries read K/V through block tables."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSeq:
    """One prefill chunk: queries [q_start, q_start + q_len) of the flat batch."""

    q_start: int
    q_len: int
    context_slots: torch.Tensor  # [ctx_len] slots of every token up to the chunk's end
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None for a chunk starting at position 0 (plain causal)


@dataclass(slots=True)
class SharedPrefix:
    """Leading blocks that several decodes of the step share (the same physical blocks)."""

    rows: torch.Tensor  # [G] rows of the decode batch whose block tables start with these blocks
    slots: torch.Tensor  # [S] slots of the shared blocks


@dataclass(slots=True)
class DecodeBatch:
    """Every one-token query of the step, attended in one batched call.

    Decodes whose block tables start with the same blocks (a shared system prompt) read those
    blocks once per group (cascade attention); each query then reads its own rest. A decode that
    shares nothing is in no group and reads its whole context as its rest.
    """

    token_idx: torch.Tensor  # [B] positions in the flat batch
    slots: torch.Tensor  # [B, max_rest] slots after each row's shared part (padded with slot 0)
    lengths: torch.Tensor  # [B] each row's number of slots in `slots` (at least its newest token)
    bias: torch.Tensor | None  # [B, 1, 1, max_rest] added to the scores: -inf on padding; None when no row is
    # padded or the paged CPU kernel reads `lengths` instead
    shared: list[SharedPrefix]
    paged_kernel: bool = False  # attended by the compiled paged CPU kernel (paged_decode_cpu.py), else by torch


@dataclass(slots=True)
class BlockTableDecode:
    """Every row of a decode-only step, read through block tables by a kernel (paged_decode_cuda.py): fixed
    shapes and no per-step gather, so a CUDA graph can replay the step (decode_graph_cuda.py). Each row
    reads its whole context; a shared prefix is read once per row, from the GPU's L2 after the first."""

    block_tables: torch.Tensor  # [B, max_blocks] int32 block ids, row by row (unused tail: anything)
    context_lens: torch.Tensor  # [B] int32, each row's tokens including its newest
    block_size: int


@dataclass(slots=True)
class BlockTableBatch:
    """Every row of a step with a prefill chunk (its chunks and decodes alike), read through block tables by one
    kernel launch (paged_prefill_cuda.py): no gather of the context, no score matrix. Rows are contiguous in the
    flat batch and in its order; a row's chunk ends its context, so it starts at context_len - its queries."""

    block_tables: torch.Tensor  # [R, max_blocks] int32 block ids, row by row (unused tail: 0)
    query_starts: torch.Tensor  # [R + 1] int32: row r's queries are [query_starts[r], query_starts[r + 1])
    context_lens: torch.Tensor  # [R] int32, each row's tokens up to its chunk's end
    block_size: int

    @classmethod
    def build(cls, rows: list[tuple[int, list[int], int]], block_size: int,
              device: torch.device) -> BlockTableBatch:
        """rows: (queries, block ids, context end) of every chunk, in batch order."""
        needed = [-(-end // block_size) for _, _, end in rows]
        tables = torch.zeros(len(rows), max(needed), dtype=torch.int32)
        for row, ((_, block_ids, _), n) in enumerate(zip(rows, needed)):
            tables[row, :n] = torch.tensor(block_ids[:n], dtype=torch.int32)
        starts = torch.tensor([0] + [queries for queries, _, _ in rows]).cumsum(0).to(torch.int32)
        ends = torch.tensor([end for _, _, end in rows], dtype=torch.int32)
        return cls(tables.to(device), starts.to(device), ends.to(device), block_size)


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] slot of each new token
    prefills: list[PrefillSeq]
    decodes: DecodeBatch | BlockTableDecode | None
    block_table_batch: BlockTableBatch | None = None  # set (prefills, decodes empty): the step in one kernel


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KVH, D] of the step's tokens to their slots; caches: [num_slots, KVH, D], in the model's dtype
    or the one chosen for K/V (kv_cache_dtype)."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, H, D]; caches: [num_slots, KVH, D] holding the step's own K/V already (store_kv), read back in q's
    dtype. Returns [T, H, D]."""
    if (batch := meta.block_table_batch) is not None:
        from engine.model import paged_prefill_cuda  # (Triton: imported only where a CUDA step runs)
        return paged_prefill_cuda.paged_prefill(q, k_cache, v_cache, batch.block_tables, batch.query_starts,
                                                batch.context_lens, scale, batch.block_size)
    if not meta.prefills and meta.decodes is not None:  # a decode-only step: every row is a decode, in order
        return _decode_attention(q, k_cache, v_cache, meta.decodes, scale)
    out = torch.empty_like(q)
    for seq in meta.prefills:
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        keys = k_cache.index_select(0, seq.context_slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
        values = v_cache.index_select(0, seq.context_slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
        query = q[rows].transpose(0, 1).unsqueeze(0)
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=seq.mask,
                                              is_causal=seq.mask is None, scale=scale, enable_gqa=True)
        out[rows] = attn[0].transpose(0, 1)
    if meta.decodes is not None:
        out[meta.decodes.token_idx] = _decode_attention(q[meta.decodes.token_idx], k_cache, v_cache,
                                                        meta.decodes, scale)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      batch: DecodeBatch | BlockTableDecode, scale: float) -> torch.Tensor:
    """q: [B, H, D] -> [B, H, D]."""
    if isinstance(batch, BlockTableDecode):
        from engine.model import paged_decode_cuda  # (Triton: imported only where a CUDA step runs)
        return paged_decode_cuda.paged_decode(q, k_cache, v_cache, batch.block_tables, batch.context_lens, scale,
                                              batch.block_size)
    if batch.paged_kernel:  # it reads each shared prefix once per group itself
        from engine.model import paged_decode_cpu  # (numba: only where the compiled CPU kernels run)
        return paged_decode_cpu.paged_decode(q, k_cache, v_cache, batch.slots, batch.lengths, scale, batch.shared)
    keys = _gather(k_cache, batch.slots).to(q.dtype).transpose(1, 2)  # [B, KVH, max_rest, D]
    values = _gather(v_cache, batch.slots).to(q.dtype).transpose(1, 2)
    rest, rest_lse = _attend(q.unsqueeze(2), keys, values, batch.bias, scale)  # [B, H, 1, D], [B, H, 1, 1]
    for group in batch.shared:
        shared_keys = k_cache.index_select(0, group.slots).to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, KVH, S, D]
        shared_values = v_cache.index_select(0, group.slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
        # the group's G queries attend the shared blocks as one sequence of G queries: K/V read once
        shared, shared_lse = _attend(q[group.rows].transpose(0, 1).unsqueeze(0), shared_keys, shared_values,
                                     None, scale)
        shared, shared_lse = shared[0].transpose(0, 1).unsqueeze(2), shared_lse[0].transpose(0, 1).unsqueeze(2)
        # merge the two partial softmaxes by their log-sum-exps
        w_shared = torch.sigmoid(shared_lse - rest_lse[group.rows])
        rest[group.rows] = (w_shared * shared + (1 - w_shared) * rest[group.rows]).to(rest.dtype)
    return rest.squeeze(2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns the log-sum-exp of the scores. q: [N, H, L, D]; k, v: [N, KVH, S, D]
    (strided views are fine); bias: [N, 1, 1, S] added to the scores (-inf on padding) or None."""
    if q.device.type == "cpu":
        # torch's fused CPU kernel: reads grouped K/V in place (no per-head copy) and gives the lse too
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)
        return out, lse.unsqueeze(-1)
    return _attend_matmul(q, k, v, bias, scale)


def _attend_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`_attend` in plain matmuls, for devices without the fused CPU kernel."""
    n, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    # query head h reads kv head h // (heads // kv_heads): group the query heads of each kv head
    grouped = q.reshape(n, kv_heads, heads // kv_heads * length, dim)
    scores = grouped @ k.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.exp(scores - lse) @ v
    return out.view(n, heads, length, dim), lse.view(n, heads, length, 1)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for a 2-D slot matrix; index_select copies whole rows, far faster than advanced indexing."""
    return cache.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[1:])
