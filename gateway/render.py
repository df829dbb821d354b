"""OpenAI chat messages -> template messages ({role, content}, plus tool_calls / tool_call_id) ->
prompt token ids via the chat template (with the request's tools, see tool_prompt.py)."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import jinja2

from gateway.errors import invalid
from gateway.tool_prompt import ToolTemplate, hermes_messages
from gateway.tools import parse_tools

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
          "function": "tool"}  # "function": the deprecated answer to a `function_call`
_OFFLOAD_CHARS = 8192  # render bigger prompts on a worker thread so the event loop stays responsive
_OFFLOAD_TOKENS = 10_000  # decode longer token lists there too
_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "documents")  # set by their own request fields


def normalize_messages(raw: Any, max_messages: int) -> list[dict[str, Any]]:
    """Validates `messages`; content is a string or a list of {"type": "text", "text": ...} parts."""
    if not isinstance(raw, list) or not raw:
        raise invalid("messages must be a non-empty array", "messages")
    if len(raw) > max_messages:
        raise invalid(f"at most {max_messages} messages are allowed", "messages", "array_above_max_length")  # OpenAI's
    return [_normalize_message(message, f"messages[{i}]") for i, message in enumerate(raw)]


def _normalize_message(message: Any, param: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise invalid("each message must be an object", param)
    role = message.get("role")
    if not isinstance(role, str) or role not in _ROLES:  # a list or object is unhashable
        raise invalid(f"unsupported role {role!r}; use one of {', '.join(_ROLES)}", f"{param}.role")
    content = message.get("content")
    tool_calls = message.get("tool_calls") if role == "assistant" else None
    if role == "assistant" and tool_calls is None and message.get("function_call") is not None:
        tool_calls = [_legacy_call(message["function_call"], f"{param}.function_call")]
    if content is None and role == "assistant":
        content = ""
    out: dict[str, Any] = {"role": _ROLES[role], "content": content_text(content, f"{param}.content")}
    if role != "function" and message.get("name") is not None:
        if not isinstance(message["name"], str):
            raise invalid("a message's name must be a string", f"{param}.name")
        out["name"] = message["name"]  # (to the template, as vLLM passes it: one may show who speaks)
    if role == "function":
        if not isinstance(message.get("name"), str):
            raise invalid("a function message needs the string name of the function it answers", f"{param}.name")
        out["tool_call_id"] = _legacy_call_id(message["name"])
    elif role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise invalid("a tool message needs the string tool_call_id of the call it answers",
                          f"{param}.tool_call_id")
        out["tool_call_id"] = message["tool_call_id"]
    if tool_calls is not None:
        out["tool_calls"] = _tool_calls(tool_calls, f"{param}.tool_calls")
    for name in ("reasoning", "reasoning_content") if role == "assistant" else ():
        if message.get(name) is not None:  # an earlier answer's thinking, sent back: Qwen3's template may show it
            if not isinstance(message[name], str):
                raise invalid(f"a message's {name} must be a string", f"{param}.{name}")
            out["reasoning_content"] = message[name]
    return out


def _legacy_call(raw: Any, param: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise invalid('function_call must be {"name", "arguments"}', param)
    return {"id": _legacy_call_id(raw["name"]), "type": "function", "function": raw}


def _legacy_call_id(name: str) -> str:
    """Legacy calls carry no id; the answer names the function instead, so the name pairs them."""
    return f"call_{name}"


def _tool_calls(raw: Any, param: str) -> list[dict[str, Any]]:
    """As chat templates expect them: arguments as a JSON value (vLLM does the same), not a string."""
    if not isinstance(raw, list):
        raise invalid("tool_calls must be an array", param)
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(function, dict):
            raise invalid('each tool call must be {"id", "type": "function", "function": {"name", "arguments"}}',
                          f"{param}[{j}]")
        if not isinstance(call.get("id"), str):
            raise invalid("a tool call needs a string id", f"{param}[{j}].id")
        if not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str):
            raise invalid("function.name and function.arguments must be strings", f"{param}[{j}].function")
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = function["arguments"]
        calls.append({"id": call["id"], "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def content_text(content: Any, at: str, part_types: tuple[str, ...] = ("text",), joiner: str = "\n") -> str:
    """A message's content as text: a string, or an array of text parts (of `part_types`) joined by `joiner`;
    anything else a 400 naming the field."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("message content must be a string or an array of content parts", at)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise invalid("each content part must be an object", f"{at}[{j}]")
        if part.get("type") not in part_types:
            raise invalid(f"only text content parts ({', '.join(part_types)}) are supported", f"{at}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise invalid("text must be a string" if "text" in part else "text is required", f"{at}[{j}].text")
        texts.append(part["text"])
    return joiner.join(texts)


def template_variables(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs` (more variables for the chat template, e.g. Qwen3's `enable_thinking`) and
    `documents` (the template's `documents`, as transformers passes them); a request's own `chat_template` is
    refused: the model's template renders every chat."""
    if body.get("chat_template") not in (None, ""):
        raise invalid("a request's own chat_template is not supported: the model's template renders every chat",
                      "chat_template")
    raw = body.get("chat_template_kwargs")
    if raw is not None and not isinstance(raw, dict):
        raise invalid("chat_template_kwargs must be an object of template variables", "chat_template_kwargs")
    variables = dict(raw or {})
    for name in _TEMPLATE_OWN:
        if name in variables:
            raise invalid(f"chat_template_kwargs.{name} is set by the request's own field", "chat_template_kwargs")
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise invalid("documents must be an array of objects", "documents")
        variables["documents"] = documents
    return variables


async def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                      tool_template: ToolTemplate | None = None, add_generation_prompt: bool = True,
                      continue_final_message: bool = False, variables: dict[str, Any] | None = None) -> list[int]:
    """`tool_template` None: the template renders tools itself (or there are none). `continue_final_message`: the
    prompt ends inside the final (assistant) message, for the answer to continue it. `variables`: more for the
    template (template_variables)."""
    if tool_template is not None and not tool_template.native:
        messages, tools = hermes_messages(messages, tools), None
    args = (tokenizer, messages, tools, add_generation_prompt, continue_final_message, variables or {})
    if sum(len(m["content"]) for m in messages) > _OFFLOAD_CHARS:
        return await asyncio.to_thread(_render_chat, *args)
    return _render_chat(*args)


async def encode_prompts(tokenizer: Any, prompts: list[str | list[int]], param: str,
                         add_special_tokens: bool = False) -> list[list[int]]:
    """Texts tokenized (after the tokenizer's BOS with `add_special_tokens`), token-id lists taken as they are and
    checked: 400 naming `param` for an empty prompt or an unknown id."""
    encoded = [await encode(tokenizer, p, add_special_tokens) if isinstance(p, str) else p for p in prompts]
    if any(not p for p in encoded):
        raise invalid(f"{param} must not be empty", param)
    if any(not 0 <= t < tokenizer.vocab_size for p in encoded for t in p):
        raise invalid(f"token ids must be in [0, {tokenizer.vocab_size})", param)
    return encoded


async def encode(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """`add_special_tokens`: the tokenizer's BOS first (vLLM's and transformers' default for a text prompt)."""
    ids = await asyncio.to_thread(tokenizer.encode, text) if len(text) > _OFFLOAD_CHARS else tokenizer.encode(text)
    return with_bos(tokenizer, ids, add_special_tokens)


def with_bos(tokenizer: Any, ids: list[int], add_special_tokens: bool) -> list[int]:
    return [*tokenizer.bos_token_ids, *ids] if add_special_tokens else ids


async def decode(tokenizer: Any, token_ids: list[int]) -> str:
    """Token ids' text, special tokens' included (as transformers' decode and vLLM's /detokenize give it): the text
    encodes to the same ids again."""
    if len(token_ids) > _OFFLOAD_TOKENS:
        return await asyncio.to_thread(tokenizer.decode, token_ids, False)
    return tokenizer.decode(token_ids, skip_special_tokens=False)


async def render_body_chat(tokenizer: Any, body: dict[str, Any], max_messages: int, tool_template: ToolTemplate,
                           add_generation_prompt: bool, continue_final_message: bool = False
                           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any], list[int]]:
    """A body's `messages` (with its `tools` and template variables) rendered as a chat request's: the messages, the
    tools the template shows, the variables, and the prompt's tokens (routes that take a chat but generate from
    none: cache warm, tokenize)."""
    messages = normalize_messages(body["messages"], max_messages)
    template_tools = tool_template.shown(parse_tools(body))
    variables = template_variables(body)
    return messages, template_tools, variables, await render_chat(tokenizer, messages, template_tools, tool_template,
                                                               add_generation_prompt, continue_final_message, variables)


def _render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 add_generation_prompt: bool = True, continue_final_message: bool = False,
                 variables: dict[str, Any] | None = None) -> list[int]:
    if continue_final_message:
        if messages[-1]["role"] != "assistant":
            raise invalid("continue_final_message needs an assistant message last (the one the answer continues)",
                          "messages")
        messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             variables=variables)
    # e.g. a template that wants alternating roles, or a template variable of a type it cannot use
    except (ValueError, TypeError, LookupError, jinja2.TemplateError) as exc:
        raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None
    if continue_final_message:
        text = _cut_at_tag(text)
    return tokenizer.encode(text)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' mark of where the final message's text ends


def _cut_at_tag(text: str) -> str:
    """The rendered chat up to the end of the final message's text, as transformers' continue_final_message cuts
    it: at the tag put after that text, so neither the template's closing nor a match inside it is kept; where the
    template trimmed the text's trailing space (and so the tag's), what precedes the tag is trimmed too."""
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise invalid("continue_final_message needs the final message's text, as the chat template renders it",
                      "messages")
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
