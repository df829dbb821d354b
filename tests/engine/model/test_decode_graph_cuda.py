"""Decode steps replayed from CUDA graphs give the eager steps' tokens and logits (CUDA only)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.model.decode_graph_cuda import MAX_GRAPH_ROWS, graph_batch_sizes

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_graph_batch_sizes_cover_every_batch_once():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 4]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(33) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_batch_sizes(10_000)[-1] == MAX_GRAPH_ROWS
    assert len(set(graph_batch_sizes(10_000))) == len(graph_batch_sizes(10_000))


def _prompts(vocab_size: int, lengths=(40, 9, 70, 1, 33)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, vocab_size, (20,), generator=gen).tolist()
    return [shared + torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' argmax token by token (its generate() with min_new_tokens would mask EOS, which
    ignore_eos lets our engine pick)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("chunk,max_seqs", [(512, 8), (7, 4)])  # 7: chunked prefill beside graph decodes
def test_graphs_give_transformers_greedy_tokens(arch, chunk, max_seqs, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    expected = [_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(str(model_dir), device="cuda", dtype="float32", block_size=16, num_kv_blocks=256,
              max_num_seqs=max_seqs, max_num_batched_tokens=chunk)
    graphs = llm.core.runner.graph_decode
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8][:max_seqs.bit_length()]
    assert graphs.logits.shape == (max_seqs, hf.config.vocab_size)  # one output buffer for every graph
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected  # 5 rows in a graph of 8, or 4 + 1
    again = llm.generate(prompts[:3], GREEDY)  # cache hits, 3 rows in a graph of 4
    assert [o.token_ids for o in again] == expected[:3]
    assert all(o.num_cached_tokens > 0 for o in again)


@needs_cuda
def test_graph_logits_equal_eager_logits(tiny_llama_dir):
    """Every decode step's logits, graphs against enforce_eager, over the same requests (float32: in bfloat16
    the eager path's attention rounds to bfloat16 where the Triton kernel keeps float32)."""
    captured: dict[bool, list[torch.Tensor]] = {}
    for eager in (True, False):
        llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=4,
                  enforce_eager=eager)
        assert (llm.core.runner.graph_decode is None) == eager
        runner, steps = llm.core.runner, []
        execute = runner.execute

        def spy(chunks, execute=execute, steps=steps):
            logits, sampled = execute(chunks)
            if all(not c.request.is_prefilling for c in chunks):
                steps.append(logits.float().cpu())
            return logits, sampled

        runner.execute = spy
        llm.generate(_prompts(512, (5, 30, 17)), GREEDY)
        captured[eager] = steps
    assert len(captured[False]) == len(captured[True]) > 0
    for graph_logits, eager_logits in zip(captured[False], captured[True]):
        torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-4, atol=1e-4)


@needs_cuda
def test_graph_steps_leave_no_blocks_held(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    llm.generate(_prompts(512, (5, 30, 17)), GREEDY)
    pool = llm.core.kv.pool
    assert pool.num_free_blocks == len(pool.blocks)
