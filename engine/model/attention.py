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
class AttentionMetadata:
    """Built once per step by the runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] slot of each new token
    prefills: list[PrefillSeq]
    decode_token_idx: torch.Tensor | None  # [num_decodes] positions in the flat batch
    decode_slots: torch.Tensor | None  # [num_decodes, max_ctx] (padded with slot 0)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_ctx] bool, False on padding


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
    if meta.decode_token_idx is not None:
        query = q[meta.decode_token_idx].unsqueeze(2)  # [B, H, 1, D]
        keys = _gather(k_cache, meta.decode_slots).transpose(1, 2)  # [B, KVH, max_ctx, D]
        values = _gather(v_cache, meta.decode_slots).transpose(1, 2)
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=meta.decode_mask,
                                              scale=scale, enable_gqa=True)
        out[meta.decode_token_idx] = attn.squeeze(2)
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for a 2-D slot matrix; index_select copies whole rows, far faster than advanced indexing."""
    return cache.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[1:])
