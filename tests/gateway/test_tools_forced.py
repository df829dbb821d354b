"""Forced tool calls (tool_choice "required" or a named function) through the real `openai` SDK against
the real server and a tiny random-weight model: the grammar (engine/structured.py, SamplingParams.
structured) makes even a random model write a valid call for the schema."""
from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from engine.async_engine import AsyncEngine
from engine.tokenizer import load_tokenizer
from tests.support.gateway_helpers import LiveServer, ask, sdk_client, tiny_settings

BLOCK = 16
CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}  # bounded: a random model cannot ramble
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city", "parameters": {
        "type": "object", "properties": {"city": CITY}, "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class GetWeather(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]  # bounded like CITY: a free string lets a random model ramble


@pytest.fixture(scope="module")
def server(tiny_tools_dir):
    settings = tiny_settings(tiny_tools_dir, engine={"num_kv_blocks": 512})
    with LiveServer(settings, AsyncEngine.from_config(settings.engine)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with sdk_client(server, timeout=60) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.state.model_name


def check_call(call, name: str) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    arguments = json.loads(call.function.arguments)
    schema = WEATHER if name == "get_weather" else TIME
    assert set(arguments) == set(schema["function"]["parameters"]["required"])
    for key, value in arguments.items():
        assert value in schema["function"]["parameters"]["properties"][key]["enum"]
    return arguments


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_function_is_always_a_valid_call(client, model, temperature):
    resp = client.chat.completions.create(model=model, messages=ask("Weather?"), tools=[WEATHER, TIME],
                                          tool_choice=NAMED, temperature=temperature, seed=1, max_tokens=200)
    choice = resp.choices[0]
    # "stop" for a named function, as OpenAI answers it ("tool_calls" for "required" and "auto")
    assert choice.finish_reason == "stop" and not choice.message.content
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0], "get_weather")


def test_a_forced_call_sets_response_format_aside_for_its_answer(client, model):
    """As OpenAI answers it (agent frameworks send their output type on every turn, a forced tool turn too): the call
    is the whole output; the format shapes the text answers of later turns."""
    class Answer(BaseModel):
        city: Literal["Paris", "Rome"]

    schema = {"name": "Answer", "schema": Answer.model_json_schema(), "strict": True}
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": schema}):
        resp = client.chat.completions.create(model=model, messages=ask("Weather?"), tools=[WEATHER, TIME],
                                              tool_choice="required", response_format=fmt, temperature=0,
                                              max_tokens=300)
        assert resp.choices[0].finish_reason == "tool_calls"
        for call in resp.choices[0].message.tool_calls:
            check_call(call, call.function.name)
    with pytest.raises(openai.BadRequestError) as both:  # vLLM's grammar fields: two grammars for one answer
        client.chat.completions.create(model=model, messages=ask("Weather?"), tools=[WEATHER], tool_choice=NAMED,
                                       extra_body={"guided_regex": "a+"}, max_tokens=5)
    assert both.value.param == "tool_choice"


def test_required_is_always_at_least_one_valid_call(client, model):
    for seed in range(3):
        resp = client.chat.completions.create(model=model, messages=ask("Anything?"), tools=[WEATHER, TIME],
                                              tool_choice="required", temperature=1.0, seed=seed, max_tokens=300)
        calls = resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            check_call(call, call.function.name)


def test_required_without_parallel_calls_is_one_call(client, model):
    resp = client.chat.completions.create(model=model, messages=ask("Anything?"), tools=[WEATHER, TIME],
                                          tool_choice="required", parallel_tool_calls=False, max_tokens=300)
    assert len(resp.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_call_streams_like_the_non_streaming_answer(client, model, tool_choice):
    kwargs = dict(model=model, messages=ask("Weather?"), tools=[WEATHER, TIME], tool_choice=tool_choice,
                  temperature=0, max_tokens=300)
    plain = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == plain.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
           [(c.function.name, c.function.arguments) for c in plain.message.tool_calls]
    for call in plain.message.tool_calls:
        check_call(call, call.function.name)


def test_parse_returns_typed_arguments(client, model):
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    resp = client.chat.completions.parse(model=model, messages=ask("Weather?"), tools=[tool],
                                         tool_choice=NAMED, max_tokens=200)
    call = resp.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_agent_loop_forced_call_then_answer_hits_the_cache(client, model):
    messages = ask("What is the weather in Paris? " * 3)
    kwargs = dict(model=model, tools=[WEATHER], temperature=0, max_tokens=200)
    first = client.chat.completions.create(messages=messages, tool_choice=NAMED, **kwargs)
    call = first.choices[0].message.tool_calls[0]
    city = check_call(call, "get_weather")["city"]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": f"sunny in {city}"}]
    second = client.chat.completions.create(messages=messages, **{**kwargs, "max_tokens": 8})
    messages += [{"role": "assistant", "content": second.choices[0].message.content or ""},
                 {"role": "user", "content": "And tomorrow?"}]
    third = client.chat.completions.create(messages=messages, **{**kwargs, "max_tokens": 8})
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, second, third)]
    assert cached[0] == 0
    assert cached[1] >= first.usage.prompt_tokens // BLOCK * BLOCK > 0
    assert cached[2] >= second.usage.prompt_tokens // BLOCK * BLOCK > cached[1]


# a string that cannot close within max_tokens: the call is always cut short, however the random model samples
NOTE = {"type": "function", "function": {"name": "take_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "minLength": 2000}}, "required": ["text"]}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "take_note"}}],
                         ids=["required", "named"])
def test_a_call_cut_short_by_max_tokens_stays_a_call(client, model, tool_choice):
    kwargs = dict(model=model, messages=ask("Note this."), tools=[NOTE], tool_choice=tool_choice, temperature=0,
                  max_tokens=64)
    plain = client.chat.completions.create(**kwargs).choices[0]
    assert plain.finish_reason == "length" and not plain.message.content  # no internal call text leaked
    (call,) = plain.message.tool_calls
    assert call.function.name == "take_note" and call.function.arguments.startswith('{"text"')
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    deltas = [c.delta for c in chunks]  # (the SDK's stream helper raises on "length" before showing the calls)
    assert chunks[-1].finish_reason == "length" and not "".join(d.content or "" for d in deltas)
    pieces = [p for d in deltas for p in d.tool_calls or ()]
    assert {p.index for p in pieces} == {0} and pieces[0].function.name == "take_note"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["string", "token id"])
def test_a_call_cut_by_a_stop_stays_a_call_streamed_or_not(client, model, tiny_tools_dir, include, stop):
    tokenizer = load_tokenizer(tiny_tools_dir, set())
    kwargs = dict(model=model, messages=ask("Note this."), tools=[NOTE], tool_choice="required", temperature=0,
                  max_tokens=64)
    if stop == "string":
        kwargs.update(stop=['"text"'], extra_body={"include_stop_str_in_output": include})
    else:  # a token of the call's text, where it first comes after the function's name
        ids = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True}).choices[0].token_ids
        named = next(i for i in range(len(ids)) if "take_note" in tokenizer.decode(ids[:i]))
        at = next(i for i in range(named + 1, len(ids)) if ids[i] not in ids[:i])
        kwargs.update(extra_body={"stop_token_ids": [ids[at]], "include_stop_str_in_output": include})
    plain = client.chat.completions.create(**kwargs).choices[0]
    assert plain.finish_reason == "tool_calls" and not plain.message.content
    (call,) = plain.message.tool_calls
    assert call.function.name == "take_note"
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    pieces = [p for c in chunks for p in c.delta.tool_calls or ()]
    assert chunks[-1].finish_reason == "tool_calls" and not "".join(c.delta.content or "" for c in chunks)
    assert pieces[0].function.name == "take_note"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


def test_a_forced_call_stopped_anywhere_reads_the_same_streamed_or_not(client, model):
    kwargs = dict(model=model, messages=ask("Note this."), tools=[NOTE], tool_choice="required", temperature=0,
                  max_tokens=24)
    ids = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True}).choices[0].token_ids
    for at in [i for i in range(1, len(ids)) if ids[i] not in ids[:i]]:  # each token where it first comes
        stopped = dict(kwargs, extra_body={"stop_token_ids": [ids[at]]})
        plain = client.chat.completions.create(**stopped).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in plain.message.tool_calls or ()]
        chunks = [c.choices[0] for c in client.chat.completions.create(**stopped, stream=True) if c.choices]
        pieces = [p for c in chunks for p in c.delta.tool_calls or ()]
        streamed = [(p.function.name, "".join(q.function.arguments or "" for q in pieces if q.index == p.index))
                    for p in pieces if p.function.name]
        assert (plain.message.content or "", calls, plain.finish_reason) == (
            "".join(c.delta.content or "" for c in chunks), streamed, chunks[-1].finish_reason), at


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_grammar_may_hold_the_text_of_an_added_token(client, model, tiny_tools_dir, temperature):
    """<tool_call> is an added token the tokenizer does not call special (as Qwen's): the model writes it as that one
    token, which the grammar takes for its text."""
    tokenizer = load_tokenizer(tiny_tools_dir, set())
    assert len(tokenizer.encode("<tool_call>")) == 1
    for extra in ({"guided_regex": "<tool_call>"}, {"guided_choice": ["<tool_call>", "<tool_response>"]}):
        text = client.completions.create(model=model, prompt="hi", max_tokens=16, temperature=temperature,
                                         extra_body=extra).choices[0].text
        assert text in ("<tool_call>", "<tool_response>")


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_auto_tools_beside_a_json_format_answer_with_a_call_or_the_format(client, model, tiny_tools_dir, api):
    """tool_choice auto beside response_format (chat) or text.format (Responses): OpenAI lets the model choose a call
    or text in the format, and agent frameworks send both on every turn (openai-agents' tools with an output type);
    the format's grammar alone allowed no call. Its first token pushed either way with logit_bias (a bias cannot
    lift the grammar's mask): toward <tool_call>, a valid call; toward "{", JSON of the format, no call."""
    class Answer(BaseModel):
        city: Literal["Paris", "Rome"]

    tokenizer = load_tokenizer(tiny_tools_dir, set())
    [tag] = tokenizer.encode("<tool_call>")
    [brace] = tokenizer.encode("{")
    schema = {"name": "Answer", "schema": Answer.model_json_schema(), "strict": True}
    for first, called in ((tag, True), (brace, False)):
        extra = {"logit_bias": {str(first): 100}}
        if api == "chat":
            message = client.chat.completions.create(
                model=model, messages=ask("Weather?"), tools=[WEATHER, TIME], temperature=0, max_tokens=300,
                response_format={"type": "json_schema", "json_schema": schema}, extra_body=extra).choices[0].message
            calls, text = message.tool_calls or [], message.content
        else:
            resp = client.responses.create(
                model=model, input="Weather?", tools=[{"type": "function", **t["function"]} for t in (WEATHER, TIME)],
                temperature=0, max_output_tokens=300, extra_body=extra,
                text={"format": {"type": "json_schema", "name": "Answer", "schema": Answer.model_json_schema(),
                                 "strict": True}})
            calls = [type("Call", (), {"type": "function", "id": "call_" + i.call_id, "function": i})
                     for i in resp.output if i.type == "function_call"]
            text = resp.output_text
        if called:
            assert calls and not text
            for call in calls:
                check_call(call, call.function.name)
        else:
            assert not calls and Answer.model_validate_json(text)


def test_legacy_functions_get_the_legacy_shape(client, model):
    kwargs = dict(model=model, messages=ask("Weather?"), functions=[WEATHER["function"], TIME["function"]],
                  function_call={"name": "get_weather"}, temperature=0, max_tokens=200)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None  # (named: as OpenAI)
    assert choice.message.function_call.name == "get_weather"
    city = json.loads(choice.message.function_call.arguments)["city"]
    assert city in CITY["enum"]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    pieces = [c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert pieces[0].name == "get_weather"
    assert "".join(p.arguments or "" for p in pieces) == choice.message.function_call.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"
    history = ask("Weather?") + [choice.message.model_dump(exclude_none=True),
                                 {"role": "function", "name": "get_weather", "content": f"sunny in {city}"}]
    answer = client.chat.completions.create(model=model, messages=history, functions=[WEATHER["function"]],
                                            function_call="none", max_tokens=4)
    assert answer.choices[0].message.function_call is None and answer.choices[0].message.content
