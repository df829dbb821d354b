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
class DecodeBatch:
    """Every one-token query of the step, attended in one batched call.

    Blocks at the head of every block table in the batch (a shared system prompt) are
    read once for all queries (cascade attention); each query then reads its own rest.
    """

    token_idx: torch.Tensor  # [B] positions in the flat batch
    shared_slots: torch.Tensor | None  # [S] slots of the blocks all B sequences share
    slots: torch.Tensor  # [B, max_rest] slots after the shared ones (padded with slot 0)
    mask: torch.Tensor  # [B, 1, 1, max_rest] bool, False on padding


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] slot of each new token
    prefills: list[PrefillSeq]
    decodes: DecodeBatch | None


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_slots, KVH, D]. Returns [T, H, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    for seq in meta.prefills:
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        keys = k_cache.index_select(0, seq.context_slots).transpose(0, 1).unsqueeze(0)
        values = v_cache.index_select(0, seq.context_slots).transpose(0, 1).unsqueeze(0)
        query = q[rows].transpose(0, 1).unsqueeze(0)
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=seq.mask,
                                              is_causal=seq.mask is None, scale=scale, enable_gqa=True)
        out[rows] = attn[0].transpose(0, 1)
    if meta.decodes is not None:
        out[meta.decodes.token_idx] = _decode_attention(q[meta.decodes.token_idx], k_cache, v_cache,
                                                        meta.decodes, scale)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
                      scale: float) -> torch.Tensor:
    """q: [B, H, D] -> [B, H, D]."""
    keys = _gather(k_cache, batch.slots).transpose(1, 2)  # [B, KVH, max_rest, D]
    values = _gather(v_cache, batch.slots).transpose(1, 2)
    if batch.shared_slots is None:
        return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=batch.mask,
                                              scale=scale, enable_gqa=True).squeeze(2)
    rest, rest_lse = _attend(q.unsqueeze(2), keys, values, batch.mask, scale)  # [B, H, 1, D], [B, H, 1, 1]
    shared_keys = k_cache.index_select(0, batch.shared_slots).transpose(0, 1).unsqueeze(0)  # [1, KVH, S, D]
    shared_values = v_cache.index_select(0, batch.shared_slots).transpose(0, 1).unsqueeze(0)
    # all B queries attend the shared blocks as one sequence of B queries: no mask, K/V read once
    shared, shared_lse = _attend(q.transpose(0, 1).unsqueeze(0), shared_keys, shared_values, None, scale)
    shared, shared_lse = shared[0].transpose(0, 1).unsqueeze(2), shared_lse[0].transpose(0, 1).unsqueeze(2)
    # merge the two partial softmaxes by their log-sum-exps
    w_shared = torch.sigmoid(shared_lse - rest_lse)
    return (w_shared * shared + (1 - w_shared) * rest).squeeze(2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns the log-sum-exp of the scores. q: [N, H, L, D]; k, v: [N, KVH, S, D]."""
    n, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    # query head h reads kv head h // (heads // kv_heads): group the query heads of each kv head
    grouped = q.reshape(n, kv_heads, heads // kv_heads * length, dim)
    scores = grouped @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.exp(scores - lse) @ v
    return out.view(n, heads, length, dim), lse.view(n, heads, length, 1)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for a 2-D slot matrix; index_select copies whole rows, far faster than advanced indexing."""
    return cache.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[1:])
