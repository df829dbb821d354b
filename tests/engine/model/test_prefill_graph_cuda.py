"""Steps with a prefill chunk replayed from CUDA graphs: the padded inputs (on any device), and on CUDA the eager
steps' tokens and logits."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model import attention, llama
from engine.model.prefill_graph_cuda import TOKEN_BUCKETS, GraphPrefill, PrefillGraphInputs, prefill_token_buckets
from tests.support.machine import triton_module

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_buckets_end_at_the_first_that_holds_the_token_budget():
    assert prefill_token_buckets(7) == [16]
    assert prefill_token_buckets(16) == [16]
    assert prefill_token_buckets(100) == [16, 32, 64, 128]
    assert prefill_token_buckets(512) == [16, 32, 64, 128, 256, 384, 512]
    assert prefill_token_buckets(100_000) == list(TOKEN_BUCKETS)


def test_a_step_is_padded_with_one_row_of_unstored_tokens_and_empty_rows():
    """Two rows (a 3-token chunk ending a 7-token context mid-block, a decode at context 9) in the 16-token
    bucket of a runner of at most 4 rows: 12 padding tokens in row 2 with slot -1, reading block 0, and row 3
    empty; each row's logits from its last token."""
    inputs = PrefillGraphInputs(tokens=32, rows=4, max_blocks=6, block_size=4, device=torch.device("cpu"))
    rows = [(3, [5, 2, 8], 7), (1, [4, 6, 1], 9)]
    inputs.fill(16, 4, [11, 12, 13, 14], [4, 5, 6, 8], [9, 10, 11, 32], rows)
    ids, positions, meta, logits_rows = inputs.step(16, 4)
    assert ids.tolist() == [11, 12, 13, 14] + [0] * 12
    assert positions.tolist() == [4, 5, 6, 8] + [0] * 12
    assert meta.slot_mapping.tolist() == [9, 10, 11, 32] + [-1] * 12
    batch = meta.block_table_batch
    assert batch.query_starts.tolist() == [0, 3, 4, 16, 16, 16]
    assert batch.context_lens.tolist() == [7, 9, 12, 12, 12]
    assert batch.block_tables[:3, :3].tolist() == [[5, 2, 0], [4, 6, 1], [0, 0, 0]]
    assert logits_rows.tolist() == [2, 3, 15, 15, 15]
    assert meta.prefills == [] and meta.decodes is None and batch.block_size == 4
    # a smaller bucket after a larger one: only its own slice is read
    inputs.fill(16, 4, [7] * 16, list(range(16)), list(range(16)), [(16, [1, 2, 3, 4], 16)])
    _, _, meta, logits_rows = inputs.step(16, 4)
    assert meta.slot_mapping.tolist() == list(range(16))
    assert meta.block_table_batch.query_starts.tolist() == [0, 16, 16, 16, 16, 16]
    assert logits_rows.tolist() == [15, 15, 15, 15, 15]


@pytest.mark.slow  # off CUDA, Triton's interpreter runs the prefill kernel in Python
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's twin of the test below, which runs on CUDA")
def test_a_padded_step_gives_the_eager_steps_logits_and_kv(tiny_llama_dir, monkeypatch):
    """What a recorded step computes, run eagerly on CPU through the interpreter's kernel: every step of chunked
    prompts beside decodes, then cache hits, padded to its bucket (GraphPrefill.forward over the filled buffers)
    against the runner's own step from the same K/V. The same logits and K/V afterwards, and no slot but the
    step's written: the padding row stores nothing (CUDA's fused store skips slot -1; on CPU the eager store is told to) and changes no real
    row."""
    triton_module("paged_prefill_cuda")
    store = attention.store_kv
    monkeypatch.setattr(llama, "store_kv", lambda k, v, k_cache, v_cache, slots: store(
        k[slots >= 0], v[slots >= 0], k_cache, v_cache, slots[slots >= 0]))
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
              cpu_kernels="eager", max_num_seqs=4, max_num_batched_tokens=6, enforce_eager=True)
    runner = llm.core.runner
    runner.prefill_kernel = True
    graphs = GraphPrefill(runner.model, runner.kv_slots, 4, max_rows=4, max_tokens=6, max_model_len=64)
    assert graphs.buckets == [16] and graphs.holds(6, 4) and not graphs.holds(17, 1) and not graphs.holds(6, 5)
    execute, compared = runner.execute, []

    def both(chunks):
        ids, positions, slots, rows, sampled_rows = [], [], [], [], []
        for i, chunk in enumerate(chunks):
            request = chunk.request
            start, end = request.num_computed_tokens, request.num_computed_tokens + chunk.num_tokens
            block_ids = runner.kv.block_ids(request.request_id)
            ids += request.all_token_ids[start:end]
            positions += range(start, end)
            slots += runner.kv.slots(request.request_id)[start:end].tolist()
            rows.append((chunk.num_tokens, block_ids, end))
            if end == request.num_tokens:
                sampled_rows.append(i)
        before = runner.kv_slots.clone()
        graphs.inputs.fill(16, 4, ids, positions, slots, rows)
        padded = graphs.forward(16)[:len(rows)][sampled_rows]
        padded_kv = runner.kv_slots.clone()
        runner.kv_slots.copy_(before)
        logits, sampled = execute(chunks)
        torch.testing.assert_close(padded, logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded_kv, runner.kv_slots, rtol=1e-5, atol=1e-5)  # (other matmul shapes)
        untouched = torch.ones(runner.kv_slots.shape[2], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(padded_kv[:, :, untouched], before[:, :, untouched])  # the padding stored nothing
        compared.append(len(rows))
        return logits, sampled

    runner.execute = both
    prompts = [list(range(3, 20)), list(range(60, 71))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = llm.generate(prompts, params) + llm.generate([prompts[0] + list(range(30, 39)), prompts[1][:9] + [50]],
                                                      params)
    assert [o.num_cached_tokens for o in out] == [0, 0, 16, 8] and len(compared) > 10 and max(compared) == 2


def _prompts(vocab_size: int, lengths=(40, 9, 70, 33)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(3, vocab_size, (24,), generator=gen).tolist()
    return [shared + torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@needs_cuda
def test_prefill_graphs_give_the_eager_steps_tokens_and_logits(tiny_llama_dir):
    """Chunks of 24 tokens beside decodes, then the same prompts again (cache hits: each step is a prompt's last
    block), with the graphs and with enforce_eager: the same tokens, and every step's logits close (float32)."""
    captured: dict[bool, tuple[list, list[torch.Tensor]]] = {}
    for eager in (True, False):
        llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", block_size=16, num_kv_blocks=128,
                  max_num_seqs=4, max_num_batched_tokens=24, enforce_eager=eager)
        graphs = llm.core.runner.graph_prefill
        assert (graphs is None) == eager
        if graphs is not None:
            assert graphs.buckets == [16, 32] and graphs.logits.shape[0] == 5
        runner, steps = llm.core.runner, []
        execute = runner.execute

        def spy(chunks, execute=execute, steps=steps):
            logits, sampled = execute(chunks)
            if any(c.request.is_prefilling for c in chunks):
                steps.append(logits.float().cpu())
            return logits, sampled

        runner.execute = spy
        prompts = _prompts(512)
        first = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        again = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in again] == first
        assert all(o.num_cached_tokens > 0 for o in again)
        pool = llm.core.kv.pool
        assert pool.num_free_blocks == len(pool.blocks)
        captured[eager] = (first, steps)
    assert captured[False][0] == captured[True][0]
    assert len(captured[False][1]) == len(captured[True][1]) > 0
    for graph_logits, eager_logits in zip(captured[False][1], captured[True][1]):
        torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-4, atol=1e-4)
