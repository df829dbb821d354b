"""Request bodies -> validated dataclasses. Unknown fields are ignored; a wrong one is a 400 naming it."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.messages import CacheBreakpoint
from engine.structured import StructuredOutput
from gateway.cache_control import ChatBreakpoint, chat_breakpoints, completion_breakpoints
from gateway.errors import invalid
from gateway.generation_defaults import SAMPLING_FIELDS
from gateway.render import normalize_messages, template_variables
from gateway.sampling_fields import completion_extras, sampling_fields
from gateway.settings import GatewaySettings
from gateway.tools import ToolRequest, parse_tools

MAX_SEED = 2**63 - 1


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    model: str | None  # None: left out, the served model (as vLLM and SGLang take it)
    max_tokens: int | None  # None: the route's default
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    n: int
    logprobs: int | None  # the engine's: None none, 0 the chosen token's, k also the top k
    stream: bool
    include_usage: bool
    continuous_usage: bool  # vLLM's stream_options.continuous_usage_stats: usage in every chunk
    user: str | None
    cache_salt: str | None
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: dict[int, float]
    stop_token_ids: tuple[int, ...]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    allowed_token_ids: tuple[int, ...] | None  # None: every token
    structured: StructuredOutput | None
    truncate_prompt_tokens: int | None  # vLLM's: keep the prompt's last k tokens (-1: as many as fit)
    return_token_ids: bool  # vLLM's: the prompt's and the answer's token ids beside the text
    return_tokens_as_token_ids: bool  # vLLM's: logprobs name each token `token_id:ID`
    prompt_logprobs: int | None  # vLLM's: each prompt token's logprob (k: and the top k), beside the answer
    max_tokens_param: str  # the field the request sent its max_tokens in (its 400s name it)


@dataclass(frozen=True, slots=True)
class ChatRequest(GenerationRequest):
    messages: list[dict[str, str]]
    tools: ToolRequest | None = None  # None: no tools
    breakpoints: tuple[ChatBreakpoint, ...] = ()  # cache_control (gateway/cache_control.py)
    add_generation_prompt: bool = True  # vLLM's: the prompt ends with the assistant's header
    continue_final_message: bool = False  # vLLM's: the prompt ends inside the final assistant message
    template_variables: dict[str, Any] = field(default_factory=dict)  # vLLM's chat_template_kwargs, documents
    add_special_tokens: bool = False  # vLLM's: the tokenizer's BOS before the rendered chat too
    echo: str = ""  # vLLM's echo: the last message's text (an assistant's) before the answer's


@dataclass(frozen=True, slots=True)
class CompletionRequest(GenerationRequest):
    prompts: list[str | list[int]]
    best_of: int  # choices generated per prompt; the n with the highest cumulative logprob are returned
    echo: bool  # the prompt's text comes before each choice's
    breakpoints: tuple[CacheBreakpoint, ...] = ()  # cache_control, by prompt tokens
    add_special_tokens: bool = True  # the tokenizer's BOS before each text prompt (vLLM's, transformers' default)


def parse_chat(body: Any, limits: GatewaySettings, defaults: Mapping[str, Any] = SAMPLING_FIELDS) -> ChatRequest:
    fields = _Fields(body)
    want_logprobs = fields.boolean("logprobs", False)
    top = fields.integer("top_logprobs", None, 0, limits.max_top_logprobs)
    if top is not None and not want_logprobs:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    max_tokens = fields.integer("max_completion_tokens", None, 1)
    # the field its 400s name: the one the client sent (max_completion_tokens, OpenAI's newer name, wins)
    max_tokens_param = "max_tokens" if max_tokens is None else "max_completion_tokens"
    if max_tokens is None:
        max_tokens = fields.integer("max_tokens", None, 1)
    common = _common(fields, limits, max_tokens, (top or 0) if want_logprobs else None, defaults, max_tokens_param)
    messages = normalize_messages(fields.body.get("messages"), limits.max_messages)
    # vLLM's echo: an answer that continues the last message, an assistant's, starts with that message's text
    echo = messages[-1]["content"] if fields.boolean("echo", False) and messages[-1]["role"] == "assistant" else ""
    add_generation_prompt, continue_final_message = prompt_ending(fields)
    breakpoints = tuple(chat_breakpoints(fields.body))
    check_truncation(common["truncate_prompt_tokens"], breakpoints)
    tools = parse_tools(fields.body)
    if tools is not None and tools.forced and common["allowed_token_ids"] is not None:
        raise invalid("allowed_token_ids cannot be combined with a forced tool call (its grammar picks the tokens)",
                      "allowed_token_ids")
    return ChatRequest(**common, messages=messages, tools=tools,
                       breakpoints=breakpoints, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, template_variables=template_variables(fields.body),
                       add_special_tokens=fields.boolean("add_special_tokens", False), echo=echo)


def prompt_ending(fields: "_Fields") -> tuple[bool, bool]:
    """vLLM's `add_generation_prompt` (default true) and `continue_final_message` (default false): a chat's prompt
    ends with the assistant's header (a new answer), with the last message closed, or inside the final assistant
    message, which the answer then continues."""
    add_generation_prompt = fields.boolean("add_generation_prompt", True)
    continue_final_message = fields.boolean("continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise invalid("continue_final_message needs add_generation_prompt set to false (as vLLM asks)",
                      "continue_final_message")
    return add_generation_prompt, continue_final_message


def parse_completion(body: Any, limits: GatewaySettings,
                     defaults: Mapping[str, Any] = SAMPLING_FIELDS) -> CompletionRequest:
    fields = _Fields(body)
    logprobs = fields.integer("logprobs", None, 0, limits.max_top_logprobs)
    common = _common(fields, limits, fields.integer("max_tokens", None, 0), logprobs, defaults)
    extras = completion_extras(fields, common["n"], limits.max_n, common["stream"])
    if common["max_tokens"] == 0 and not extras["echo"]:  # OpenAI's legacy scoring: the prompt echoed, nothing new
        raise invalid("max_tokens must be >= 1 (0 only with echo: the prompt alone, with its logprobs)", "max_tokens")
    breakpoints = tuple(completion_breakpoints(fields.body))
    check_truncation(common["truncate_prompt_tokens"], breakpoints)
    return CompletionRequest(**common, prompts=parse_prompts(fields.body.get("prompt"), limits.max_prompts),
                             breakpoints=breakpoints, add_special_tokens=fields.boolean("add_special_tokens", True),
                             **extras)


def truncate_prompt_tokens(fields: "_Fields") -> int | None:
    """vLLM's truncate_prompt_tokens: -1 or k >= 1 (whether k fits is checked with the context length)."""
    keep = fields.integer("truncate_prompt_tokens", None, -1)
    if keep == 0:
        raise invalid("truncate_prompt_tokens must be -1 (as many as fit) or >= 1", "truncate_prompt_tokens")
    return keep


def check_truncation(keep: int | None, breakpoints: tuple[Any, ...]) -> None:
    if keep is not None and breakpoints:
        raise invalid("truncate_prompt_tokens cannot be combined with cache_control: the breakpoints would fall "
                      "elsewhere in the cut prompt", "truncate_prompt_tokens")


def _common(fields: "_Fields", limits: GatewaySettings, max_tokens: int | None, logprobs: int | None,
            defaults: Mapping[str, Any], max_tokens_param: str = "max_tokens") -> dict[str, Any]:
    """The fields chat and completions share; `defaults`: the sampling defaults in force (the model's)."""
    model = fields.string("model", None) or None
    if max_tokens is not None and limits.max_tokens_limit is not None and max_tokens > limits.max_tokens_limit:
        raise invalid(f"{max_tokens_param} must be <= {limits.max_tokens_limit}", max_tokens_param)
    stream_options = fields.body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    options = _Fields(stream_options or {}, "stream_options.")
    include_usage = options.boolean("include_usage", False)
    continuous_usage = options.boolean("continuous_usage_stats", False)
    if continuous_usage and not include_usage:
        raise invalid("stream_options.continuous_usage_stats needs include_usage", "stream_options")
    if stream_options is not None and fields.body.get("stream") is not True:  # as OpenAI answers
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    return dict(
        model=model,
        max_tokens=max_tokens,
        temperature=fields.number("temperature", defaults["temperature"], 0.0, 2.0),
        top_p=fields.number("top_p", defaults["top_p"], 0.0, 1.0, low_open=True),
        top_k=fields.integer("top_k", defaults["top_k"], -1),
        seed=_seed(fields),
        stop=_stop(fields.body.get("stop"), limits.max_stop_sequences),
        n=fields.integer("n", 1, 1, limits.max_n),
        logprobs=logprobs,
        stream=fields.boolean("stream", False),
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        user=fields.string("user", None),
        cache_salt=fields.string("cache_salt", None),
        ignore_eos=fields.boolean("ignore_eos", False),
        truncate_prompt_tokens=truncate_prompt_tokens(fields),
        return_token_ids=fields.boolean("return_token_ids", False),
        return_tokens_as_token_ids=fields.boolean("return_tokens_as_token_ids", False),
        prompt_logprobs=_prompt_logprobs(fields, limits),
        max_tokens_param=max_tokens_param,
        **sampling_fields(fields, defaults),
    )


def _prompt_logprobs(fields: "_Fields", limits: GatewaySettings) -> int | None:
    """vLLM's prompt_logprobs: k >= 0 (-1, the whole vocabulary, is not offered); not while streaming, as vLLM."""
    k = fields.integer("prompt_logprobs", None, 0, limits.max_top_logprobs)
    if k is not None and fields.body.get("stream") is True:
        raise invalid("prompt_logprobs is not available with stream (as in vLLM); /v1/completions streams a prompt's "
                      "logprobs with echo and logprobs", "prompt_logprobs")
    return k


def _seed(fields: "_Fields") -> int | None:
    """vLLM's range, int64, where -1 means no seed (UIs send it for "random"): each answer sampled afresh."""
    seed = fields.integer("seed", None, -MAX_SEED - 1, MAX_SEED)
    return None if seed == -1 else seed


def _stop(raw: Any, max_stop: int) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop must be a non-empty string or an array of non-empty strings", "stop")
    if len(stops) > max_stop:
        raise invalid(f"at most {max_stop} stop sequences are allowed", "stop")
    return tuple(stops)


def parse_prompts(raw: Any, max_prompts: int, param: str = "prompt") -> list[str | list[int]]:
    """A string, a list of strings, a token id list, or a list of token id lists (`param`: the field's name)."""
    if isinstance(raw, str):
        prompts: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(_is_token_id(t) for t in raw):
        prompts = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
        prompts = raw
    elif isinstance(raw, list) and raw and all(_is_token_list(p) for p in raw):
        prompts = raw
    else:
        raise invalid(f"{param} must be a string, an array of strings, an array of token ids, "
                      "or an array of token id arrays", param)
    if any(len(p) == 0 for p in prompts):
        raise invalid(f"{param} must not be empty", param)
    if len(prompts) > max_prompts:
        raise invalid(f"at most {max_prompts} {param}s are allowed per request", param)
    return prompts


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_token_id(t) for t in value)


class _Fields:
    """Typed reads of a JSON object; null counts as absent."""

    def __init__(self, body: Any, prefix: str = "") -> None:
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object", prefix.rstrip(".") or None)
        self.body = body
        self.prefix = prefix

    def integer(self, name: str, default: int | None, low: int | None = None,
                high: int | None = None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not _is_token_id(value):
            raise invalid(f"{name} must be an integer", self.prefix + name)
        self._range(name, value, low, high)
        return value

    def number(self, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or (isinstance(value, float) and not math.isfinite(value)):
            raise invalid(f"{name} must be a finite number", self.prefix + name)
        if value < low or value > high or (low_open and value == low):
            bracket = "(" if low_open else "["
            raise invalid(f"{name} must be in {bracket}{low}, {high}]", self.prefix + name)
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        return self._typed(name, default, bool, "a boolean")

    def string(self, name: str, default: str | None) -> str | None:
        return self._typed(name, default, str, "a string")

    def _typed(self, name: str, default: Any, kind: type, what: str) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, kind):
            raise invalid(f"{name} must be {what}", self.prefix + name)
        return value

    def _range(self, name: str, value: int, low: int | None, high: int | None) -> None:
        if low is not None and value < low:
            raise invalid(f"{name} must be >= {low}", self.prefix + name)
        if high is not None and value > high:
            raise invalid(f"{name} must be <= {high}", self.prefix + name)
