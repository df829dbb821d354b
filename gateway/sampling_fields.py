"""Request fields that shape the output: structured outputs, penalties and biases, stop tokens, best_of and echo.

OpenAI's `response_format`, and vLLM's extras (`guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`, the `structured_outputs` object, `repetition_penalty`, `min_p`, `min_tokens`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `allowed_token_ids`).
A field we cannot honour is a 400 naming it, never ignored.
"""
from __future__ import annotations

from collections.abc import Mapping

import json
from typing import Any

from engine.structured import StructuredOutput, build_grammar
from gateway.errors import invalid

MAX_LOGIT_BIAS_ENTRIES = 1024  # each entry is work on every decode step
MAX_TOKEN_ID_LIST = 1024  # stop_token_ids, allowed_token_ids: the same
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                           "json_object": "json_object"}
# fields of OpenAI's API and vLLM's extras that would change the output and that this server cannot honour:
# field -> (why, the values that ask for nothing)
REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "suffix": ("suffix is not supported: the model has no fill-in-the-middle tokens", (None, "")),
    "prediction": ("prediction (predicted outputs) is not supported", (None, "")),
    "audio": ("audio output is not supported", (None, "")),
    "modalities": ('only text output is offered: modalities ["text"]', (None, ["text"])),
    "web_search_options": ("web search is not supported", (None, "")),
    "bad_words": ("bad_words is not supported; logit_bias bans single tokens", (None, [])),
    "use_beam_search": ("beam search is not supported", (None, False)),
    "logits_processors": ("custom logits processors are not supported", (None, [])),
    "priority": ("priority is not supported: requests are scheduled first come, cached prefixes first", (None, 0)),
    "guided_whitespace_pattern": ("guided_whitespace_pattern is not supported", (None, "")),
    "structural_tag": ("structural_tag is not supported; use response_format, guided_* or structured_outputs",
                       (None, "")),
}


def sampling_fields(fields: Any, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Penalties, biases, min_p, min_tokens and the stop tokens (ranges as OpenAI and vLLM define them);
    `defaults` holds the model's defaults of those a model may set (gateway/generation_defaults.py)."""
    for name, (message, asks_nothing) in REFUSED.items():
        if not _among(fields.body.get(name), asks_nothing):
            raise invalid(message, name)
    fields.boolean("spaces_between_special_tokens", True)  # vLLM's; a fast tokenizer's decode has no such choice
    structured = structured_output(fields.body)
    allowed_token_ids = _token_ids(fields.body, "allowed_token_ids")
    if allowed_token_ids is not None and structured is not None:
        raise invalid("allowed_token_ids cannot be combined with an output constraint (the grammar picks the "
                      "tokens)", "allowed_token_ids")
    return dict(
        presence_penalty=fields.number("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=fields.number("repetition_penalty", defaults["repetition_penalty"], 0.01, 10.0),
        min_p=fields.number("min_p", defaults["min_p"], 0.0, 1.0),
        min_tokens=fields.integer("min_tokens", 0, 0),
        logit_bias=_logit_bias(fields.body.get("logit_bias")),
        stop_token_ids=_token_ids(fields.body, "stop_token_ids") or (),
        include_stop_str_in_output=fields.boolean("include_stop_str_in_output", False),
        skip_special_tokens=fields.boolean("skip_special_tokens", True),
        allowed_token_ids=allowed_token_ids,
        structured=structured,
    )


def _among(value: Any, values: tuple[Any, ...]) -> bool:
    """`value in values`, where a boolean equals only a boolean (False is not 0)."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in values)


def _token_ids(body: dict[str, Any], name: str) -> tuple[int, ...] | None:
    """A list of token ids (their range in the vocabulary is the engine's check: sampling_params.check_token_ids)."""
    raw = body.get(name)
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw):
        raise invalid(f"{name} must be an array of token ids (non-negative integers)", name)
    if len(raw) > MAX_TOKEN_ID_LIST:
        raise invalid(f"{name} may hold at most {MAX_TOKEN_ID_LIST} token ids", name)
    if not raw and name == "allowed_token_ids":
        raise invalid("allowed_token_ids must not be empty: it would allow no token", name)
    return tuple(raw)


def _logit_bias(raw: Any) -> dict[int, float]:
    """{"token id": bias in [-100, 100]}; whether the id is in the vocabulary is checked with the tokenizer."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise invalid("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    if len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias")
    bias = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise invalid(f"logit_bias keys must be token ids (non-negative integers), got {key!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise invalid(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {key}",
                          "logit_bias")
        bias[int(key)] = float(value)
    return bias


def structured_output(body: dict[str, Any]) -> StructuredOutput | None:
    """At most one of response_format (not text), guided_*, structured_outputs; its spec checked here."""
    found = [(name, so) for name, so in _candidates(body) if so is not None]
    if len(found) > 1:
        raise invalid(f"only one output constraint may be set; got {', '.join(n for n, _ in found)}", found[1][0])
    if not found:
        return None
    param, so = found[0]
    try:
        build_grammar(so)
    except ValueError as exc:
        raise invalid(f"{param}: {exc}", param) from None
    return so


def _candidates(body: dict[str, Any]):
    yield "response_format", _response_format(body.get("response_format"))
    for name, kind in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            yield name, _spec(kind, body[name], name)
    if body.get("structured_outputs") is not None:
        yield "structured_outputs", _structured_outputs(body["structured_outputs"])


def _response_format(raw: Any) -> StructuredOutput | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid('response_format.type must be "text", "json_object" or "json_schema"', "response_format")
    if raw["type"] == "text":
        return None
    if raw["type"] == "json_object":
        return StructuredOutput("json_object")
    json_schema = raw.get("json_schema")
    if not isinstance(json_schema, dict) or not isinstance(json_schema.get("name"), str):
        raise invalid("response_format.json_schema must be an object with a name", "response_format")
    if json_schema.get("schema") is None:  # OpenAI: no schema means any JSON object
        return StructuredOutput("json_object")
    return _spec("json_schema", json_schema["schema"], "response_format")


def _structured_outputs(raw: Any) -> StructuredOutput | None:
    if not isinstance(raw, dict):
        raise invalid("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(set(raw) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise invalid(f"structured_outputs.{unknown[0]} is not supported; supported: "
                      f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}", "structured_outputs")
    set_keys = [k for k, v in raw.items() if v not in (None, False)]
    if len(set_keys) != 1:
        raise invalid("structured_outputs must set exactly one of " + ", ".join(STRUCTURED_OUTPUTS_KEYS),
                      "structured_outputs")
    key = set_keys[0]
    if key == "json_object":
        return StructuredOutput("json_object")
    return _spec(STRUCTURED_OUTPUTS_KEYS[key], raw[key], "structured_outputs")


def _spec(kind: str, value: Any, param: str) -> StructuredOutput:
    """A JSON schema (object or its JSON text), a regex or EBNF (string), or a choice list."""
    if kind == "json_schema":
        if isinstance(value, str):
            return StructuredOutput(kind, value)
        if isinstance(value, dict):
            return StructuredOutput(kind, json.dumps(value))
        raise invalid(f"{param}: a JSON schema must be an object", param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid(f"{param}: choice must be a non-empty array of non-empty strings", param)
        return StructuredOutput(kind, json.dumps(value))
    if not isinstance(value, str) or not value:
        raise invalid(f"{param}: {kind} must be a non-empty string", param)
    return StructuredOutput(kind, value)


def completion_extras(fields: Any, n: int, max_n: int, stream: bool) -> dict[str, Any]:
    """/v1/completions only: best_of (the n best of best_of by cumulative logprob) and echo (the prompt before each
    answer; with logprobs, the prompt's logprobs before the answer's)."""
    best_of = fields.integer("best_of", n, n, max_n)
    if best_of > n and stream:
        raise invalid("best_of cannot be used with stream (the best choices are known only at the end)", "best_of")
    return dict(best_of=best_of, echo=fields.boolean("echo", False))
