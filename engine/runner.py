"""Turns a step's chunks into one flat batch, runs the model, and returns the logits to sample."""
from __future__ import annotations

import importlib.util
import logging
import time

import numpy as np
import torch

from engine.kv.kv_cache_manager import KVCacheManager
from engine.model.attention import AttentionMetadata, BlockTableBatch, DecodeBatch, PrefillSeq, SharedPrefix
from engine.model.linear import uniform_linears
from engine.model.llama import LlamaForCausalLM
from engine.request import Request
from engine.scheduler import ScheduledChunk

logger = logging.getLogger("prefixgate.engine")


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, kv: KVCacheManager,
                 device: torch.device, compiled_kernels: bool = True, decode_step: bool = True) -> None:
        """compiled_kernels: the numba CPU kernels (paged decode attention, the compiled decode step) where
        they apply; off, every step runs in eager PyTorch (engine/model/cpu_kernels.py). decode_step False: no
        compiled decode step (decode-only steps run per layer, on the paged attention)."""
        self.model = model
        # [2, layers, num_blocks, block_size, kv_heads, head_dim] seen as flat slots per layer
        two, layers, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        self.kv_slots = kv_cache.view(two, layers, num_blocks * block_size, kv_heads, head_dim)
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.compiled_decode = None
        self.graph_decode = None  # decode steps as CUDA graphs (capture_cuda_graphs)
        self.graph_prefill = None  # steps with a prefill chunk, up to a token bucket, as CUDA graphs
        self.dtype = model.model.norm.weight.dtype  # the model's; the K/V pool's may differ (kv_cache_dtype)
        self.paged_kernel = False  # decode attention by the compiled paged kernel
        self.max_compiled_rows = 0  # decode-only steps of up to this many rows take the compiled step
        # steps with a prefill chunk attend through block tables in one Triton launch (paged_prefill_cuda.py)
        self.prefill_kernel = False
        if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
            from engine.model import paged_prefill_cuda
            self.prefill_kernel = paged_prefill_cuda.supports(head_dim)
        # final hidden states of the sampled rows of the last step that had a pooling request (else stale)
        self.hidden: torch.Tensor | None = None
        # the last step's greedy token of each logits row, where its path found them (the compiled CPU step)
        self.greedy_ids: np.ndarray | None = None
        # the last step's logits of prompt positions, for requests that want their prompt's logprobs:
        # (request, the prompt position of the first token they predict, logits [tokens, vocab])
        self.prompt_logits: list[tuple[Request, int, torch.Tensor]] = []
        if compiled_kernels and device.type == "cpu":
            from engine.model import decode_step_cpu, paged_decode_cpu
            self.paged_kernel = paged_decode_cpu.supports(kv_cache.dtype, device)
            # the step multiplies by packed (or quantized) weights
            if (decode_step and decode_step_cpu.supports(self.dtype, device)
                    and decode_step_cpu.supports(kv_cache.dtype, device) and uniform_linears(model)):
                self.compiled_decode = decode_step_cpu.CompiledDecode(model)
                self.max_compiled_rows = decode_step_cpu.MAX_ROWS
                self._load_kernels()

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Returns logits [num_sampled, vocab] and the chunks they belong to (those that reach the end)."""
        self.greedy_ids = None
        self.prompt_logits = []
        if (self.compiled_decode is not None and len(chunks) <= self.max_compiled_rows
                and all(c.num_tokens == 1 and _is_decode(c.request, c.request.num_computed_tokens,
                                                         c.request.num_computed_tokens + 1) for c in chunks)):
            return self._compiled_decode_step([c.request for c in chunks]), chunks
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        prefills: list[PrefillSeq] = []
        decodes: list[tuple[int, str, int]] = []  # (position in the batch, request id, context length)
        logits_idx: list[int] = []
        sampled: list[ScheduledChunk] = []
        sampled_rows: list[int] = []  # their rows' places among the step's rows
        rows: list[tuple[int, str, int]] = []  # (queries, request id, context end) of every chunk
        prompt_idx: list[int] = []  # rows whose logits score the next prompt token (after the sampled rows')
        scored: list[tuple[Request, int, int]] = []  # (request, first prompt position predicted, how many)
        for chunk in chunks:
            request = chunk.request
            start, end = request.num_computed_tokens, request.num_computed_tokens + chunk.num_tokens
            slots = self.kv.slots(request.request_id)
            q_start = len(input_ids)
            input_ids += request.all_token_ids[start:end]
            positions += range(start, end)
            if chunk.num_tokens == 1:
                slot_mapping.append(int(slots[start]))
            else:
                slot_mapping += slots[start:end].tolist()
            rows.append((chunk.num_tokens, request.request_id, end))
            if _is_decode(request, start, end):
                decodes.append((q_start, request.request_id, end))
            elif not self.prefill_kernel:  # (the kernel reads block tables: no slot lists or masks to build)
                prefills.append(PrefillSeq(q_start, chunk.num_tokens, self._tensor_of(slots[:end]),
                                           _chunk_mask(start, end, self.device)))
            if request.prompt_logprobs is not None:  # position p's logits predict prompt token p + 1
                first = max(start, len(request.prompt_logprobs) - 1)  # (not those scored before a preemption)
                last = min(end, request.num_prompt_tokens - 1)
                if last > first:
                    prompt_idx += range(q_start + first - start, q_start + last - start)
                    scored.append((request, first + 1, last - first))
            if end == request.num_tokens:
                logits_idx.append(len(input_ids) - 1)
                sampled.append(chunk)
                sampled_rows.append(len(rows) - 1)
        decode_only = len(decodes) == len(chunks)
        if self.graph_decode is not None and decode_only and len(decodes) <= self.graph_decode.max_rows:
            logits = self.graph_decode(input_ids, positions, slot_mapping,
                                       [self.kv.block_ids(request_id) for _, request_id, _ in decodes],
                                       [end for _, _, end in decodes])
            return logits, sampled
        pooling = any(c.request.params.pooling for c in sampled)
        if (self.graph_prefill is not None and not decode_only and not pooling and not scored
                and self.graph_prefill.holds(len(input_ids), len(rows))):
            logits = self.graph_prefill(input_ids, positions, slot_mapping, self._block_tables(rows))
            return (logits if len(sampled) == len(rows) else logits[self._tensor(sampled_rows)]), sampled
        if self.prefill_kernel and not decode_only:
            meta = AttentionMetadata(self._tensor(slot_mapping), [], None,
                                     BlockTableBatch.build(self._block_tables(rows), self.block_size, self.device))
        else:
            meta = AttentionMetadata(self._tensor(slot_mapping), prefills, self._decode_batch(decodes))
        indices = self._tensor(logits_idx + prompt_idx)
        if pooling:  # an embedding request's prompt ends in this step
            logits, self.hidden = self.model(self._tensor(input_ids), self._tensor(positions), self.kv_slots, meta,
                                             indices, return_hidden=True)
        else:
            logits = self.model(self._tensor(input_ids), self._tensor(positions), self.kv_slots, meta, indices)
        row = len(logits_idx)
        for request, first, count in scored:
            self.prompt_logits.append((request, first, logits[row:row + count]))
            row += count
        return logits[:len(logits_idx)], sampled

    def capture_cuda_graphs(self, max_rows: int, max_model_len: int, max_tokens: int) -> bool:
        """Records decode-only steps of up to max_rows rows (decode_graph_cuda.py), and steps with a prefill chunk
        of up to max_tokens tokens in token buckets (prefill_graph_cuda.py), as CUDA graphs; False where they do
        not apply (not CUDA, or a head size the Triton kernels have no block shape for)."""
        if self.device.type != "cuda":
            return False
        from engine.model import paged_decode_cuda  # (Triton comes with CUDA builds of torch)
        if not paged_decode_cuda.supports(self.kv_slots.shape[-1]):
            return False
        from engine.model.decode_graph_cuda import GraphDecode
        self.graph_decode = GraphDecode(self.model, self.kv_slots, self.block_size, max_rows, max_model_len)
        self.graph_decode.capture()
        if self.prefill_kernel:
            from engine.model.prefill_graph_cuda import GraphPrefill
            self.graph_prefill = GraphPrefill(self.model, self.kv_slots, self.block_size, max_rows, max_tokens,
                                              max_model_len)
            self.graph_prefill.capture()
        return True

    def _load_kernels(self) -> None:
        """Compiles the step (or loads it from numba's disk cache) now, not in a request, and says so: the
        first start is silent for most of a minute otherwise."""
        from engine.model import kernel_cache
        if kernel_cache.has_compiled("decode_step_cpu._step"):
            logger.info("loading the compiled CPU kernels from %s", kernel_cache.FOLDER)
        else:  # (python -m engine.model.compile does it ahead of time, as deploy/Dockerfile does)
            logger.info("compiling the CPU kernels, as a first start does: about 1 minute on 2 cores (%s)",
                        f"cached in {kernel_cache.FOLDER} after that" if kernel_cache.CACHE else "in memory, not cached")
        started = time.perf_counter()
        self.decode_probe()
        logger.info("CPU kernels ready in %.1f s", time.perf_counter() - started)

    def decode_probe(self) -> None:
        """A one-row decode step on the path serving uses (compiled where there is one) reading and writing
        slot 0, whose K/V are put back afterwards: warms the compiled step, and the thread budget times it."""
        if self.compiled_decode is None:
            self.calibration_step(0, 1)
            return
        saved = self.kv_slots[:, :, 0].clone()
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        self.compiled_decode(zero, zero, self.kv_slots, zero, zero[None, :], zero + 1, zero)
        self.kv_slots[:, :, 0] = saved

    def calibration_step(self, num_prefill_tokens: int, decode_context_tokens: int) -> None:
        """One forward shaped like a step with a prefill chunk and one decode, over scratch slots from 0
        (engine/step_cost.py times it). It overwrites K/V there: run it before any request holds blocks."""
        p, c = num_prefill_tokens, decode_context_tokens
        decode_slots = torch.arange(c, device=self.device)
        prefills = [PrefillSeq(0, p, torch.arange(p, device=self.device), None)] if p else []
        decode = DecodeBatch(self._tensor([p]), decode_slots[None, :], self._tensor([c]), None, [], self.paged_kernel)
        slot_mapping = torch.cat([torch.arange(p, device=self.device), decode_slots[-1:]])
        meta = AttentionMetadata(slot_mapping, prefills, decode)
        if self.prefill_kernel and p:  # the path such a step takes: scratch slots from 0 are blocks from 0
            scratch = [(p, list(range(-(-p // self.block_size))), p), (1, list(range(-(-c // self.block_size))), c)]
            meta = AttentionMetadata(slot_mapping, [], None, BlockTableBatch.build(scratch, self.block_size,
                                                                                   self.device))
        self.model(torch.zeros(p + 1, dtype=torch.long, device=self.device),
                   torch.cat([torch.arange(p, device=self.device), decode_slots[-1:]]), self.kv_slots, meta,
                   self._tensor([p]))

    def _tensor(self, values: list[int]) -> torch.Tensor:
        # (np.fromiter: torch.tensor of a long list of ints is several times slower)
        return torch.from_numpy(np.fromiter(values, np.int64, len(values))).to(self.device)

    def _block_tables(self, rows: list[tuple[int, str, int]]) -> list[tuple[int, list[int], int]]:
        """(queries, block ids, context end) of each row given as (queries, request id, context end)."""
        return [(queries, self.kv.block_ids(request_id), end) for queries, request_id, end in rows]

    def _tensor_of(self, slots: np.ndarray) -> torch.Tensor:
        """A tensor of slots on the device (a copy: on CPU, torch.from_numpy would share the slot table)."""
        return torch.from_numpy(slots.copy()).to(self.device)

    def _compiled_decode_step(self, requests: list[Request]) -> torch.Tensor:
        """A decode-only step on the compiled CPU step, its arrays built in numpy from the slot tables (the
        general path's lists and tensors cost 0.1 ms of Python right after a step: docs/speed.md#the-decode-step)."""
        rows = len(requests)
        contexts = [self.kv.slots(r.request_id)[:r.num_tokens] for r in requests]
        slots, lengths, shared = self._attended_slots(contexts)
        input_ids = np.fromiter((r.all_token_ids[-1] for r in requests), np.int64, rows)
        positions = np.fromiter((len(c) - 1 for c in contexts), np.int64, rows)
        slot_mapping = np.fromiter((c[-1] for c in contexts), np.int64, rows)
        logits, self.greedy_ids = self.compiled_decode.run(input_ids, positions, self.kv_slots, slot_mapping, slots,
                                                           lengths, np.arange(rows), shared)
        return logits

    def _attended_slots(self, contexts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, list[SharedPrefix]]:
        """The slots each decode attends ([rows, longest], padded with slot 0, never counted), how many, and the
        cascade groups whose shared slots come before them."""
        if len(contexts) == 1:  # nothing to share: the slot table itself, no copy
            return contexts[0][None, :], np.array([len(contexts[0])]), []
        shared, rest_starts = self._shared_prefixes(contexts)
        lengths = np.array([len(context) - rest_start for context, rest_start in zip(contexts, rest_starts)])
        slots = np.zeros((len(contexts), lengths.max()), np.int64)
        for row, (context, rest_start) in enumerate(zip(contexts, rest_starts)):
            slots[row, :lengths[row]] = context[rest_start:]
        return slots, lengths, shared

    def _decode_batch(self, decodes: list[tuple[int, str, int]]) -> DecodeBatch | None:
        if not decodes:
            return None
        slots, lengths, shared = self._attended_slots([self.kv.slots(rid)[:end] for _, rid, end in decodes])
        bias = None
        if lengths.min() < slots.shape[1] and not self.paged_kernel:
            padding = torch.from_numpy(np.arange(slots.shape[1])[None, :] >= lengths[:, None]).to(self.device)
            bias = torch.zeros(padding.shape, dtype=self.dtype, device=self.device)
            bias = bias.masked_fill_(padding, float("-inf"))[:, None, None, :]
        return DecodeBatch(self._tensor([i for i, _, _ in decodes]), torch.from_numpy(slots).to(self.device),
                           torch.from_numpy(lengths).to(self.device), bias, shared, self.paged_kernel)

    def _shared_prefixes(self, contexts: list[np.ndarray]) -> tuple[list[SharedPrefix], list[int]]:
        """Groups decodes (each its context's slots) by their first block; returns each group's shared leading
        blocks (cascade attention) and where each sequence's own rest starts. A sequence alone in its group
        shares nothing."""
        bs = self.block_size
        groups: dict[int, list[int]] = {}
        for row, context in enumerate(contexts):
            if len(context) - 1 >= bs:  # each sequence keeps at least its newest token outside the shared part
                groups.setdefault(int(context[0]), []).append(row)
        shared: list[SharedPrefix] = []
        rest_starts = [0] * len(contexts)
        for rows in groups.values():
            if len(rows) < 2:
                continue
            limit = min((len(contexts[r]) - 1) // bs for r in rows)
            tables = np.array([contexts[r][:limit * bs:bs] for r in rows])  # each block's first slot
            differs = (tables != tables[0]).any(axis=0)  # the blocks where some table leaves the first one
            num = int(differs.argmax()) if differs.any() else limit
            shared.append(SharedPrefix(self._tensor(rows), self._tensor_of(contexts[rows[0]][:num * bs])))
            for r in rows:
                rest_starts[r] = num * bs
        return shared, rest_starts


def _is_decode(request: Request, start: int, end: int) -> bool:
    """A decode computes the one newest token of a request past its prompt (a 1-token prefill chunk is not one)."""
    return not request.is_prefilling and start == request.num_tokens - 1 and end == request.num_tokens


def _chunk_mask(start: int, end: int, device: torch.device) -> torch.Tensor | None:
    """Causal mask of queries [start, end) over keys [0, end); None when plain causal applies."""
    if start == 0:
        return None
    keys = torch.arange(end, device=device)
    queries = torch.arange(start, end, device=device)
    return keys[None, :] <= queries[:, None]
