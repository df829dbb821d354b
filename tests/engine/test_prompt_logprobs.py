"""Prompt logprobs (SamplingParams.prompt_logprobs): transformers' numbers for every prompt token, whatever the cache,
the prefill chunks or a preemption do."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.request import Request

PROMPT_LEN = 70


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """(prompt, transformers' logprobs [prompt positions, vocab]: row i scores token i + 1)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompt = torch.randint(3, hf.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    return prompt, torch.log_softmax(logits.float(), dim=-1)


def _check(scored, prompt, expected, k):
    assert [t.token_id for t in scored] == prompt
    assert scored[0].logprob is None and scored[0].top_logprobs is None  # nothing comes before the first token
    chosen = expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([t.logprob for t in scored[1:]]), chosen, rtol=1e-4, atol=1e-4)
    ranks = torch.tensor([t.rank for t in scored[1:]])  # 1 + the tokens more likely (within rounding of near ties)
    assert ((expected > chosen[:, None] + 1e-4).sum(1) + 1 <= ranks).all()
    assert (ranks <= (expected > chosen[:, None] - 1e-4).sum(1) + 1).all()
    for t, row in zip(scored[1:], expected):
        assert (t.top_logprobs is None if k == 0 else [i for i, _ in t.top_logprobs] == row.topk(k).indices.tolist())


@pytest.mark.parametrize("chunk", [7, 512])
def test_prompt_logprobs_match_transformers_and_never_read_the_cache(tiny_llama_dir, reference, chunk):
    prompt, expected = reference
    llm = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=64, max_num_batched_tokens=chunk,
              max_num_seqs=min(chunk, 8))
    scoring = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, ignore_eos=True)
    first = llm.generate(prompt, scoring)[0]
    _check(first.prompt_logprobs, prompt, expected, 2)
    again = llm.generate(prompt, scoring)[0]  # its blocks are cached now, and not read
    assert again.num_cached_tokens == 0
    assert [t.logprob for t in again.prompt_logprobs] == [t.logprob for t in first.prompt_logprobs]
    assert again.token_ids == first.token_ids
    plain = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert plain.num_cached_tokens == (PROMPT_LEN - 1) // 16 * 16  # the scoring requests wrote the cache
    assert plain.token_ids == first.token_ids and plain.prompt_logprobs is None
    stats = llm.stats()  # the scoring requests looked nothing up: the hit rate is the plain request's alone
    assert (stats.requests, stats.queries, stats.hits) == (1, PROMPT_LEN, plain.num_cached_tokens)
    assert llm.core.kv.pool.num_free_blocks == 64


def test_prompt_logprobs_across_a_preemption(tiny_llama_dir, reference):
    """Preempted in its prefill, a request keeps the logprobs it scored, hits the cache up to them on its return, and
    scores the rest (a chunk that overlaps both scores only the rest)."""
    prompt, expected = reference
    # 10 blocks of 8 hold one of these prompts and its answer, not two: they preempt each other, mid-prefill too
    llm = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=10, max_num_batched_tokens=16, max_num_seqs=2)
    params = SamplingParams(max_tokens=30, temperature=0, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate([prompt[:40], prompt[:44]], params)
    assert llm.core.scheduler.num_preemptions > 0
    _check(outs[0].prompt_logprobs, prompt[:40], expected[:39], 1)
    _check(outs[1].prompt_logprobs, prompt[:44], expected[:43], 1)
    alone = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=64).generate([prompt[:40], prompt[:44]], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]


def test_a_prompt_scored_without_an_answer(tiny_llama_dir, reference):
    """pooling "none" (completions' echo with max_tokens 0): the prompt is computed and scored, nothing sampled."""
    prompt, expected = reference
    llm = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)
    out = llm.generate(prompt, SamplingParams(prompt_logprobs=0, pooling="none"))[0]
    assert out.token_ids == []
    _check(out.prompt_logprobs, prompt, expected, 0)
    assert llm.generate(prompt[:1], SamplingParams(prompt_logprobs=0, pooling="none"))[0].prompt_logprobs[0].logprob \
        is None


def test_prompt_logprobs_come_once_in_the_stream(tiny_llama_dir, reference):
    prompt, _ = reference
    llm = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    request = Request("r", prompt, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, ignore_eos=True))
    llm.core.add_request(request)
    outputs = []
    while llm.core.has_unfinished():
        outputs += llm.core.step()[0]
    carrying = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is outputs[0] and len(carrying[0].prompt_logprobs) == PROMPT_LEN
    assert outputs[0].new_token_ids  # with the first token, once the whole prompt is scored


def test_prompt_logprobs_must_not_be_negative():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("weights", ["float32", "Q4_1"])
def test_an_answer_scored_as_a_prompt_gets_the_logprobs_it_was_sampled_with(weights, tiny_llama_dir, reference,
                                                                           tmp_path):
    """The prefill path's scores of prompt + answer are the decode step's logprobs of the answer (the compiled CPU
    step; a Q4_1 file's native kernels on both paths)."""
    from gguf import GGMLQuantizationType as QType

    from tests.support.tiny_gguf import write_gguf_model

    model_dir = tiny_llama_dir
    if weights != "float32":
        model_dir = write_gguf_model(tiny_llama_dir, tmp_path / "gguf", lambda name: QType[weights])
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)
    prompt, _ = reference
    answer = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True))[0]
    scored = llm.generate(prompt + answer.token_ids, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0
    torch.testing.assert_close(torch.tensor([t.logprob for t in scored.prompt_logprobs[len(prompt):]]),
                               torch.tensor([t.logprob for t in answer.logprobs]), rtol=1e-3, atol=1e-3)
    assert all(t.rank == 1 for t in scored.prompt_logprobs[len(prompt):])  # greedy: each the most likely


def test_a_scoring_request_hits_only_the_tokens_it_scored():
    """A cache hit's tokens never run through the model: a request that scores its prompt may hit only blocks whose
    every token it scored already (before a preemption), and it looks nothing up in the hit rate's counts."""
    from engine.kv.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(num_blocks=16, block_size=16)
    request = Request("r", list(range(3, 73)), SamplingParams(prompt_logprobs=0))
    assert kv.num_hittable_blocks(request) == 0
    request.prompt_logprobs += [request.prompt_logprobs[0]] * 39  # 40 scored: tokens 0..39, so 0..38 may be hit
    assert kv.num_hittable_blocks(request) == 39 // 16
    request.prompt_logprobs += [request.prompt_logprobs[0]] * 30  # the whole prompt: as any request
    assert kv.num_hittable_blocks(request) == kv.num_hittable_blocks(Request("p", list(range(3, 73)),
                                                                           SamplingParams())) == 69 // 16
    kv.record_lookup(request, kv.find_cached_prefix(request))
    assert (kv.num_lookups, kv.num_queried_tokens) == (0, 0)
