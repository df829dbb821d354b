"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request: validated, and the JSON schema
that forces a call when tool_choice is "required" or names a function (as vLLM builds it)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.structured import StructuredOutput, build_grammar, closed_objects, load_json_object
from gateway.errors import APIError, invalid

if TYPE_CHECKING:
    from gateway.tool_parsers import CallSyntax

MAX_TOOLS = 128  # OpenAI's limit
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# vLLM's fields that constrain the output too: a forced call's grammar cannot be beside one of them. OpenAI's
# response_format can: it shapes text answers, and a forced call is the whole output, so for that answer it is set
# aside (as OpenAI does: agent frameworks send their output type on every turn, tool turns included)
_OUTPUT_CONSTRAINTS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {name, description?, parameters?}}
    choice: str  # "none" | "auto" | "required" | "function" (the one named by `function_name`)
    function_name: str | None
    parallel: bool  # false: at most one call per answer
    legacy: bool = False  # sent as `functions` / `function_call`: answered with `function_call`, not tool_calls

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def forced_schema(self) -> dict[str, Any] | None:
        """The JSON the output must be: the named function's arguments, or a non-empty array of
        {"name", "parameters"} objects for "required" (vLLM's shapes, so its parsers read ours)."""
        if self.choice == "function":
            return self._parameters(self._function(self.function_name))
        if self.choice != "required":
            return None
        defs: dict[str, Any] = {}
        one_of = [{"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                  "parameters": _hoist_defs(self._parameters(t["function"]), defs)},
                   "required": ["name", "parameters"]} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": one_of}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def structured_output(self) -> StructuredOutput | None:
        schema = self.forced_schema()
        return None if schema is None else StructuredOutput("json_schema", json.dumps(schema))

    def calls_or_format(self, text_format: StructuredOutput, parser: CallSyntax) -> StructuredOutput | None:
        """With tool_choice auto beside a JSON response_format: the answer is either calls, in the tool parser's
        syntax, or text in that format, as OpenAI lets the model choose (the format's grammar alone, from the first
        token, left no call possible: an agent with tools and an output type never called one). None where the
        format is no JSON one (vLLM's regex, choice and grammar keep their grammar alone) or the two do not compile
        together (the format's alone then, as before)."""
        if text_format.kind not in ("json_object", "json_schema"):
            return None
        compact = {"x-guidance": {"whitespace_flexible": False}}  # (as build_grammar's: a weak model pads forever)
        key = parser.args_keys[0]
        defs: dict[str, Any] = {}
        try:
            answer = {"type": "object"} if text_format.kind == "json_object" else closed_objects(
                load_json_object(text_format.spec, "the schema"))
            # (arguments closed as a forced call's are: no key its schema does not name)
            one_of = [{"type": "object", "properties": {
                "name": {"const": t["function"]["name"]},
                key: closed_objects(_hoist_defs(self._parameters(t["function"]), defs))},
                "required": ["name", key], "additionalProperties": False} for t in self.tools]
        except (ValueError, APIError):  # (two tools' $defs of one name: fine for auto calls, not in one grammar)
            return None
        call = {"anyOf": one_of, **({"$defs": closed_objects(defs)} if defs else {}), **compact}
        grammar = f"start: answer | calls\nanswer: %json {json.dumps({**answer, **compact})}\n" \
                  + parser.call_rules(f"%json {json.dumps(call)}", self.parallel)
        union = StructuredOutput("grammar", grammar)
        try:
            build_grammar(union)
        except ValueError:
            return None
        return union

    def _function(self, name: str | None) -> dict[str, Any]:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)

    @staticmethod
    def _parameters(function: dict[str, Any]) -> dict[str, Any]:
        return function.get("parameters") or _EMPTY_PARAMETERS


def _hoist_defs(parameters: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """`#/$defs/...` references point at the root, which is the array schema once nested."""
    if not isinstance(parameters.get("$defs"), dict):
        return parameters
    for name, definition in parameters["$defs"].items():
        if defs.setdefault(name, definition) != definition:
            raise invalid(f"two tools define $defs/{name} differently", "tools")
    return {k: v for k, v in parameters.items() if k != "$defs"}


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """None when the request has no tools. 400 naming the field for anything malformed."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        return _legacy_functions(body)
    raw_tools, raw_choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if raw_tools is None:
        for name, value in (("tool_choice", raw_choice), ("parallel_tool_calls", parallel)):
            if value is not None:
                raise invalid(f"{name} is only allowed when tools are specified", name)
        return None
    tools = _tools(raw_tools)
    names = [t["function"]["name"] for t in tools]
    choice, function_name = _tool_choice(raw_choice, names)
    constraint = next((k for k in _OUTPUT_CONSTRAINTS if body.get(k) is not None), None)
    if choice in ("required", "function") and constraint is not None:  # one grammar per request
        raise invalid(f"a forced tool_choice cannot be combined with {constraint}", "tool_choice")
    return _checked(ToolRequest(tools, choice, function_name, parallel is not False))


def _checked(request: ToolRequest) -> ToolRequest:
    """A forced call's grammar compiles here, a 400 naming the function's parameters where it does not: the engine
    compiles it only once the answer starts (there a failure is the server's 500). Unforced, the parameters are
    only shown to the model, which JSON schemas the grammar engine does not run may be."""
    if not request.forced:
        return request
    for i, tool in enumerate(request.tools):
        function = tool["function"]
        if request.choice == "required" or function["name"] == request.function_name:
            param = f"functions[{i}].parameters" if request.legacy else f"tools[{i}].function.parameters"
            _compiles(StructuredOutput("json_schema", json.dumps(request._parameters(function))), param)
    _compiles(request.structured_output(), "tool_choice")  # all of them together, for "required"
    return request


def _compiles(so: StructuredOutput, param: str) -> None:
    try:
        build_grammar(so)
    except ValueError as exc:
        raise invalid(f"{param}: {exc}", param) from None


def _legacy_functions(body: dict[str, Any]) -> ToolRequest | None:
    """The deprecated `functions` / `function_call` as one tool call at most, as OpenAI answered them."""
    for modern in ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(modern) is not None:
            raise invalid(f"functions and function_call cannot be combined with {modern}", modern)
    raw_functions, raw_choice = body.get("functions"), body.get("function_call")
    if raw_functions is None:
        raise invalid("function_call is only allowed when functions are specified", "function_call")
    _check_array(raw_functions, "functions", "functions")
    tools = _unique_functions([(f, f"functions[{i}]") for i, f in enumerate(raw_functions)])
    if raw_choice is None or raw_choice in ("none", "auto"):
        return ToolRequest(tools, raw_choice or "auto", None, parallel=False, legacy=True)
    name = raw_choice.get("name") if isinstance(raw_choice, dict) and set(raw_choice) == {"name"} else None
    if name not in [t["function"]["name"] for t in tools]:
        raise invalid('function_call must be "none", "auto" or {"name": ...} naming one of functions',
                      "function_call")
    return _checked(ToolRequest(tools, "function", name, parallel=False, legacy=True))


def _tools(raw: Any) -> tuple[dict[str, Any], ...]:
    _check_array(raw, "tools", "function tools")
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid('each tool must be an object with "type": "function"', f"tools[{i}].type")
    return _unique_functions([(tool.get("function"), f"tools[{i}].function") for i, tool in enumerate(raw)])


def _check_array(raw: Any, field: str, what: str) -> None:
    if not isinstance(raw, list) or not raw:
        raise invalid(f"{field} must be a non-empty array of {what}", field)
    if len(raw) > MAX_TOOLS:
        raise invalid(f"at most {MAX_TOOLS} {field} are allowed", field)


def _unique_functions(entries: list[tuple[Any, str]]) -> tuple[dict[str, Any], ...]:
    """(raw function, its param) -> tools, each function validated, no name twice."""
    tools, seen = [], set()
    for raw, param in entries:
        function = _function(raw, param)
        if function["name"] in seen:
            raise invalid(f"the function name {function['name']!r} is used twice", f"{param}.name")
        seen.add(function["name"])
        tools.append({"type": "function", "function": function})
    return tuple(tools)


def _function(raw: Any, param: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise invalid("function must be an object", param)
    name = raw.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise invalid("function.name must be 1-64 letters, digits, underscores or dashes", f"{param}.name")
    function: dict[str, Any] = {"name": name}
    description = raw.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise invalid("function.description must be a string", f"{param}.description")
        function["description"] = description
    parameters = raw.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise invalid("function.parameters must be a JSON Schema object", f"{param}.parameters")
        function["parameters"] = parameters
    strict = raw.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("function.strict must be a boolean", f"{param}.strict")
    return function


def _tool_choice(raw: Any, names: list[str]) -> tuple[str, str | None]:
    if raw is None:
        return "auto", None
    if isinstance(raw, str):
        if raw not in _CHOICES:
            raise invalid(f"tool_choice must be one of {', '.join(_CHOICES)} or a named function", "tool_choice")
        return raw, None
    function = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise invalid('tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
                      "tool_choice")
    if name not in names:
        raise invalid(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return "function", name
