"""One HTTP request through the engine, the same way for every endpoint (chat, completions, Responses,
embeddings, cache warm): the engine's liveness checked once, every choice run, the outputs closed when the
handler ends (a disconnect aborts the engine requests), and the engine's own ValueErrors turned into a 400
naming the request field they are about. Cache commands (list pins, erase) go through `run_command`.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from engine.client import EngineClient, EngineDeadError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from gateway.auth import Tenant
from gateway.errors import APIError, engine_down, invalid
from gateway.generate import Choice, check_output, run_choices
from gateway.protocol import ChatRequest, GenerationRequest
from gateway.state import GatewayState
from gateway.tool_parsers import make_parser

R = TypeVar("R")
Outputs = AsyncIterator[tuple[Choice, RequestOutput]]


def check_engine(engine: EngineClient) -> None:
    """A request is refused before it reaches an engine whose loop is not running."""
    if not engine.is_alive():
        raise engine_down("the engine is not running", "engine_unavailable")


@dataclass(slots=True)
class RequestRun:
    """The engine requests of one HTTP request. `param`: the request field an engine ValueError is about."""

    state: GatewayState
    tenant: Tenant
    cache_salt: str | None  # the body's own; the tenant's salt is always applied under it
    choices: list[Choice]
    param: str

    async def to_end(self) -> None:
        """Runs every choice to its end, each output added to its choice."""
        async with self._outputs() as outputs:
            async for choice, out in outputs:
                check_output(out)
                choice.add(out)

    async def streamed(self, write: Callable[[Outputs], Awaitable[R]]) -> R:
        """`write` consumes the outputs as they come (an SSE stream) and returns the response."""
        async with self._outputs() as outputs:
            return await write(outputs)

    @contextlib.asynccontextmanager
    async def _outputs(self) -> AsyncIterator[Outputs]:
        check_engine(self.state.engine)
        outputs = run_choices(self.state.engine, self.choices, cache_salt=self.tenant.cache_salt(self.cache_salt),
                              tenant=self.tenant.name, shutdown=self.state.shutdown)
        async with contextlib.aclosing(outputs):
            try:
                yield outputs
            except ValueError as exc:  # the engine's own checks, before any output
                raise invalid(str(exc), getattr(exc, "param", self.param)) from None


async def run_command(engine: EngineClient, command: Coroutine[Any, Any, R]) -> R:
    """A cache command (list pins, erase): 503 if the engine is not running or stops meanwhile."""
    try:
        check_engine(engine)
    except APIError:
        command.close()  # never awaited
        raise
    try:
        return await command
    except (EngineDeadError, RuntimeError) as exc:
        raise engine_down(f"the engine stopped: {exc}", "engine_dead") from None


def with_calls_beside_format(req: ChatRequest, parser: str) -> ChatRequest:
    """A chat request whose tools may be called (tool_choice auto) beside a JSON response_format: its output
    constraint lets the answer be calls or text in the format (ToolRequest.calls_or_format)."""
    if req.tools is None or req.tools.forced or not req.tools.parses_calls or req.structured is None:
        return req
    union = req.tools.calls_or_format(req.structured, make_parser(parser))
    return req if union is None else replace(req, structured=union)


def sampling_params(req: GenerationRequest, max_tokens: int, choice: int,
                    rank_by_logprob: bool = False) -> SamplingParams:
    """The engine's parameters for choice `choice` of a chat or completion request (seeds differ by choice).
    max_tokens 0 (completions' echo): the prompt computed and scored, nothing generated."""
    logprobs = 0 if rank_by_logprob and req.logprobs is None else req.logprobs
    prompt_logprobs = req.prompt_logprobs
    if getattr(req, "echo", False) and req.logprobs is not None:  # the echoed prompt's tokens come with logprobs
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    structured = req.structured
    if (tools := getattr(req, "tools", None)) is not None and tools.forced:  # the grammar forces a valid call
        structured = tools.structured_output()  # response_format set aside; protocol refuses vLLM's beside it
    return SamplingParams(max_tokens=max(max_tokens, 1), pooling="none" if max_tokens == 0 else None,
                          prompt_logprobs=prompt_logprobs, temperature=req.temperature, top_p=req.top_p,
                          top_k=req.top_k, seed=None if req.seed is None else req.seed + choice,
                          stop=list(req.stop), stop_token_ids=list(req.stop_token_ids),
                          include_stop_str_in_output=req.include_stop_str_in_output,
                          skip_special_tokens=req.skip_special_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty, min_p=req.min_p, min_tokens=req.min_tokens,
                          logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids, structured=structured)
