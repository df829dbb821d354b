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


def test_a_plain_sdk_call_samples_with_the_model_cards_defaults():
    """The SDK sends no temperature: the server samples at the converted model's recommended 0.2 / top_p 0.9.
    At temperature 1 (the old default) most answers were word salad ("Estèle_is_la_lande, or in French, ...").
    NOTE: this Q4_1-derived model's first token is nearly flat (The 15 %, L 14 %, La 10 %), so at 0.2 seeds 0-9
    gave 6 answers naming Paris and 4 French lists ("L'Étoile, la Cité, ..."): 9 of 10 needs near-greedy."""
    import openai

    from tests.support.gateway_helpers import served

    question = [{"role": "user", "content": "What is the capital of France?"}]
    with served("--model", "default", "--kv-cache-memory-mb", "128") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        card = client.models.retrieve(model).model_dump()
        assert card["sampling_defaults"]["temperature"] == 0.2 and card["sampling_defaults"]["top_p"] == 0.9
        assert card["sampling_defaults"]["max_tokens"] == 1024  # an answer without max_tokens ends by then

        def answers(**fields) -> list[str]:
            return [client.chat.completions.create(model=model, messages=question, max_tokens=32, seed=seed,
                                                   **fields).choices[0].message.content for seed in range(10)]
        plain, hot = answers(), answers(temperature=1.0, top_p=1.0)  # a request's own fields win
    assert sum("Paris" in a for a in plain) >= 6, plain
    clean = "The capital of France is Paris."
    assert sum(a == clean for a in plain) >= 5 and sum(a == clean for a in hot) <= 2, (plain, hot)
