"""What the handlers share: settings, engine, tenants, admission, metrics (one typed app key)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from engine.client import EngineClient
from gateway.admission import Admission
from gateway.auth import Authenticator
from gateway.errors import APIError, invalid
from gateway.generate import Shutdown
from gateway.generation_defaults import SAMPLING_FIELDS
from gateway.settings import Settings


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    engine: EngineClient
    auth: Authenticator
    admission: Admission
    metrics: Any  # metrics.prometheus.Metrics
    model_names: frozenset[str]  # those that select the model: --served-model-name's, else its name and --model
    shutdown: Shutdown  # the drain's end (app.py's InFlight)
    # what requests that leave sampling fields out get (gateway/generation_defaults.py)
    sampling_defaults: dict[str, Any] = field(default_factory=lambda: dict(SAMPLING_FIELDS))
    created: int = field(default_factory=lambda: int(time.time()))
    splits_thinking: bool = False  # chat answers' <think>...</think> go to `reasoning` (gateway/reasoning.py)

    @property
    def model_name(self) -> str:
        return api_model_name(self.settings, self.engine)

    def check_sent_model(self, fields: Any) -> None:
        """The body's `model` (protocol._Fields), where the route lets it leave one out (cache warm, tokenize)."""
        self.check_model(fields.string("model", None) or None)

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve; None (left out, as vLLM and SGLang allow) is the served one."""
        if model is not None and model not in self.model_names:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def prompt_limit(self, generates: bool = True) -> int:
        """The longest prompt served: max_prompt_tokens, and the context less the first token to generate."""
        context = self.engine.max_model_len
        return min(self.settings.gateway.max_prompt_tokens or context, context - generates)

    def truncated(self, prompt: list[int], keep: int | None, generates: bool = True) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens; -1: as many as the server takes (the
        context less one token to generate, or max_prompt_tokens); None: the whole prompt."""
        if keep is None:
            return prompt
        limit = self.prompt_limit(generates)
        if keep == -1:
            keep = limit
        elif keep > limit:
            raise invalid(f"truncate_prompt_tokens must be -1 or at most {limit} (the longest prompt served)",
                          "truncate_prompt_tokens")
        return prompt[-keep:]

    def check_prompt(self, num_prompt_tokens: int, prompt_param: str, generates: bool = True) -> None:
        """400 when the prompt is over max_prompt_tokens or the context (less the first token to generate,
        for a request that generates)."""
        context, limit = self.engine.max_model_len, self.prompt_limit(generates)
        if num_prompt_tokens > limit:
            left = ", one token left to generate" if generates else ""
            raise invalid(f"the prompt has {num_prompt_tokens} tokens; the limit is {limit} "
                          f"(context length {context}{left})", prompt_param, "context_length_exceeded")

    def check_lengths(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                      default_max_tokens: int | None = None, max_tokens_param: str = "max_tokens") -> int:
        """The request's max_tokens; a request without one gets the smallest of the route's default, the
        server's (sampling_defaults' max_tokens), max_tokens_limit and the rest of the context. 400 when the
        prompt, or the prompt and the request's own max_tokens, cannot fit."""
        context = self.engine.max_model_len
        self.check_prompt(num_prompt_tokens, prompt_param, generates=max_tokens != 0)  # (0: echo, nothing new)
        if max_tokens is None:  # a default is clamped to the context, never refused
            server_cap = self.sampling_defaults.get("max_tokens")
            caps = (default_max_tokens, server_cap, self.settings.gateway.max_tokens_limit)
            max_tokens = min([context - num_prompt_tokens, *(cap for cap in caps if cap is not None)])
        if num_prompt_tokens + max_tokens > context:
            raise invalid(f"this model's maximum context length is {context} tokens; the prompt has "
                          f"{num_prompt_tokens} tokens and {max_tokens_param} is {max_tokens}", max_tokens_param,
                          "context_length_exceeded")
        return max_tokens


STATE = web.AppKey("state", GatewayState)


def api_model_name(settings: Settings, engine: EngineClient) -> str:
    """The name answers and the metrics carry: the first --served-model-name, or the model's own."""
    return next(iter(settings.gateway.served_model_name), engine.model_name)
