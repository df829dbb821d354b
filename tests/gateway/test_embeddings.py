"""Embeddings: the last token's final hidden state, L2-normalized, through the engine's prefill path (cached
like any prompt), equal to transformers' last_hidden_state; POST /v1/embeddings through the openai SDK
(which asks for base64), as floats, from token ids, and its errors."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM
from tests.support.gateway_helpers import LiveServer, is_error_body, sdk_client, tiny_settings

PROMPTS = [list(range(3, 45)), list(range(3, 21)), [7]]


def reference(model_dir, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.nn.functional.normalize(hf.model(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)


def test_vectors_equal_transformers_and_a_cached_prefix_changes_nothing(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=4)
    cold = llm.embed(PROMPTS)
    warm = llm.embed(PROMPTS)  # the first two hit their cached blocks now
    assert llm.stats().hits > 0
    for ids, a, b in zip(PROMPTS, cold, warm):
        expected = reference(tiny_llama_dir, ids)
        torch.testing.assert_close(torch.tensor(a), expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(b), expected, rtol=1e-4, atol=1e-5)
        assert math.isclose(sum(v * v for v in a), 1.0, rel_tol=1e-5)


def test_an_embedded_document_is_a_cache_hit_for_the_chat_that_follows(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=4)
    document = list(range(3, 43))
    llm.embed([document])
    from engine import SamplingParams
    out = llm.generate(document + [50, 51], SamplingParams(max_tokens=2, temperature=0))[0]
    assert out.num_cached_tokens == 40


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir, max_prompts=4)) as live:
        yield live


def test_the_sdk_gets_normalized_vectors_in_order(server, tiny_llama_dir):
    client = sdk_client(server)
    model = server.state.model_name
    texts = ["the capital of France", "a block of the prefix cache", "hello"]
    resp = client.embeddings.create(model=model, input=texts)  # the SDK asks for base64 and decodes it
    assert [d.index for d in resp.data] == [0, 1, 2] and resp.model == model
    tok = server.engine.tokenizer
    for text, item in zip(texts, resp.data):
        torch.testing.assert_close(torch.tensor(item.embedding), reference(tiny_llama_dir, tok.encode(text)),
                                   rtol=1e-4, atol=1e-5)
    assert resp.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts) == resp.usage.total_tokens
    floats = client.embeddings.create(model=model, input=texts[0], encoding_format="float")
    torch.testing.assert_close(torch.tensor(floats.data[0].embedding), torch.tensor(resp.data[0].embedding))
    from_ids = client.embeddings.create(model=model, input=[tok.encode(texts[0])], encoding_format="float")
    assert from_ids.data[0].embedding == floats.data[0].embedding
    card = client.models.retrieve(model).model_dump()
    assert card["embeddings"] == {"pooling": "last", "normalized": True}
    server.wait_idle()


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a"] * 5}, "input"),
    ({"input": [[1, 2, 10**6]]}, "input"),
    ({"input": "x " * 5000}, "input"),
    ({}, "input"),
])
def test_bad_requests_get_a_400_naming_the_field(server, body, param):
    resp = server.call(_post(server.url + "/v1/embeddings", {"model": server.state.model_name, **body}))
    status, payload = resp
    assert status == 400 and is_error_body(payload) and payload["error"]["param"] == param, payload
    server.wait_idle()


async def _post(url: str, body: dict) -> tuple[int, dict]:
    import aiohttp
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.json()
