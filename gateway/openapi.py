"""The OpenAPI 3 description of our endpoints, built from the live limits (served at /openapi.json).

The schemas state what the gateway accepts, bounds included, so a fuzzer's valid requests are
valid here and its invalid ones are invalid for a reason the schema names. Rules that span
fields (top_logprobs needs logprobs, prompt + max_tokens within the context, prompts x n within
admission capacity) are in the descriptions only: they are 400s, not schema violations. What the
gateway sends back is described in gateway/openapi_responses.py.
"""
from __future__ import annotations

from typing import Any

from gateway import __version__
from gateway.openapi_responses import ref, response_schemas
from gateway.openapi_responses_api import responses_paths, responses_request, responses_schemas
from gateway.protocol import MAX_SEED
from gateway.sampling_fields import MAX_TOKEN_ID_LIST
from gateway.settings import GatewaySettings

OPENAPI_VERSION = "3.0.3"
_JSON = "application/json"


def build_openapi(model_name: str, vocab_size: int, limits: GatewaySettings) -> dict[str, Any]:
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "prefixgate", "version": __version__,
                 "description": "OpenAI-compatible API with automatic prefix caching"},
        "paths": {
            "/v1/chat/completions": _generation(_chat_request(model_name, vocab_size, limits), "ChatCompletion",
                                                "Create a chat completion"),
            "/v1/completions": _generation(_completion_request(model_name, vocab_size, limits), "Completion",
                                           "Create a text completion"),
            "/v1/models": {"get": _operation("List the served model", ref("ModelList"), secured=True)},
            "/v1/models/{model_id}": {"get": _model_operation()},
            "/v1/cache": {"get": _operation("The caller's pinned prefixes", ref("CachePins"), secured=True,
                                            errors=(503,)),
                          "delete": _operation("Erase the caller's cached blocks, in memory and on disk, pinned "
                                               "or not, and its stored responses", ref("CacheDeleted"), secured=True,
                                               errors=(503,))},
            "/v1/cache/warm": {"post": _warm_operation(model_name, vocab_size, limits)},
            "/v1/cache/stats": {"get": _operation("The caller's hit rate and the pool's occupancy", ref("CacheStats"),
                                                  secured=True)},
            "/v1/embeddings": {"post": _embeddings_operation(model_name, vocab_size, limits)},
            "/tokenize": {"post": _tokenize_operation(model_name, vocab_size, limits)},
            "/detokenize": {"post": _detokenize_operation(model_name, vocab_size)},
            "/tokenizer_info": {"get": _operation("The tokenizer's class, special tokens and chat template (vLLM's; "
                                                  "lm-evaluation-harness's remote tokenizer reads it)",
                                                  ref("TokenizerInfo"), secured=True)},
            **responses_paths(_responses_request(model_name, vocab_size, limits), _operation),
            "/health": {"get": _operation("Liveness of the engine loop", ref("Health"), errors=(503,))},
            "/ping": {method: _operation("/health's answer (vLLM's and SageMaker's liveness probe)", ref("Health"),
                                         errors=(503,)) for method in ("get", "post")},
            "/version": {"get": _operation("The server's version", ref("Version"))},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
                "description": "exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {
                "200": {"description": "OpenAPI 3 document", "content": {_JSON: {"schema": {"type": "object"}}}}}}},
        },
        "components": {"schemas": {**(schemas := response_schemas(model_name)),
                                   **responses_schemas(model_name, schemas["Usage"])},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _generation(body: dict[str, Any], response: str, summary: str) -> dict[str, Any]:
    op = _operation(summary, ref(response), secured=True, errors=(400, 401, 404, 413, 429, 500, 503))
    op["requestBody"] = {"required": True, "content": {_JSON: {"schema": body}}}
    chunk = response + "Chunk"
    op["responses"]["200"]["content"]["text/event-stream"] = {
        "schema": {"type": "string", "description": f"with stream: true, `data: {{{chunk}}}` events, then "
                   "`data: [DONE]`; a failure after the first event is one `data: {Error}` event, then `data: [DONE]`"},
        "x-stream-chunk": ref(chunk)}  # OpenAPI 3.0 cannot type the events themselves
    return {"post": op}


def _model_operation() -> dict[str, Any]:
    op = _operation("The served model (under either of its names)", ref("Model"), secured=True, errors=(404,))
    op["parameters"] = [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"},
                         "description": 'may hold slashes ("org/name")'}]
    return op


def _operation(summary: str, ok: dict[str, Any], *, secured: bool = False,
               errors: tuple[int, ...] = ()) -> dict[str, Any]:
    responses = {"200": {"description": "success", "content": {_JSON: {"schema": ok}}}}
    for status in errors + ((401,) if secured and 401 not in errors else ()):
        responses[str(status)] = {"description": "an OpenAI error object",
                                  "content": {_JSON: {"schema": ref("Error")}}}
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if secured:  # no key needed when the server runs without keys
        op["security"] = [{"bearer": []}, {}]
    return op


_TRUNCATE = {"type": "integer", "minimum": -1, "not": {"enum": [0]}, "nullable": True,
             "description": "keep the prompt's last k tokens (-1: as many as fit)"}


_ADD_SPECIAL_TOKENS = {"type": "boolean", "nullable": True, "description": (
    "the tokenizer's BOS (where it has one) first: default true for a text prompt, false for a chat")}


def _served_model(model_name: str) -> dict[str, Any]:
    return {"type": "string", "enum": [model_name], "nullable": True,
            "description": "left out: the served model (as vLLM and SGLang take it)"}


def _token(vocab_size: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}


def _common(model_name: str, vocab_size: int, limits: GatewaySettings) -> dict[str, Any]:
    max_tokens: dict[str, Any] = {"type": "integer", "minimum": 1, "nullable": True}
    if limits.max_tokens_limit is not None:
        max_tokens["maximum"] = limits.max_tokens_limit
    text = {"type": "string", "minLength": 1}
    return {
        "model": _served_model(model_name),
        "max_tokens": max_tokens,
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
        "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1, "nullable": True},
        "top_k": {"type": "integer", "minimum": -1, "nullable": True},
        "seed": {"type": "integer", "minimum": -MAX_SEED - 1, "maximum": MAX_SEED, "nullable": True},
        "stop": {"nullable": True, "oneOf": [
            text, {"type": "array", "items": text, "maxItems": limits.max_stop_sequences}]},
        "n": {"type": "integer", "minimum": 1, "maximum": limits.max_n, "nullable": True},
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {"type": "object", "nullable": True,
                           "properties": {"include_usage": {"type": "boolean", "nullable": True},
                                          "continuous_usage_stats": {
                                              "type": "boolean", "nullable": True,
                                              "description": "usage in every chunk; needs include_usage"}}},
        "user": {"type": "string", "nullable": True},
        "cache_salt": {"type": "string", "nullable": True,
                       "description": "narrows the caller's prefix cache; never widens it"},
        "ignore_eos": {"type": "boolean", "nullable": True},
        "truncate_prompt_tokens": {**_TRUNCATE, "description": _TRUNCATE["description"] + "; not with cache_control"},
        "add_special_tokens": _ADD_SPECIAL_TOKENS,
        "return_token_ids": {"type": "boolean", "nullable": True,
                             "description": "the prompt's and the answer's token ids beside the text"},
        "return_tokens_as_token_ids": {"type": "boolean", "nullable": True,
                                       "description": "logprobs name each token token_id:ID"},
        "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": limits.max_top_logprobs, "nullable": True,
                            "description": "each prompt token's logprob, and the top k of each position; not with "
                                           "stream; the prompt's cached blocks are not read"},
        **_output_fields(vocab_size),
    }


def _output_fields(vocab_size: int) -> dict[str, Any]:
    """Penalties, biases, stop tokens and output constraints (gateway/sampling_fields.py)."""
    penalty = {"type": "number", "minimum": -2, "maximum": 2, "nullable": True}
    text = {"type": "string", "minLength": 1}
    token = _token(vocab_size)
    return {
        "presence_penalty": penalty,
        "frequency_penalty": penalty,
        "repetition_penalty": {"type": "number", "minimum": 0.01, "maximum": 10, "nullable": True},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
        "min_tokens": {"type": "integer", "minimum": 0, "nullable": True, "description": "at most max_tokens"},
        "logit_bias": {"type": "object", "nullable": True, "description": "token id (a string) -> bias",
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
        "stop_token_ids": {"type": "array", "items": token, "maxItems": MAX_TOKEN_ID_LIST, "nullable": True,
                           "description": "the answer ends at any of them; its text is left out, as a stop string's"},
        "include_stop_str_in_output": {"type": "boolean", "nullable": True,
                                       "description": "the stop string (or stop token's text) ends the answer"},
        "skip_special_tokens": {"type": "boolean", "nullable": True,
                                "description": "default true; false: special tokens' text is in the answer"},
        "spaces_between_special_tokens": {"type": "boolean", "nullable": True,
                                          "description": "accepted; no effect with a fast tokenizer (as in vLLM)"},
        "allowed_token_ids": {"type": "array", "items": token, "minItems": 1, "maxItems": MAX_TOKEN_ID_LIST,
                              "nullable": True, "description": "only these tokens may be sampled; not with an "
                                                               "output constraint"},
        "response_format": {"type": "object", "nullable": True, "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
        "guided_json": {"type": "object", "nullable": True, "description": "a JSON schema"},
        "guided_regex": {**text, "nullable": True},
        "guided_choice": {"type": "array", "items": text, "minItems": 1, "nullable": True},
        "guided_grammar": {**text, "nullable": True, "description": "EBNF (GBNF) or Lark"},
        "structured_outputs": {"type": "object", "nullable": True, "description": "exactly one of json, regex, "
                               "choice, grammar, json_object", "properties": {
                                   "json": {"type": "object"}, "regex": text, "grammar": text,
                                   "choice": {"type": "array", "items": text, "minItems": 1},
                                   "json_object": {"type": "boolean"}}},
    }


_CACHE_CONTROL = {"type": "object", "required": ["type"], "nullable": True,
                  "description": "pins the prompt up to the end of this part (at most 4 breakpoints a request)",
                  "properties": {"type": {"type": "string", "enum": ["ephemeral"]},
                                 "ttl": {"type": "string", "enum": ["5m", "1h"], "description": "default 5m"}}}


def _top_level_cache_control(position: dict[str, Any]) -> dict[str, Any]:
    """The body's own `cache_control` (extra_body): one breakpoint or an array of them."""
    breakpoint = {**_CACHE_CONTROL, "nullable": False,
                  "properties": {**_CACHE_CONTROL["properties"], **position}}
    return {"nullable": True, "oneOf": [breakpoint, {"type": "array", "items": breakpoint, "maxItems": 4}],
            "description": "breakpoints for clients whose message types drop cache_control (at most 4 in all)"}


def _chat_request(model_name: str, vocab_size: int, limits: GatewaySettings) -> dict[str, Any]:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"},
                           "cache_control": _CACHE_CONTROL}}
    content = {"oneOf": [{"type": "string"}, {"type": "array", "items": part}]}
    call = {"type": "object", "required": ["id", "function"], "properties": {
        "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON text"}}}}}
    message = {"oneOf": [  # told apart by role
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"type": "string", "enum": ["system", "developer", "user"]}, "content": content,
            "cache_control": _CACHE_CONTROL}},
        {"type": "object", "required": ["role"], "properties": {
            "role": {"type": "string", "enum": ["assistant"]}, "content": {**content, "nullable": True},
            "tool_calls": {"type": "array", "items": call, "nullable": True},
            "function_call": {**call["properties"]["function"], "nullable": True, "description": "deprecated"}}},
        {"type": "object", "required": ["role", "tool_call_id", "content"], "properties": {
            "role": {"type": "string", "enum": ["tool"]}, "tool_call_id": {"type": "string"}, "content": content}},
        {"type": "object", "required": ["role", "name", "content"], "description": "deprecated: answers a function_call",
         "properties": {"role": {"type": "string", "enum": ["function"]}, "name": {"type": "string"},
                        "content": content}},
    ]}
    properties = _common(model_name, vocab_size, limits)
    properties.update({
        "messages": {"type": "array", "items": message, "minItems": 1, "maxItems": limits.max_messages},
        "max_completion_tokens": properties["max_tokens"],
        "logprobs": {"type": "boolean", "nullable": True},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": limits.max_top_logprobs, "nullable": True,
                         "description": "needs logprobs: true"},
        "cache_control": _top_level_cache_control({"message": {
            "type": "integer", "description": "the index of the message it ends (default: the last)"}}),
        **_tool_fields(),
        **_PROMPT_ENDING,
        "chat_template_kwargs": {"type": "object", "nullable": True, "description": (
            "more chat template variables (e.g. enable_thinking); not messages, tools, add_generation_prompt or "
            "documents")},
        "documents": {"type": "array", "items": {"type": "object"}, "nullable": True,
                      "description": "the chat template's documents"},
        "echo": {"type": "boolean", "nullable": True,
                 "description": "vLLM's: an answer that continues the last message, an assistant's "
                                "(continue_final_message), starts with its text"},
    })
    return {"type": "object", "required": ["messages"], "properties": properties}


_PROMPT_ENDING = {  # vLLM's: how a chat's prompt ends
    "add_generation_prompt": {"type": "boolean", "nullable": True,
                              "description": "default true: the prompt ends with the assistant's header"},
    "continue_final_message": {"type": "boolean", "nullable": True, "description": (
        "the prompt ends inside the final message, an assistant's, which the answer continues; needs "
        "add_generation_prompt false")},
}


def _tool_fields() -> dict[str, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls` (the history's tool messages are accepted too)."""
    name = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
    function = {"type": "object", "required": ["name"], "properties": {
        "name": name, "description": {"type": "string"}, "parameters": {"type": "object"}}}
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]}, "function": function}}
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "properties": {"name": name}}}}
    return {
        "functions": {"type": "array", "items": function, "minItems": 1, "nullable": True,
                      "description": "deprecated: tools with at most one call, answered as function_call; not "
                                     "with tools"},
        "function_call": {"nullable": True, "description": "deprecated: needs functions",
                          "oneOf": [{"type": "string", "enum": ["auto", "none"]},
                                    {"type": "object", "required": ["name"], "properties": {"name": name}}]},
        "tools": {"type": "array", "items": tool, "minItems": 1, "nullable": True},
        "tool_choice": {"nullable": True, "description": "needs tools; a named function must be one of them",
                        "oneOf": [{"type": "string", "enum": ["auto", "none", "required"]}, named]},
        "parallel_tool_calls": {"type": "boolean", "nullable": True, "description": "needs tools"},
    }


def _completion_request(model_name: str, vocab_size: int, limits: GatewaySettings) -> dict[str, Any]:
    tokens = {"type": "array", "items": _token(vocab_size), "minItems": 1}
    prompt = {"oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": limits.max_prompts},
        tokens,
        {"type": "array", "items": tokens, "minItems": 1, "maxItems": limits.max_prompts},
    ]}
    properties = _common(model_name, vocab_size, limits)
    properties.update({
        "prompt": prompt,
        "logprobs": {"type": "integer", "minimum": 0, "maximum": limits.max_top_logprobs, "nullable": True},
        "best_of": {"type": "integer", "minimum": 1, "maximum": limits.max_n, "nullable": True,
                    "description": ">= n; not with stream"},
        "echo": {"type": "boolean", "nullable": True,
                 "description": "with logprobs, the prompt's tokens and logprobs come first (the first token's null)"},
        "max_tokens": {**properties["max_tokens"], "minimum": 0,
                       "description": "0 only with echo: the prompt alone (with logprobs, scored)"},
        "cache_control": _top_level_cache_control({"tokens": {
            "type": "integer", "minimum": 1, "description": "pins this prompt prefix (default: the whole prompt)"}}),
    })
    return {"type": "object", "required": ["prompt"], "properties": properties}


def _warm_operation(model_name: str, vocab_size: int, limits: GatewaySettings) -> dict[str, Any]:
    chat = _chat_request(model_name, vocab_size, limits)["properties"]
    prompt = _completion_request(model_name, vocab_size, limits)["properties"]["prompt"]
    op = _operation("Compute and pin a prompt prefix without generating", ref("CacheWarm"), secured=True,
                    errors=(400, 404, 413, 429, 503))
    op["requestBody"] = {"required": True, "content": {_JSON: {"schema": {
        "type": "object", "description": "messages (with optional tools) or prompt, not both",
        "properties": {"model": chat["model"], "messages": chat["messages"],
                       "tools": chat["tools"], "prompt": prompt,
                       "cache_control": {**_CACHE_CONTROL, "description": "the pin's TTL (default 5m)"},
                       "cache_salt": chat["cache_salt"], "add_special_tokens": _ADD_SPECIAL_TOKENS,
                       "chat_template_kwargs": chat["chat_template_kwargs"], "documents": chat["documents"]}}}}}
    return op


def _embeddings_operation(model_name: str, vocab_size: int, limits: GatewaySettings) -> dict[str, Any]:
    op = _operation("Embed each input (last-token pooling, L2-normalized)", ref("EmbeddingList"), secured=True,
                    errors=(400, 404, 413, 429, 503))
    op["requestBody"] = {"required": True, "content": {_JSON: {"schema": {
        "type": "object", "required": ["input"], "properties": {
            "model": _served_model(model_name),
            "input": _completion_request(model_name, vocab_size, limits)["properties"]["prompt"],
            "encoding_format": {"type": "string", "enum": ["float", "base64"], "nullable": True},
            "user": {"type": "string", "nullable": True},
            "cache_salt": {"type": "string", "nullable": True},
            "truncate_prompt_tokens": _TRUNCATE, "add_special_tokens": _ADD_SPECIAL_TOKENS}}}}}
    return op


def _tokenize_operation(model_name: str, vocab_size: int, limits: GatewaySettings) -> dict[str, Any]:
    chat = _chat_request(model_name, vocab_size, limits)["properties"]
    op = _operation("A prompt's tokens as this server counts them (a chat's through its template)", ref("Tokenized"),
                    secured=True, errors=(400, 404, 413))
    op["requestBody"] = {"required": True, "content": {_JSON: {"schema": {
        "type": "object", "description": "messages (with optional tools) or prompt, not both",
        "properties": {"model": chat["model"], "messages": chat["messages"],
                       "tools": chat["tools"], "prompt": {"type": "string"},
                       **_PROMPT_ENDING, "chat_template_kwargs": chat["chat_template_kwargs"],
                       "documents": chat["documents"],
                       "add_special_tokens": _ADD_SPECIAL_TOKENS,
                       "return_token_strs": {"type": "boolean", "nullable": True}}}}}}
    return op


def _detokenize_operation(model_name: str, vocab_size: int) -> dict[str, Any]:
    op = _operation("Token ids back to text", ref("Detokenized"), secured=True, errors=(400, 404, 413))
    op["requestBody"] = {"required": True, "content": {_JSON: {"schema": {
        "type": "object", "required": ["tokens"],
        "properties": {"model": _served_model(model_name), "tokens": {"type": "array", "items": _token(vocab_size)}}}}}}
    return op


def _responses_request(model_name: str, vocab_size: int, limits: GatewaySettings) -> dict[str, Any]:
    return responses_request(_chat_request(model_name, vocab_size, limits)["properties"])
