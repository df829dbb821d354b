"""Tool calling through the real `openai` SDK against the real server on a tiny model whose chat
template renders tools (Qwen2.5's).

A random-weight model never writes a tool call by itself, so `ScriptedEngine` replaces the text of
the tokens the real engine samples with a script (same number of tokens): prompt rendering, the
prefix cache, usage, the HTTP layer and the SDK are all real; only the sampled text is scripted.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import urllib.request

import pytest

from engine.async_engine import AsyncEngine
from engine.outputs import FinishReason
from engine.tokenizer import load_tokenizer
from tests.support.gateway_helpers import LiveServer, ask, sdk_client, tiny_settings

BLOCK = 16
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL_TEXT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
TWO_CALLS = (CALL_TEXT + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


class ScriptedEngine:
    """The real AsyncEngine; while `script` is set, each sampled token's text is the script's next
    piece and the request ends there as if at EOS."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self.script: list[str] | None = None
        self.script_ids = False  # True: each piece is one token of the vocabulary, and the outputs carry its id

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, request_id, prompt_token_ids, params, **kwargs):
        script = self.script
        if script is not None:
            params = dataclasses.replace(params, max_tokens=len(script), ignore_eos=True)
        gen = self._engine.generate(request_id, prompt_token_ids, params, **kwargs)
        async with contextlib.aclosing(gen):
            sent = 0
            async for out in gen:
                if script is not None:
                    pieces = script[sent:sent + len(out.new_token_ids)]
                    out.new_text = "".join(pieces)
                    if self.script_ids:
                        out.new_token_ids = [self._engine.tokenizer.encode(piece)[0] for piece in pieces]
                    sent += len(pieces)
                    if out.finished:
                        out.finish_reason = FinishReason.STOP
                yield out


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.fixture(scope="module")
def server(tiny_tools_dir):
    settings = tiny_settings(tiny_tools_dir, engine={"num_kv_blocks": 512})
    engine = ScriptedEngine(AsyncEngine.from_config(settings.engine))
    with LiveServer(settings, engine) as live:
        live.scripted = engine
        yield live


@pytest.fixture()
def client(server):
    server.scripted.script = None
    with sdk_client(server) as sdk:
        yield sdk
    server.scripted.script = None


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.state.model_name


def test_tool_call_parsed_into_message_tool_calls(server, client, model):
    server.scripted.script = pieces(TWO_CALLS)
    resp = client.chat.completions.create(model=model, messages=ask("Weather and time in Paris?"),
                                          tools=[WEATHER, TIME], temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    first, second = choice.message.tool_calls
    assert first.type == "function" and first.id.startswith("call_") and first.id != second.id
    assert first.function.name == "get_weather" and json.loads(first.function.arguments) == {"city": "Paris", "unit": "C"}
    assert second.function.name == "get_time" and json.loads(second.function.arguments) == {}
    assert resp.usage.completion_tokens == len(server.scripted.script)


def test_tool_call_streamed_as_delta_tool_calls(server, client, model):
    server.scripted.script = pieces(TWO_CALLS, 2)
    kwargs = dict(model=model, messages=ask("Weather and time?"), tools=[WEATHER, TIME], temperature=0)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in d.tool_calls or ()]
    heads = [c for c in calls if c.id is not None]
    assert [(h.index, h.type, h.function.name) for h in heads] == [(0, "function", "get_weather"),
                                                                   (1, "function", "get_time")]
    fragments = [c.function.arguments for c in calls if c.index == 0 and c.function.arguments]
    assert len(fragments) > 5  # arguments arrive in pieces, as OpenAI sends them
    assert json.loads("".join(fragments)) == {"city": "Paris", "unit": "C"}
    assert "".join(d.content or "" for d in deltas) == "Checking."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the SDK's own stream accumulator builds the same message as the non-streaming answer
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    plain = client.chat.completions.create(**kwargs).choices[0]
    assert final.finish_reason == plain.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
           [(c.function.name, c.function.arguments) for c in plain.message.tool_calls]


def test_parallel_tool_calls_false_returns_one_call(server, client, model):
    server.scripted.script = pieces(TWO_CALLS)
    resp = client.chat.completions.create(model=model, messages=ask("Both?"), tools=[WEATHER, TIME],
                                          parallel_tool_calls=False)
    assert [c.function.name for c in resp.choices[0].message.tool_calls] == ["get_weather"]


def test_tool_choice_none_leaves_the_text_alone(server, client, model):
    server.scripted.script = pieces(CALL_TEXT)
    resp = client.chat.completions.create(model=model, messages=ask("Weather?"), tools=[WEATHER], tool_choice="none")
    assert resp.choices[0].message.content == CALL_TEXT and resp.choices[0].message.tool_calls is None
    assert resp.choices[0].finish_reason == "stop"
    # the tools are shown all the same (vLLM's default), so the prompt is the one "auto" renders
    assert prompt_count(server, tools=[WEATHER], tool_choice="none") == prompt_count(server, tools=[WEATHER]) > \
        prompt_count(server)


def test_exclude_tools_when_tool_choice_none_leaves_them_out_of_the_prompt(tiny_tools_dir):
    with LiveServer(tiny_settings(tiny_tools_dir, exclude_tools_when_tool_choice_none=True)) as excluding:
        assert prompt_count(excluding, tools=[WEATHER], tool_choice="none") == prompt_count(excluding) < \
            prompt_count(excluding, tools=[WEATHER])
        with sdk_client(excluding) as sdk:
            resp = sdk.chat.completions.create(model=excluding.state.model_name, messages=HI, tools=[WEATHER],
                                               tool_choice="none", max_tokens=2)
        assert resp.usage.prompt_tokens == prompt_count(excluding)  # the chat's route leaves them out too


HI = [{"role": "user", "content": "hi"}]


def prompt_count(server, **body) -> int:
    """The prompt's tokens as the server renders a chat of one "hi" (POST /tokenize)."""
    request = urllib.request.Request(server.url + "/tokenize", method="POST", data=json.dumps(
        {"messages": HI, **body}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        return json.load(response)["count"]


def test_malformed_call_is_returned_as_content(server, client, model):
    broken = '<tool_call>\n{"name": get_weather}\n</tool_call>'
    server.scripted.script = pieces(broken)
    resp = client.chat.completions.create(model=model, messages=ask("Weather?"), tools=[WEATHER])
    assert resp.choices[0].message.content == broken and resp.choices[0].message.tool_calls is None
    assert resp.choices[0].finish_reason == "stop"


def test_a_streamed_responses_calls_are_the_ones_its_next_turn_answers(server, client, model):
    """A call whose arguments break after its name has streamed (a parse of the whole text makes it text) stays the
    call the client saw: the stored turn holds the streamed calls and ids, so an output for either call continues
    the conversation (the second call's output was a 400 "no function call found", the first's rendered as the
    second's answer)."""
    tools = [{"type": "function", **WEATHER["function"]}, {"type": "function", **TIME["function"]}]
    server.scripted.script = pieces('<tool_call>\n{"name": "get_weather", "arguments": BAD}\n</tool_call>\n'
                                    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', 2)
    events = list(client.responses.create(model=model, input="Weather and time?", tools=tools, stream=True))
    calls = [item for item in events[-1].response.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    for call in calls:
        server.scripted.script = pieces("Done.")
        answer = client.responses.create(model=model, previous_response_id=events[-1].response.id, tools=tools,
                                         input=[{"type": "function_call_output", "call_id": call.call_id,
                                                 "output": "sunny"}])
        assert answer.output_text == "Done."
    server.scripted.script = None


def test_tools_reach_the_prompt_through_the_chat_template(server, client, model, tiny_tools_dir):
    messages = ask("Weather?")
    tok = load_tokenizer(tiny_tools_dir, set())
    with_tools = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=1)
    without = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert with_tools.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(messages, tools=[WEATHER])))
    assert without.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(messages)))
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 40


def test_agent_loop_call_result_answer_hits_the_cache(client, model):
    """Step 1 offers the tool; step 2 sends the call (crafted: a random model does not write one) and
    its result; step 3 goes on. Each step's prompt starts with the previous one, so its blocks hit."""
    messages = ask("What is the weather in Paris? " * 3)
    kwargs = dict(model=model, tools=[WEATHER], temperature=0, max_tokens=8)
    first = client.chat.completions.create(messages=messages, **kwargs)
    call = {"id": "call_abc", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21 C"}]
    second = client.chat.completions.create(messages=messages, **kwargs)
    messages += [{"role": "assistant", "content": second.choices[0].message.content or ""},
                 {"role": "user", "content": "And tomorrow?"}]
    third = client.chat.completions.create(messages=messages, **kwargs)
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, second, third)]
    assert cached[0] == 0
    assert cached[1] >= first.usage.prompt_tokens // BLOCK * BLOCK > 0
    assert cached[2] >= second.usage.prompt_tokens // BLOCK * BLOCK > cached[1]
