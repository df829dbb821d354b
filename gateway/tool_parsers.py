"""Tool calls out of generated text, whole (non-streaming) or as the text grows (streaming).

Formats: Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, SmolLM3,
and our fallback prompt for templates without tools), Llama 3 JSON `{"name": ..., "parameters":
{...}}` (optionally after `<|python_tag|>`, several separated by `;`), and the two forced shapes
(tool_choice "required": a JSON array of {"name", "parameters"}; a named function: the arguments).

Every parser maps the text so far to a snapshot (content, calls); a stream sends the difference
between consecutive snapshots, so the streamed pieces add up to the non-streaming answer. A
snapshot only grows: text that may still become part of a call (a partial `<tool_call>` tag,
whitespace next to a call, a call whose name is not complete yet) is held back until decided.
Arguments are the model's own JSON text of the arguments value, so the streamed fragments
concatenate to exactly the non-streaming string.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from gateway.tools import ToolRequest

PARSER_NAMES = ("hermes", "llama3_json")
_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text (in a snapshot of a call still being generated: its beginning)


@dataclass(slots=True)
class Parsed:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    def parse(self, text: str, final: bool, committed: int) -> Parsed:
        """`final`: the whole output; else a snapshot of a growing one. The first `committed` calls
        were streamed already: they stay calls even if their JSON breaks later."""


class CallSyntax(Protocol):
    """A parser of calls the model writes of its own accord (hermes, llama3_json), as a grammar can hold them."""

    args_keys: tuple[str, ...]  # the arguments' key the model writes first

    def call_rules(self, call: str, parallel: bool) -> str:
        """The Lark rules `calls` (one call, or several where `parallel`) and `call`, in this syntax, each call's
        JSON the rule text `call` (ToolRequest.calls_or_format)."""


def _call_rules(one: str, between: str, parallel: bool) -> str:
    return f"calls: {f'call ({between} call)*' if parallel else 'call'}\ncall: {one}\n"


def extract(parser: ToolParser, text: str, max_calls: int | None = None, cut_short: bool = False) -> Parsed:
    parsed = _settle(parser, text, 0, cut_short)
    return Parsed(parsed.content, parsed.calls[:max_calls])


def _settle(parser: ToolParser, text: str, committed: int, cut_short: bool) -> Parsed:
    """The whole output's snapshot. Cut short by max_tokens, a call still being generated stays a call
    with its arguments so far (as OpenAI returns it), and text held back as a possible call's beginning
    is dropped rather than leaked into content."""
    final = parser.parse(text, final=True, committed=committed)
    if not cut_short:
        return final
    growing = parser.parse(text, final=False, committed=committed)
    held_back = len(growing.content) < len(final.content.rstrip(_WHITESPACE))
    return growing if len(growing.calls) > len(final.calls) or held_back else final


@dataclass(frozen=True, slots=True)
class CallDelta:
    index: int
    name: str | None  # set in the first delta of a call
    arguments: str


@dataclass(frozen=True, slots=True)
class StreamDelta:
    content: str
    calls: list[CallDelta]


class ToolCallStream:
    """One choice's stream: text deltas in, content and tool call deltas out."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self._parser = parser
        self._max_calls = max_calls
        self._text = ""
        self._content_sent = 0
        self._args_sent: list[int] = []  # per call started: how much of its arguments went out
        self._committed = 0  # calls any snapshot has shown (sent or not): they stay calls

    @property
    def num_calls(self) -> int:
        return len(self._args_sent)

    def feed(self, text: str) -> StreamDelta:
        self._text += text
        return self._diff(self._parser.parse(self._text, final=False, committed=self._committed))

    def finish(self, cut_short: bool = False) -> StreamDelta:
        return self._diff(_settle(self._parser, self._text, self._committed, cut_short))

    def _diff(self, parsed: Parsed) -> StreamDelta:
        self._committed = max(self._committed, len(parsed.calls))
        content = parsed.content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(parsed.content))
        deltas = []
        for i, call in enumerate(parsed.calls[:self._max_calls]):
            name = None
            if i == len(self._args_sent):
                self._args_sent.append(0)
                name = call.name
            fragment = call.arguments[self._args_sent[i]:]
            self._args_sent[i] += len(fragment)
            if name is not None or fragment:
                deltas.append(CallDelta(i, name, fragment))
        return StreamDelta(content, deltas)


# ---- one call's JSON object: {"name": ..., "arguments" | "parameters": ...}

def _skip(text: str, pos: int, chars: str = _WHITESPACE) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _value_spans(text: str) -> tuple[dict[str, tuple[int, int | None]], bool]:
    """Spans of the top-level values of the JSON object `text` starts, as far as it goes (end None:
    the value is not complete yet), and whether the object is closed."""
    spans: dict[str, tuple[int, int | None]] = {}
    pos = _skip(text, 0)
    if not text.startswith("{", pos):
        return spans, False
    pos += 1
    while True:
        pos = _skip(text, pos, _WHITESPACE + ",")
        if pos >= len(text):
            return spans, False
        if text[pos] == "}":
            return spans, True
        try:
            key, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return spans, False
        pos = _skip(text, pos)
        if not isinstance(key, str) or not text.startswith(":", pos):
            return spans, False
        pos = _skip(text, pos + 1)
        if pos >= len(text):
            return spans, False
        try:
            _, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            spans[key] = (pos, None)
            return spans, False
        spans[key] = (pos, end)
        pos = end


def _call(body: str, args_keys: tuple[str, ...], strict: bool) -> ToolCall | None:
    """strict: only a whole valid object with a string name and object (or string) arguments.
    Else the call as far as it goes, once its name is complete."""
    if strict:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        args = next((value[k] for k in args_keys if k in value), {})
        if not isinstance(args, (dict, str)):
            return None
    spans, closed = _value_spans(body)
    name_span = spans.get("name")
    if name_span is None or name_span[1] is None:
        return None
    name = json.loads(body[name_span[0]:name_span[1]])
    if not isinstance(name, str):
        return None
    return ToolCall(name, _arguments(body, next((spans[k] for k in args_keys if k in spans), None), closed))


def _arguments(body: str, span: tuple[int, int | None] | None, closed: bool) -> str:
    if span is None:
        return "{}" if closed else ""
    start, end = span
    if end is None:  # still being generated: an object streams as it grows, a string when complete
        return body[start:].rstrip() if body.startswith("{", start) else ""
    raw = body[start:end]
    return json.loads(raw) if raw.startswith('"') else raw


# ---- formats

class HermesParser:
    start, end = "<tool_call>", "</tool_call>"
    args_keys = ("arguments", "parameters")

    def parse(self, text: str, final: bool, committed: int) -> Parsed:
        items: list[str | ToolCall] = []  # content pieces and calls, in order
        pos, pending = 0, False
        while (begin := text.find(self.start, pos)) >= 0:
            items.append(text[pos:begin])
            body_at = begin + len(self.start)
            close = text.find(self.end, body_at)
            body = text[body_at:] if close < 0 else text[body_at:close]
            pos = len(text) if close < 0 else close + len(self.end)
            call = self._block(body, final or close >= 0, _count_calls(items) < committed)
            if call is None and close < 0 and not final and body.lstrip(_WHITESPACE)[:1] in ("", "{"):
                pending = True  # the name is not complete yet: this may still become a call
                break
            items.append(call if call is not None else text[begin:pos])
        else:
            items.append(text[pos:])
        return _compose(items, final, pending, self.start)

    def call_rules(self, call: str, parallel: bool) -> str:
        # (the lines the Hermes format writes around and between calls)
        opening, closing, between = json.dumps(self.start + "\n"), json.dumps("\n" + self.end), json.dumps("\n")
        return _call_rules(f"{opening} {call} {closing}", between, parallel)

    def _block(self, body: str, complete: bool, committed: bool) -> ToolCall | None:
        if not complete:
            return _call(body, self.args_keys, strict=False)
        return _call(body, self.args_keys, strict=True) or (
            _call(body, self.args_keys, strict=False) if committed else None)


class JsonCallsParser:
    """Calls as JSON objects one after another: Llama 3 JSON (`opener` "<|python_tag|>", optional,
    `;` between calls) and tool_choice "required" (`opener` "[", required, `,` between, `]` ends).
    All or nothing, as vLLM's llama3_json parser: text that is not entirely calls is content."""

    def __init__(self, opener: str, opener_required: bool, separator: str, closer: str | None,
                 args_keys: tuple[str, ...]) -> None:
        self.opener = opener
        self.opener_required = opener_required
        self.separator = separator
        self.closer = closer
        self.args_keys = args_keys

    def parse(self, text: str, final: bool, committed: int) -> Parsed:
        pos = _skip(text, 0)
        head = text[pos:pos + len(self.opener)]
        if head == self.opener:
            pos += len(self.opener)
        elif self.opener.startswith(head) and head and not final:
            return Parsed("")  # maybe the opener, still arriving
        elif self.opener_required:
            return self._not_calls(text, final)
        pos = _skip(text, pos)
        if pos >= len(text) and not final:
            return Parsed("")
        if not text.startswith("{", pos):
            return self._not_calls(text, final)
        calls, broken = self._calls(text, pos, final, committed)
        if broken and not committed:  # not all calls: all content, as soon as that is known
            return self._not_calls(text, final)
        return Parsed("", calls)

    def call_rules(self, call: str, parallel: bool) -> str:  # (the opener, optional, is left out)
        return _call_rules(call, json.dumps(self.separator), parallel)

    def _calls(self, text: str, pos: int, final: bool, committed: int) -> tuple[list[ToolCall], bool]:
        calls: list[ToolCall] = []
        while True:
            pos = _skip(text, pos, _WHITESPACE + self.separator)
            if pos >= len(text):
                return calls, False
            if text[pos] == self.closer:
                return calls, bool(text[pos + 1:].strip(_WHITESPACE))
            if text[pos] != "{":
                return calls, True
            try:
                _, end = _DECODER.raw_decode(text, pos)
            except ValueError:  # the last call, still being generated (or broken, if final)
                lenient = not final or len(calls) < committed
                call = _call(text[pos:], self.args_keys, strict=False) if lenient else None
                return calls + ([call] if call else []), final and call is None
            call = _call(text[pos:end], self.args_keys, strict=True)
            if call is None:
                return calls, True
            calls.append(call)
            pos = end

    @staticmethod
    def _not_calls(text: str, final: bool) -> Parsed:
        return Parsed(text if final else text.rstrip(_WHITESPACE))


class NamedCallParser:
    """tool_choice names a function: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool, committed: int) -> Parsed:
        return Parsed("", [ToolCall(self.name, text.strip(_WHITESPACE))])


def _count_calls(items: list[str | ToolCall]) -> int:
    return sum(isinstance(item, ToolCall) for item in items)


def _compose(items: list[str | ToolCall], final: bool, pending: bool, start_tag: str) -> Parsed:
    """Content = the text between calls, trimmed where it touches a call; the tail of a growing
    text holds back what may still turn out to be next to a call."""
    merged: list[str | ToolCall] = []
    for item in items:  # a broken block is content: join it with its neighbours
        if isinstance(item, str) and merged and isinstance(merged[-1], str):
            merged[-1] += item
        else:
            merged.append(item)
    content = []
    before = ""  # the whitespace the model wrote before the last call
    for i, raw in enumerate(merged):
        if isinstance(raw, ToolCall):
            continue
        last = i == len(merged) - 1
        item = raw.lstrip(_WHITESPACE) if i > 0 else raw
        if not last or pending:
            item = item.rstrip(_WHITESPACE)
        elif not final:
            item = item[:len(item) - partial_tag_length(item, start_tag)].rstrip(_WHITESPACE)
        if item and any(content):  # text on both sides of a call keeps a space the model wrote around it
            content.append(raw[:len(raw) - len(raw.lstrip(_WHITESPACE))] or before)
        content.append(item)
        before = raw[len(raw.rstrip(_WHITESPACE)):]
    return Parsed("".join(content), [item for item in merged if isinstance(item, ToolCall)])


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a stream holds it back: the tag may be coming)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def make_parser(name: str) -> ToolParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return JsonCallsParser("<|python_tag|>", False, ";", None, ("parameters", "arguments"))
    raise ValueError(f"unknown tool call parser {name!r}; use one of {', '.join(PARSER_NAMES)}")


def parser_for(tools: ToolRequest | None, parser_name: str) -> ToolParser | None:
    """The parser of one request: None when no calls are parsed (no tools, or tool_choice "none")."""
    if tools is None or not tools.parses_calls:
        return None
    if tools.choice == "function":
        return NamedCallParser(tools.function_name)
    if tools.choice == "required":
        return JsonCallsParser("[", True, ",", "]", ("parameters",))
    return make_parser(parser_name)
