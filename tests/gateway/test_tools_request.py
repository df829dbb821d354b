"""`tools` / `tool_choice` validation, the schema that forces a call, tool messages in the history, and
how tools reach the prompt (the model's template, or the Hermes prompt where the template has none)."""
from __future__ import annotations

import json

import pytest

from engine.tokenizer import load_tokenizer
from gateway.errors import APIError
from gateway.protocol import parse_chat
from gateway.render import _render_chat, normalize_messages, render_chat
from gateway.settings import GatewaySettings
from gateway.tool_prompt import HERMES_TOOLS_PROMPT, ToolTemplate, detect_tool_template, hermes_messages
from gateway.tool_parsers import make_parser
from gateway.tools import parse_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


def chat_body(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_parse_chat_carries_tools():
    req = parse_chat(chat_body(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False),
                     GatewaySettings())
    assert req.tools.choice == "required" and not req.tools.parallel
    shown = ToolTemplate(native=True, parser="hermes").shown(req.tools)
    assert [t["function"]["name"] for t in shown] == ["get_weather", "get_time"]
    assert parse_chat(chat_body(), GatewaySettings()).tools is None
    auto = parse_tools({"tools": [WEATHER]})
    assert auto.choice == "auto" and auto.parallel and auto.parses_calls and not auto.forced
    assert auto.structured_output() is None and not parse_tools({"tools": [WEATHER], "tool_choice": "none"}).parses_calls
    none = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert ToolTemplate(True, "hermes").shown(none) == [WEATHER] and ToolTemplate(True, "hermes", True).shown(none) is None
    assert ToolTemplate(True, "hermes", True).shown(auto) == [WEATHER] and ToolTemplate(True, "hermes").shown(None) is None
    text_format = parse_tools({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "text"}})
    assert text_format.forced and text_format.max_calls is None


BAD = [
    ({"tools": {}}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"functions": [WEATHER["function"]], "tools": [WEATHER]}, "tools"),
    ({"functions": [WEATHER["function"]], "tool_choice": "auto"}, "tool_choice"),
    ({"functions": []}, "functions"),
    ({"functions": [{"name": "has space"}]}, "functions[0].name"),
    ({"functions": [WEATHER["function"]], "function_call": "required"}, "function_call"),
    ({"functions": [WEATHER["function"]], "function_call": {"name": "get_time"}}, "function_call"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].name"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_json": {"type": "object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "guided_regex": "a+"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": {}}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]}, "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "id": 5}]}]}, "messages[0].tool_calls[0].id"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": {}}}]}]}, "messages[0].tool_calls[0].function"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[p for _, p in BAD])
def test_bad_tool_fields_are_400_naming_the_field(extra, param):
    with pytest.raises(APIError) as err:
        parse_chat(chat_body(**extra), GatewaySettings())
    assert err.value.status == 400 and err.value.param == param


def test_forced_schemas_have_vllms_shapes():
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.forced and named.forced_schema() == WEATHER["function"]["parameters"]
    output = named.structured_output()
    assert output.kind == "json_schema" and json.loads(output.spec) == WEATHER["function"]["parameters"]
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}).forced_schema()
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    assert required["items"]["anyOf"][0] == {
        "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                       "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"]}
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    one = parse_tools({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}).forced_schema()
    assert one["maxItems"] == 1


def test_required_schema_hoists_defs_to_the_root():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    tool = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": point}}}}
    schema = parse_tools({"tools": [tool], "tool_choice": "required"}).forced_schema()
    assert schema["$defs"] == {"Point": point}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]


def test_history_with_tool_calls_and_results():
    messages = normalize_messages(HISTORY, 10)
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert messages[2] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}


def test_the_models_own_template_renders_tools_and_history(tiny_tools_dir):
    tok = load_tokenizer(tiny_tools_dir, set())
    assert detect_tool_template(tok, "auto") == ToolTemplate(native=True, parser="hermes")
    assert detect_tool_template(tok, "llama3_json").parser == "llama3_json"
    text = tok.apply_chat_template(normalize_messages(HISTORY, 10), tools=[WEATHER])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


async def test_a_template_without_tools_gets_the_hermes_prompt(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir, set())  # plain ChatML: knows nothing of tools
    template = detect_tool_template(tok, "auto")
    assert template == ToolTemplate(native=False, parser="hermes")
    messages = normalize_messages([{"role": "system", "content": "Be brief."}, *HISTORY], 10)
    rendered = hermes_messages(messages, [WEATHER])
    assert rendered[0]["role"] == "system" and rendered[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert rendered[3] == {"role": "user", "content": "<tool_response>\nsunny, 21 C\n</tool_response>"}
    ids = await render_chat(tok, messages, [WEATHER], template)
    assert ids == tok.encode(tok.apply_chat_template(rendered))
    without_system = hermes_messages(normalize_messages(HISTORY[:1], 10), [WEATHER])
    assert without_system[0]["content"] == HERMES_TOOLS_PROMPT.format(tools=json.dumps(WEATHER))


def test_tools_none_renders_as_before(tiny_tools_dir):
    tok = load_tokenizer(tiny_tools_dir, set())
    messages = [{"role": "user", "content": "hi"}]
    assert _render_chat(tok, messages, None) == tok.encode(tok.apply_chat_template(messages))


def test_legacy_functions_map_to_one_tool_call_at_most():
    legacy = parse_tools({"functions": [WEATHER["function"], TIME["function"]], "function_call": {"name": "get_time"}})
    assert legacy.legacy and legacy.choice == "function" and legacy.function_name == "get_time"
    assert legacy.max_calls == 1 and [t["function"]["name"] for t in legacy.tools] == ["get_weather", "get_time"]
    assert parse_tools({"functions": [WEATHER["function"]]}).choice == "auto"
    assert not parse_tools({"functions": [WEATHER["function"]], "function_call": "none"}).parses_calls


def test_legacy_history_pairs_a_function_call_with_its_answer():
    messages = normalize_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"role": "function", "name": "get_weather", "content": "sunny"}], 10)
    call = messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": call["id"]}


def _accepts(so, tokenizer, text: str) -> bool:
    """Whether the grammar of `so` takes `text` whole (the tiny tools model's tokenizer)."""
    from engine.grammar import GrammarCache, GrammarError
    matcher = GrammarCache(tokenizer, 516).matcher(so)
    try:
        for token in tokenizer.encode(text):
            matcher.accept(token)
    except GrammarError:
        return False
    return matcher._matcher.is_accepting()


@pytest.mark.parametrize("parser, call", [
    ("hermes", '<tool_call>\n{"name":"f","arguments":{"city":"P"%s}}\n</tool_call>'),
    ("llama3_json", '{"name":"f","parameters":{"city":"P"%s}}'),
])
def test_a_call_beside_a_format_holds_to_its_schema_and_the_format_to_its_own(tiny_tools_dir, parser, call):
    """The calls-or-format grammar (tool_choice auto beside a JSON format): a call with the arguments its schema
    names, or the format's JSON; not an argument key the schema does not name (closed, as a forced call's)."""
    from engine.structured import StructuredOutput
    tools = parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]})
    fmt = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                      "required": ["a"]}))
    so = tools.calls_or_format(fmt, make_parser(parser))
    tokenizer = load_tokenizer(tiny_tools_dir, set())
    assert _accepts(so, tokenizer, call % "") and _accepts(so, tokenizer, '{"a":1}')
    assert not _accepts(so, tokenizer, call % ',"extra":1') and not _accepts(so, tokenizer, "hello")


def test_tools_whose_defs_clash_keep_the_format_alone_beside_auto():
    """Two tools defining one $defs name differently cannot share a grammar: an auto choice beside a format keeps
    the format's grammar alone (a 400 "two tools define $defs/Item differently" otherwise, where the same tools
    without a format are a 200)."""
    from engine.structured import StructuredOutput

    def tool(name: str, item: dict) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"x": {"$ref": "#/$defs/Item"}}, "$defs": {"Item": item}}}}
    tools = parse_tools({"tools": [tool("a", {"type": "string"}), tool("b", {"type": "integer"})]})
    assert tools.calls_or_format(StructuredOutput("json_object"), make_parser("hermes")) is None
