"""A hostile corpus for the Responses API, embeddings and cache warm: each body valid but for one field, set
to a value of the wrong type (or a lone surrogate), with the `param` its 400 must name."""
from __future__ import annotations

import copy
import json
from typing import Any

# one of each JSON type, and text that is no Unicode (json.dumps writes it as the escape "\ud800")
WRONG = (5, 2.5, None, True, ["a"], {"a": 1}, "\ud800")
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
ITEMS = [
    {"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
]
LENIENT = {"arguments": (None,), "id": (None,), "output": WRONG[:2] + WRONG[3:6]}  # values these fields accept
# top-level fields: values each must refuse, with the param its 400 names where it is not the field itself
TOP_LEVEL = {
    "instructions": (5, ["a"], {"a": 1}), "previous_response_id": (5, []), "store": ("yes", 5),
    "max_output_tokens": ("5", 0, 2.5, []), "temperature": ("0", -1, 3), "top_p": ("x", 2), "stream": ("true", 5),
    "metadata": (5, []), "user": (5, []), "cache_salt": (5, {}), "model": (5, []), "background": (True,),
    "text": (5, "json"), "tools": (5, {"a": 1}), "top_logprobs": ("3", 2.5, -1, 3),  # (3: without its include)
    # fields it cannot honour: refused, never dropped in silence
    "conversation": ("conv_1", {"id": "conv_1"}), "prompt": ({"id": "pmpt_1"},),
    "truncation": (5, "x"), "include": (5, "reasoning.encrypted_content"),
}


def field_corpus(model: str) -> list[tuple[str, bytes, str]]:
    return _input_items(model) + _top_level(model) + _embeddings(model) + _warm(model)


def _body(model: str, **fields: Any) -> bytes:
    return json.dumps({"model": model, "max_output_tokens": 2, **fields}).encode()


def _with(model: str, key: str, value: Any, **fields: Any) -> bytes:
    """A valid Responses body but for `key`."""
    return json.dumps({"model": model, "max_output_tokens": 2, **fields, key: value}).encode()


def _input_items(model: str) -> list[tuple[str, bytes, str]]:
    """Every field of every input item and of its content part, each wrong type in turn."""
    corpus = []
    for i, item in enumerate(ITEMS):
        for key in item:
            for value in WRONG:
                if value in LENIENT.get(key, ()):
                    continue
                items = copy.deepcopy(ITEMS)
                items[i][key] = value
                param = f"input[{i}].{key}" + ("[0]" if key == "content" and value == ["a"] else "")
                corpus.append(("/v1/responses", _body(model, input=items), param))
        for key in ("type", "text"):
            for value in WRONG:
                if i == 0:
                    items = copy.deepcopy(ITEMS)
                    items[0]["content"][0][key] = value
                    corpus.append(("/v1/responses", _body(model, input=items), f"input[0].content[0].{key}"))
    return corpus


def _top_level(model: str) -> list[tuple[str, bytes, str]]:
    corpus = []
    for key, values in TOP_LEVEL.items():
        for value in values:
            param = "text.format" if key == "text" and isinstance(value, dict) else key
            corpus.append(("/v1/responses", _with(model, key, value, input="hi"), param))
    for key, value in (("parallel_tool_calls", "yes"), ("tool_choice", 5), ("tool_choice", "maybe")):
        corpus.append(("/v1/responses", _with(model, key, value, input="hi", tools=[TOOL]), key))
    corpus.append(("/v1/responses", _body(model, input="hi", tools=[{"type": "function"}]), "tools[0]"))
    return corpus


def _embeddings(model: str) -> list[tuple[str, bytes, str]]:
    fields = {"input": (5, None, [2.5], [[1, "a"]], [], "\ud800", ["ok", {"a": 1}]),
              "encoding_format": (5, "hex", ["float"]), "dimensions": (3,), "user": (5,), "cache_salt": (5, [])}
    return [("/v1/embeddings", json.dumps({"model": model, "input": "hello", **{key: value}}).encode(), key)
            for key, values in fields.items() for value in values]


def _warm(model: str) -> list[tuple[str, bytes, str]]:
    fields = {"prompt": (5, [2.5], [], "\ud800"), "cache_control": (5, []), "cache_salt": (5, []), "model": (5, [])}
    corpus = [("/v1/cache/warm", json.dumps({"model": model, "prompt": "hello", key: value}).encode(), key)
              for key, values in fields.items() for value in values]
    for key, value, param in (
            ("cache_control", {"type": "forever"}, "cache_control.type"),
            ("cache_control", {"type": "ephemeral", "ttl": 5}, "cache_control.ttl"),
            ("cache_control", {"type": "ephemeral", "ttl": []}, "cache_control.ttl"),  # (unhashable: was a 500)
            ("cache_control", {"type": "ephemeral", "ttl": {}}, "cache_control.ttl"),
            ("messages", [{"role": "user", "content": "x", "cache_control": {"type": "ephemeral", "ttl": ["5m"]}}],
             "messages[0].cache_control.ttl"),
            ("messages", 5, "messages"), ("messages", [5], "messages[0]"),
            ("messages", [{"role": ["user"], "content": "x"}], "messages[0].role"),
            ("messages", [{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text")):
        body = {"model": model, "prompt": "hello"} if key != "messages" else {"model": model}
        corpus.append(("/v1/cache/warm", json.dumps({**body, key: value}).encode(), param))
    return corpus
