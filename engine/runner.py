"""Turns a step's chunks into one flat batch, runs the model, and returns the logits to sample."""
from __future__ import annotations

import torch

from engine.kv.kv_cache_manager import KVCacheManager
from engine.model.attention import AttentionMetadata, PrefillSeq
from engine.model.llama import LlamaForCausalLM
from engine.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, kv: KVCacheManager,
                 device: torch.device) -> None:
        self.model = model
        # [2, layers, num_blocks, block_size, kv_heads, head_dim] seen as flat slots per layer
        two, layers, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        self.kv_slots = kv_cache.view(two, layers, num_blocks * block_size, kv_heads, head_dim)
        self.kv = kv
        self.device = device

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Returns logits [num_sampled, vocab] and the chunks they belong to (those that reach the end)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        prefills: list[PrefillSeq] = []
        decode_idx: list[int] = []
        decode_ctx: list[torch.Tensor] = []
        logits_idx: list[int] = []
        sampled: list[ScheduledChunk] = []
        for chunk in chunks:
            request = chunk.request
            start, end = request.num_computed_tokens, request.num_computed_tokens + chunk.num_tokens
            q_start = len(input_ids)
            input_ids += request.all_token_ids[start:end]
            positions += range(start, end)
            slot_mapping += self.kv.slots(request, start, end)
            context = self._context_slots(request, end)
            if chunk.num_tokens == 1:
                decode_idx.append(q_start)
                decode_ctx.append(context)
            else:
                prefills.append(PrefillSeq(q_start, chunk.num_tokens, context, _chunk_mask(start, end, self.device)))
            if end == request.num_tokens:
                logits_idx.append(len(input_ids) - 1)
                sampled.append(chunk)
        meta = AttentionMetadata(self._tensor(slot_mapping), prefills, *self._decode_batch(decode_idx, decode_ctx))
        logits = self.model(self._tensor(input_ids), self._tensor(positions), self.kv_slots, meta,
                            self._tensor(logits_idx))
        return logits, sampled

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _context_slots(self, request, end: int) -> torch.Tensor:
        bs = self.kv.block_size
        table = self.kv.block_tables[request.request_id][:-(-end // bs)]
        block_ids = self._tensor([b.block_id for b in table])
        offsets = torch.arange(bs, device=self.device)
        return (block_ids[:, None] * bs + offsets[None, :]).flatten()[:end]

    def _decode_batch(self, idx: list[int], contexts: list[torch.Tensor]):
        if not idx:
            return None, None, None
        lengths = self._tensor([len(c) for c in contexts])
        slots = torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True)  # padding reads slot 0, masked out
        mask = torch.arange(slots.shape[1], device=self.device)[None, :] < lengths[:, None]
        return self._tensor(idx), slots, mask[:, None, None, :]


def _chunk_mask(start: int, end: int, device: torch.device) -> torch.Tensor | None:
    """Causal mask of queries [start, end) over keys [0, end); None when plain causal applies."""
    if start == 0:
        return None
    keys = torch.arange(end, device=device)
    queries = torch.arange(start, end, device=device)
    return keys[None, :] <= queries[:, None]
