"""Decode steps on CUDA replayed from captured CUDA graphs.

A decode step of a small model is hundreds of tiny kernels (SmolLM2: 464, 15 a layer for 30
layers); launched one by one from Python each costs more than it computes, so the GPU idles
between them. At start-up the runner runs one decode step per batch size of graph_batch_sizes
(up to max_num_seqs) under `torch.cuda.graph`, which records its kernels; a step then copies its
token ids, positions, slots, block tables and context lengths into the graph's fixed input buffers
and replays the recording in one launch. Attention reads K/V through the block tables
(paged_decode_cuda.py), so nothing in the recording depends on a context's length. A step of n
rows replays the smallest graph of at least n rows; the padding rows repeat the last real row (the
same K/V written to the same slot), and their logits are dropped.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.model.attention import AttentionMetadata, BlockTableDecode
from engine.model.llama import LlamaForCausalLM

MAX_GRAPH_ROWS = 256  # larger decode steps run eagerly (their launches are a small share of their work)


def graph_batch_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to the first size that holds max_rows (vLLM's ladder)."""
    cap = min(max_rows, MAX_GRAPH_ROWS)
    sizes = [1, 2, 4, 8]
    while sizes[-1] < cap:
        sizes.append(sizes[-1] + 8)
    return [s for s in sizes if s < cap] + [next(s for s in sizes if s >= cap)]


class GraphInputs:
    """The fixed buffers a recorded decode step reads (token ids, positions, slots, block tables, context
    lengths), and their filling from a step's rows: the part of a replay that runs on any device."""

    def __init__(self, rows: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.tokens = torch.zeros(3, rows, dtype=torch.long, device=device)  # ids, positions, slots
        self.context_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
        self.row_ids = torch.arange(rows, device=device)
        pinned = device.type == "cuda"  # (page-locked host memory: copies that do not wait for the GPU)
        self._host_tokens = torch.zeros(3, rows, dtype=torch.long, pin_memory=pinned)
        self._host_context_lens = torch.ones(rows, dtype=torch.int32, pin_memory=pinned)
        self._host_tables = torch.zeros(rows, max_blocks, dtype=torch.int32, pin_memory=pinned)

    def fill(self, rows: int, input_ids: list[int], positions: list[int], slot_mapping: list[int],
             block_tables: list[list[int]], context_lens: list[int]) -> None:
        """The step's n rows, then rows - n padding rows that repeat the last one (the same K/V to the same slot)."""
        order = list(range(len(input_ids))) + [len(input_ids) - 1] * (rows - len(input_ids))
        tokens = self._host_tokens.numpy()
        tokens[0, :rows] = np.asarray(input_ids)[order]
        tokens[1, :rows] = np.asarray(positions)[order]
        tokens[2, :rows] = np.asarray(slot_mapping)[order]
        self._host_context_lens.numpy()[:rows] = np.asarray(context_lens)[order]
        tables = self._host_tables.numpy()
        for row, source in enumerate(order):
            tables[row, :len(block_tables[source])] = block_tables[source]
        # (the pinned buffers are rewritten only after the sampler has read this step's logits, a sync)
        self.tokens[:, :rows].copy_(self._host_tokens[:, :rows], non_blocking=True)
        self.context_lens[:rows].copy_(self._host_context_lens[:rows], non_blocking=True)
        self.block_tables[:rows].copy_(self._host_tables[:rows], non_blocking=True)

    def step(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The model's arguments for the first `rows` rows: ids, positions, metadata, logits rows."""
        ids, positions, slots = self.tokens[:, :rows]
        meta = AttentionMetadata(slots, [], BlockTableDecode(self.block_tables[:rows], self.context_lens[:rows],
                                                             self.block_size))
        return ids, positions, meta, self.row_ids[:rows]


class GraphDecode:
    """One captured decode step per batch size (capture()), over the engine's KV pool and one set of input
    buffers."""

    def __init__(self, model: LlamaForCausalLM, kv_slots: torch.Tensor, block_size: int, max_rows: int,
                 max_model_len: int) -> None:
        self.model = model
        self.kv_slots = kv_slots
        self.batch_sizes = graph_batch_sizes(max_rows)
        rows, device = self.batch_sizes[-1], kv_slots.device
        self.inputs = GraphInputs(rows, -(-max_model_len // block_size), block_size, device)
        # every graph writes its logits here: outputs left inside the pool would stay allocated, one per graph
        # (256 graph rows x a 128k vocabulary: 2 GB over the ladder)
        self.logits = torch.empty(rows, model.lm_head.out_features, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def max_rows(self) -> int:
        return self.batch_sizes[-1]

    def graph_rows(self, n: int) -> int:
        """Rows of the smallest graph that holds an n-row step."""
        return next(size for size in self.batch_sizes if size >= n)

    def forward(self, rows: int) -> torch.Tensor:
        """The recorded step run eagerly over the input buffers: the kernels each replay launches."""
        ids, positions, meta, logits_rows = self.inputs.step(rows)
        return self.model(ids, positions, self.kv_slots, meta, logits_rows)

    def capture(self) -> None:
        """Largest first, all in one memory pool (the smaller graphs reuse the largest one's buffers). The
        recorded steps write slot 0's K/V, which is put back afterwards."""
        saved = self.kv_slots[:, :, 0].clone()
        pool = None
        for rows in reversed(self.batch_sizes):
            self.forward(rows)  # warm-up outside the recording: Triton compiles, cuBLAS picks its kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:rows].copy_(self.forward(rows))
            pool = graph.pool()
            self.graphs[rows] = graph
        self.kv_slots[:, :, 0] = saved
        torch.cuda.synchronize()

    def __call__(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
                 block_tables: list[list[int]], context_lens: list[int]) -> torch.Tensor:
        """Logits [n, vocab] of an n-row decode-only step, n <= max_rows (a view into the graphs' output buffer:
        read it before the next call)."""
        rows = self.graph_rows(len(input_ids))
        self.inputs.fill(rows, input_ids, positions, slot_mapping, block_tables, context_lens)
        self.graphs[rows].replay()
        return self.logits[:len(input_ids)]
