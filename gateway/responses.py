"""The Responses API (`/v1/responses`) over the chat machinery: a request's `input` items and `instructions`
become chat messages, run through the same template, tool parser and structured outputs as
/v1/chat/completions, and the answer comes back as a response object, or as the documented event stream.

Stored responses (`store`, default true) keep their conversation per tenant: `previous_response_id`
continues it by re-rendering the stored messages and the answer's text, the tokens the prefix cache already
holds, so the next turn is a cache hit over the whole earlier turn. Another tenant's response id is a 404.
"""
from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from engine.outputs import FinishReason

from gateway.cache_control import chat_directives
from gateway.errors import APIError, invalid
from gateway.formats import ChatFormat
from gateway.generate import Choice, check_output, usage
from gateway.jsonbody import parse_body
from gateway.protocol import ChatRequest, parse_chat
from gateway.reasoning import answer_starts_thinking
from gateway.render import content_text, render_chat
from gateway.response_store import Stored
from gateway.response_store_pending import PendingPuts
from gateway.responses_fields import VLLM_EXTRAS, check_fields, items_page, logprobs_fields
from gateway.runner import RequestRun, sampling_params, with_calls_beside_format
from gateway.state import STATE
from gateway.streaming import SSE_HEADERS, TimedStream, encode_event, end, end_on_error
from gateway.tool_prompt import TOOL_TEMPLATE

HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
                "image_generation", "mcp", "local_shell")
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_ITEM_FIELDS = {"message": ("id", "role", "content", "status"),  # the input item types taken, with their fields
                "function_call": ("id", "call_id", "name", "arguments", "status"),
                "function_call_output": ("id", "call_id", "output", "status"),
                "reasoning": ("id", "summary", "content", "status")}
ITEM_TYPES = tuple(_ITEM_FIELDS)
# OpenAI's item id prefixes
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
TEXT_PARTS = ("input_text", "output_text", "text")
# chat parameter names as the Responses API calls them, for the 400s the chat parser raises
PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


RESPONSE_STORE = web.AppKey("response_store", PendingPuts)


# ---- the request

@dataclass(slots=True)
class ResponsesRequest:
    chat: ChatRequest
    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]  # the conversation before this answer, as chat messages (instructions aside)
    store: bool
    previous_response_id: str | None
    tools: list[dict[str, Any]] = field(default_factory=list)


async def _previous(store: PendingPuts, tenant: str, response_id: str) -> Stored:
    """The stored response a request continues; one not stored (for this key) is a 400
    `previous_response_not_found`, as OpenAI answers it (clients such as Codex resend the whole conversation on
    that code), where GET / DELETE of it are 404s."""
    try:
        return await store.aget(tenant, response_id)
    except APIError as exc:
        if exc.code != "response_not_found":
            exc.param = "previous_response_id"  # (a 503: the store could not read it now)
            raise
        raise APIError(400, f"Previous response with id {response_id!r} not found.", param="previous_response_id",
                       code="previous_response_not_found") from None


async def parse_responses(body: Any, state, tenant: str, store: PendingPuts) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    if body.get("background"):
        raise invalid("background responses are not offered by this server", "background")
    check_fields(body)
    previous_id = body.get("previous_response_id")
    if previous_id is not None and not isinstance(previous_id, str):
        raise invalid("previous_response_id must be a string", "previous_response_id")
    history = list((await _previous(store, tenant, previous_id)).messages) if previous_id is not None else []
    items = _input_items(body.get("input"))
    conversation = history + _conversation(items)
    _check_outputs_answer_calls(history, items)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions must be a string", "instructions")
    # instructions lead this request's prompt only (OpenAI: not carried over by previous_response_id), beside the
    # system and developer messages of the input, which are the conversation's and are
    messages = ([{"role": "system", "content": instructions}] if instructions is not None else []) + conversation
    if not messages:
        raise invalid("input must not be empty", "input")
    tools = _tools(body.get("tools"))
    if not tools and body.get("tool_choice") not in (None, "auto", "none"):  # (as OpenAI: not a choice dropped)
        raise invalid("tool_choice other than auto or none needs tools", "tool_choice")
    chat_body = {"model": body.get("model"), "messages": messages, "stream": body.get("stream", False),
                 "max_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
                 "top_p": body.get("top_p"), "user": body.get("user"), "cache_salt": body.get("cache_salt"),
                 "cache_control": body.get("cache_control"),  # breakpoints by message index (docs/prompt-caching.md)
                 **{name: body.get(name) for name in VLLM_EXTRAS}, **logprobs_fields(body)}
    if tools:
        chat_body["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                                if k in t}} for t in tools]
        chat_body["tool_choice"] = _tool_choice(body.get("tool_choice"))
        if body.get("parallel_tool_calls") is not None:
            chat_body["parallel_tool_calls"] = body["parallel_tool_calls"]
    forced = tools and chat_body["tool_choice"] not in (None, "auto", "none")
    if (fmt := _text_format(body.get("text"))) is not None and not forced:
        # (a forced call is the whole output: text.format shapes text, as agents send it on every turn)
        chat_body["response_format"] = fmt
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise invalid("parallel_tool_calls must be a boolean", "parallel_tool_calls")  # echoed even without tools
    with responses_params():
        chat = parse_chat({k: v for k, v in chat_body.items() if v is not None}, state.settings.gateway,
                          state.sampling_defaults)
    store_it = body.get("store", True)
    if not isinstance(store_it, bool):
        raise invalid("store must be a boolean", "store")
    return ResponsesRequest(chat, body, items, conversation, store_it, previous_id, tools)


@contextlib.contextmanager
def responses_params():
    """A chat 400 raised inside names the field as the Responses API calls it."""
    try:
        yield
    except APIError as err:
        if err.param:
            err.param = _responses_param(err.param)
        raise


def _check_outputs_answer_calls(history: list[dict[str, Any]], items: list[dict[str, Any]]) -> None:
    """Each function_call_output answers a function call made before it, in this input or in the conversation it
    continues (OpenAI: "No tool call found for function call output")."""
    calls = {call["id"] for message in history for call in message.get("tool_calls") or ()}
    for i, item in enumerate(items):
        if item["type"] == "function_call":
            calls.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in calls:
            raise invalid(f"no function call found for function_call_output with call_id {item['call_id']!r}",
                          f"input[{i}].call_id")


def _responses_param(chat_param: str) -> str:
    """The Responses name of the field a chat parser's 400 names."""
    head = chat_param.split("[")[0].split(".")[0]
    if head == "tools":  # a Responses tool is flat: tools[0].parameters, not tools[0].function.parameters
        return chat_param.replace(".function.", ".", 1)
    return PARAMS.get(head, chat_param)


def _input_items(raw: Any) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    if not isinstance(raw, list):
        raise invalid("input must be a string or an array of items", "input")
    items = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise invalid("each input item must be an object", f"input[{i}]")
        kind = item.get("type", "message")
        if kind not in ITEM_TYPES:
            raise invalid(f"input items of type {kind!r} are not supported; supported: {', '.join(ITEM_TYPES)}",
                          f"input[{i}].type")
        _optional_string(item, "id", f"input[{i}]")
        # kept with the fields of its type only (others never reach the prompt: stored, they would cost the store
        # and its memory whatever they hold); a message's text as parts and a call output as text, as OpenAI lists them
        item = {key: item[key] for key in _ITEM_FIELDS[kind] if key in item}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        elif kind == "message" and isinstance(item.get("content"), list):  # (a part that is not text: a 400 below)
            item["content"] = [{"type": p.get("type"), "text": p["text"]} if isinstance(p, dict) and "text" in p
                               else p for p in item["content"]]
        if kind == "function_call_output" and item.get("output") is not None and not isinstance(item["output"], str):
            item["output"] = json.dumps(item["output"])
        items.append({**item, "type": kind})
    return items


def _conversation(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as chat messages. An answer's items come back as they went out (reasoning, message, calls):
    its message and the function calls right after it are one assistant message, as the answer was (and as a
    conversation continued by previous_response_id holds it), so the prompt renders as the cache holds it; a
    reasoning item's text is that message's reasoning_content (which a template like Qwen3's shows in the turn)."""
    messages, thinking, answer = [], None, None  # answer: the assistant message function calls may still join
    for i, item in enumerate(items):
        if item["type"] == "reasoning":
            thinking, answer = _reasoning_text(item, f"input[{i}]"), None
            continue
        for message in _messages(item, f"input[{i}]"):
            if answer is not None and message["role"] == "assistant" and message.get("tool_calls"):
                answer["tool_calls"] = answer.get("tool_calls", []) + message["tool_calls"]
                continue
            if thinking is not None and message["role"] == "assistant":
                message["reasoning_content"], thinking = thinking, None
            messages.append(message)
            answer = message if message["role"] == "assistant" else None
    return messages


def _reasoning_text(item: dict[str, Any], at: str) -> str:
    """A reasoning item's text: its reasoning_text parts (as this server writes them), else its summary's."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == part_type
                                                  and isinstance(p.get("text"), str) for p in parts):
            raise invalid(f'a reasoning item\'s {key} must be an array of {{"type": "{part_type}", "text"}} parts',
                          f"{at}.{key}")
        if parts:
            return "".join(p["text"] for p in parts)
    return ""


def _messages(item: dict[str, Any], at: str) -> list[dict[str, Any]]:
    """One input item (at `at`, as `input[3]`) as chat messages."""
    if item["type"] == "function_call":
        call = {"name": _string(item, "name", at), "arguments": _optional_string(item, "arguments", at) or ""}
        return [{"role": "assistant", "content": "", "tool_calls": [{
            "id": _string(item, "call_id", at), "type": "function", "function": call}]}]
    if item["type"] == "function_call_output":
        call_id, output = _string(item, "call_id", at), item.get("output")
        if output is None:
            raise invalid("a function_call_output needs its output", f"{at}.output")
        return [{"role": "tool", "tool_call_id": call_id,
                 "content": output if isinstance(output, str) else json.dumps(output)}]
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid(f"unknown role {role!r}; expected one of {sorted(ROLES)}", f"{at}.role")
    return [{"role": ROLES[role], "content": content_text(item.get("content"), f"{at}.content", TEXT_PARTS, "")}]


def _string(obj: dict[str, Any], key: str, at: str) -> str:
    if not isinstance(value := obj.get(key), str):
        raise invalid(f"{key} must be a string" if key in obj else f"{key} is required", f"{at}.{key}")
    return value


def _optional_string(obj: dict[str, Any], key: str, at: str) -> str | None:
    return None if obj.get(key) is None else _string(obj, key, at)


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid("tools must be an array", "tools")
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in HOSTED_TOOLS:
            raise invalid(f"the hosted tool {kind!r} is not available on this server; only function tools are",
                          f"tools[{i}].type")
        if kind != "function" or not isinstance(tool.get("name"), str):
            raise invalid('each tool must be {"type": "function", "name": ..., "parameters": ...}', f"tools[{i}]")
    return raw


def _tool_choice(raw: Any) -> Any:
    if isinstance(raw, dict) and raw.get("type") == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    return raw


def _text_format(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid("text must be an object", "text")
    fmt = raw.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):  # optional in chat's response_format, required here
            raise invalid("text.format.schema must be a JSON schema object", "text.format.schema")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


# ---- the answer

def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _output_items(message: dict[str, Any], finish_reason: str | None,
                  logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chat answer as Responses output items: its thinking as a reasoning item, its text as a message (with
    `logprobs`, message_logprobs' list), each tool call as a function_call."""
    items = []
    if message.get("reasoning"):
        items.append(_reasoning_item(message["reasoning"], "completed"))
    if message.get("content"):
        items.append({"type": "message", "id": _new_id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message["content"], "annotations": [],
                                   "logprobs": logprobs}]})
    for call in message.get("tool_calls") or ():
        items.append({"type": "function_call", "id": _new_id("fc"), "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    _mark_cut_short(items, finish_reason)
    return items


def message_logprobs(fmt: ChatFormat, choice: Choice, first: int = 0) -> list[dict[str, Any]]:
    """The logprobs of the answer's tokens after its thinking, from its first-th on, as chat's logprobs.content
    lists them (token, logprob, bytes, top_logprobs): [] where the request asked for none. Tokens that a tool
    parser turned into function calls are among them (as vLLM's are): a call item carries no logprobs."""
    start = max(first, choice.num_reasoning_tokens)
    return (fmt.logprobs(choice, choice.logprobs[start:]) or {"content": []})["content"]


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    """vLLM's reasoning output item: the thinking as one reasoning_text part, no summary."""
    return {"type": "reasoning", "id": _new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _mark_cut_short(items: list[dict[str, Any]], finish_reason: str | None) -> None:
    """The item max_output_tokens cut (the last one) is "incomplete", as OpenAI marks it."""
    if items and finish_reason == FinishReason.LENGTH:
        items[-1]["status"] = "incomplete"


def _response(response_id: str, req: ResponsesRequest, model: str, created: int, output: list[dict[str, Any]],
              finish_reason: str | None, use: dict[str, Any] | None) -> dict[str, Any]:
    body = req.body
    incomplete = finish_reason == "length"
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model,
        "status": "in_progress" if use is None else "incomplete" if incomplete else "completed",
        "completed_at": int(time.time()) if use is not None and not incomplete else None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete and use is not None else None,
        "error": None, "instructions": body.get("instructions"), "output": output,
        # (a field sent as null echoed as its default: the SDK's types want a value)
        "parallel_tool_calls": _or(body.get("parallel_tool_calls"), True),
        "tool_choice": _or(body.get("tool_choice"), "auto"),
        "tools": req.tools, "temperature": req.chat.temperature, "top_p": req.chat.top_p,
        "top_logprobs": req.chat.logprobs or 0,
        "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": req.previous_response_id,
        "store": req.store, "metadata": body.get("metadata") or {}, "user": body.get("user"),
        "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
        "prompt_cache_key": body.get("prompt_cache_key"), "service_tier": "default",  # (one tier here)
        "usage": None if use is None else {
            "input_tokens": use["prompt_tokens"],
            "input_tokens_details": use["prompt_tokens_details"],
            "output_tokens": use["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": use["completion_tokens_details"]["reasoning_tokens"]},
            "total_tokens": use["total_tokens"]},
    }


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


async def create(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    state = request.app[STATE]
    tenant = state.auth.authenticate(request)
    store = request.app[RESPONSE_STORE]
    req = await parse_responses(parse_body(await request.read()), state, tenant.name, store)
    state.check_model(req.chat.model)
    tool_template = request.app[TOOL_TEMPLATE]
    chat = with_calls_beside_format(req.chat, tool_template.parser)
    with state.admission.admit(tenant, 1):
        tools = tool_template.shown(chat.tools)
        prompt = await render_chat(state.engine.tokenizer, chat.messages, tools, tool_template)
        with responses_params():
            max_tokens = state.check_lengths(len(prompt), chat.max_tokens, "input")
        cache = await chat_directives(state.engine.tokenizer, chat.messages, chat.breakpoints, prompt, tools,
                                      tool_template, tenant.max_pinned_blocks)
        response_id = _new_id("resp")
        fmt = ChatFormat(response_id, state.model_name, state.engine.tokenizer, tools=chat.tools,
                         tool_call_parser=tool_template.parser,
                         thinking=answer_starts_thinking(state.engine.tokenizer, chat) if state.splits_thinking
                         else None)
        choice = Choice(0, 0, response_id, prompt, sampling_params(chat, max_tokens, 0), cache, stream=chat.stream)
        run = RequestRun(state, tenant, chat.cache_salt, [choice], "input")
        created = int(time.time())
        if chat.stream:
            return await run.streamed(lambda outputs: _stream(request, req, fmt, choice, outputs, created, store,
                                                              tenant.name))
        await run.to_end()
    fmt.count_reasoning_tokens(choice)
    body = fmt.choice_body(choice)
    output = _output_items(body["message"], body["finish_reason"], message_logprobs(fmt, choice))
    response = _response(response_id, req, state.model_name, created, output, body["finish_reason"], usage([choice]))
    await _remember(store, tenant.name, req, response, body["message"])
    return web.json_response(response)


async def input_tokens(request: web.Request) -> web.Response:
    """POST /v1/responses/input_tokens: how many input tokens a response to this body would be prompted with (its
    instructions, input, earlier turns by previous_response_id, and tools, as create renders them); no engine."""
    state = request.app[STATE]
    tenant = state.auth.authenticate(request)
    req = await parse_responses(parse_body(await request.read()), state, tenant.name, request.app[RESPONSE_STORE])
    state.check_model(req.chat.model)
    tool_template = request.app[TOOL_TEMPLATE]
    prompt = await render_chat(state.engine.tokenizer, req.chat.messages, tool_template.shown(req.chat.tools),
                               tool_template)
    return web.json_response({"object": "response.input_tokens", "input_tokens": len(prompt)})


async def _remember(store: PendingPuts, tenant: str, req: ResponsesRequest, response: dict[str, Any],
                    message: dict[str, Any]) -> None:
    if req.store:
        answer = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}
        answer["content"] = answer.get("content") or ""
        if message.get("reasoning"):  # the next turn renders this turn as the model wrote it
            answer["reasoning_content"] = message["reasoning"]
        await store.aput(Stored(tenant, response, req.input_items, req.messages + [answer]))


async def _stream(request: web.Request, req: ResponsesRequest, fmt: ChatFormat, choice: Choice, outputs,
                  created: int, store: PendingPuts, tenant: str) -> web.StreamResponse:
    """The documented event sequence, each event with its sequence_number; a client that goes away ends it
    (its request aborted), as a chat stream. As a chat stream's, the headers (and response.created) go out with the
    engine's first output, so a request the engine refuses (a logit_bias token past the vocabulary) is a plain 400,
    not a 200 stream that breaks."""
    given: int | None = None  # the answer's tokens whose logprobs went out with the message's text

    def take_logprobs() -> list[dict[str, Any]]:
        nonlocal given
        if choice.params.logprobs is None:
            return []
        if given is None:  # (the message's first text: the thinking, if any, is over)
            fmt.count_reasoning_tokens(choice)
        entries, given = message_logprobs(fmt, choice, given or 0), len(choice.logprobs)
        return entries

    events = _Events(fmt.response_id, lambda output, reason, use: _response(
        fmt.response_id, req, fmt.model, created, output, reason, use), take_logprobs)
    resp: TimedStream | None = None

    timeout_s = request.app[STATE].settings.gateway.stream_write_timeout_s

    async def opened() -> TimedStream:
        stream = TimedStream(web.StreamResponse(headers=SSE_HEADERS), timeout_s)
        await stream.response.prepare(request)
        for event in events.start():
            await stream.write(event)
        return stream

    try:
        async for _, out in outputs:
            check_output(out)
            resp = resp or await opened()
            choice.add(out)
            if (chunk := fmt.delta_chunk(choice, out)) is not None:
                for event in events.delta(chunk["choices"][0]["delta"]):
                    await resp.write(event)
            if out.finished:
                for event in events.delta(fmt.finish_chunk(choice)["choices"][0]["delta"]):
                    await resp.write(event)
        resp = resp or await opened()
        body = fmt.choice_body(choice)
        finish = events.finish(body["finish_reason"], usage([choice]), message_logprobs(fmt, choice))
        # stored before the client hears it is: a client may continue it the moment response.completed arrives; as
        # streamed (where the tool parser's stream and a parse of the whole text disagree, a malformed call, the
        # calls' ids are those the client holds)
        await _remember(store, tenant, req, events.final, events.answer())
        for event in finish:
            await resp.write(event)
    except Exception as exc:  # (a client that stopped reading is dropped, as a chat stream's)
        return await end_on_error(request, resp, exc, events.failed, timeout_s)
    return await end(resp)


# a text item's part type (and its events' names)
_TEXT_PARTS = {"message": "output_text", "reasoning": "reasoning_text"}


class _Events:
    """Turns chat deltas (text, tool call fragments) into Responses stream events."""

    def __init__(self, response_id: str, response, take_logprobs) -> None:
        self.response_id = response_id
        self.response = response  # (output, finish_reason, usage) -> the response object
        self.take_logprobs = take_logprobs  # () -> the logprobs of the message's text not yet sent
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items in order, as they stand
        self.message: dict[str, Any] | None = None  # the open message item
        self.reasoning: dict[str, Any] | None = None  # the reasoning item, once the thinking began
        self.calls: dict[int, dict[str, Any]] = {}  # tool call index -> its function_call item
        self.num_done = 0  # items before this one are done (their output_item.done sent)
        self.final: dict[str, Any] = {}

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\n" + encode_event(payload)

    def start(self) -> list[bytes]:
        response = self.response([], None, None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        """A new output item; the one before it is done where nothing more can come to it (the thinking, a call
        whose arguments ended as the next began), as OpenAI closes an item before the next opens. A message stays
        open: text may still come after the calls."""
        events = []
        if self.items and self.items[-1]["type"] != "message" and self.num_done == len(self.items) - 1:
            self.items[-1]["status"] = "completed"
            events += self._done(len(self.items) - 1)
            self.num_done = len(self.items)
        self.items.append(item)
        return events + [self._event("response.output_item.added", output_index=len(self.items) - 1,
                                     item=dict(item))]

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        events = []
        if delta.get("reasoning"):  # (all of it comes before the answer's text and calls)
            self.reasoning = self.reasoning or {**_reasoning_item("", "in_progress"), "content": []}
            events += self._text(self.reasoning, delta["reasoning"])
        if delta.get("content"):
            self.message = self.message or {"type": "message", "id": _new_id("msg"), "status": "in_progress",
                                             "role": "assistant", "content": []}
            events += self._text(self.message, delta["content"])
        for call in delta.get("tool_calls") or ():
            item = self.calls.get(call["index"])
            if item is None:
                item = {"type": "function_call", "id": _new_id("fc"), "call_id": call.get("id") or _new_id("call"),
                        "name": call["function"].get("name"), "arguments": "", "status": "in_progress"}
                self.calls[call["index"]] = item
                events += self._add(item)
            if fragment := call["function"].get("arguments"):
                item["arguments"] += fragment
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self.items.index(item), delta=fragment))
        return events

    def _text(self, item: dict[str, Any], text: str) -> list[bytes]:
        """The next piece of a text item's (a message's, the thinking's) one part, the item and part opened first."""
        kind, message = _TEXT_PARTS[item["type"]], item["type"] == "message"
        events = []
        if not item["content"]:
            events += self._add(item)
            # (OpenAI's output_text part: annotations, none here, and logprobs, [] until its done event)
            item["content"].append({"type": kind, "text": "", **({"annotations": [], "logprobs": []} if message
                                                                 else {})})
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.items) - 1, content_index=0, part=dict(item["content"][0])))
        item["content"][0]["text"] += text
        extra = {"logprobs": self.take_logprobs()} if message else {}
        return events + [self._event(f"response.{kind}.delta", item_id=item["id"], output_index=self.items.index(item),
                                     content_index=0, delta=text, **extra)]

    def finish(self, finish_reason: str | None, use: dict[str, Any], logprobs: list[dict[str, Any]]) -> list[bytes]:
        """The last events; `logprobs`: the message text's whole list (message_logprobs)."""
        events = []
        for item in self.items:
            item["status"] = "completed"
        if self.message is not None:
            self.message["content"][0]["logprobs"] = logprobs
        _mark_cut_short(self.items, finish_reason)
        for index in range(self.num_done, len(self.items)):
            events += self._done(index)
        self.final = self.response(self.items, finish_reason, use)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=self.final))
        return events

    def _done(self, index: int) -> list[bytes]:
        item = self.items[index]
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"])]
        else:
            part, kind = item["content"][0], _TEXT_PARTS[item["type"]]
            extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            events = [self._event(f"response.{kind}.done", item_id=item["id"], output_index=index, content_index=0,
                                  text=part["text"], **extra),
                      self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def answer(self) -> dict[str, Any]:
        """The answer as the events gave it, as a chat message (gateway/formats.py's choice_body's shape)."""
        message: dict[str, Any] = {"role": "assistant",
                                   "content": self.message["content"][0]["text"] if self.message else ""}
        if calls := [item for item in self.items if item["type"] == "function_call"]:
            message["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        if self.reasoning is not None:
            message["reasoning"] = self.reasoning["content"][0]["text"]
        return message

    def failed(self, err: APIError) -> list[bytes]:
        """A failure after the first event: an `error` event, then response.failed (the stream's last)."""
        body = err.body()["error"]
        response = {**self.response(self.items, None, None), "status": "failed",
                    "error": {"code": body["code"], "message": body["message"]}}
        return [self._event("error", code=body["code"], message=body["message"], param=body["param"]),
                self._event("response.failed", response=response)]


# ---- stored responses

async def retrieve(request: web.Request) -> web.Response:
    """GET /v1/responses/{response_id}."""
    tenant = request.app[STATE].auth.authenticate(request)
    if request.query.get("stream", "false").lower() != "false":  # (the SDK's retrieve(stream=True) would read none)
        raise invalid("streaming a stored response's events is for background responses, which this server does "
                      "not offer", "stream")
    stored = await request.app[RESPONSE_STORE].aget(tenant.name, request.match_info["response_id"])
    return web.json_response(stored.response)


async def delete(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{response_id}."""
    tenant = request.app[STATE].auth.authenticate(request)
    response_id = request.match_info["response_id"]
    await request.app[RESPONSE_STORE].adelete(tenant.name, response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def input_items(request: web.Request) -> web.Response:
    """GET /v1/responses/{response_id}/input_items: this request's own input items (not earlier turns')."""
    tenant = request.app[STATE].auth.authenticate(request)
    response_id = request.match_info["response_id"]
    stored = await request.app[RESPONSE_STORE].aget(tenant.name, response_id)
    # an item sent without an id gets one from its response and place, the same at every read (pages go by ids)
    items = [{**item, "id": item.get("id") or f"{_ITEM_PREFIX[item['type']]}_{response_id.removeprefix('resp_')}_{i}",
              "status": item.get("status") or "completed"} for i, item in enumerate(stored.input_items)]
    return web.json_response(items_page(items, request.query))


async def cancel(request: web.Request) -> web.Response:
    """POST /v1/responses/{response_id}/cancel: only background responses can be cancelled, and this server
    runs none."""
    tenant = request.app[STATE].auth.authenticate(request)
    await request.app[RESPONSE_STORE].aget(tenant.name, request.match_info["response_id"])  # 404 first if not ours
    raise invalid("only background responses can be cancelled; this server does not offer background mode",
                  "response_id")
