"""Steps with a prefill chunk on CUDA, replayed from captured CUDA graphs.

A step of a few hundred tokens (a cached prompt's last block, a chunk beside decodes) computes little on a large
GPU but launches over ten kernels a layer from Python, which takes longer than the work
(docs/speed.md#on-a-gpu-cuda). The paged prefill kernel (paged_prefill_cuda.py) reads every row through block
tables and numbers its programs from the row offsets alone, so once its tokens and rows are padded such a step
has fixed shapes and no host sync: at start-up the runner records one step per token bucket under
`torch.cuda.graph`, over fixed input buffers (token ids, positions, slots, block tables, row offsets, context
lengths). A step of n tokens replays the smallest bucket of at least n. Its padding tokens form one more row,
with slot -1 (the K/V store skips them) and keys read from block 0 (finite values, whatever they hold; the row's
outputs are dropped); the rows after that one are empty.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.model.attention import AttentionMetadata, BlockTableBatch
from engine.model.llama import LlamaForCausalLM

# a bucket wastes at most a third of its tokens on padding; larger steps are bound by their GPU work, not their
# launches, and run eagerly
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)


def prefill_token_buckets(max_tokens: int) -> list[int]:
    """The buckets up to the first that holds a step of max_tokens tokens (the scheduler's token budget), all of
    them for a budget past the largest."""
    smaller = [b for b in TOKEN_BUCKETS if b < max_tokens]
    return smaller + [b for b in TOKEN_BUCKETS if b >= max_tokens][:1]


class PrefillGraphInputs:
    """The fixed buffers a recorded step reads, and their filling from a step's rows: the part of a replay that
    runs on any device. rows: the most rows a step may have, the padding row not counted."""

    def __init__(self, tokens: int, rows: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.tokens = torch.zeros(3, tokens, dtype=torch.long, device=device)  # ids, positions, slots
        # one row more than a step may have: the padding row (and query starts end one further)
        self.block_tables = torch.zeros(rows + 1, max_blocks, dtype=torch.int32, device=device)
        self.query_starts = torch.zeros(rows + 2, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(rows + 1, dtype=torch.int32, device=device)
        self.logits_rows = torch.zeros(rows + 1, dtype=torch.long, device=device)
        self._device = {"tokens": self.tokens, "block_tables": self.block_tables, "query_starts": self.query_starts,
                        "context_lens": self.context_lens, "logits_rows": self.logits_rows}
        pinned = device.type == "cuda"  # (page-locked host memory: copies that do not wait for the GPU)
        self._host = {name: torch.zeros_like(buffer, device="cpu").pin_memory() if pinned
                      else torch.zeros_like(buffer, device="cpu")
                      for name, buffer in self._device.items()}
        self._arrays = {name: buffer.numpy() for name, buffer in self._host.items()}  # what fill() writes
        # the last step's copies out of those buffers: a step that samples nothing (a chunk mid-prompt) has no
        # sync after it, so the next fill waits for them before it rewrites the buffers
        self._copied = torch.cuda.Event() if pinned else None

    def fill(self, tokens: int, rows: int, input_ids: list[int], positions: list[int], slot_mapping: list[int],
             step_rows: list[tuple[int, list[int], int]]) -> None:
        """A step's n tokens in r rows ((queries, block ids, context end) each, in batch order) padded to `tokens`
        tokens and rows + 1 rows: row r holds the padding tokens, rows after it are empty."""
        n, r = len(input_ids), len(step_rows)
        if self._copied is not None:
            self._copied.synchronize()
        host = self._arrays
        ids_positions_slots = host["tokens"]
        ids_positions_slots[:, n:tokens] = 0
        ids_positions_slots[0, :n], ids_positions_slots[1, :n] = input_ids, positions
        ids_positions_slots[2, :n] = slot_mapping
        ids_positions_slots[2, n:tokens] = -1
        starts = host["query_starts"]
        starts[0] = 0
        starts[1:r + 1] = np.cumsum([queries for queries, _, _ in step_rows])
        starts[r + 1:rows + 2] = tokens
        context_lens = host["context_lens"]
        context_lens[:r] = [end for _, _, end in step_rows]
        context_lens[r:rows + 1] = max(1, tokens - n)  # (the padding row sees its own queries' count of keys)
        tables = host["block_tables"]
        for row, (_, block_ids, end) in enumerate(step_rows):
            needed = -(-end // self.block_size)
            tables[row, :needed] = block_ids[:needed]
        tables[r, :-(-(tokens - n) // self.block_size)] = 0
        logits_rows = host["logits_rows"]
        logits_rows[:r] = starts[1:r + 1] - 1
        logits_rows[r:rows + 1] = tokens - 1
        self.tokens[:, :tokens].copy_(self._host["tokens"][:, :tokens], non_blocking=True)
        for name, used in (("block_tables", rows + 1), ("query_starts", rows + 2), ("context_lens", rows + 1),
                           ("logits_rows", rows + 1)):
            self._device[name][:used].copy_(self._host[name][:used], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def step(self, tokens: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The model's arguments for a bucket of `tokens` tokens and `rows` rows (the padding row not counted):
        ids, positions, metadata, logits rows."""
        ids, positions, slots = self.tokens[:, :tokens]
        batch = BlockTableBatch(self.block_tables[:rows + 1], self.query_starts[:rows + 2],
                                self.context_lens[:rows + 1], self.block_size)
        return ids, positions, AttentionMetadata(slots, [], None, batch), self.logits_rows[:rows + 1]


class GraphPrefill:
    """One captured step per token bucket (capture()), over the engine's KV pool and one set of input buffers."""

    def __init__(self, model: LlamaForCausalLM, kv_slots: torch.Tensor, block_size: int, max_rows: int,
                 max_tokens: int, max_model_len: int) -> None:
        self.model = model
        self.kv_slots = kv_slots
        self.buckets = prefill_token_buckets(max_tokens)
        self.max_rows = max_rows
        device = kv_slots.device
        # (wide enough for the padding row too, whose keys may outnumber a context's under a short max_model_len)
        max_blocks = -(-max(max_model_len, self.buckets[-1]) // block_size)
        self.inputs = PrefillGraphInputs(self.buckets[-1], max_rows, max_blocks, block_size, device)
        # every graph writes its logits here (one buffer, not one left in the pool per graph)
        self.logits = torch.empty(max_rows + 1, model.lm_head.out_features, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def holds(self, tokens: int, rows: int) -> bool:
        return tokens <= self.max_tokens and rows <= self.max_rows

    def _rows(self, tokens: int) -> int:
        """Rows of a bucket: a step cannot have more rows than tokens."""
        return min(tokens, self.max_rows)

    def forward(self, tokens: int) -> torch.Tensor:
        """The recorded step run eagerly over the input buffers: the kernels each replay launches."""
        ids, positions, meta, logits_rows = self.inputs.step(tokens, self._rows(tokens))
        return self.model(ids, positions, self.kv_slots, meta, logits_rows)

    def capture(self) -> None:
        """Largest first, all in one memory pool (the smaller graphs reuse the largest one's buffers). The
        recorded steps are padding only: they write no K/V."""
        pool = None
        for tokens in reversed(self.buckets):
            rows = self._rows(tokens)
            self.inputs.fill(tokens, rows, [], [], [], [])
            self.forward(tokens)  # warm-up outside the recording: Triton compiles, cuBLAS picks its kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:rows + 1].copy_(self.forward(tokens))
            pool = graph.pool()
            self.graphs[tokens] = graph
        torch.cuda.synchronize()

    def __call__(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
                 rows: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Logits [r, vocab] of the last token of each of a step's r rows (a view into the graphs' output
        buffer: read it before the next call)."""
        tokens = next(b for b in self.buckets if b >= len(input_ids))
        self.inputs.fill(tokens, self._rows(tokens), input_ids, positions, slot_mapping, rows)
        self.graphs[tokens].replay()
        return self.logits[:len(rows)]
