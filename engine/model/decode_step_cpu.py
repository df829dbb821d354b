"""A whole decode step of a Llama-family model in one compiled call on CPU (float32 or bfloat16).

At batch 1 a decode step is 121 small matmuls plus some 1,500 tiny ops (norms, rotary, cache
writes, residual adds) that eager PyTorch dispatches one by one: on a 2-core machine that dispatch
cost about a third of the weights' streaming time. Here numba compiles the step (every layer, the
final norm and the lm_head) into one function: the matmuls (over the packed weights of
packed_matmul_cpu.py, or the quantized tiles of quant_matmul_cpu.py) and the attention split their work
over numba's threads, the small ops run inline, and decode attention reads K/V where they sit in the paged
cache. The threads are launched once a step, not once a matmul: one parallel region walks every layer, the
threads claiming each phase's work and meeting at its end by spinning on counters (work_phases.py), where a
region per matmul and per attention call (181 a step) cost each its launch, its join and a plan of the
attention's tasks. The runner takes this path for decode-only steps of up to MAX_ROWS rows; prefill, larger
batches and CUDA keep the PyTorch path. bfloat16 weights and caches (either or both: kv_cache_dtype may differ
from the model's) are read as their bits and widened to float32, in which the step computes (new K/V are
rounded to bfloat16): half the bytes of float32, on any x86 CPU.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from numba import njit, prange
from numba.typed import List

from engine.model import kernel_cache  # numba's cache folder, set before any @njit below
from engine.model import paged_decode_cpu, simd, work_phases
from engine.model.attention import SharedPrefix
from engine.model.bfloat16_bits import as_float32, numpy_view, to_element
from engine.model.cpu_threads import launch_lock, use_threads
from engine.model.linear import MAX_PACKED_ROWS, matmul_tail, matmul_weight
from engine.model.llama import LlamaForCausalLM
from engine.model.quant_matmul_cpu import embed_row, linear_tiles, tile_count
from engine.model.paged_decode_cpu import cascade_groups
from engine.model.packed_matmul_cpu import TILE
from engine.model.paged_decode_loops import fast_exp
from engine.model.paged_decode_vectors import _largest

# decode-only steps of up to this many rows take the compiled step: as many as the packed weights serve
# (linear.MAX_PACKED_ROWS); measured faster than eager there (docs/speed.md#the-decode-step)
MAX_ROWS = MAX_PACKED_ROWS


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Where the attention kernel the step is built on runs (its own switch, so the benchmarks can turn the
    step off alone)."""
    return paged_decode_cpu.supports(dtype, device)


class CompiledDecode:
    """The model's weights as numpy views (no copies) and the compiled step over them."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        config = model.config
        layers = model.model.layers
        attn = layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.scale = np.float32(attn.scale)
        self.eps = np.float32(config.rms_norm_eps)
        self.qk_norm = attn.qk_norm
        embed = model.model.embed_tokens
        self.embed = embed.quant.arrays() if embed.quant is not None else numpy_view(embed.row_tiles())
        self.rotary = model.model.rotary_emb
        self._cos = self._sin = np.zeros((0, 0), np.float32)  # the rotary table of every position so far
        self._kv_slots: torch.Tensor | None = None  # the K/V pool of the last step, and its numpy view
        self._kv_view: np.ndarray | None = None
        self.vocab_size = model.lm_head.out_features

        def weights(get) -> List:
            return typed_list([numpy_view(get(layer)) for layer in layers])

        def biases(get) -> List:  # (empty: none)
            return typed_list([numpy_view(get(layer)) if get(layer) is not None else np.zeros(0, np.float32)
                               for layer in layers])

        def matmuls(get) -> List:
            return typed_list([matmul_weight(get(layer)) for layer in layers])

        qkv = [layer.self_attn.qkv_proj for layer in layers]
        tail_size = max(p.quant_tail.out_features if p.quant_tail is not None else 0 for p in qkv)
        qkv_biases = [_split_bias(p) for p in qkv]
        self.out_features = (attn.qkv_proj.out_features, layers[0].mlp.gate_up_proj.out_features, tail_size)
        self.weights = (
            weights(lambda l: l.input_layernorm.weight),
            weights(lambda l: l.post_attention_layernorm.weight),
            matmuls(lambda l: l.self_attn.qkv_proj),
            typed_list([head for head, _ in qkv_biases]),
            typed_list([matmul_tail(p) for p in qkv]),
            typed_list([tail for _, tail in qkv_biases]),
            weights(lambda l: l.self_attn.q_norm.weight) if self.qk_norm else typed_list([np.ones(1, np.float32)]),
            weights(lambda l: l.self_attn.k_norm.weight) if self.qk_norm else typed_list([np.ones(1, np.float32)]),
            matmuls(lambda l: l.self_attn.o_proj),
            biases(lambda l: l.self_attn.o_proj.bias),
            matmuls(lambda l: l.mlp.gate_up_proj),
            biases(lambda l: l.mlp.gate_up_proj.bias),
            matmuls(lambda l: l.mlp.down_proj),
            biases(lambda l: l.mlp.down_proj.bias),
            numpy_view(model.model.norm.weight),
            matmul_weight(model.lm_head),
            np.zeros(0, np.float32),
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_slots: torch.Tensor,
                 slot_mapping: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                 logits_indices: torch.Tensor, shared: Sequence[SharedPrefix] = ()) -> torch.Tensor:
        """One decode step: row i is the newest token of a sequence whose context (itself included) sits in
        slots[i, :lengths[i]], after its cascade group's shared slots if it is in one of `shared`; its K/V go
        to slot_mapping[i]. kv_slots: [2, layers, num_slots, KVH, D]. Returns the logits
        [len(logits_indices), vocab] of the rows in logits_indices."""
        return self.run(input_ids.numpy(), positions.numpy(), kv_slots, slot_mapping.numpy(), slots.numpy(),
                        lengths.numpy(), logits_indices.numpy(), shared)[0]

    def run(self, input_ids: np.ndarray, positions: np.ndarray, kv_slots: torch.Tensor, slot_mapping: np.ndarray,
            slots: np.ndarray, lengths: np.ndarray, logits_indices: np.ndarray,
            shared: Sequence[SharedPrefix] = ()) -> tuple[torch.Tensor, np.ndarray]:
        """__call__ with its index arguments as int64 numpy arrays (the runner builds them so; slots C-ordered):
        no tensor is made only to be taken apart again, each a few microseconds right after a step. Returns the
        logits and each row's greedy token (its largest logit's column, the first of equals, as np.argmax)."""
        cos, sin = self._rotary_rows(positions)
        logits = np.empty((len(logits_indices), self.vocab_size), np.float32)
        greedy = np.empty(len(logits_indices), np.int64)
        group, shared_slots, shared_lengths = cascade_groups(shared, len(input_ids))
        if kv_slots is not self._kv_slots:  # (the same pool every step: its view is made once)
            self._kv_slots, self._kv_view = kv_slots, numpy_view(kv_slots)
        with launch_lock:
            threads = use_threads()
            _step(input_ids, self.embed, cos, sin, self._kv_view, slot_mapping, slots, lengths, group, shared_slots,
                  shared_lengths, logits_indices, *self.weights, *self.out_features,
                  self.num_heads, self.num_kv_heads, self.eps, self.scale, self.qk_norm, threads, logits, greedy)
        return torch.from_numpy(logits), greedy

    def _rotary_rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin [rows, head_dim] of `positions`, rows of a table of the rotary module's own output (grown
        by doubling): a table lookup, where the module's half-dozen small torch ops cost far more a step."""
        needed = int(positions[0] if len(positions) == 1 else positions.max()) + 1  # (numpy's max: 5-10 us cold)
        if needed > len(self._cos):
            size = max(needed, 2 * len(self._cos), 1024)
            with torch.inference_mode():
                cos, sin = self.rotary(torch.arange(size))
            self._cos, self._sin = cos.float().contiguous().numpy(), sin.float().contiguous().numpy()
        if len(positions) == 1:  # a view, not fancy indexing's copy
            return self._cos[needed - 1:needed], self._sin[needed - 1:needed]
        return self._cos[positions], self._sin[positions]


def _split_bias(linear) -> tuple[np.ndarray, np.ndarray]:
    """A Linear's bias as the step reads it: for its rows in `quant` and in `quant_tail` (empty: none)."""
    if linear.bias is None:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    bias = numpy_view(linear.bias)
    head = linear.quant.out_features if linear.quant_tail is not None else len(bias)
    return bias[:head], bias[head:]


def typed_list(items: Sequence) -> List:
    """A numba typed list of `items` (one type), built by the cached functions below. `List(items)` from Python
    compiles the list's own methods for the item type in every new process (numba caches none of them), which
    was most of an engine's start (docs/engine.md)."""
    out = _list_of(items[0])
    for item in items[1:]:
        _append(out, item)
    return out


@njit(cache=kernel_cache.CACHE)
def _list_of(item):
    items = List()
    items.append(item)
    return items


@njit(cache=kernel_cache.CACHE)
def _append(items, item):
    items.append(item)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _rms_norm(x, weight, eps, out):
    """out[m] = weight * x[m] / rms(x[m]) for every row m."""
    for m in range(x.shape[0]):
        total = np.float32(0.0)
        for i in range(x.shape[1]):
            total += x[m, i] * x[m, i]
        inv = np.float32(1.0) / np.float32(math.sqrt(total / x.shape[1] + eps))
        for i in range(x.shape[1]):
            out[m, i] = as_float32(weight[i]) * (x[m, i] * inv)


# error_model="numpy": a float division checked for a zero divisor (numba's default) keeps the loop scalar, 14x
# slower (3.9 against 0.27 us for one row of 1,536, 4% of a batch-1 step at 968 tokens: docs/speed.md#the-decode-step)
@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, error_model="numpy")
def _silu_and_mul(gate_up, out):
    """out = silu(gate) * up, gate and up being the two halves of gate_up's rows."""
    inter = out.shape[1]
    for m in range(out.shape[0]):
        for i in range(inter):
            gate = gate_up[m, i]
            e = fast_exp(-abs(gate))  # the sigmoid from e^-|gate|, which cannot overflow
            sigmoid = np.float32(1.0) / (np.float32(1.0) + e)
            out[m, i] = gate * (sigmoid if gate >= 0 else e * sigmoid) * gate_up[m, inter + i]


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _rotate(heads, cos, sin):
    """Rotary embedding of one row's heads [n, dim], in place."""
    half = heads.shape[1] // 2
    first, second = heads[:, :half], heads[:, half:]
    cos_first, cos_second, sin_first, sin_second = cos[:half], cos[half:], sin[:half], sin[half:]
    for h in range(heads.shape[0]):
        for d in range(half):
            x1, x2 = first[h, d], second[h, d]
            first[h, d] = x1 * cos_first[d] - x2 * sin_first[d]
            second[h, d] = x2 * cos_second[d] + x1 * sin_second[d]


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _head_norm(head, weight, eps):
    """RMS norm of one head's vector (Qwen3's q/k norm), in place."""
    total = np.float32(0.0)
    for d in range(len(head)):
        total += head[d] * head[d]
    inv = np.float32(1.0) / np.float32(math.sqrt(total / len(head) + eps))
    for d in range(len(head)):
        head[d] = as_float32(weight[d]) * (head[d] * inv)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _rope_and_store(m, by_head, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads, q_norm, k_norm, qk_norm,
                    eps, scale, scaled):
    """Row m's q/k/v heads by_head[m] [heads + 2 kv_heads, dim]: rotates q and k in place (after Qwen3's q/k norm),
    writes k and v to the row's slot and the queries times `scale` to scaled[m] [heads, dim]."""
    row, slot, dim = by_head[m], slot_mapping[m], cos.shape[1]
    if qk_norm:
        for h in range(heads + kv_heads):
            _head_norm(row[h], q_norm if h < heads else k_norm, eps)
    _rotate(row[:heads + kv_heads], cos[m], sin[m])
    for h in range(kv_heads):
        key, value = row[heads + h], row[heads + kv_heads + h]
        for d in range(dim):
            k_cache[slot, h, d] = to_element(k_cache, key[d])
            v_cache[slot, h, d] = to_element(v_cache, value[d])
    paged_decode_cpu.scale_queries(by_head[m:m + 1, :heads], scale, scaled[m:m + 1])


# phases of a layer: qkv, rotary and cache writes, attention, o_proj, gate_up, down
LAYER_PHASES = 6


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, parallel=True)
def _step(input_ids, embed, cos, sin, kv, slot_mapping, slots, lengths, group, shared_slots, shared_lengths,
          logits_indices, input_norm, post_norm, qkv_w, qkv_b, qkv_tail_w, qkv_tail_b, q_norm, k_norm, o_w, o_b,
          gate_up_w, gate_up_b, down_w, down_b, final_norm, lm_head, lm_head_b, qkv_size, gate_up_size, tail_size,
          heads, kv_heads, eps, scale, qk_norm, threads, logits, greedy):
    """The step in one parallel region: each of `threads` threads walks every layer's phases (_thread), the
    work of each phase shared by claims (work_phases); the buffers all threads read and write are made here.
    greedy[r]: the column of logits row r's largest value (the first of equals)."""
    rows, hidden = len(input_ids), final_norm.shape[0]
    x = np.empty((rows, hidden), np.float32)  # the step computes in float32 whatever the weights
    for m in range(rows):
        embed_row(embed, input_ids[m], x[m])
    dim = cos.shape[1]
    qkv = np.empty((rows, qkv_size), np.float32)
    tail = np.empty((rows, tail_size), np.float32)  # the products of qkv's tail rows (Linear.quant_tail)
    scaled = np.empty((rows, heads, dim), np.float32)
    gate_up = np.empty((rows, gate_up_size), np.float32)
    plan = paged_decode_cpu.plan(lengths, group, shared_lengths, threads, heads // kv_heads, dim)
    partials = paged_decode_cpu.new_partials(plan, heads, dim)
    counters = work_phases.new_counters(len(qkv_w) * LAYER_PHASES + 1)
    best = np.empty((threads, len(logits_indices)), np.int64)  # each lm_head run's largest logit, per row
    for _ in prange(threads):
        _thread(x, qkv, tail, scaled, gate_up, plan, partials, counters, cos, sin, kv, slot_mapping, slots,
                shared_slots, logits_indices, input_norm, post_norm, qkv_w, qkv_b, qkv_tail_w, qkv_tail_b, q_norm,
                k_norm, o_w, o_b, gate_up_w, gate_up_b, down_w, down_b, final_norm, lm_head, lm_head_b, heads,
                kv_heads, eps, scale, qk_norm, threads, logits, best)
    _greedy_of_runs(logits, best, min(tile_count(lm_head), threads), greedy)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _thread(x, qkv, tail, scaled, gate_up, plan, partials, counters, cos, sin, kv, slot_mapping, slots,
            shared_slots, logits_indices, input_norm, post_norm, qkv_w, qkv_b, qkv_tail_w, qkv_tail_b, q_norm,
            k_norm, o_w, o_b, gate_up_w, gate_up_b, down_w, down_b, final_norm, lm_head, lm_head_b, heads, kv_heads,
            eps, scale, qk_norm, threads, logits, best):
    """One thread's walk through the step. The small ops whose output every thread reads in full (the norms,
    the merge of the attention's partials, silu-and-mul) each thread does for itself into its own buffers, which
    costs no wait; the matmuls, the rows' rotary and cache writes and the attention's bins are claimed."""
    rows, hidden, dim = x.shape[0], x.shape[1], cos.shape[1]
    normed = np.empty_like(x)
    attn = np.empty((rows, heads * dim), np.float32)
    act = np.empty((rows, gate_up.shape[1] // 2), np.float32)
    # q heads, k heads, v heads: indexed by loop counters only, measured faster than computed indices like
    # q_size + h * dim + d, which numba checks for wraparound (docs/speed.md#the-decode-step)
    by_head = qkv.reshape(rows, heads + 2 * kv_heads, dim)
    merged = attn.reshape(rows, heads, dim)
    bins = paged_decode_cpu.bins(plan)
    phase = np.int64(0)  # (a literal 0 gives the inlined phases' first claims a type of their own)
    for layer in range(len(qkv_w)):
        k_cache, v_cache = kv[0, layer], kv[1, layer]
        _rms_norm(x, input_norm[layer], eps, normed)
        _stacked_phase(normed, qkv_w[layer], qkv_b[layer], qkv, qkv_tail_w[layer], qkv_tail_b[layer], tail,
                       counters, phase, threads)
        phase += 1
        tail_from = tile_count(qkv_w[layer]) * TILE if tile_count(qkv_tail_w[layer]) else qkv.shape[1]
        for m in work_phases.claimed(counters, phase, rows):
            qkv[m, tail_from:] = tail[m, :qkv.shape[1] - tail_from]
            _rope_and_store(m, by_head, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads,
                            q_norm[layer if qk_norm else 0], k_norm[layer if qk_norm else 0], qk_norm, eps, scale,
                            scaled)
        phase += 1
        for b in work_phases.claimed(counters, phase, bins):
            paged_decode_cpu.run_bin(plan, b, scaled, k_cache, v_cache, slots, shared_slots, partials)
        phase += 1
        for m in range(rows):
            paged_decode_cpu.merge_row(plan, partials, m, merged[m])
        _matmul_phase(attn, o_w[layer], o_b[layer], x, True, counters, phase, threads)  # the residual add folded in
        phase += 1
        _rms_norm(x, post_norm[layer], eps, normed)
        _matmul_phase(normed, gate_up_w[layer], gate_up_b[layer], gate_up, False, counters, phase, threads)
        phase += 1
        _silu_and_mul(gate_up, act)
        _matmul_phase(act, down_w[layer], down_b[layer], x, True, counters, phase, threads)
        phase += 1
    last = np.empty((len(logits_indices), hidden), np.float32)
    for r in range(len(logits_indices)):
        last[r] = x[logits_indices[r]]
    _rms_norm(last, final_norm, eps, last)
    _lm_head_phase(last, lm_head, lm_head_b, logits, counters, phase, threads, best)


# the phases are inlined into _thread: numba links a callee's code into each caller's module and optimizes and
# compiles it there again, so every function between the step and the kernels costs a compile of all of them
@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _lm_head_phase(x, weight, bias, logits, counters, phase, threads, best):
    """_matmul_phase for the lm_head, where the thread that computes a run of columns also finds each row's
    largest logit among them (best[run, row]) while they are in its cache: the sampler's argmax over the whole
    row took 31 us right after a step against 3.5 us warm (half the row in the other core's cache)."""
    tiles = tile_count(weight)
    runs = min(tiles, threads)
    for c in work_phases.claimed(counters, phase, runs):
        first, end = c * tiles // runs, (c + 1) * tiles // runs
        linear_tiles(x, weight, bias, logits, False, first, end)
        for r in range(logits.shape[0]):
            best[c, r] = _first_largest(logits[r], first * TILE, min(end * TILE, logits.shape[1]))


@njit(nogil=True, cache=kernel_cache.CACHE)
def _greedy_of_runs(logits, best, runs, greedy):
    """greedy[r] = the first column of logits[r]'s largest value, from the largest of each of the `runs` runs of
    columns (best[c, r], runs in column order: a later run wins by a larger value only)."""
    for r in range(logits.shape[0]):
        column = best[0, r]
        for c in range(1, runs):
            if logits[r, best[c, r]] > logits[r, column]:
                column = best[c, r]
        greedy[r] = column


@njit(nogil=True, cache=kernel_cache.CACHE)  # (no fastmath: an infinite logit compares as it is)
def _first_largest(row, start, end):
    """The first column of row[start:end] (start < end) that holds its largest value: that value by vectors
    (_largest), then a scan for it (a loop keeping the index does not vectorize). Logits are finite or
    infinite; a NaN row's pick is unspecified (np.argmax would take its first NaN)."""
    vectors = (end - start) // simd.LANES
    top = _largest(row[start:], vectors) if vectors else row[start]
    for j in range(start + vectors * simd.LANES, end):
        top = max(top, row[j])
    for j in range(start, end):
        if row[j] == top:
            return j
    return start


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")  # (as _lm_head_phase)
def _stacked_phase(x, weight, bias, out, tail, tail_bias, tail_out, counters, phase, threads):
    """_matmul_phase of a weight whose last rows have tiles of their own (Linear.quant_tail; none: an empty
    `tail`): the tiles of both shared out as one run, the tail's products into tail_out. One call of the kernel
    for either (each call site compiles the kernel again)."""
    head_tiles = tile_count(weight)
    tiles = head_tiles + tile_count(tail)
    chunks = min(tiles, threads)
    for c in work_phases.claimed(counters, phase, chunks):
        first, end = c * tiles // chunks, (c + 1) * tiles // chunks
        while first < end:
            if first < head_tiles:
                w, b, into, offset, stop = weight, bias, out, 0, min(end, head_tiles)
            else:
                w, b, into, offset, stop = tail, tail_bias, tail_out, head_tiles, end
            linear_tiles(x, w, b, into, False, first - offset, stop - offset)
            first = stop


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")  # (as _lm_head_phase)
def _matmul_phase(x, weight, bias, out, accumulate, counters, phase, threads):
    """out (+)= x @ weight.T + bias by the threads of the region, each claiming an equal run of tiles (one stream
    of the weight; 4 runs a thread, claimed in turn, measured slower); returns when the whole product is done."""
    tiles = tile_count(weight)
    chunks = min(tiles, threads)
    for c in work_phases.claimed(counters, phase, chunks):
        linear_tiles(x, weight, bias, out, accumulate, c * tiles // chunks, (c + 1) * tiles // chunks)
