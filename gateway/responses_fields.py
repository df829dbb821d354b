"""The Responses API's fields that shape no chat request: checked (a field this server cannot honour is a 400, never
a silent 200), and the paging of a stored response's input items; and vLLM's sampling extras, which it passes on."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import invalid

# OpenAI's limits on metadata: 16 pairs, keys of up to 64 characters, string values of up to 512
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
TRUNCATION = ("auto", "disabled")
# what `include` may ask for: the message text's logprobs (honoured), and outputs of hosted tools and images, which
# this server never produces, and reasoning's encrypted_content, which its reasoning items never carry (so there is
# nothing to add)
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (LOGPROBS, "code_interpreter_call.outputs", "computer_call_output.output.image_url",
              "file_search_call.results", "message.input_image.image_url", "reasoning.encrypted_content",
              "web_search_call.action.sources", "web_search_call.results")
# the sampling fields vLLM's /v1/responses takes beside OpenAI's, passed on as chat completions take them (the same
# checks and 400s; priority: a non-zero one is refused there)
VLLM_EXTRAS = ("top_k", "repetition_penalty", "seed", "stop", "ignore_eos", "skip_special_tokens",
               "include_stop_str_in_output", "logit_bias", "structured_outputs", "priority")
MAX_ITEMS_PAGE = 100  # input_items' limit: 1 to 100, 20 by default (OpenAI's)
DEFAULT_ITEMS_PAGE = 20


def check_fields(body: dict[str, Any]) -> None:
    """400 naming the first field of `body` that asks for what this server does not do, or is malformed."""
    if body.get("conversation") is not None:
        raise invalid("conversation objects are not offered by this server (no Conversations API); continue a "
                      "conversation with previous_response_id, or send its items as input", "conversation")
    if body.get("prompt") is not None:
        raise invalid("stored prompt templates are not offered by this server; send instructions and input",
                      "prompt")
    if body.get("truncation") is not None and body["truncation"] not in TRUNCATION:
        raise invalid(f"truncation must be one of {', '.join(TRUNCATION)}", "truncation")
    _check_include(body.get("include"))
    _check_metadata(body.get("metadata"))
    if body.get("prompt_cache_key") is not None and not isinstance(body["prompt_cache_key"], str):
        raise invalid("prompt_cache_key must be a string (echoed; this server's cache needs no key)",
                      "prompt_cache_key")


def _check_include(raw: Any) -> None:
    if raw is None:
        return
    if not isinstance(raw, list):
        raise invalid("include must be an array of strings", "include")
    for i, value in enumerate(raw):
        if value not in INCLUDABLE:
            raise invalid(f"include values this server accepts: {', '.join(INCLUDABLE)} (all but the first with "
                          f"nothing to add: it produces none of those outputs or fields); got {value!r}",
                          f"include[{i}]")


def logprobs_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The chat fields for the Responses way of asking for logprobs: `include` message.output_text.logprobs, with
    top_logprobs alternatives at each token (0 by default, as OpenAI and vLLM). top_logprobs without that include
    would return nothing (OpenAI drops it in silence): a 400."""
    top = body.get("top_logprobs")
    if LOGPROBS in (body.get("include") or ()):
        return {"logprobs": True, "top_logprobs": 0 if top is None else top}  # (chat checks top_logprobs)
    if isinstance(top, float) and top.is_integer():  # (2.0 as 2, as chat's integer fields take it)
        top = int(top)
    if top is None or type(top) is int and top == 0:
        return {}
    if type(top) is not int:
        raise invalid("top_logprobs must be an integer", "top_logprobs")
    raise invalid(f"top_logprobs needs include [{LOGPROBS!r}] (the logprobs come with the message's text)",
                  "top_logprobs")


def _check_metadata(raw: Any) -> None:
    if raw is None:
        return
    if not isinstance(raw, dict):
        raise invalid("metadata must be an object", "metadata")
    if len(raw) > MAX_METADATA_PAIRS:
        raise invalid(f"metadata holds at most {MAX_METADATA_PAIRS} key-value pairs", "metadata")
    for key, value in raw.items():
        if len(key) > MAX_METADATA_KEY:
            raise invalid(f"metadata keys are at most {MAX_METADATA_KEY} characters", "metadata")
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise invalid(f"metadata values are strings of at most {MAX_METADATA_VALUE} characters",
                          f"metadata.{key}")


def items_page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """The list object of GET /v1/responses/{id}/input_items: `order` (desc, the default, or asc), `after` (an
    item id: the page starts past it) and `limit` (1 to 100, default 20)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order must be asc or desc", "order")
    limit = query.get("limit", str(DEFAULT_ITEMS_PAGE))
    if not (limit.isascii() and limit.isdigit()) or not 1 <= int(limit) <= MAX_ITEMS_PAGE:  # ("²" is a digit)
        raise invalid(f"limit must be an integer from 1 to {MAX_ITEMS_PAGE}", "limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if (after := query.get("after")) is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise invalid(f"after names no input item of this response: {after!r}", "after")
        start = ids.index(after) + 1
    page = ordered[start:start + int(limit)]
    return {"object": "list", "data": page, "has_more": start + len(page) < len(ordered),
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}
