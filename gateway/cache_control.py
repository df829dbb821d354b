"""`cache_control` breakpoints -> the prompt token counts the engine pins (engine/kv/pins.py).

The shape is the one of the most used hosted API's prompt caching: `{"type": "ephemeral", "ttl": "5m" | "1h"}`
on a chat message or on one of its content parts marks the prompt up to the end of that part. Clients whose
message types drop unknown fields send it at the top of the body instead (the openai SDK's `extra_body`):
an object or an array of objects, each with `message` (the index of the message it ends; default the last)
for chat, or `tokens` (a prompt prefix by token count; default the whole prompt) for completions. At most
MAX_BREAKPOINTS per request; a 400 names the field of the one beyond.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from engine.messages import CacheBreakpoint, CacheDirectives
from gateway.errors import APIError, invalid
from gateway.render import render_chat

MAX_BREAKPOINTS = 4
TTLS = {"5m": 300.0, "1h": 3600.0}
DEFAULT_TTL = "5m"
WHOLE_PROMPT = sys.maxsize  # a breakpoint past the prompt's end pins all of it (the engine cuts it there)


@dataclass(frozen=True, slots=True)
class ChatBreakpoint:
    """The prompt up to the end of message `message` (its first `chars` characters of content; None: all)."""

    message: int
    chars: int | None
    ttl_s: float


def parse_ttl(raw: Any, param: str) -> float:
    """The TTL in seconds of one `cache_control` object."""
    if not isinstance(raw, dict):
        raise invalid('cache_control must be an object {"type": "ephemeral", "ttl": "5m" | "1h"}', param)
    if raw.get("type") != "ephemeral":
        raise invalid('cache_control.type must be "ephemeral"', f"{param}.type")
    ttl = raw.get("ttl", DEFAULT_TTL)
    if not isinstance(ttl, str) or ttl not in TTLS:  # (a list or object: unhashable, not a TTL)
        raise invalid(f"cache_control.ttl must be one of {', '.join(TTLS)}", f"{param}.ttl")
    return TTLS[ttl]


def chat_breakpoints(body: dict[str, Any]) -> list[ChatBreakpoint]:
    """Breakpoints on messages and content parts, then the body's own `cache_control` (the message shapes were
    checked by normalize_messages already)."""
    found: list[ChatBreakpoint] = []
    messages = body["messages"]
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            chars = -1  # the parts are joined with "\n"
            for j, part in enumerate(content):
                chars += 1 + len(part["text"])
                if part.get("cache_control") is not None:
                    param = f"messages[{i}].content[{j}].cache_control"
                    _add(found, ChatBreakpoint(i, chars, parse_ttl(part["cache_control"], param)), param)
        if message.get("cache_control") is not None:
            param = f"messages[{i}].cache_control"
            _add(found, ChatBreakpoint(i, None, parse_ttl(message["cache_control"], param)), param)
    for param, raw in _top_level(body):
        index = raw.get("message", len(messages) - 1)
        if isinstance(index, bool) or not isinstance(index, int) or not -len(messages) <= index < len(messages):
            raise invalid(f"cache_control.message must be the index of a message (0 to {len(messages) - 1})",
                          f"{param}.message")
        _add(found, ChatBreakpoint(index % len(messages), None, parse_ttl(raw, param)), param)
    return found


def completion_breakpoints(body: dict[str, Any]) -> list[CacheBreakpoint]:
    """The breakpoints of the body's `cache_control`, by prompt tokens (the same for every prompt)."""
    found: list[CacheBreakpoint] = []
    for param, raw in _top_level(body):
        tokens = raw.get("tokens")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise invalid("cache_control.tokens must be a positive integer", f"{param}.tokens")
        _add(found, CacheBreakpoint(tokens or WHOLE_PROMPT, parse_ttl(raw, param)), param)
    return found


def _top_level(body: dict[str, Any]) -> list[tuple[str, dict]]:
    raw = body.get("cache_control")
    if raw is None:
        return []
    if isinstance(raw, list):
        for j, item in enumerate(raw):
            if not isinstance(item, dict):
                raise invalid("each cache_control must be an object", f"cache_control[{j}]")
        return [(f"cache_control[{j}]", item) for j, item in enumerate(raw)]
    if not isinstance(raw, dict):
        raise invalid("cache_control must be an object or an array of objects", "cache_control")
    return [("cache_control", raw)]


def _add(found: list, breakpoint: Any, param: str) -> None:
    if len(found) == MAX_BREAKPOINTS:
        raise invalid(f"at most {MAX_BREAKPOINTS} cache_control breakpoints are allowed per request", param)
    found.append(breakpoint)


async def chat_directives(tokenizer: Any, messages: list[dict[str, Any]], breakpoints: tuple[ChatBreakpoint, ...],
                          prompt_ids: list[int], tools: list[dict[str, Any]] | None, tool_template: Any,
                          max_pinned_blocks: int | None, variables: dict[str, Any] | None = None, offset: int = 0
                          ) -> CacheDirectives | None:
    """A chat's breakpoints as prompt lengths: the conversation up to each, rendered alone, as far as its tokens
    agree with the whole prompt's (a template's end-of-message tokens, or a token merged across the boundary,
    are not part of the prefix a later request shares). `variables`: the chat's template variables; `offset`: tokens
    the prompt has before the rendered chat (a BOS). None without breakpoints."""
    out = []
    for breakpoint in breakpoints:
        message = dict(messages[breakpoint.message])
        if breakpoint.chars is not None:
            message["content"] = message["content"][:breakpoint.chars]
        try:
            ids = await render_chat(tokenizer, [*messages[:breakpoint.message], message], tools, tool_template,
                                    add_generation_prompt=False, variables=variables)
        except APIError:  # a template that refuses the cut conversation: that breakpoint pins nothing
            continue
        out.append(CacheBreakpoint(offset + _common_prefix(ids, prompt_ids), breakpoint.ttl_s))
    return directives(out, max_pinned_blocks)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def directives(breakpoints: list[CacheBreakpoint], max_pinned_blocks: int | None) -> CacheDirectives | None:
    if not breakpoints:
        return None
    return CacheDirectives(tuple(breakpoints), max_pinned_blocks)
