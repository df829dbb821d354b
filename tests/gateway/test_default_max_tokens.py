"""Bounded answers by default: a request that sets no max_tokens (max_completion_tokens, max_output_tokens)
gets the model's generation_config.json max_new_tokens, else --default-max-tokens, never more than the context
leaves; a request's own value wins, up to the context (beyond it: 400 as before). The cap is on the model card
and in the start-up log."""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from engine.config import EngineConfig
from gateway.__main__ import build_parser, settings_from_args
from gateway.app import create_app
from gateway.generation_defaults import SAMPLING_FIELDS, parse_override, sampling_defaults
from gateway.settings import GatewaySettings, Settings
from gateway.state import STATE
from tests.support.gateway_helpers import LiveServer, sdk_client, tiny_settings

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def make_client(aiohttp_client, tiny_llama_dir):
    async def make(model_dir=tiny_llama_dir, engine: dict | None = None, **gateway):
        config = EngineConfig(model=str(model_dir), block_size=16, num_kv_blocks=320, **(engine or {}))
        settings = Settings(config, GatewaySettings(salt_secret="test", engine_process=False, **gateway))
        return await aiohttp_client(create_app(settings))
    return make


@pytest.fixture
def capped_model_dir(tiny_llama_dir, tmp_path):
    """The tiny model with max_new_tokens 5 in its generation_config.json."""
    model_dir = tmp_path / "capped"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5, "temperature": 0.5}))
    return model_dir


async def chat(client, **fields) -> dict:
    body = {"model": client.app[STATE].model_name, "messages": QUESTION, "ignore_eos": True, **fields}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


def completion_tokens(body: dict) -> int:
    return body["usage"]["completion_tokens"]


def test_the_cap_comes_from_the_model_then_the_override_else_the_setting(capped_model_dir, tiny_llama_dir):
    assert sampling_defaults(capped_model_dir, "auto", {}, 7)["max_tokens"] == 5
    assert sampling_defaults(capped_model_dir, "auto", {"max_new_tokens": 3}, 7)["max_tokens"] == 3
    assert sampling_defaults(capped_model_dir, "none", {}, 7) == {**SAMPLING_FIELDS, "max_tokens": 7}
    assert sampling_defaults(tiny_llama_dir, "auto", {}, 7)["max_tokens"] == 7  # no generation_config.json
    assert sampling_defaults(tiny_llama_dir, "auto", {}, None)["max_tokens"] is None  # the rest of the context


@pytest.mark.parametrize("value", [0, True, 2.5, "9"])
def test_a_max_new_tokens_that_is_no_token_count_is_not_a_cap(tmp_path, value):
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": value}))
    assert sampling_defaults(tmp_path, "auto", {}, 7)["max_tokens"] == 7


@pytest.mark.parametrize("text", ['{"max_new_tokens": 0}', '{"max_new_tokens": 2.5}'])
def test_an_override_cap_must_be_a_token_count(text):
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        parse_override(text)


def test_default_max_tokens_is_a_setting_and_a_flag():
    assert GatewaySettings().default_max_tokens == 1024
    args = build_parser().parse_args(["serve", "--default-max-tokens", "none"])
    assert settings_from_args(args).gateway.default_max_tokens is None
    args = build_parser().parse_args(["serve", "--default-max-tokens", "64"])
    assert settings_from_args(args).gateway.default_max_tokens == 64
    with pytest.raises(ValueError, match="default_max_tokens must be >= 1"):
        GatewaySettings(default_max_tokens=0)


async def test_a_request_without_max_tokens_gets_exactly_the_cap(make_client):
    client = await make_client(default_max_tokens=7)
    body = await chat(client)
    assert completion_tokens(body) == 7 and body["choices"][0]["finish_reason"] == "length"
    streamed = await client.post("/v1/chat/completions", json={
        "model": client.app[STATE].model_name, "messages": QUESTION, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})
    usage = [json.loads(line[6:])["usage"] for line in (await streamed.text()).splitlines()
             if line.startswith("data: {") and '"usage":{' in line]
    assert usage[-1]["completion_tokens"] == 7


async def test_the_models_max_new_tokens_goes_before_the_setting(make_client, capped_model_dir):
    client = await make_client(capped_model_dir, default_max_tokens=7)
    assert completion_tokens(await chat(client)) == 5


async def test_the_requests_own_value_wins_over_the_cap(make_client):
    client = await make_client(default_max_tokens=7)
    assert completion_tokens(await chat(client, max_tokens=12)) == 12
    assert completion_tokens(await chat(client, max_completion_tokens=3)) == 3


async def test_the_cap_is_clamped_to_the_context_and_a_requests_value_beyond_it_is_refused(make_client):
    client = await make_client(engine={"max_model_len": 40}, default_max_tokens=1024)
    body = await chat(client)
    assert body["usage"]["total_tokens"] == 40  # the default gives what the context leaves, no 400
    resp = await client.post("/v1/chat/completions", json={
        "model": client.app[STATE].model_name, "messages": QUESTION, "max_tokens": 1024})
    error = (await resp.json())["error"]
    assert resp.status == 400 and (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")


async def test_no_default_cap_runs_to_the_context_as_vllm(make_client):
    client = await make_client(engine={"max_model_len": 40}, default_max_tokens=None)
    assert (await chat(client))["usage"]["total_tokens"] == 40


async def test_completions_keep_openais_16_under_a_larger_cap_and_the_cap_under_a_smaller_one(make_client):
    for cap, expected in ((1024, 16), (7, 7)):
        client = await make_client(default_max_tokens=cap)
        resp = await client.post("/v1/completions", json={
            "model": client.app[STATE].model_name, "prompt": "Once upon a time", "ignore_eos": True})
        assert completion_tokens(await resp.json()) == expected


async def test_the_responses_api_gets_the_cap_and_marks_the_answer_incomplete(make_client):
    client = await make_client(default_max_tokens=6)
    resp = await client.post("/v1/responses", json={
        "model": client.app[STATE].model_name, "input": "What is the capital of France?", "temperature": 0})
    body = await resp.json()
    assert resp.status == 200, body
    assert body["usage"]["output_tokens"] == 6
    assert (body["status"], body["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})


async def test_the_model_card_and_the_start_up_log_show_the_cap(make_client, capped_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="gateway"):
        client = await make_client(capped_model_dir)
    model = client.app[STATE].model_name
    card = await (await client.get(f"/v1/models/{model}")).json()
    assert card["sampling_defaults"] == {**SAMPLING_FIELDS, "temperature": 0.5, "max_tokens": 5}
    listed = await (await client.get("/v1/models")).json()
    assert listed["data"][0]["sampling_defaults"]["max_tokens"] == 5
    assert ("sampling defaults for requests that leave them out: temperature=0.5, top_p=1.0, top_k=0, min_p=0.0, "
            "repetition_penalty=1.0 (generation_config.json); max_tokens=5 (generation_config.json's "
            "max_new_tokens)") in caplog.messages


def test_a_plain_sdk_call_ends_at_the_cap(tiny_llama_dir):
    """The openai SDK sends no max_tokens unless told: the answer still ends, at the server's cap."""
    with LiveServer(tiny_settings(tiny_llama_dir, default_max_tokens=9)) as server:
        client = sdk_client(server)
        model = client.models.list().data[0].id
        assert client.models.retrieve(model).model_dump()["sampling_defaults"]["max_tokens"] == 9
        resp = client.chat.completions.create(model=model, messages=QUESTION, extra_body={"ignore_eos": True})
        assert (resp.usage.completion_tokens, resp.choices[0].finish_reason) == (9, "length")
