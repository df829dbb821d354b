"""Drives the engine for one HTTP request: every choice of every prompt, merged into one stream.

With n > 1 all choices go to the engine at once, first choice first; the engine's scheduler
holds back a request whose next prompt block a running prefill is computing, so the other
n - 1 choices hit the first one's blocks instead of prefilling the same tokens again.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.client import EngineClient, EngineDeadError
from engine.messages import CacheDirectives
from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import SampledToken, SamplingParams
from gateway.errors import APIError, engine_down

LIVENESS_CHECK_S = 1.0  # how often a request waiting on the engine checks that the engine loop still runs


@dataclass(slots=True)
class Choice:
    """One engine request: choice `index` of the response, for prompt `prompt_index`."""

    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache: CacheDirectives | None = None  # breakpoints to pin (cache_control)
    stream: bool = True  # False: the response goes out once the request finished (see EngineClient.generate)
    # filled in as outputs arrive
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_disk_cached_tokens: int = 0
    num_cache_write_tokens: int = 0
    num_output_tokens: int = 0
    num_pinned_tokens: int = 0
    pinned_until: float | None = None
    pin_refused: str | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id it ended at (vLLM's)
    embedding: list[float] | None = None  # a pooling request's vector, when it finished
    prompt_logprobs: list[SampledToken] | None = None  # SamplingParams.prompt_logprobs: one per prompt token
    num_reasoning_tokens: int = 0  # output tokens of its thinking (a reasoning model's; gateway/formats.py counts)

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs or ())
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached_tokens = out.num_cached_tokens
        self.num_disk_cached_tokens = out.num_disk_cached_tokens
        self.num_cache_write_tokens = out.num_cache_write_tokens
        self.num_output_tokens = out.num_output_tokens
        self.num_pinned_tokens = out.num_pinned_tokens
        self.pinned_until = out.pinned_until
        self.pin_refused = out.pin_refused
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.embedding = out.embedding


def check_output(out: RequestOutput) -> None:
    """An engine failure or an abort ends the HTTP request with an error object."""
    if out.finish_reason == FinishReason.ERROR and out.error_is_request:  # its grammar gave up: the request's own
        reason = out.error or "the output constraint failed"  # (the grammar engine's own, at most a paragraph of it)
        raise APIError(400, reason if len(reason) <= 400 else reason[:400] + "...", code="output_constraint_failed")
    if out.finish_reason == FinishReason.ERROR:
        raise APIError(500, f"the engine failed while generating: {out.error or 'unknown error'}",
                       code="engine_error")
    if out.finish_reason == FinishReason.ABORT:
        raise APIError(503, "the request was aborted (the server is shutting down, or an operator aborted it)",
                       code="aborted")


def best_choices(choices: list[Choice], n: int, keep_logprobs: bool) -> list[Choice]:
    """Per prompt, the n choices with the highest cumulative logprob (best_of), renumbered prompt by prompt."""
    by_prompt: dict[int, list[Choice]] = {}
    for choice in choices:
        by_prompt.setdefault(choice.prompt_index, []).append(choice)
    best = []
    for prompt_index in sorted(by_prompt):
        ranked = sorted(by_prompt[prompt_index], key=lambda c: -sum(t.logprob for t in c.logprobs))
        best += ranked[:n]
    for index, choice in enumerate(best):
        choice.index = index
        if not keep_logprobs:  # asked for internally to rank the choices
            choice.logprobs = []
    return best


def usage(choices: list[Choice]) -> dict[str, Any]:
    """Each prompt counted once; cached tokens are those of the prompt's first choice (what a
    single request would see; the other choices also hit the blocks the first one computed)."""
    leaders = {}
    for choice in choices:
        leaders.setdefault(choice.prompt_index, choice)
    prompt_tokens = sum(len(c.prompt_ids) for c in leaders.values())
    completion_tokens = sum(c.num_output_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": prompt_tokens_details(leaders.values()),
        "completion_tokens_details": {"reasoning_tokens": sum(c.num_reasoning_tokens for c in choices),
                                      "audio_tokens": 0,  # as OpenAI sends them
                                      "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    }


def prompt_tokens_details(leaders) -> dict[str, Any]:
    """OpenAI's cached_tokens, and where they came from and went: disk_cached_tokens (the part of
    cached_tokens read back from the disk tier), cache_write_tokens (prompt tokens computed and written to
    the cache by this request), pinned_tokens and pinned_until (the prompt's pinned prefix this request made
    or renewed, and when it expires, in Unix seconds; the earliest where several prompts have one), and
    pin_refused only where a breakpoint was not pinned (the quota it would have exceeded)."""
    leaders = list(leaders)
    expiries = [c.pinned_until for c in leaders if c.pinned_until is not None]
    details: dict[str, Any] = {
        "cached_tokens": sum(c.num_cached_tokens for c in leaders),
        "disk_cached_tokens": sum(c.num_disk_cached_tokens for c in leaders),
        "cache_write_tokens": sum(c.num_cache_write_tokens for c in leaders),
        "pinned_tokens": sum(c.num_pinned_tokens for c in leaders),
        "pinned_until": int(min(expiries)) if expiries else None}
    refused = next((c.pin_refused for c in leaders if c.pin_refused), None)
    if refused is not None:
        details["pin_refused"] = refused
    return details


class Shutdown:
    """The end of a drain: every request still waiting on the engine then ends with a 503
    `server_shutting_down` (a stream: its terminal error event), never cut off without a word."""

    def __init__(self, retry_after_s: int) -> None:
        self.retry_after_s = retry_after_s
        self._queues: set[asyncio.Queue] = set()  # those of the requests now running
        self.cut = False

    def watch(self, queue: asyncio.Queue) -> None:
        self._queues.add(queue)
        if self.cut:
            queue.put_nowait(self._error())

    def unwatch(self, queue: asyncio.Queue) -> None:
        self._queues.discard(queue)

    def cut_off(self) -> None:
        self.cut = True
        for queue in self._queues:
            queue.put_nowait(self._error())  # after the outputs already queued; later ones are not waited for

    def _error(self) -> APIError:
        return APIError(503, "the server is shutting down; this request did not finish, send it again",
                        code="server_shutting_down", headers={"Retry-After": str(self.retry_after_s)})


async def run_choices(engine: EngineClient, choices: list[Choice], *, cache_salt: str, tenant: str,
                      shutdown: Shutdown | None = None) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Yields (choice, delta) as the engine produces them. Closing this generator (a client
    disconnect cancels the handler) cancels every engine request, which releases its blocks."""
    queue: asyncio.Queue[tuple[Choice, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def run_one(choice: Choice) -> None:
        gen = engine.generate(choice.request_id, choice.prompt_ids, choice.params,
                              cache_salt=cache_salt, tenant=tenant, cache=choice.cache, stream=choice.stream)
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    queue.put_nowait((choice, out))
        except EngineDeadError as exc:
            raise engine_down(f"the engine stopped while generating: {exc}", "engine_dead") from None

    async def run_all() -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                for choice in choices:  # in index order: the first choice of a prompt arrives first
                    tasks.create_task(run_one(choice))
        except BaseExceptionGroup as group_error:
            queue.put_nowait(_first_leaf(group_error))
        finally:
            queue.put_nowait(None)

    runner = asyncio.create_task(run_all())
    if shutdown is not None:
        shutdown.watch(queue)
    try:
        while (item := await _next(queue, engine)) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        if shutdown is not None:
            shutdown.unwatch(queue)
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner


async def _next(queue: asyncio.Queue, engine: EngineClient) -> Any:
    """The next queued item; a 503 if the engine loop died meanwhile (its requests would never finish)."""
    while True:
        try:
            async with asyncio.timeout(LIVENESS_CHECK_S):
                return await queue.get()
        except TimeoutError:
            if not engine.is_alive():
                raise engine_down("the engine stopped while generating", "engine_dead") from None


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
