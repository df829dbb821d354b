"""The API process's tokenizer (the `tokenizers` library and jinja2, no transformers, no torch) against
transformers' own fast tokenizer of the same directory: ids, text, chat templates (with tools), special ids."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from bench.tiny_models import TOOLS_TEMPLATE
from engine.tokenizer import HFTokenizer, load_tokenizer

TEXT = "Hello world, what's the capital of France? It's Paris . ünïcode 你好 <|im_start|> x  y"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a block?"},
            {"role": "assistant", "content": "A run of tokens."}, {"role": "user", "content": "And a hit?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_tools_dir"])
def test_the_lean_tokenizer_matches_transformers(model, request):
    path = request.getfixturevalue(model)
    ours, ref = HFTokenizer(path, set()), AutoTokenizer.from_pretrained(path)
    ids = ours.encode(TEXT)
    assert ids == ref.encode(TEXT, add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.vocab_size == len(ref) and ours.special_token_ids == frozenset(ref.all_special_ids)
    assert ref.eos_token_id in ours.eos_token_ids
    for generation_prompt in (True, False):
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt) == ref.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
    if ref.chat_template == TOOLS_TEMPLATE:
        assert ours.apply_chat_template(MESSAGES, tools=[WEATHER]) == ref.apply_chat_template(
            MESSAGES, tools=[WEATHER], tokenize=False, add_generation_prompt=True)


def test_template_variables_come_as_a_mapping_or_as_keywords(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir, set())
    tok._template = tok._template.environment.from_string("{{ greeting }} {{ who }}")
    assert tok.apply_chat_template([], variables={"greeting": "hi", "who": "me", "self": "x"}) == "hi me"
    assert tok.apply_chat_template([], greeting="hello", variables={"who": "you"}) == "hello you"
