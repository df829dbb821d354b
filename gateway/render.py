"""OpenAI chat messages -> plain {role, content} messages -> prompt token ids via the chat template."""
from __future__ import annotations

import asyncio
from typing import Any

import jinja2

from gateway.errors import invalid

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_OFFLOAD_CHARS = 8192  # render bigger prompts on a worker thread so the event loop stays responsive


def normalize_messages(raw: Any, max_messages: int) -> list[dict[str, str]]:
    """Validates `messages`; content is a string or a list of {"type": "text", "text": ...} parts."""
    if not isinstance(raw, list) or not raw:
        raise invalid("messages must be a non-empty array", "messages")
    if len(raw) > max_messages:
        raise invalid(f"at most {max_messages} messages are allowed", "messages")
    return [_normalize_message(message, f"messages[{i}]") for i, message in enumerate(raw)]


def _normalize_message(message: Any, param: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise invalid("each message must be an object", param)
    role = message.get("role")
    if not isinstance(role, str) or role not in _ROLES:  # a list or object is unhashable
        raise invalid(f"unsupported role {role!r}; use one of {', '.join(_ROLES)}", f"{param}.role")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    return {"role": _ROLES[role], "content": _content_text(content, f"{param}.content")}


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("content must be a string or an array of text parts", param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise invalid("only {\"type\": \"text\"} content parts are supported", f"{param}[{j}]")
        if not isinstance(part.get("text"), str):
            raise invalid("a text part needs a string 'text'", f"{param}[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)


async def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if sum(len(m["content"]) for m in messages) > _OFFLOAD_CHARS:
        return await asyncio.to_thread(_render_chat, tokenizer, messages)
    return _render_chat(tokenizer, messages)


async def encode(tokenizer: Any, text: str) -> list[int]:
    if len(text) > _OFFLOAD_CHARS:
        return await asyncio.to_thread(tokenizer.encode, text)
    return tokenizer.encode(text)


def _render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except (ValueError, jinja2.TemplateError) as exc:  # e.g. a template that wants alternating roles
        raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None
    return tokenizer.encode(text)
