"""Our engine gives transformers' greedy tokens for the same weights, whatever the cache does."""
from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.request import Request

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
ARCHS = ["llama", "qwen2", "qwen3"]


def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, vocab_size, (40,), generator=gen).tolist()
    return [shared + torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (9, 1, 30)]


@pytest.fixture(scope="module", params=ARCHS)
def reference(request):
    """(model dir, prompts, transformers' greedy continuations) for one architecture."""
    model_dir = request.getfixturevalue(f"tiny_{request.param}_dir")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    expected = []
    for prompt in prompts:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False)
        expected.append(out[0, len(prompt):].tolist())
    return model_dir, prompts, expected


@pytest.mark.parametrize("caching,block_size,chunk", list(itertools.product([True, False], [1, 16, 64], [7, 512])))
def test_greedy_matches_transformers(reference, caching, block_size, chunk):
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), enable_prefix_caching=caching, block_size=block_size,
              max_num_batched_tokens=chunk, max_num_seqs=min(chunk, 32), num_kv_blocks=max(8, 1024 // block_size))
    alone = llm.generate(prompts[0], GREEDY)[0]
    assert alone.token_ids == expected[0]
    batched = llm.generate(prompts, GREEDY)  # prompt 0 again (a cache hit when caching), with others
    assert [o.token_ids for o in batched] == expected
    hits = batched[0].num_cached_tokens
    assert hits == ((len(prompts[0]) - 1) // block_size * block_size if caching else 0)


def test_greedy_matches_across_preemption(reference):
    model_dir, prompts, expected = reference
    # 14 blocks of 8 hold two of these requests at most: the third forces preemptions
    llm = LLM(str(model_dir), block_size=8, num_kv_blocks=14, max_num_batched_tokens=64)
    outs = llm.generate(prompts, GREEDY)
    assert llm.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected


def test_logits_match_transformers(tiny_qwen3_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    prompt = _prompts(hf.config.vocab_size)[2]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    llm = LLM(str(tiny_qwen3_dir), block_size=16, num_kv_blocks=16, max_num_batched_tokens=7, max_num_seqs=7)
    request = Request("r", prompt, GREEDY)
    llm.core.add_request(request)
    captured = []
    runner = llm.core.runner
    original = runner.execute

    def spy(chunks):
        logits, sampled = original(chunks)
        captured.append(logits.clone())
        return logits, sampled

    runner.execute = spy
    while not request.output_token_ids:  # prefill in chunks of 7: the last chunk's logits give token 1
        llm.core.step()
    torch.testing.assert_close(captured[-1][0], expected, rtol=1e-4, atol=1e-4)
