"""The Responses API through the openai SDK: plain, streamed (the documented events), continued with
previous_response_id (the second turn a cache hit over the whole first), function tools, text.format, vLLM's
sampling extras, the stored responses' routes, and tenants that never see each other's response ids."""
from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from gateway.settings import ApiKey
from tests.support.gateway_helpers import LiveServer, sdk_client, tiny_settings

KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
SYSTEM = "You are a helpful assistant who answers about the capital of France and the prefix cache. " * 3
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server(tiny_tools_dir):
    keys = tuple(ApiKey(key, tenant) for tenant, key in KEYS.items())
    with LiveServer(tiny_settings(tiny_tools_dir, keys=keys)) as live:
        live.clients = {}
        yield live
        for sdk in live.clients.values():
            sdk.close()


def client(server, tenant: str = "alice") -> openai.OpenAI:
    """One SDK client per tenant, closed with the server (an unclosed pool's sockets warn at garbage collection)."""
    if tenant not in server.clients:
        server.clients[tenant] = sdk_client(server)
        server.clients[tenant].api_key = KEYS[tenant]
    return server.clients[tenant]


def test_a_plain_response_and_its_stored_routes(server):
    sdk, model = client(server), server.state.model_name
    resp = sdk.responses.create(model=model, input="hello world", max_output_tokens=6, temperature=0)
    assert resp.object == "response" and resp.status in ("completed", "incomplete")
    assert resp.output[0].type == "message" and resp.output_text == resp.output[0].content[0].text
    assert resp.usage.input_tokens > 0 and resp.usage.input_tokens_details.cached_tokens == 0
    assert resp.usage.output_tokens == 6 and resp.incomplete_details.reason == "max_output_tokens"
    assert sdk.responses.retrieve(resp.id).output_text == resp.output_text
    items = sdk.responses.input_items.list(resp.id)
    assert [i.content[0].text for i in items.data] == ["hello world"]
    assert resp.completed_at is None and resp.service_tier == "default"  # (incomplete: cut at max_output_tokens)
    with pytest.raises(openai.BadRequestError, match="background"):
        sdk.responses.cancel(resp.id)
    with pytest.raises(openai.BadRequestError) as streamed:  # the SDK would read no event from a JSON body
        sdk.responses.retrieve(resp.id, stream=True)
    assert streamed.value.param == "stream"
    # list items with string content are listed as parts, as OpenAI lists them (code reads item.content[0].type)
    listed = sdk.responses.create(model=model, max_output_tokens=1, prompt_cache_key="chat-7", input=[
        {"role": "user", "content": "hi", "extra": "x" * 1000}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"}])  # (a field an item does not have is not stored)
    assert listed.prompt_cache_key == "chat-7"
    listed_items = sdk.responses.input_items.list(listed.id, order="asc").data
    assert not hasattr(listed_items[0], "extra") or listed_items[0].extra is None
    parts = [(i.role, i.status, [(p.type, p.text) for p in i.content]) for i in listed_items]
    assert parts == [("user", "completed", [("input_text", "hi")]),
                     ("assistant", "completed", [("output_text", "hello")]),
                     ("user", "completed", [("input_text", "again")])]
    sdk.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(resp.id)
    server.wait_idle()


def test_input_tokens_count_what_a_response_is_prompted_with(server):
    sdk, model = client(server), server.state.model_name
    first = sdk.responses.create(model=model, instructions=SYSTEM, input="What is the capital of France?",
                                 max_output_tokens=2, temperature=0)
    body = dict(model=model, instructions="Be brief.", input="And of Italy?", previous_response_id=first.id,
                tools=[WEATHER])
    counted = sdk.responses.input_tokens.count(**body)
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == sdk.responses.create(**body, max_output_tokens=1).usage.input_tokens
    with pytest.raises(openai.BadRequestError) as lost:
        client(server, "bob").responses.input_tokens.count(model=model, input="x", previous_response_id=first.id)
    assert lost.value.code == "previous_response_not_found"
    server.wait_idle()


def test_previous_response_id_continues_from_the_cache(server):
    sdk, model = client(server), server.state.model_name
    first = sdk.responses.create(model=model, instructions=SYSTEM, input="What is the capital of France?",
                                 max_output_tokens=20, temperature=0)
    second = sdk.responses.create(model=model, instructions=SYSTEM, previous_response_id=first.id,
                                  input="And of Italy?", max_output_tokens=4, temperature=0)
    turn_one = first.usage.input_tokens + first.usage.output_tokens  # the first prompt and its answer
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= (turn_one - 1) // 16 * 16 - 16, (cached, turn_one)  # all but the partial last block
    # the request sent only the new message: the server brought the conversation
    assert second.usage.input_tokens > turn_one
    server.wait_idle()


def test_instructions_lead_their_own_request_and_the_inputs_system_messages_stay(server):
    """OpenAI's rule: instructions are not carried over by previous_response_id, and they stand beside the input's own
    system and developer messages (both were wrong: the stored turn kept them, and they dropped the input's)."""
    sdk, model = client(server), server.state.model_name

    def chat_prompt_tokens(messages):
        return sdk.chat.completions.create(model=model, messages=messages, max_tokens=1).usage.prompt_tokens

    first = sdk.responses.create(model=model, instructions=SYSTEM, input="Hi", max_output_tokens=4, temperature=0)
    second = sdk.responses.create(model=model, previous_response_id=first.id, input="And?", max_output_tokens=1)
    assert second.instructions is None
    assert second.usage.input_tokens == chat_prompt_tokens([{"role": "user", "content": "Hi"}, {
        "role": "assistant", "content": first.output_text}, {"role": "user", "content": "And?"}])
    developer = [{"role": "developer", "content": "Speak French."}, {"role": "user", "content": "Hi"}]
    third = sdk.responses.create(model=model, instructions="Be short.", input=developer, max_output_tokens=1)
    assert third.usage.input_tokens == chat_prompt_tokens([{"role": "system", "content": "Be short."}, *developer])
    server.wait_idle()


def test_another_tenant_never_sees_a_response_id(server):
    alice, bob = client(server, "alice"), client(server, "bob")
    resp = alice.responses.create(model=server.state.model_name, input="a secret", max_output_tokens=2)
    for call in (lambda: bob.responses.retrieve(resp.id), lambda: bob.responses.delete(resp.id),
                 lambda: bob.responses.input_items.list(resp.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    # continuing an unknown response: OpenAI's 400 and code, on which clients (Codex) resend the conversation
    with pytest.raises(openai.BadRequestError) as lost:
        bob.responses.create(model=server.state.model_name, input="x", previous_response_id=resp.id)
    assert lost.value.code == "previous_response_not_found" and lost.value.param == "previous_response_id"
    assert alice.responses.retrieve(resp.id).id == resp.id
    server.wait_idle()


def test_a_stream_sends_the_documented_events(server):
    sdk = client(server)
    # (the SDK's stream helper wants response.completed; a response cut by max_output_tokens ends, as
    # OpenAI's do, with response.incomplete, which the plain stream hands over)
    events = list(sdk.responses.create(model=server.state.model_name, input="count", max_output_tokens=8,
                                       temperature=0, stream=True))
    final = events[-1].response
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert "response.output_text.delta" in kinds and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and final.usage.output_tokens == 8
    texts = [e for e in events if e.type in ("response.output_text.delta", "response.output_text.done")]
    assert texts and all(e.logprobs == [] for e in texts)  # (the SDK's types require the field)
    assert sdk.responses.retrieve(final.id).output_text == final.output_text  # stored too
    server.wait_idle()


def test_logprobs_come_with_the_message_text_as_on_chat(server):
    """include message.output_text.logprobs (with top_logprobs) gives the text's tokens and their alternatives, as
    chat completions give them for the same greedy answer; streamed, the text deltas carry them as they come and
    the done event and the final response the whole list."""
    sdk, model = client(server), server.state.model_name
    question = "tell me about the capital of France"
    chat = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": question}], max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True}).choices[0]
    expected = [t.model_dump() for t in chat.logprobs.content]
    assert len(expected) == 8 and all(len(t["top_logprobs"]) == 2 for t in expected)

    def same(entries) -> None:  # tokens, bytes and alternatives exactly; logprobs to the rounding of another batch
        got = [e if isinstance(e, dict) else e.model_dump() for e in entries]
        assert [(e["token"], e["bytes"], [a["token"] for a in e["top_logprobs"]]) for e in got] == \
            [(e["token"], e["bytes"], [a["token"] for a in e["top_logprobs"]]) for e in expected]
        assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in expected], abs=1e-4)

    body = dict(model=model, input=question, max_output_tokens=8, temperature=0,
                include=["message.output_text.logprobs"], top_logprobs=2, extra_body={"ignore_eos": True})
    resp = sdk.responses.create(**body)
    assert resp.output_text == chat.message.content
    same(resp.output[0].content[0].logprobs)
    same(sdk.responses.retrieve(resp.id).output[0].content[0].logprobs)  # stored with them
    events = list(sdk.responses.create(**body, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    same([entry for e in deltas for entry in e.logprobs])
    same(next(e for e in events if e.type == "response.output_text.done").logprobs)
    same(events[-1].response.output[0].content[0].logprobs)
    plain = sdk.responses.create(model=model, input=question, max_output_tokens=8, temperature=0,
                                 include=["message.output_text.logprobs"], extra_body={"ignore_eos": True})
    # (top_logprobs 0, the default: the tokens alone)
    assert [e.token for e in plain.output[0].content[0].logprobs] == [e["token"] for e in expected]
    assert all(e.top_logprobs == [] for e in plain.output[0].content[0].logprobs)
    unasked = sdk.responses.create(model=model, input=question, max_output_tokens=8, temperature=0)
    assert unasked.output[0].content[0].logprobs == []  # (OpenAI's field, empty when not asked for)
    server.wait_idle()


def test_a_function_tool_round_trip(server):
    sdk, model = client(server), server.state.model_name
    resp = sdk.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=400,
                                temperature=0)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert resp.status == "completed", resp.output  # the grammar closes the call
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    follow = sdk.responses.create(model=model, previous_response_id=resp.id, tools=[WEATHER], max_output_tokens=4,
                                  input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": '{"temperature": 21}'}])
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError, match="web_search"):
        sdk.responses.create(model=model, input="x", tools=[{"type": "web_search"}])
    server.wait_idle()


def test_a_streamed_calls_output_continues_the_conversation(server):
    """The call_id a stream hands out is the one the stored conversation holds: its output answers that call."""
    sdk, model = client(server), server.state.model_name
    events = list(sdk.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=400, temperature=0, stream=True))
    final = events[-1].response
    [call] = [o for o in final.output if o.type == "function_call"]
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert [a.call_id for a in added] == [call.call_id]
    follow = sdk.responses.create(model=model, previous_response_id=final.id, tools=[WEATHER], max_output_tokens=2,
                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    assert follow.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as unknown:
        sdk.responses.create(model=model, previous_response_id=final.id, max_output_tokens=2,
                             input=[{"type": "function_call_output", "call_id": "call_other", "output": "21 C"}])
    assert unknown.value.param == "input[0].call_id"
    server.wait_idle()


class City(BaseModel):  # enums: the tiny random model closes them at once (a free string it never ends)
    name: Literal["Paris", "Rome"]
    country: Literal["France", "Italy"]


def test_text_format_json_schema_and_parse(server):
    sdk, model = client(server), server.state.model_name
    parsed = sdk.responses.parse(model=model, input="A city, as JSON", text_format=City, max_output_tokens=600,
                                 temperature=0)
    assert isinstance(parsed.output_parsed, City)
    resp = sdk.responses.create(model=model, input="JSON please", max_output_tokens=600, temperature=0,
                                text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(resp.output_text), dict)
    server.wait_idle()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_function_call_cut_short_is_an_incomplete_call(server, stream):
    """A string that cannot close within max_output_tokens: the call is cut short, and stays a call."""
    sdk, model = client(server), server.state.model_name
    note = {"type": "function", "name": "take_note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 2000}}, "required": ["text"]}}
    kwargs = dict(model=model, input="Note this.", tools=[note], tool_choice="required", max_output_tokens=64,
                  temperature=0)
    if stream:  # (the SDK's stream helper wants response.completed; an incomplete one ends response.incomplete)
        events = list(sdk.responses.create(**kwargs, stream=True))
        assert events[-1].type == "response.incomplete"
        resp = events[-1].response
    else:
        resp = sdk.responses.create(**kwargs)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in resp.output] == ["function_call"]  # no internal tool-call text as a message
    call = resp.output[0]
    assert call.name == "take_note" and call.status == "incomplete"
    assert call.arguments.startswith('{"text"') and not call.arguments.endswith("}")
    server.wait_idle()


def test_a_forced_call_with_a_text_format_is_the_call(server):
    """Agents send text.format (their output type) on every turn, and force a tool on some: the call wins."""
    sdk, model = client(server), server.state.model_name
    resp = sdk.responses.create(model=model, input="Weather?", tools=[WEATHER], max_output_tokens=400,
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                text={"format": {"type": "json_schema", "name": "City", "strict": True,
                                                 "schema": City.model_json_schema() | {"additionalProperties": False}}})
    assert [o.type for o in resp.output] == ["function_call"] and resp.output[0].name == "get_weather"
    server.wait_idle()


def test_vllms_sampling_extras_shape_the_answer_as_on_chat(server):
    """vLLM's /v1/responses extras (top_k, seed, stop, logit_bias, repetition_penalty, structured_outputs, ...) give
    the answer chat completions give with the same fields, each where it changes the answer; a dropped one would
    give another (they were dropped until 2026-12-01)."""
    sdk, model = client(server), server.state.model_name
    question = "tell me about the capital of France"

    def both(temperature: float = 0, **extra) -> tuple[str, str]:  # (the response's text, the chat answer's)
        resp = sdk.responses.create(model=model, input=question, max_output_tokens=12, temperature=temperature,
                                    extra_body=extra)
        chat = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                           max_tokens=12, temperature=temperature, extra_body=extra)
        return resp.output_text, chat.choices[0].message.content

    greedy = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": question}], max_tokens=12,
                                         temperature=0, extra_body={"return_token_ids": True}).choices[0]
    assert both() == (greedy.message.content,) * 2
    seeded = both(temperature=1.0, seed=11)
    assert seeded[0] == seeded[1] == both(temperature=1.0, seed=11)[0] != greedy.message.content
    assert both(temperature=1.0, seed=11, top_k=1) == (greedy.message.content,) * 2  # top 1: the greedy token
    stop = greedy.message.content[len(greedy.message.content) // 2:][:3]
    cut = both(stop=[stop])
    assert cut[0] == cut[1] == greedy.message.content[:greedy.message.content.index(stop)]
    assert both(stop=[stop], include_stop_str_in_output=True)[0] == cut[0] + stop
    banned = both(logit_bias={str(greedy.token_ids[0]): -100})
    assert banned[0] == banned[1] != greedy.message.content
    penalized = both(repetition_penalty=2.0)
    assert penalized[0] == penalized[1]
    chosen = both(structured_outputs={"choice": ["Paris", "Lyon"]})
    assert chosen[0] == chosen[1] and chosen[0] in ("Paris", "Lyon")
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model=model, input=question, extra_body={"priority": 1})
    assert refused.value.param == "priority"
    with pytest.raises(openai.BadRequestError) as twice:  # one output constraint a request, as on chat
        sdk.responses.create(model=model, input=question, text={"format": {"type": "json_object"}},
                             extra_body={"structured_outputs": {"choice": ["Paris"]}})
    assert twice.value.param in ("structured_outputs", "text.format")
    for stream in (False, True):  # the engine's own refusal: a plain 400 even for a stream (its headers not sent)
        with pytest.raises(openai.BadRequestError) as past_vocabulary:
            sdk.responses.create(model=model, input=question, stream=stream, extra_body={"logit_bias": {"999999": 5}})
        assert past_vocabulary.value.param == "logit_bias"
    server.wait_idle()
