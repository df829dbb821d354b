"""The OpenAPI description of the Responses API (`/v1/responses` and its stored responses' routes, built by
gateway/responses.py), both halves: what a request may send and what comes back."""
from __future__ import annotations

from typing import Any

from gateway.openapi_responses import closed, const, nullable, ref, token_logprob
from gateway.responses_fields import (DEFAULT_ITEMS_PAGE, INCLUDABLE, MAX_ITEMS_PAGE, MAX_METADATA_PAIRS,
                                      MAX_METADATA_VALUE, TRUNCATION, VLLM_EXTRAS)

_TEXT = {"type": "string"}
_COUNT = {"type": "integer", "minimum": 0}
_STATUS = {"type": "string", "enum": ["completed", "incomplete"]}


def responses_request(chat: dict[str, Any]) -> dict[str, Any]:
    """`chat`: the chat request's field schemas (gateway/openapi.py), whose rules the Responses fields share."""
    part = {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"type": "string", "enum": ["input_text", "output_text", "text"]}, "text": _TEXT}}
    content = {"oneOf": [_TEXT, {"type": "array", "items": part}]}
    item = {"oneOf": [  # told apart by type (a message may leave it out)
        {"type": "object", "required": ["role", "content"], "properties": {
            "type": {"type": "string", "enum": ["message"]}, "id": _TEXT,
            "role": {"type": "string", "enum": ["user", "system", "developer", "assistant"]}, "content": content}},
        {"type": "object", "required": ["type", "call_id", "name"], "properties": {
            "type": {"type": "string", "enum": ["function_call"]}, "id": _TEXT, "call_id": _TEXT,
            "name": chat["tools"]["items"]["properties"]["function"]["properties"]["name"],
            "arguments": {**_TEXT, "description": "JSON text"}}},
        {"type": "object", "required": ["type", "call_id", "output"], "properties": {
            "type": {"type": "string", "enum": ["function_call_output"]}, "id": _TEXT, "call_id": _TEXT,
            "output": {"oneOf": [_TEXT, {"type": "object"}, {"type": "array"}],
                       "description": "text; any other JSON value is sent to the model as its JSON text"}}},
        {"type": "object", "required": ["type"], "description": "an earlier answer's thinking: the next assistant "
         "item's, for the template", "properties": {
            "type": {"type": "string", "enum": ["reasoning"]}, "id": _TEXT,
            "summary": {"type": "array", "items": _reasoning_part("summary_text")},
            "content": {"type": "array", "items": _reasoning_part("reasoning_text")}}},
    ]}
    function = chat["tools"]["items"]["properties"]["function"]
    tool = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"type": "string", "enum": ["function"]}, **function["properties"]}}
    text_format = {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "name": _TEXT, "schema": {"type": "object"}, "strict": {"type": "boolean"}},
        "description": "json_schema needs a name and a schema"}
    return {"type": "object", "required": ["input"], "properties": {
        "model": chat["model"],
        "input": {"oneOf": [_TEXT, {"type": "array", "items": item}],
                  "description": "not empty unless previous_response_id brings a conversation"},
        "instructions": {**_TEXT, "nullable": True, "description": "this request's system message (not carried "
                                                                   "over by previous_response_id)"},
        "previous_response_id": {**_TEXT, "nullable": True, "description": "a stored response of the caller's"},
        "store": {"type": "boolean", "nullable": True, "description": "default true"},
        "max_output_tokens": chat["max_tokens"],
        **{name: chat[name] for name in ("temperature", "top_p", "stream", "user", "cache_salt")},
        "tools": {"type": "array", "items": tool, "nullable": True},
        "tool_choice": {"nullable": True, "description": "needs tools", "oneOf": [
            {"type": "string", "enum": ["auto", "none", "required"]},
            {"type": "object", "required": ["type", "name"], "properties": {
                "type": {"type": "string", "enum": ["function"]}, "name": function["properties"]["name"]}}]},
        "parallel_tool_calls": chat["parallel_tool_calls"],
        "text": {"type": "object", "nullable": True, "properties": {"format": text_format}},
        "metadata": {"type": "object", "nullable": True, "maxProperties": MAX_METADATA_PAIRS,
                     "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE}},
        "truncation": {"type": "string", "enum": list(TRUNCATION), "nullable": True,
                       "description": "either runs untruncated: a conversation past the context is a 400"},
        "include": {"type": "array", "nullable": True, "items": {"type": "string", "enum": list(INCLUDABLE)},
                    "description": "message.output_text.logprobs: the message text's logprobs; the others name "
                                   "outputs and fields this server never produces: accepted, nothing to add"},
        "top_logprobs": {**chat["top_logprobs"], "description": "alternatives at each token of the logprobs that "
                                                                "include asks for (0 by default); > 0 needs it"},
        "background": {"type": "boolean", "enum": [False], "nullable": True,
                       "description": "background mode is not offered"},
        "cache_control": chat["cache_control"],
        **{name: chat[name] for name in VLLM_EXTRAS if name in chat},  # (vLLM's; as chat checks them)
    }}


def responses_schemas(model_name: str, usage: dict[str, Any]) -> dict[str, Any]:
    """`usage`: the chat Usage schema, whose prompt_tokens_details input_tokens_details repeats."""
    return {
        "Response": _response(model_name, usage),
        "ResponseInputTokens": closed({"object": const("response.input_tokens"), "input_tokens": _COUNT}),
        "ResponseDeleted": closed({"id": _TEXT, "object": const("response.deleted"),
                                   "deleted": {"type": "boolean", "enum": [True]}}),
        "ResponseInputItems": closed({
            "object": const("list"),
            "data": {"type": "array", "items": {"type": "object", "required": ["id", "type"],
                                                "description": "the request's own input items, as sent"}},
            "has_more": {"type": "boolean", "enum": [False]}, "first_id": nullable(_TEXT),
            "last_id": nullable(_TEXT)}),
    }


def _reasoning_part(part_type: str) -> dict[str, Any]:
    return {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"type": "string", "enum": [part_type]}, "text": _TEXT}}


def _response(model_name: str, usage: dict[str, Any]) -> dict[str, Any]:
    message = closed({"type": const("message"), "id": {"type": "string", "pattern": "^msg_[0-9a-f]{32}$"},
                      "status": _STATUS, "role": const("assistant"),
                      "content": {"type": "array", "items": closed({
                          "type": const("output_text"), "text": _TEXT,
                          "annotations": {"type": "array", "maxItems": 0},
                          "logprobs": {"type": "array", "items": token_logprob(),
                                       "description": "with include message.output_text.logprobs: the text's "
                                                      "tokens (after any thinking); else []"}})}})
    call = closed({"type": const("function_call"), "id": {"type": "string", "pattern": "^fc_[0-9a-f]{32}$"},
                   "call_id": _TEXT, "name": _TEXT, "arguments": {**_TEXT, "description": "JSON text"},
                   "status": _STATUS})
    reasoning = closed({"type": const("reasoning"), "id": {"type": "string", "pattern": "^rs_[0-9a-f]{32}$"},
                        "summary": {"type": "array", "maxItems": 0}, "status": _STATUS,
                        "content": {"type": "array", "items": closed({"type": const("reasoning_text"),
                                                                       "text": _TEXT})}})
    echo = {"description": "as the request sent it"}
    return closed({
        "id": {"type": "string", "pattern": "^resp_[0-9a-f]{32}$"}, "object": const("response"),
        "created_at": _COUNT, "model": {"type": "string", "enum": [model_name]},
        "status": {"type": "string", "enum": ["completed", "incomplete"]},
        "incomplete_details": nullable(closed({"reason": const("max_output_tokens")})),
        "error": nullable({"type": "object"}, "null: a failed response is an error object, not a response"),
        "instructions": nullable(_TEXT), "output": {"type": "array", "items": {"oneOf": [reasoning, message, call]}},
        "parallel_tool_calls": {"type": "boolean", "description": "as the request sent it; true where it sent none"},
        "tool_choice": {"description": "as the request sent it; auto where it sent none"},
        "tools": {"type": "array", "items": {"type": "object"}, **echo},
        "temperature": nullable({"type": "number"}), "top_p": nullable({"type": "number"}),
        "top_logprobs": {**_COUNT, "description": "as the request sent it; 0 where it sent none"},
        "max_output_tokens": nullable({"type": "integer", "minimum": 1}), "previous_response_id": nullable(_TEXT),
        "store": {"type": "boolean"}, "metadata": {"type": "object", **echo}, "user": nullable(_TEXT),
        "text": {"type": "object", **echo}, "truncation": const("disabled"),
        "completed_at": nullable({**_COUNT, "description": "null unless completed"}),
        "prompt_cache_key": nullable({**_TEXT, **echo}), "service_tier": const("default"),
        "usage": closed({
            "input_tokens": _COUNT, "input_tokens_details": usage["properties"]["prompt_tokens_details"],
            "output_tokens": _COUNT, "output_tokens_details": closed({"reasoning_tokens": _COUNT}),
            "total_tokens": _COUNT}),
    })


def responses_paths(request: dict[str, Any], operation) -> dict[str, Any]:
    """`operation(summary, ok, secured=, errors=)`: gateway/openapi.py's operation builder."""
    create = operation("Create a response", ref("Response"), secured=True,
                       errors=(400, 401, 404, 413, 429, 500, 503))
    create["requestBody"] = {"required": True, "content": {"application/json": {"schema": request}}}
    create["responses"]["200"]["content"]["text/event-stream"] = {"schema": {
        "type": "string", "description": "with stream: true, `event: <type>` + `data: {...}` pairs: "
        "response.created, response.in_progress, output item / content part / delta events, then "
        "response.completed or response.incomplete; a failure after the first event is an `error` event, "
        "then response.failed"}}

    def stored(summary: str, ok: dict[str, Any], errors: tuple[int, ...] = (404,)) -> dict[str, Any]:
        op = operation(summary, ok, secured=True, errors=errors)
        op["parameters"] = [{"name": "response_id", "in": "path", "required": True, "schema": _TEXT}]
        return op

    items = stored("The stored response's own input items, a page of them", ref("ResponseInputItems"),
                   errors=(400, 404))
    items["parameters"] += [
        {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"], "default": "desc"}},
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ITEMS_PAGE,
                                                    "default": DEFAULT_ITEMS_PAGE}},
        {"name": "after", "in": "query", "schema": {**_TEXT, "description": "an item id: the page starts past it"}}]
    counted = operation("The input tokens a response to this body would be prompted with (no engine)",
                        ref("ResponseInputTokens"), secured=True, errors=(400, 401, 404, 413))
    counted["requestBody"] = create["requestBody"]
    return {
        "/v1/responses": {"post": create},
        "/v1/responses/input_tokens": {"post": counted},
        "/v1/responses/{response_id}": {"get": stored("A stored response of the caller's", ref("Response")),
                                        "delete": stored("Delete a stored response (503: the database is "
                                                         "locked by another writer)", ref("ResponseDeleted"),
                                                         errors=(404, 503))},
        "/v1/responses/{response_id}/input_items": {"get": items},
        "/v1/responses/{response_id}/cancel": {"post": stored(
            "Cancel a background response (none runs here: 400 for the caller's own, else 404)", ref("Response"),
            errors=(400, 404))},
    }
