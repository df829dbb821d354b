"""Turns a step's chunks into one flat batch, runs the model, and returns the logits to sample."""
from __future__ import annotations

import torch

from engine.kv.kv_cache_manager import KVCacheManager
from engine.model.attention import AttentionMetadata, DecodeBatch, PrefillSeq
from engine.model.llama import LlamaForCausalLM
from engine.request import Request
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
        decodes: list[tuple[int, Request, int]] = []  # (position in the batch, request, context length)
        logits_idx: list[int] = []
        sampled: list[ScheduledChunk] = []
        for chunk in chunks:
            request = chunk.request
            start, end = request.num_computed_tokens, request.num_computed_tokens + chunk.num_tokens
            q_start = len(input_ids)
            input_ids += request.all_token_ids[start:end]
            positions += range(start, end)
            slot_mapping += self.kv.slots(request, start, end)
            if chunk.num_tokens == 1:
                decodes.append((q_start, request, end))
            else:
                prefills.append(PrefillSeq(q_start, chunk.num_tokens, self._context_slots(request, 0, end),
                                           _chunk_mask(start, end, self.device)))
            if end == request.num_tokens:
                logits_idx.append(len(input_ids) - 1)
                sampled.append(chunk)
        meta = AttentionMetadata(self._tensor(slot_mapping), prefills, self._decode_batch(decodes))
        logits = self.model(self._tensor(input_ids), self._tensor(positions), self.kv_slots, meta,
                            self._tensor(logits_idx))
        return logits, sampled

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _context_slots(self, request: Request, start: int, end: int) -> torch.Tensor:
        """Slots of token positions [start, end); start is a block boundary."""
        bs = self.kv.block_size
        table = self.kv.block_tables[request.request_id][start // bs:-(-end // bs)]
        block_ids = self._tensor([b.block_id for b in table])
        offsets = torch.arange(bs, device=self.device)
        return (block_ids[:, None] * bs + offsets[None, :]).flatten()[:end - start]

    def _decode_batch(self, decodes: list[tuple[int, Request, int]]) -> DecodeBatch | None:
        if not decodes:
            return None
        num_shared = self._num_shared_blocks([(r, end) for _, r, end in decodes])
        start = num_shared * self.kv.block_size
        shared = self._context_slots(decodes[0][1], 0, start) if num_shared else None
        rests = [self._context_slots(r, start, end) for _, r, end in decodes]
        lengths = self._tensor([len(c) for c in rests])
        slots = torch.nn.utils.rnn.pad_sequence(rests, batch_first=True)  # padding reads slot 0, masked out
        mask = torch.arange(slots.shape[1], device=self.device)[None, :] < lengths[:, None]
        return DecodeBatch(self._tensor([i for i, _, _ in decodes]), shared, slots, mask[:, None, None, :])

    def _num_shared_blocks(self, seqs: list[tuple[Request, int]]) -> int:
        """Leading blocks every sequence's table has in common (the same physical blocks)."""
        if len(seqs) < 2:
            return 0
        tables = [self.kv.block_tables[r.request_id] for r, _ in seqs]
        # each sequence keeps at least its newest token outside the shared part
        limit = min((end - 1) // self.kv.block_size for _, end in seqs)
        num = 0
        while num < limit and all(t[num] is tables[0][num] for t in tables):
            num += 1
        return num


def _chunk_mask(start: int, end: int, device: torch.device) -> torch.Tensor | None:
    """Causal mask of queries [start, end) over keys [0, end); None when plain causal applies."""
    if start == 0:
        return None
    keys = torch.arange(end, device=device)
    queries = torch.arange(start, end, device=device)
    return keys[None, :] <= queries[:, None]
