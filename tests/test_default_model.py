"""The real default model (SmolLM2-135M-Instruct) answers through our engine, cached or not."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM("default", kv_cache_memory_mb=128)


def test_default_model_knows_the_capital_of_france(llm):
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    first, second = llm.generate([prompt, prompt], SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in first.text
    assert first.finish_reason == "stop"  # <|im_end|> ends the answer
    assert second.token_ids == first.token_ids


def test_cache_hit_gives_the_same_answer(llm):
    system = "You are a geography teacher. Answer in one short sentence. " * 8
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of Italy?"}]
    prompt = llm.tokenizer.apply_chat_template(messages)
    cold = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0]
    warm = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0]
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == (len(llm.tokenizer.encode(prompt)) - 1) // 16 * 16
    assert warm.token_ids == cold.token_ids
