"""The Triton paged decode kernel (CUDA graphs' attention) against gather + softmax, on CUDA where there is
one and through Triton's interpreter on CPU (conftest sets TRITON_INTERPRET there), so CI checks its
block-table addressing, partitions and merge without a GPU."""
from __future__ import annotations

import pytest
import torch

from engine.model.attention import AttentionMetadata, DecodeBatch
from engine.model.decode_graph_cuda import GraphDecode
from engine.model.llama import head_dim
from engine.model.loader import load_model
from engine.model.model_config import load_config
from tests.support.machine import KERNEL_DEVICE as DEVICE, triton_module

pytestmark = pytest.mark.slow  # off CUDA, Triton's interpreter runs each kernel in Python

paged_decode_cuda = triton_module("paged_decode_cuda")

# Cases that check the kernel on more shapes and dtypes run with coverage paused: Triton's interpreter under
# coverage's line tracer takes three times its CPU, and they reach no line of engine/ that the first reference
# case and the model's steps below do not (checked with --cov-context=test over the whole suite)
more_cases = pytest.mark.no_cover


def _reference(q, k_cache, v_cache, block_tables, context_lens, scale, block_size):
    """Each row's context gathered through its block table, softmax in float64."""
    out = []
    group = q.shape[1] // k_cache.shape[1]
    for row, length in enumerate(context_lens.tolist()):
        positions = torch.arange(length, device=q.device)
        slots = block_tables[row, positions // block_size].long() * block_size + positions % block_size
        keys = k_cache[slots].double().transpose(0, 1).repeat_interleave(group, 0)  # [H, n, D]
        values = v_cache[slots].double().transpose(0, 1).repeat_interleave(group, 0)
        weights = (torch.einsum("hd,hnd->hn", q[row].double(), keys) * scale).softmax(-1)
        out.append(torch.einsum("hn,hnd->hd", weights, values))
    return torch.stack(out)


def _case(heads, kv_heads, dim, block_size, lengths, cache_dtype, seed=0, width=None):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 4
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen).to(cache_dtype)
    width = width or max(-(-n // block_size) for n in lengths) + 3  # unused tail columns, as in a real table
    # scattered blocks, never shared between rows (the pool hands each row its own)
    order = torch.randperm(num_blocks, generator=gen)
    tables, used = [], 0
    for n in lengths:
        need = -(-n // block_size)
        tables.append(torch.cat([order[used:used + need], torch.full((width - need,), 10**6)]))
        used += need
    block_tables = torch.stack(tables).int()
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    context_lens = torch.tensor(lengths, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k_cache, v_cache, block_tables, context_lens)]


@pytest.mark.parametrize("heads,kv_heads,dim,block_size,lengths", [
    (9, 3, 64, 16, [1000, 1, 257]),  # SmolLM2's heads; many partitions of 64
    pytest.param(4, 2, 16, 1, [3, 255, 256], marks=more_cases),  # the tiny test models; block size 1
    pytest.param(8, 8, 128, 64, [513], marks=more_cases),  # no GQA, head size 128
    pytest.param(12, 1, 32, 16, [40, 17], marks=more_cases),  # one kv head for 12 query heads (group padded to 16)
])
def test_kernel_matches_reference(heads, kv_heads, dim, block_size, lengths):
    q, k_cache, v_cache, block_tables, context_lens = _case(heads, kv_heads, dim, block_size, lengths, torch.float32)
    scale = dim ** -0.5
    out = paged_decode_cuda.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, block_size)
    expected = _reference(q, k_cache, v_cache, block_tables, context_lens, scale, block_size)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@more_cases
def test_partitions_grow_with_the_table_width():
    """A table for 200 blocks of 64 (12,800 tokens) takes partitions of 128, so a row has at most 100 partials."""
    q, k_cache, v_cache, block_tables, context_lens = _case(4, 2, 16, 64, [700, 64, 129], torch.float32, seed=4,
                                                            width=200)
    out = paged_decode_cuda.paged_decode(q, k_cache, v_cache, block_tables, context_lens, 0.25, 64)
    expected = _reference(q, k_cache, v_cache, block_tables, context_lens, 0.25, 64)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@more_cases
def test_kernel_reads_a_bf16_cache_for_fp32_queries():
    q, k_cache, v_cache, block_tables, context_lens = _case(9, 3, 64, 16, [300, 20], torch.bfloat16, seed=3)
    out = paged_decode_cuda.paged_decode(q, k_cache, v_cache, block_tables, context_lens, 0.125, 16)
    expected = _reference(q, k_cache, v_cache, block_tables, context_lens, 0.125, 16)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@more_cases
def test_bf16_queries_over_a_bf16_cache_take_16_bit_dots():
    """A bf16 model: scores and weighted values in bf16 operands with float32 sums (the weights rounded to bf16
    for the second dot), within bf16's rounding of the exact result. (On CPU, in Triton's interpreter, the kernel
    keeps float32 dots: the interpreter's 16-bit dots are wrong.)"""
    q, k_cache, v_cache, block_tables, context_lens = _case(9, 3, 64, 16, [300, 20, 1], torch.bfloat16, seed=6)
    q = q.to(torch.bfloat16)
    out = paged_decode_cuda.paged_decode(q, k_cache, v_cache, block_tables, context_lens, 0.125, 16)
    expected = _reference(q, k_cache, v_cache, block_tables, context_lens, 0.125, 16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2)


def test_supports_power_of_two_head_sizes_only():
    assert [d for d in (16, 64, 80, 96, 128, 256) if paged_decode_cuda.supports(d)] == [16, 64, 128, 256]


def test_graph_inputs_step_equals_the_slot_path(tiny_llama_dir):
    """A decode step of the whole model as a graph records it (GraphDecode, run eagerly: 3 rows padded to 4,
    attention through block tables) against the per-row slot lists of DecodeBatch: the same logits and the same K/V written; the
    padding row repeats the last one."""
    config = load_config(tiny_llama_dir)
    model = load_model(tiny_llama_dir, config, torch.float32, DEVICE, pack=False)
    block_size, lengths = 4, [9, 30, 1]
    layers, kv_heads, dim = config.num_hidden_layers, config.num_key_value_heads, head_dim(config)
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(2, layers, 64 * block_size, kv_heads, dim, generator=gen).to(DEVICE)
    tables = [[7, 3, 12], [20, 1, 2, 40, 41, 42, 50, 51], [9]]
    slots = [[t[p // block_size] * block_size + p % block_size for p in range(n)] for t, n in zip(tables, lengths)]
    ids, positions, new_slots = [5, 17, 33], [n - 1 for n in lengths], [s[-1] for s in slots]
    rows = torch.arange(3, device=DEVICE)
    padded = torch.zeros(3, max(lengths), dtype=torch.long)
    for row, s in enumerate(slots):
        padded[row, :len(s)] = torch.tensor(s)
    by_slots = DecodeBatch(rows, padded.to(DEVICE), torch.tensor(lengths, device=DEVICE), None, [],
                           paged_kernel=DEVICE.type == "cpu")  # on CPU the paged kernel reads the lengths
    if DEVICE.type == "cuda":  # the slot path's padding needs its -inf bias there
        bias = torch.zeros(3, 1, 1, max(lengths), device=DEVICE)
        for row, n in enumerate(lengths):
            bias[row, ..., n:] = float("-inf")
        by_slots.bias = bias
    kv_by_slots, kv_by_tables = kv.clone(), kv.clone()
    expected = model(torch.tensor(ids, device=DEVICE), torch.tensor(positions, device=DEVICE), kv_by_slots,
                     AttentionMetadata(torch.tensor(new_slots, device=DEVICE), [], by_slots), rows)
    graphs = GraphDecode(model, kv_by_tables, block_size, max_rows=8, max_model_len=40)  # (not captured: eager)
    assert graphs.batch_sizes == [1, 2, 4, 8] and graphs.graph_rows(3) == 4 and graphs.max_rows == 8
    inputs = graphs.inputs
    inputs.fill(4, ids, positions, new_slots, tables, lengths)
    assert inputs.tokens[:, 3].tolist() == inputs.tokens[:, 2].tolist() == [33, 0, 9 * block_size]
    assert inputs.context_lens[:4].tolist() == [9, 30, 1, 1] and inputs.block_tables[3, 0] == 9
    logits = graphs.forward(4)  # the step a replay of the 4-row graph runs
    torch.testing.assert_close(logits[:3], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[3], logits[2])
    torch.testing.assert_close(kv_by_tables, kv_by_slots, rtol=1e-5, atol=1e-5)
