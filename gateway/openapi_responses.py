"""The response half of the OpenAPI document: the bodies and stream chunks that gateway/formats.py,
generate.py (usage), routes.py and errors.py build, field for field.

Every object is closed (additionalProperties: false) and lists what is always sent as required, so
tests/gateway/test_openapi_responses.py fails as soon as the gateway sends a field the document does not
describe, or stops sending one it does.
"""
from __future__ import annotations

from typing import Any

from engine.tokenizer import SPECIAL_TOKEN_NAMES
from gateway.generation_defaults import SAMPLING_FIELDS

_COUNT = {"type": "integer", "minimum": 0}
_TEXT = {"type": "string"}
_LOGPROB = {"type": "number", "maximum": 0}
_CALL_ID = {"type": "string", "pattern": "^call_[0-9a-f]{24}$"}
_IDS = {"type": "array", "items": _COUNT, "description": "with return_token_ids (in a stream: the prompt's in a "
                                                          "choice's first chunk, the answer's as they come)"}
_REASONING = {name: {**_TEXT, "minLength": 1, "description": "a reasoning model's thinking (--reasoning-parser): "
                     "vLLM's reasoning, and DeepSeek's and llama.cpp's reasoning_content, the same text"}
              for name in ("reasoning", "reasoning_content")}
_CHUNK_USAGE = ("null but in the last chunk, with stream_options.include_usage (in every chunk, its choice's usage so "
                "far, with continuous_usage_stats too)")
_STOP_REASON = {"nullable": True, "oneOf": [_TEXT, _COUNT], "description": (
    "vLLM's: the stop string or stop token id the answer ended at; null for the end-of-sequence token, a length "
    "or an error (in a stream: in the finish chunk)")}


def response_schemas(model_name: str) -> dict[str, Any]:
    usage = _usage()
    return {
        "Error": _error(),
        "Usage": usage,
        "ToolCall": _tool_call(),
        "ChatCompletion": closed({
            **_head("chat.completion", "chatcmpl-", model_name), "prompt_token_ids": _IDS,
            "choices": {"type": "array", "items": closed({
                "index": _COUNT, "message": _chat_message(), "logprobs": nullable(_chat_logprobs()),
                "finish_reason": {"type": "string", "enum": ["stop", "length", "tool_calls", "function_call"],
                                  "description": '"tool_calls" ("function_call" for legacy functions) when the '
                                                 'message holds calls and ended normally; a call cut short by '
                                                 'max_tokens stays "length", its arguments as far as they go'},
                "stop_reason": _STOP_REASON, "token_ids": _IDS}, optional=("token_ids",))},
            "usage": ref("Usage"), "prompt_logprobs": _prompt_logprobs()},
            optional=("prompt_token_ids", "prompt_logprobs")),
        "ChatCompletionChunk": closed({
            **_head("chat.completion.chunk", "chatcmpl-", model_name), "prompt_token_ids": _IDS,
            "choices": {"type": "array", "description": "empty in the usage chunk", "items": closed({
                "index": _COUNT, "delta": _chat_delta(), "logprobs": nullable(_chat_logprobs()),
                "finish_reason": _nullable_enum("stop", "length", "tool_calls", "function_call"),
                "stop_reason": _STOP_REASON, "token_ids": _IDS}, optional=("stop_reason", "token_ids"))},
            "usage": nullable(usage, _CHUNK_USAGE)}, optional=("prompt_token_ids",)),
        "Completion": closed({
            **_head("text_completion", "cmpl-", model_name),
            "choices": {"type": "array", "items": closed({
                "index": _COUNT, "text": _TEXT, "logprobs": nullable(_completion_logprobs()),
                "finish_reason": {"type": "string", "enum": ["stop", "length"]}, "stop_reason": _STOP_REASON,
                "prompt_token_ids": _IDS, "token_ids": _IDS, "prompt_logprobs": _prompt_logprobs()},
                optional=("prompt_token_ids", "token_ids", "prompt_logprobs"))},
            "usage": ref("Usage")}),
        "CompletionChunk": closed({
            **_head("text_completion", "cmpl-", model_name),
            "choices": {"type": "array", "description": "empty in the usage chunk", "items": closed({
                "index": _COUNT, "text": _TEXT, "logprobs": nullable(_completion_logprobs()),
                "finish_reason": _nullable_enum("stop", "length"), "stop_reason": _STOP_REASON,
                "prompt_token_ids": _IDS, "token_ids": _IDS},
                optional=("stop_reason", "prompt_token_ids", "token_ids"))},
            "usage": nullable(usage, _CHUNK_USAGE)}),
        "Model": _model(model_name),
        "ModelList": closed({"object": const("list"), "data": {"type": "array", "items": ref("Model")}}),
        "CachePins": closed({
            "object": const("list"), "data": {"type": "array", "items": closed({
                "object": const("cache.pin"), "id": {"type": "string", "pattern": "^pin_[0-9a-f]{32}$"},
                "tokens": _COUNT, "blocks": _COUNT, "ttl": _TEXT, "created_at": _COUNT, "expires_at": _COUNT,
                "hits": _COUNT})},
            "pinned_blocks": _COUNT, "max_pinned_blocks": nullable({**_COUNT, "description": "the key's quota"})}),
        "CacheDeleted": closed({"object": const("cache.deleted"), "deleted": {"type": "boolean", "enum": [True]},
                                 "blocks": _COUNT, "disk_blocks": _COUNT, "pins": _COUNT,
                                 "responses": {**_COUNT, "description": "stored responses erased"}}),
        "CacheWarm": closed({"object": const("cache.warm"), "model": {"type": "string", "enum": [model_name]},
                              "usage": closed({"prompt_tokens": _COUNT, "total_tokens": _COUNT,
                                                "prompt_tokens_details": usage["properties"]["prompt_tokens_details"]})}),
        "CacheStats": closed({
            "object": const("cache.stats"), "tenant": _TEXT, "prompt_tokens": _COUNT, "cached_tokens": _COUNT,
            "hit_rate": {"type": "number", "minimum": 0, "maximum": 1}, "evicted_blocks": _COUNT,
            "kv_blocks": closed({
                "total": _COUNT, "used": _COUNT, "cached": _COUNT, "free": _COUNT,
                "free_cached": {**_COUNT, "description": "free blocks still cached: hittable until handed out"},
                "free_empty": {**_COUNT, "description": "free blocks holding nothing to hit: handed out first"}}),
            "disk": nullable(closed({"blocks": _COUNT, "bytes": _COUNT}), "null without a disk tier")}),
        "EmbeddingList": closed({
            "object": const("list"), "model": {"type": "string", "enum": [model_name]},
            "data": {"type": "array", "items": closed({
                "object": const("embedding"), "index": _COUNT,
                "embedding": {"oneOf": [{"type": "array", "items": {"type": "number"}},
                                        {"type": "string", "description": "base64 of little-endian float32"}]}})},
            "usage": closed({"prompt_tokens": _COUNT, "total_tokens": _COUNT,
                             "prompt_tokens_details": usage["properties"]["prompt_tokens_details"]})}),
        "Tokenized": closed({"count": _COUNT, "max_model_len": _COUNT, "tokens": {"type": "array", "items": _COUNT},
                             "token_strs": {"type": "array", "items": {"type": "string"}, "nullable": True}}),
        "Detokenized": closed({"prompt": {"type": "string"}}),
        "TokenizerInfo": closed({"tokenizer_class": _TEXT, "chat_template": _TEXT,
                                 "model_max_length": {"type": "integer", "minimum": 1},
                                 **{name: nullable(_TEXT) for name in SPECIAL_TOKEN_NAMES}}),
        "Version": closed({"version": _TEXT}),
        "Health": closed({"status": const("ok"), "replicas_up": _COUNT, "replicas": _COUNT},
                          optional=("replicas_up", "replicas")),
    }


def closed(properties: dict[str, Any], *, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """An object with exactly these fields, each always sent unless named in `optional`."""
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required := [name for name in properties if name not in optional]:
        schema["required"] = required
    return schema


def nullable(schema: dict[str, Any], description: str | None = None) -> dict[str, Any]:
    return {**schema, "nullable": True, **({"description": description} if description else {})}


def _nullable_enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "nullable": True, "enum": [*values, None]}


def const(value: str) -> dict[str, Any]:
    return {"type": "string", "enum": [value]}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _head(object_name: str, id_prefix: str, model_name: str) -> dict[str, Any]:
    return {"id": {"type": "string", "pattern": f"^{id_prefix}[0-9a-f]{{32}}$"}, "object": const(object_name),
            "created": _COUNT, "model": {"type": "string", "enum": [model_name]},
            "system_fingerprint": {"type": "string", "pattern": "^fp_[0-9a-f]{10}$",
                                   "description": "changes when the model or the engine configuration does"}}


def _usage() -> dict[str, Any]:
    return closed({
        "prompt_tokens": _COUNT, "completion_tokens": _COUNT, "total_tokens": _COUNT,
        "prompt_tokens_details": closed({
            "cached_tokens": {**_COUNT, "description": "prompt tokens served from the prefix cache"},
            "disk_cached_tokens": {**_COUNT, "description": "the part of cached_tokens read back from the disk tier"},
            "cache_write_tokens": {**_COUNT, "description": "prompt tokens this request computed and wrote to the "
                                                            "cache (its full blocks not served from it)"},
            "pinned_tokens": {**_COUNT, "description": "the prompt's pinned prefix (cache_control) this request "
                                                       "made or renewed by a hit"},
            "pinned_until": nullable({**_COUNT, "description": "when that pin expires (Unix seconds)"}),
            "pin_refused": {"type": "string", "enum": ["tenant_quota", "pool_quota", "not_cached"],
                            "description": "only when a breakpoint was not pinned: the quota it would exceed"}},
            optional=("pin_refused",)),
        "completion_tokens_details": {**closed({
            "reasoning_tokens": {**_COUNT, "description": "a reasoning model's thinking (--reasoning-parser)"},
            **{name: {**_COUNT, "enum": [0]} for name in (
                "audio_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens")}}),
            "description": "zeros but for a reasoning model's thinking (no audio or predicted outputs), as OpenAI "
                           "sends them"},
    })


def _error() -> dict[str, Any]:
    fields = {"message": _TEXT, "type": _TEXT, "param": nullable(_TEXT), "code": nullable(_TEXT)}
    return closed({"error": closed(fields)})


def _tool_call() -> dict[str, Any]:
    return closed({"id": _CALL_ID, "type": const("function"),
                    "function": closed({"name": _TEXT, "arguments": {**_TEXT, "description": "JSON text"}})})


def _chat_message() -> dict[str, Any]:
    """Plain text, or tool calls with the text around them (null when there is none); a request that sent
    the deprecated `functions` gets its one call as `function_call`."""
    role = const("assistant")
    thinking = ("reasoning", "reasoning_content")
    return {"oneOf": [
        closed({"role": role, "content": _TEXT, **_REASONING}, optional=thinking),
        closed({"role": role, "content": nullable(_TEXT),
                 "tool_calls": {"type": "array", "items": ref("ToolCall"), "minItems": 1}, **_REASONING},
               optional=thinking),
        closed({"role": role, "content": nullable(_TEXT),
                 "function_call": closed({"name": _TEXT, "arguments": {**_TEXT, "description": "JSON text"}}),
                 **_REASONING}, optional=thinking),
    ]}


def _chat_delta() -> dict[str, Any]:
    """The first chunk has the role (and content ""); a call's first delta has its id, type and
    name, its later ones only index and the next piece of the arguments."""
    head = closed({"index": _COUNT, "id": _CALL_ID, "type": const("function"),
                    "function": closed({"name": _TEXT, "arguments": _TEXT})})
    piece = closed({"index": _COUNT, "function": closed({"arguments": _TEXT})})
    legacy = closed({"name": _TEXT, "arguments": _TEXT}, optional=("name",))
    return closed({"role": const("assistant"), "content": _TEXT,
                    "tool_calls": {"type": "array", "items": {"oneOf": [head, piece]}, "minItems": 1},
                    "function_call": legacy, **_REASONING},
                   optional=("role", "content", "tool_calls", "function_call", "reasoning", "reasoning_content"))


def _chat_logprobs() -> dict[str, Any]:
    return closed({"content": {"type": "array", "items": token_logprob()}})


def token_logprob() -> dict[str, Any]:
    """One answer token's logprob as chat's logprobs.content and a Responses output_text's logprobs list it."""
    token = {"token": {**_TEXT, "description": 'a token holding part of a UTF-8 character: "bytes:\\xNN..."'},
             "logprob": _LOGPROB, "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                        "maximum": 255}}}
    top = {"type": "array", "items": closed(token), "description": "top_logprobs of them; [] without it"}
    return closed({**token, "top_logprobs": top})


def _completion_logprobs() -> dict[str, Any]:
    top = {"type": "object", "additionalProperties": _LOGPROB, "nullable": True}
    first = "; null for an echoed prompt's first token"
    return closed({"tokens": {"type": "array", "items": _TEXT},
                    "token_logprobs": {"type": "array", "items": {**_LOGPROB, "nullable": True},
                                       "description": "echo: the prompt's tokens' first" + first},
                    "top_logprobs": {"type": "array", "items": top, "nullable": True,
                                     "description": "token -> logprob, when logprobs > 0" + first},
                    "text_offset": {"type": "array", "items": _COUNT}})


def _prompt_logprobs() -> dict[str, Any]:
    scored = closed({"logprob": _LOGPROB, "rank": {"type": "integer", "minimum": 1}, "decoded_token": _TEXT})
    return {"type": "array", "items": {"type": "object", "additionalProperties": scored, "nullable": True},
            "description": "vLLM's, with prompt_logprobs: per prompt token, null for the first, else token id -> "
                           "its logprob, rank and text, for the prompt's token and the top k of its position"}


def _model(model_name: str) -> dict[str, Any]:
    return closed({"id": {"type": "string", "enum": [model_name]}, "object": const("model"), "created": _COUNT,
                    "owned_by": const("prefixgate"), "max_model_len": {"type": "integer", "minimum": 1},
                    "sampling_defaults": closed({**{name: {"type": "number"} for name in SAMPLING_FIELDS},
                                                  "max_tokens": {"type": "integer", "minimum": 1, "nullable": True,
                                                                 "description": "for a request that sets none; "
                                                                                "null: the rest of the context"}}),
                    "embeddings": closed({"pooling": const("last"), "normalized": {"type": "boolean"}})})
