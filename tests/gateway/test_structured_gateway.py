"""Structured outputs and sampling fields through HTTP: the real openai SDK against the real app.

The tiny model has random weights, so any valid JSON, regex match or choice in its output is there
only because the grammar masked every step.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from gateway.app import create_app
from gateway.formats import token_string
from gateway.settings import GatewaySettings, Settings
from tests.gateway.test_gateway_openai import ServerThread

PROMPT = "the capital of France is Paris. what is the capital of France?"


class Answer(BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), block_size=16, num_kv_blocks=1024)
    engine = AsyncEngine.from_config(config)
    with ServerThread(create_app(Settings(config, GatewaySettings()), engine)) as running:
        running.engine = engine
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.engine.model_name


def _chat(client, model, **kwargs):
    kwargs = {"max_tokens": 64, "temperature": 0, **kwargs}
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], **kwargs)


def _complete(client, model, **kwargs):
    return client.completions.create(model=model, prompt=PROMPT, **{"max_tokens": 12, "temperature": 0, **kwargs})


# ---- structured outputs

def test_parse_returns_the_typed_object(client, model):
    completion = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": PROMPT}],
                                               response_format=Answer, max_tokens=64, temperature=0)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Answer)
    assert completion.choices[0].finish_reason == "stop"


def test_unconstrained_output_is_not_json(client, model):
    """The control for every test here: without a constraint the random model writes no JSON."""
    with pytest.raises(ValueError):
        json.loads(_chat(client, model, max_tokens=24).choices[0].message.content)


def test_json_object_gives_parseable_json(client, model):
    resp = _chat(client, model, response_format={"type": "json_object"}, temperature=1.0, seed=5)
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_json_schema_stream(client, model):
    schema = Answer.model_json_schema()
    stream = _chat(client, model, stream=True, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    Answer.model_validate_json(text)


@pytest.mark.parametrize("extra", [
    {"guided_choice": ["Paris", "London", "Rome"]},
    {"structured_outputs": {"choice": ["Paris", "London", "Rome"]}},
])
def test_guided_choice_returns_a_choice(client, model, extra):
    assert _chat(client, model, extra_body=extra).choices[0].message.content in ("Paris", "London", "Rome")


@pytest.mark.parametrize("extra", [
    {"guided_regex": r"[a-z]{2,6}-[0-9]{3}"},
    {"structured_outputs": {"regex": r"[a-z]{2,6}-[0-9]{3}"}},
])
def test_guided_regex_matches(client, model, extra):
    assert re.fullmatch(r"[a-z]{2,6}-[0-9]{3}", _complete(client, model, max_tokens=32, extra_body=extra)
                        .choices[0].text)


@pytest.mark.parametrize("extra", [
    {"guided_json": Answer.model_json_schema()},
    {"structured_outputs": {"json": Answer.model_json_schema()}},
    {"guided_grammar": 'root ::= "{\\"color\\":\\"red\\",\\"ok\\":" ("true" | "false") "}"'},
])
def test_guided_json_and_grammar(client, model, extra):
    Answer.model_validate_json(_complete(client, model, max_tokens=64, extra_body=extra).choices[0].text)


async def test_constrained_request_leaves_batched_free_requests_unchanged(server, model):
    """Greedy free requests give the same tokens alone and batched with a schema-constrained one."""
    prompts = ["the world is", "a cache block of the", "hello world the system", "she said what"]
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none",
                                  max_retries=0, timeout=60) as client:
        async def free(prompt):
            resp = await client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                                   logprobs=0, extra_body={"ignore_eos": True})
            return resp.choices[0].logprobs.tokens

        alone = [await free(p) for p in prompts]
        constrained = client.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": PROMPT}], response_format=Answer, max_tokens=64,
            temperature=0)
        *mixed, parsed = await asyncio.gather(*(free(p) for p in prompts), constrained)
    assert mixed == alone
    assert isinstance(parsed.choices[0].message.parsed, Answer)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_invalid_constraints_are_400_naming_the_field(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, model, extra_body=extra)
    assert err.value.body["param"] == param


# ---- sampling fields: each changes the output as OpenAI / vLLM define it

def _tokens(resp) -> list[str]:
    return resp.choices[0].logprobs.tokens


def test_logit_bias_forces_and_bans_tokens(client, model, server):
    tok = server.engine.tokenizer
    target = tok.encode(" Paris")[0]
    forced = _complete(client, model, logprobs=0, logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
    assert set(forced.choices[0].logprobs.tokens) == {token_string(tok.token_bytes(target))}
    first = _tokens(_complete(client, model, logprobs=0, extra_body={"ignore_eos": True}))[0]
    ids = [i for i in range(tok.vocab_size) if token_string(tok.token_bytes(i)) == first]  # as logprobs spell it
    banned = _complete(client, model, logprobs=0, logit_bias={str(i): -100 for i in ids},
                       extra_body={"ignore_eos": True})
    assert first not in _tokens(banned)


@pytest.mark.parametrize("field, value", [("frequency_penalty", 2.0), ("presence_penalty", 2.0),
                                          ("repetition_penalty", 2.0)])
def test_penalties_break_repetition(client, model, field, value):
    free = _tokens(_complete(client, model, max_tokens=24, logprobs=0, extra_body={"ignore_eos": True}))
    assert len(set(free)) < len(free)
    extra = {"ignore_eos": True}
    kwargs = {field: value} if field != "repetition_penalty" else {}
    if field == "repetition_penalty":
        extra[field] = value
    penalized = _tokens(_complete(client, model, max_tokens=24, logprobs=0, extra_body=extra, **kwargs))
    assert len(set(penalized)) > len(set(free))


def test_min_p_keeps_only_likely_tokens(client, model):
    """min_p=1 keeps only the top token: sampling at any temperature is then greedy."""
    greedy = _complete(client, model, extra_body={"ignore_eos": True}).choices[0].text
    sampled = [_complete(client, model, temperature=1.5, seed=s, extra_body={"ignore_eos": True, "min_p": 1.0})
               .choices[0].text for s in range(3)]
    assert sampled == [greedy] * 3
    unfiltered = {_complete(client, model, temperature=1.5, seed=s, extra_body={"ignore_eos": True})
                  .choices[0].text for s in range(3)}
    assert unfiltered != {greedy}


def test_min_tokens_defers_eos(client, model, server):
    eos = str(min(server.engine.tokenizer.eos_token_ids))
    short = _complete(client, model, logit_bias={eos: 100})
    assert short.usage.completion_tokens == 1 and short.choices[0].finish_reason == "stop"
    long = _complete(client, model, logit_bias={eos: 100}, extra_body={"min_tokens": 7})
    assert long.usage.completion_tokens == 8 and long.choices[0].finish_reason == "stop"


def test_best_of_returns_the_highest_cumulative_logprob(client, model):
    kwargs = dict(temperature=1.0, seed=100, max_tokens=8, extra_body={"ignore_eos": True})
    samples = _complete(client, model, n=4, logprobs=0, **kwargs)
    totals = [sum(c.logprobs.token_logprobs) for c in samples.choices]
    best = _complete(client, model, n=1, best_of=4, **kwargs)
    assert best.choices[0].text == samples.choices[totals.index(max(totals))].text
    assert best.choices[0].logprobs is None and len(best.choices) == 1
    assert best.usage.completion_tokens == 32  # every sample generated is counted
    two = _complete(client, model, n=2, best_of=4, logprobs=0, **kwargs)
    ranked = sorted(totals, reverse=True)[:2]
    assert [sum(c.logprobs.token_logprobs) for c in two.choices] == pytest.approx(ranked)
    assert [c.index for c in two.choices] == [0, 1]


def test_echo_prepends_the_prompt(client, model):
    plain = _complete(client, model).choices[0].text
    echoed = _complete(client, model, echo=True).choices[0].text
    assert echoed == PROMPT + plain
    stream = _complete(client, model, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == PROMPT + plain


@pytest.mark.parametrize("kwargs, param", [
    ({"suffix": "the end"}, "suffix"),
    ({"max_tokens": 0}, "max_tokens"),  # (0 only with echo)
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"repetition_penalty": 5e-324}}, "repetition_penalty"),
    ({"extra_body": {"min_p": 1.5}}, "min_p"),
    ({"extra_body": {"min_tokens": 20}}, "min_tokens"),
    ({"extra_body": {"prediction": {"type": "content", "content": "x"}}}, "prediction"),
    ({"extra_body": {"modalities": ["text", "audio"]}}, "modalities"),  # (a 200 of text alone until 2026-12-01)
])
def test_unsupported_or_out_of_range_fields_are_400(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        _complete(client, model, **kwargs)
    assert err.value.body["param"] == param
