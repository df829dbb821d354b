"""The Triton paged prefill kernel (CUDA steps with a prefill chunk) against gathered K/V, an explicit causal mask
and a softmax in float64, on CUDA where there is one and through Triton's interpreter on CPU (conftest sets
TRITON_INTERPRET there): varlen rows (prefill chunks and decodes in one launch), chunks that start mid-block after
a cache hit, GQA, planted score spikes; then the hook in paged_attention and whole engine steps through it."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.attention import AttentionMetadata, BlockTableBatch, DecodeBatch, PrefillSeq, paged_attention, store_kv
from tests.support.machine import KERNEL_DEVICE as DEVICE, triton_module

pytestmark = pytest.mark.slow  # off CUDA, Triton's interpreter runs each kernel in Python

paged_prefill_cuda = triton_module("paged_prefill_cuda")

# Cases that check the kernel on more shapes and dtypes run with coverage paused: Triton's interpreter under
# coverage's line tracer takes three times its CPU, and they reach no line of engine/ that the first reference
# case and the engine's steps below do not (checked with --cov-context=test over the whole suite)
more_cases = pytest.mark.no_cover
SMALL_TILES = (32, 16, 4, 2)  # 16 keys a tile on CUDA as in the interpreter: short test contexts cross several


def _reference(q, k_cache, v_cache, block_tables, query_starts, context_lens, scale, block_size):
    """Each row's context gathered through its block table; query i of a row of n queries over c tokens sees
    positions <= c - n + i; softmax in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    group = q.shape[1] // k_cache.shape[1]
    for row, length in enumerate(context_lens.tolist()):
        first, last = query_starts[row].item(), query_starts[row + 1].item()
        positions = torch.arange(length, device=q.device)
        slots = block_tables[row, positions // block_size].long() * block_size + positions % block_size
        keys = k_cache[slots].double().transpose(0, 1).repeat_interleave(group, 0)  # [H, c, D]
        values = v_cache[slots].double().transpose(0, 1).repeat_interleave(group, 0)
        query_positions = torch.arange(length - (last - first), length, device=q.device)
        seen = positions[None, :] <= query_positions[:, None]  # [n, c]
        scores = torch.einsum("nhd,hcd->hnc", q[first:last].double(), keys) * scale
        weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[first:last] = torch.einsum("hnc,hcd->nhd", weights, values)
    return out


def _case(heads, kv_heads, dim, block_size, rows, cache_dtype=torch.float32, seed=0):
    """rows: (queries, context length) per row. Scattered blocks, never shared, a table wider than any row needs
    (unused tail columns point nowhere, as in a real table)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-context // block_size) for _, context in rows]
    num_blocks = sum(needed) + 4
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen).to(cache_dtype)
    order = torch.randperm(num_blocks, generator=gen)
    width = max(needed) + 2
    tables = [torch.cat([order[sum(needed[:r]):sum(needed[:r + 1])], torch.full((width - n,), 10**6)])
              for r, n in enumerate(needed)]
    block_tables = torch.stack(tables).int()
    query_starts = torch.tensor([0] + [n for n, _ in rows]).cumsum(0).int()
    q = torch.randn(int(query_starts[-1]), heads, dim, generator=gen)
    context_lens = torch.tensor([c for _, c in rows], dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k_cache, v_cache, block_tables, query_starts, context_lens)]


def _run(case, scale, block_size):
    out = paged_prefill_cuda.paged_prefill(*case, scale, block_size)
    return out, _reference(*case, scale, block_size)


@pytest.mark.parametrize("heads,kv_heads,dim,block_size,rows", [
    # groups of 3 (SmolLM2's): a chunk of 11 after a 26-token cache hit (mid-block), decodes of 50 and 3 tokens,
    # a whole 20-token prompt from position 0 (several query tiles)
    (6, 2, 64, 8, [(11, 37), (1, 50), (20, 20), (1, 3)]),
    # no GQA; blocks the size of the interpreter's key tile
    pytest.param(4, 4, 64, 16, [(40, 40), (1, 17), (7, 30)], marks=more_cases),
    # head size 128, blocks smaller than a key tile, a 1-token context
    pytest.param(3, 1, 128, 4, [(1, 9), (5, 21), (1, 1)], marks=more_cases),
    pytest.param(2, 2, 64, 32, [(17, 70), (1, 33)], marks=more_cases),  # blocks larger than a key tile
    # head size 128 without GQA: a chunk after a 25-token hit, a decode first
    pytest.param(2, 2, 128, 16, [(1, 30), (20, 45)], marks=more_cases),
])
def test_kernel_matches_reference(heads, kv_heads, dim, block_size, rows):
    case = _case(heads, kv_heads, dim, block_size, rows)
    out, expected = _run(case, dim ** -0.5, block_size)
    assert out.dtype == case[0].dtype and out.shape == case[0].shape
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@more_cases
@pytest.mark.parametrize("tiles", [(32, 16, 4, 2), (16, 32, 2, 1)])
def test_tiles_given_by_the_caller_compute_the_same_attention(tiles):
    """bench.prefill --kernel-sweep times other tile shapes, warps and stages: each must still be the function."""
    block_size = 8
    case = _case(8, 2, 64, block_size, [(11, 37), (1, 50), (20, 20)])
    out = paged_prefill_cuda.paged_prefill(*case, 0.125, block_size, tiles=tiles)
    torch.testing.assert_close(out.double(), _reference(*case, 0.125, block_size), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keys_per_split", [16, 48])
def test_keys_split_across_programs_compute_the_same_attention(keys_per_split):
    """A small step's keys split over several programs and merged (what split_keys asks for when a step's programs
    are too few to fill the GPU): a chunk after a mid-block cache hit, decodes, a whole prompt from position 0,
    a 1-token context. Splits past a query's position leave it empty (weight 0): the merge must not count them.
    (Key tiles of 16 on CUDA too, whose own are 64: splits must be whole tiles, and these contexts are short.)"""
    block_size = 8
    case = _case(6, 2, 64, block_size, [(11, 37), (1, 50), (20, 20), (1, 1)])
    out = paged_prefill_cuda.paged_prefill(*case, 0.125, block_size, tiles=SMALL_TILES, keys_per_split=keys_per_split)
    torch.testing.assert_close(out.double(), _reference(*case, 0.125, block_size), rtol=1e-5, atol=1e-5)


def test_split_keys_splits_only_steps_too_small_to_fill_the_gpu():
    cpu = torch.device("cpu")  # Triton's interpreter counts as 8 multiprocessors
    assert paged_prefill_cuda.split_keys(8, 4096, 16, cpu) == 0  # enough programs: one walk each, no merge
    assert paged_prefill_cuda.split_keys(2, 4096, 16, cpu) == 128  # 4,096 keys in at most 32 splits of 128
    assert paged_prefill_cuda.split_keys(2, 300, 16, cpu) == 64  # at least 4 key tiles a program
    assert paged_prefill_cuda.split_keys(2, 64, 16, cpu) == 0  # one split would hold the whole context


def test_rows_without_queries_do_not_count_as_working_programs(monkeypatch):
    """A prefill graph's bucket has a row per possible request, most of them empty: 4 tokens in 6 rows number
    4 // tile_q + 6 tiles a kv head, of which at most 4 hold a query. The split is asked for 4 x kv heads."""
    asked = []
    choose = paged_prefill_cuda.split_keys
    monkeypatch.setattr(paged_prefill_cuda, "split_keys", lambda *args: asked.append(args[0]) or choose(*args))
    block_size = 8
    case = _case(4, 2, 64, block_size, [(1, 30), (1, 9), (2, 70), (0, 1), (0, 1), (0, 1)])
    out = paged_prefill_cuda.paged_prefill(*case, 0.125, block_size)
    assert asked == [4 * 2]
    torch.testing.assert_close(out.double(), _reference(*case, 0.125, block_size), rtol=1e-5, atol=1e-5)


@more_cases
def test_planted_score_spikes_rescale_the_running_softmax():
    """Keys whose dot products with the row's queries dwarf the rest: a first spike early in the context, a far
    larger one in a later key tile. Queries that see the second must drop what they summed under the first
    maximum (weights e^-80 smaller); queries before it keep the first."""
    heads, kv_heads, dim, block_size = 6, 2, 64, 8
    rows = [(11, 37), (1, 50), (20, 20)]
    q, k_cache, v_cache, block_tables, query_starts, context_lens = _case(heads, kv_heads, dim, block_size, rows,
                                                                          seed=1)
    direction = torch.randn(dim, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    direction *= dim ** 0.5 / direction.norm()  # |direction|^2 = dim
    q += 2 * direction  # every query leans towards the spikes
    for row, (early, late) in enumerate([(2, 20), (5, 44), (1, 17)]):  # in different key tiles of the interpreter's
        for position, height in ((early, 5), (late, 10)):  # scores of about 80 and 160 at the scale below
            slot = block_tables[row, position // block_size].long() * block_size + position % block_size
            k_cache[slot] = height * direction
    case = (q, k_cache, v_cache, block_tables, query_starts, context_lens)
    out, expected = _run(case, dim ** -0.5, block_size)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # keys split in 16s: the spikes fall in different splits, and the merge must rescale across them
    split = paged_prefill_cuda.paged_prefill(*case, dim ** -0.5, block_size, tiles=SMALL_TILES, keys_per_split=16)
    torch.testing.assert_close(split.double(), expected, rtol=1e-5, atol=1e-5)
    # the spikes decide: the chunk's queries (context positions 26-36) see both and read the later one's value;
    # the whole prompt's queries at positions 1-16 see only the first spike, those from 17 the second
    def value_at(row, position):
        slot = block_tables[row, position // block_size].long() * block_size + position % block_size
        return v_cache[slot].double().repeat_interleave(heads // kv_heads, 0)  # [heads, dim]

    prompt = out[12:32].double()
    torch.testing.assert_close(out[:11].double(), value_at(0, 20).expand(11, -1, -1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prompt[1:17], value_at(2, 1).expand(16, -1, -1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prompt[17:], value_at(2, 17).expand(3, -1, -1), rtol=1e-4, atol=1e-4)


@more_cases
def test_a_bf16_cache_for_fp32_queries():
    case = _case(6, 2, 64, 16, [(9, 40), (1, 33)], torch.bfloat16, seed=3)
    out, expected = _run(case, 0.125, 16)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@more_cases
def test_bf16_queries_over_a_bf16_cache():
    """A bf16 model: 16-bit dots with float32 sums on CUDA, within bf16's rounding of the exact result (in the
    interpreter the kernel keeps float32 dots: its 16-bit dots are wrong)."""
    q, *rest = _case(6, 2, 64, 16, [(9, 40), (1, 33)], torch.bfloat16, seed=4)
    out, expected = _run((q.to(torch.bfloat16), *rest), 0.125, 16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2)


def test_supports_power_of_two_head_sizes_only():
    assert [d for d in (16, 64, 80, 96, 128, 256) if paged_prefill_cuda.supports(d)] == [16, 64, 128, 256]


def test_paged_attention_through_block_tables_equals_the_gather_path():
    """One mixed step through paged_attention's hook (BlockTableBatch.build from the runner's rows) and through the
    gather path (slot lists, a causal mask, a decode batch): the same outputs."""
    heads, kv_heads, dim, block_size = 6, 2, 64, 4
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 40 * block_size, kv_heads, dim, generator=gen).to(DEVICE)
    # a chunk of 6 tokens after a 9-token cache hit, then a decode at context 14
    tables, chunk = [[7, 3, 12, 30], [20, 1, 2, 9]], (9, 15)
    slots = [[t[p // block_size] * block_size + p % block_size for p in range(n)] for t, n in zip(tables, (15, 14))]
    new_slots = torch.tensor(slots[0][9:] + slots[1][-1:], device=DEVICE)
    q, k, v = (torch.randn(7, h, dim, generator=gen).to(DEVICE) for h in (heads, kv_heads, kv_heads))
    positions = torch.arange(*chunk, device=DEVICE)
    mask = torch.arange(15, device=DEVICE)[None, :] <= positions[:, None]
    gathered = AttentionMetadata(new_slots, [PrefillSeq(0, 6, torch.tensor(slots[0], device=DEVICE), mask)],
                                 DecodeBatch(torch.tensor([6], device=DEVICE), torch.tensor([slots[1]], device=DEVICE),
                                             torch.tensor([14], device=DEVICE), None, []))
    batch = BlockTableBatch.build([(6, tables[0], 15), (1, tables[1], 14)], block_size, DEVICE)
    by_tables = AttentionMetadata(new_slots, [], None, batch)
    store_kv(k, v, kv[0], kv[1], new_slots)
    expected = paged_attention(q, kv[0], kv[1], gathered, dim ** -0.5)
    out = paged_attention(q, kv[0], kv[1], by_tables, dim ** -0.5)
    assert batch.block_tables.tolist() == [[7, 3, 12, 30], [20, 1, 2, 9]]
    assert batch.query_starts.tolist() == [0, 6, 7] and batch.context_lens.tolist() == [15, 14]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _gather_and_kernel_paths(model_dir, send, **engine):
    """send(llm) -> outputs, run on an engine of each path: (the gather path's, the kernel's)."""
    results = []
    for use_kernel in (False, True):
        llm = LLM(str(model_dir), device=DEVICE.type, dtype="float32", block_size=4, cpu_kernels="eager",
                  enforce_eager=True, **engine)
        llm.core.runner.prefill_kernel = use_kernel
        results.append(send(llm))
    return results


def _same_answers(ours, theirs):
    for mine, other in zip(ours, theirs, strict=True):
        assert mine.token_ids == other.token_ids
        assert [t.logprob for t in mine.logprobs] == pytest.approx([t.logprob for t in other.logprobs], abs=1e-4)


def test_engine_steps_through_the_kernel_give_the_gather_paths_answers(tiny_llama_dir, monkeypatch):
    """The runner's mixed steps (chunks of 6 tokens, so chunks start mid-block, decodes beside them, a second
    wave of prompts hitting the first's cached blocks) through the kernel: the same greedy tokens and logprobs as
    the gather path (on CPU the kernel is switched on by hand; CUDA turns it on by itself)."""
    calls = []
    kernel = paged_prefill_cuda.paged_prefill
    monkeypatch.setattr(paged_prefill_cuda, "paged_prefill", lambda *args: calls.append(1) or kernel(*args))
    prompts = [list(range(3, 20)), list(range(60, 71))]
    # hits of 16 and 8 tokens; the first one's rest, 10 tokens, comes in chunks from 16 and from 22 (mid-block)
    second_wave = [prompts[0] + list(range(30, 39)), prompts[1][:9] + [50]]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True)
    gather, kernel_path = _gather_and_kernel_paths(
        tiny_llama_dir, lambda llm: llm.generate(prompts, params) + llm.generate(second_wave, params),
        num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=6)
    assert calls and [r.num_cached_tokens for r in kernel_path] == [0, 0, 16, 8]
    _same_answers(kernel_path, gather)


def test_a_cached_prompts_last_block_splits_its_keys_as_the_gather_path_answers(tiny_llama_dir, monkeypatch):
    """A 100-token prompt sent twice: the second send computes its last block alone over the 96 cached tokens, a
    step of two programs (one query tile for each kv head), fewer than the interpreter's 8 "multiprocessors", so
    its keys are split (64 a program) and merged. Its greedy tokens and logprobs are the gather path's."""
    splits = []
    choose = paged_prefill_cuda.split_keys
    monkeypatch.setattr(paged_prefill_cuda, "split_keys", lambda *args: splits.append(choose(*args)) or splits[-1])
    prompt = [(7 * i) % 500 + 3 for i in range(100)]
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)
    gather, kernel_path = _gather_and_kernel_paths(
        tiny_llama_dir, lambda llm: [llm.generate(prompt, params)[0] for _ in range(2)],
        num_kv_blocks=128, max_num_seqs=2, max_num_batched_tokens=128)
    assert [r.num_cached_tokens for r in kernel_path] == [0, 96]
    if DEVICE.type == "cpu":  # (on a GPU 100 keys are fewer than one split's 256: nothing to split)
        assert 64 in splits  # the cached send's step (the uncached one has 13 query tiles a kv head: no split)
    _same_answers(kernel_path, gather)
