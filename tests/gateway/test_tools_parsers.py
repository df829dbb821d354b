"""Tool call parsers on crafted text: whole, and streamed in pieces down to one character at a time."""
from __future__ import annotations

import json

import pytest

from gateway.tool_parsers import (JsonCallsParser, NamedCallParser, ToolCall, ToolCallStream, extract,
                                  make_parser, parser_for)
from gateway.tools import parse_tools

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "note": "a }{ b"}}'
WEATHER_ARGS = '{"city": "Paris", "days": [1, 2], "note": "a }{ b"}'
HERMES = make_parser("hermes")
LLAMA3 = make_parser("llama3_json")
REQUIRED = JsonCallsParser("[", True, ",", "]", ("parameters",))


def streamed(parser, text: str, step: int = 1, max_calls: int | None = None):
    """(content, [(name, arguments)], deltas) as a client accumulates a stream fed `step` chars at a time."""
    stream = ToolCallStream(parser, max_calls)
    deltas = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)] + [stream.finish()]
    content, calls = "", {}
    for delta in deltas:
        content += delta.content
        for call in delta.calls:
            if call.name is not None:
                assert call.index == len(calls), "a call starts once, in order"
                calls[call.index] = [call.name, ""]
            calls[call.index][1] += call.arguments
    return content, [tuple(c) for c in calls.values()], deltas


def whole(parser, text: str, max_calls: int | None = None):
    parsed = extract(parser, text, max_calls)
    return parsed.content, [(c.name, c.arguments) for c in parsed.calls]


HERMES_CASES = {
    "text then a call": (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>",
                         "Let me check.", [("get_weather", WEATHER_ARGS)]),
    "two calls": (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
                  '{"name": "get_time", "arguments": {}}\n</tool_call>',
                  "", [("get_weather", WEATHER_ARGS), ("get_time", "{}")]),
    "no call": ("The capital of France is Paris.  \n", "The capital of France is Paris.  \n", []),
    "a tag cut short stays text": ("see <tool_c", "see <tool_c", []),
    "malformed JSON stays content": ('<tool_call>\n{"name": get_weather}\n</tool_call> sorry',
                                     '<tool_call>\n{"name": get_weather}\n</tool_call> sorry', []),
    "no name stays content": ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    "a broken call between good ones": (f'<tool_call>{WEATHER}</tool_call>\n<tool_call>{{oops</tool_call>\n'
                                        '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
                                        "<tool_call>{oops</tool_call>",
                                        [("get_weather", WEATHER_ARGS), ("f", '{"x": 1}')]),
    "arguments before the name": ('<tool_call>{"arguments": {"x": 1}, "name": "g"}</tool_call>', "", [("g", '{"x": 1}')]),
    "arguments as a JSON string": ('<tool_call>{"name": "g", "arguments": "{\\"x\\": 1}"}</tool_call>', "",
                                   [("g", '{"x": 1}')]),
    "no arguments": ('<tool_call>{"name": "now"}</tool_call>', "", [("now", "{}")]),
    "closing tag missing at the end": (f"<tool_call>\n{WEATHER}\n", "", [("get_weather", WEATHER_ARGS)]),
    "text after the call": (f"<tool_call>{WEATHER}</tool_call>\nDone.\n", "Done.\n", [("get_weather", WEATHER_ARGS)]),
    # the whitespace the model wrote around a call, text on both sides: its own after the call, else before
    "text on both sides of a call": (f"Let me check. <tool_call>{WEATHER}</tool_call>\n\nDone.",
                                     "Let me check.\n\nDone.", [("get_weather", WEATHER_ARGS)]),
    "a space before the call only": (f"Let me check <tool_call>{WEATHER}</tool_call>again", "Let me check again",
                                     [("get_weather", WEATHER_ARGS)]),
    "no space around the call": (f"A<tool_call>{WEATHER}</tool_call>B", "AB", [("get_weather", WEATHER_ARGS)]),
}


@pytest.mark.parametrize("text, content, calls", HERMES_CASES.values(), ids=HERMES_CASES.keys())
def test_hermes_whole_and_streamed(text, content, calls):
    assert whole(HERMES, text) == (content, calls)
    for step in (1, 2, 3, 7, len(text)):
        assert streamed(HERMES, text, step)[:2] == (content, calls), step
    for _, arguments in calls:
        json.loads(arguments)


def test_streamed_arguments_arrive_in_fragments_after_a_header():
    text = f"I will look.\n<tool_call>\n{WEATHER}\n</tool_call>"
    _, _, deltas = streamed(HERMES, text, step=1)
    call_deltas = [c for d in deltas for c in d.calls]
    assert call_deltas[0].name == "get_weather" and call_deltas[0].index == 0
    assert all(c.name is None for c in call_deltas[1:])
    fragments = [c.arguments for c in call_deltas if c.arguments]
    assert len(fragments) > 10 and "".join(fragments) == WEATHER_ARGS  # split across many chunks
    # content went out before the call started, and none after
    first_call = next(i for i, d in enumerate(deltas) if d.calls)
    assert "".join(d.content for d in deltas[:first_call]) == "I will look."
    assert not "".join(d.content for d in deltas[first_call:])


def test_streamed_text_is_not_held_back_without_a_call():
    stream = ToolCallStream(HERMES)
    assert stream.feed("Hello").content == "Hello"
    assert stream.feed(" wor").content == " wor"
    assert stream.feed("ld <tool").content == "ld"  # may be a tag: held
    assert stream.feed("box> ok").content == " <toolbox> ok"


def test_a_call_broken_after_its_name_was_streamed_stays_a_call():
    """The documented difference: a stream cannot take back a call it sent; a whole answer is judged whole."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1'
    assert whole(HERMES, text) == (text, [])
    assert streamed(HERMES, text)[:2] == ("", [("f", '{"a": 1')])
    text = '{"name": "a", "parameters": {"x": }}'
    assert whole(LLAMA3, text) == (text, [])
    assert streamed(LLAMA3, text)[:2] == ("", [("a", '{"x": }}')])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = f'<tool_call>{WEATHER}</tool_call><tool_call>{{"name": "f", "arguments": {{}}}}</tool_call>'
    assert whole(HERMES, text, max_calls=1) == ("", [("get_weather", WEATHER_ARGS)])
    assert streamed(HERMES, text, max_calls=1)[:2] == ("", [("get_weather", WEATHER_ARGS)])


LLAMA3_CASES = {
    "one call": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", '{"city": "Paris"}')]),
    "python tag and two calls": ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
                                 "", [("a", '{"x": 1}'), ("b", "{}")]),
    "arguments key": ('  {"name": "a", "arguments": {"x": [1, {"y": 2}]}}', "", [("a", '{"x": [1, {"y": 2}]}')]),
    "plain text": ("Paris is the capital.", "Paris is the capital.", []),
    "JSON that is not a call": ('{"answer": 42}', '{"answer": 42}', []),
    "malformed JSON": ('{"name": a, "parameters": {}}', '{"name": a, "parameters": {}}', []),
}


@pytest.mark.parametrize("text, content, calls", LLAMA3_CASES.values(), ids=LLAMA3_CASES.keys())
def test_llama3_json_whole_and_streamed(text, content, calls):
    assert whole(LLAMA3, text) == (content, calls)
    for step in (1, 4, len(text)):
        assert streamed(LLAMA3, text, step)[:2] == (content, calls), step


def test_required_array_and_named_function():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"s": "]"}}]'
    expected = ("", [("a", '{"x": 1}'), ("b", '{"s": "]"}')])
    assert whole(REQUIRED, text) == expected
    assert streamed(REQUIRED, text)[:2] == expected
    assert whole(REQUIRED, "no calls here") == ("no calls here", [])
    named = NamedCallParser("get_weather")
    assert whole(named, ' {"city": "Paris"}\n') == ("", [("get_weather", '{"city": "Paris"}')])
    assert streamed(named, ' {"city": "Paris"}\n')[:2] == ("", [("get_weather", '{"city": "Paris"}')])


def _tools(**extra):
    body = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}], **extra}
    return parse_tools(body)


def test_parser_for_each_tool_choice():
    assert parser_for(None, "hermes") is None
    assert parser_for(_tools(tool_choice="none"), "hermes") is None
    assert isinstance(parser_for(_tools(), "hermes"), type(HERMES))
    assert isinstance(parser_for(_tools(), "llama3_json"), JsonCallsParser)
    named = parser_for(_tools(tool_choice={"type": "function", "function": {"name": "get_weather"}}), "hermes")
    assert named.parse("{}", final=True, committed=0).calls == [ToolCall("get_weather", "{}")]
    required = parser_for(_tools(tool_choice="required"), "hermes")
    assert required.parse('[{"name": "get_weather", "parameters": {}}]', True, 0).calls == [ToolCall("get_weather", "{}")]
    with pytest.raises(ValueError, match="unknown tool call parser"):
        make_parser("mistral")


CUT_SHORT = {  # output cut by max_tokens: the call as far as it goes stays a call, never leaks into content
    "required array": (REQUIRED, '[{"name": "get_weather", "parameters": {"city": "NewToGo',
                       "", [("get_weather", '{"city": "NewToGo')]),
    "hermes mid-arguments": (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
                             "Let me check.", [("get_weather", '{"city": "Pa')]),
    "hermes before the name ends": (HERMES, 'Sure.\n<tool_call>\n{"name": "get_we', "Sure.", []),
    "hermes half a tag": (HERMES, "Sure. <tool_c", "Sure.", []),
    "llama3 mid-arguments": (LLAMA3, '{"name": "get_weather", "parameters": {"city"', "",
                             [("get_weather", '{"city"')]),
    "named function": (NamedCallParser("get_weather"), '{"city": "Par', "", [("get_weather", '{"city": "Par')]),
    "plain text keeps its spaces": (HERMES, "The capital is  ", "The capital is  ", []),
    # text that can no longer become a call is content as soon as that shows
    "hermes a tag that is no call": (HERMES, "see the <tool_call> tag", "see the <tool_call> tag", []),
    "llama3 an object that is no call": (LLAMA3, '{"answer": 42}', '{"answer": 42}', []),
}


@pytest.mark.parametrize("parser, text, content, calls", CUT_SHORT.values(), ids=CUT_SHORT.keys())
def test_a_call_cut_short_stays_a_call(parser, text, content, calls):
    parsed = extract(parser, text, cut_short=True)
    assert (parsed.content, [(c.name, c.arguments) for c in parsed.calls]) == (content, calls)
    for step in (1, 3, len(text)):
        stream = ToolCallStream(parser)
        deltas = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)] + [stream.finish(cut_short=True)]
        got_content = "".join(d.content for d in deltas)
        got_args = "".join(c.arguments for d in deltas for c in d.calls)
        assert got_content == content and got_args == "".join(a for _, a in calls), step
