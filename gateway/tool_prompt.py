"""How tools reach the prompt: through the model's own chat template when it renders `tools`, else
as a Hermes-style tool section in the system message (the format Qwen2.5 and SmolLM3 are trained
on), with earlier calls and tool results written the same way. Decided once per model."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import jinja2
from aiohttp import web

from gateway.tool_parsers import PARSER_NAMES
from gateway.tools import ToolRequest

log = logging.getLogger("gateway")

_PROBE_NAME = "prefixgate_probe_function"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
_LLAMA3_HINT = '"parameters": dictionary'  # Llama 3.1/3.2/3.3 templates ask for this JSON shape
HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


@dataclass(frozen=True, slots=True)
class ToolTemplate:
    native: bool  # the chat template renders `tools`, tool results and earlier calls itself
    parser: str  # the tool call parser for this model's output
    exclude_when_none: bool = False  # tool_choice "none" hides the tools (vLLM's flag); by default they are shown

    def shown(self, tools: ToolRequest | None) -> list[dict[str, Any]] | None:
        """The tools the prompt shows: a request's, unless it has none or they are excluded for tool_choice "none"
        (shown, they keep the prompt the same across turns whatever the choice, so its prefix stays cached)."""
        if tools is None or self.exclude_when_none and tools.choice == "none":
            return None
        return [dict(tool) for tool in tools.tools]


TOOL_TEMPLATE = web.AppKey("tool_template", ToolTemplate)


def detect_tool_template(tokenizer: Any, parser_setting: str, exclude_when_none: bool = False) -> ToolTemplate:
    """`parser_setting` "auto": Llama 3 JSON when the template asks for it, else Hermes."""
    try:
        probe = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                              tools=[_PROBE_TOOL])
    except (TypeError, ValueError, jinja2.TemplateError):
        probe = ""
    native = _PROBE_NAME in probe
    parser = parser_setting
    if parser == "auto":
        parser = "llama3_json" if native and _LLAMA3_HINT in probe else "hermes"
        if native and parser == "hermes" and "<tool_call>" not in probe:
            log.warning("the chat template renders tools in a format prefixgate does not know; parsing "
                        "Hermes <tool_call> output (set --tool-call-parser to one of %s)", ", ".join(PARSER_NAMES))
    log.info("tool calling: %s, parser %s", "the model's chat template" if native else "Hermes prompt", parser)
    return ToolTemplate(native, parser, exclude_when_none)


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools: plain roles and text only."""
    out = [_hermes_message(m) for m in messages]
    if not tools:
        return out
    section = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": out[0]["content"] + "\n\n" + section}] + out[1:]
    return [{"role": "system", "content": section}] + out


def hermes_call_text(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def _hermes_message(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    kept = {key: message[key] for key in ("reasoning_content", "name") if key in message}  # (a template may show them)
    calls = message.get("tool_calls")
    if not calls:
        return {"role": message["role"], "content": message["content"], **kept}
    texts = [message["content"]] if message["content"] else []
    texts += [hermes_call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return {"role": "assistant", "content": "\n".join(texts), **kept}
