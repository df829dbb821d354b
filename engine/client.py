"""The one seam between the API server and an engine: what the gateway knows of it, wherever it runs.

Implementations:
- `engine.async_engine.AsyncEngine`: in process, the step loop on a thread (offline use, tests, `--no-engine-process`);
- `engine.process_client.ProcessClient`: the engine in its own process, supervised (the default of `serve`);
- `cluster.client.ClusterEngine`: Ray Serve replicas behind the prefix-affinity router.

This module is plain typing: importing it loads no model code (the API process never imports torch).
"""
from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from engine.config import EngineConfig
from engine.messages import (AbortRequest, AddRequest, CacheCommand, CacheDirectives, CacheErased, CommandReply,
                             EngineError, PinList)
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import SchedulerStats, StepStats
from engine.tokenizer import Tokenizer


logger = logging.getLogger("prefixgate.engine")


class EngineDeadError(RuntimeError):
    """The engine stopped (its process died, or its loop broke) while this request waited on it."""


class EngineCommandError(Exception):
    """A cache command failed in the engine: its error's type and message, raised on this side."""

    def __init__(self, error: EngineError) -> None:
        super().__init__(f"{error.type}: {error.message}")
        self.error = error


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig  # max_num_seqs sizes the gateway's admission
    tokenizer: Tokenizer  # the API process renders, tokenizes and detokenizes with it
    model_name: str
    model_path: Path  # the model directory (its tokenizer and generation_config.json)
    max_model_len: int
    # CPU compute threads of decode-only steps and of steps with a prefill (engine/threads.py); None: not CPU
    threads: tuple[int, int] | None

    def start(self) -> None:
        """Begin serving on the running event loop."""

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Let running requests finish for up to `timeout` seconds, abort the rest, stop the engine."""

    def is_alive(self) -> bool:
        """False while the engine cannot take requests (dead, restarting, stopped)."""

    def health_details(self) -> dict:
        """Extra facts for /health (replicas up, restarts); {} when there are none."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 cache_salt: str | None = None, tenant: str | None = None,
                 cache: CacheDirectives | None = None, stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Deltas of one request until its finished output. ValueError for a request the engine refuses,
        RuntimeError when the engine is not running, EngineDeadError when it dies meanwhile. Closing the
        iterator early aborts the request and releases its blocks. `cache`: breakpoints to pin. `stream`:
        False when the caller uses the outputs only once the request finished (a non-streamed response),
        so that an engine of several replicas may restart it elsewhere if its replica dies."""

    async def list_pins(self, tenant: str) -> PinList:
        """The tenant's pinned prefixes and the distinct blocks they hold (GET /v1/cache)."""

    async def erase_cache(self, tenant: str) -> CacheErased:
        """Forgets every cached block of the tenant, pinned or not, in RAM and on disk (DELETE /v1/cache)."""

    def abort(self, request_id: str) -> None: ...

    def add_stats_listener(self, fn: Callable[[StepStats], None]) -> None:
        """`fn` gets every step's stats (on the event loop, or on the engine thread in process)."""

    def scheduler_stats(self) -> SchedulerStats: ...

    def num_unfinished(self) -> int: ...

    def request_ids(self) -> list[str]:
        """The callers' ids of the requests running now."""


class OutputStreams:
    """The callers' side of the requests in flight, for clients whose engine steps elsewhere (a thread, a
    process): an asyncio queue of outputs per engine request, the engine id of each caller's id, and `send`,
    which carries adds and aborts to the engine."""

    def __init__(self, send: Callable[[AddRequest | AbortRequest], None]) -> None:
        self._send = send
        self._queues: dict[str, tuple[str, asyncio.Queue]] = {}  # engine id -> (caller's id, its queue)
        self._engine_ids: dict[str, str] = {}  # caller's id -> engine id, while it runs
        self._next_id = itertools.count()

    async def run(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  cache_salt: str | None, tenant: str | None,
                  cache: CacheDirectives | None = None) -> AsyncIterator[RequestOutput]:
        """Sends the request to the engine and yields its outputs until its finished one; closed early, it
        aborts the request (its blocks are released at once)."""
        engine_id = self._open(request_id)
        self._send(AddRequest(engine_id, list(prompt_token_ids), params, cache_salt, tenant, time.monotonic(),
                              cache))
        async with contextlib.aclosing(self._follow(engine_id)) as outputs:
            async for output in outputs:
                yield output

    def abort(self, request_id: str) -> None:
        engine_id = self._engine_ids.get(request_id)
        if engine_id is not None:
            self._send(AbortRequest(engine_id))

    def abort_all(self) -> None:
        for engine_id in list(self._queues):
            self._send(AbortRequest(engine_id))

    def _open(self, request_id: str) -> str:
        """A new engine id for the caller's `request_id` (ValueError if that one is running)."""
        if request_id in self._engine_ids:
            raise ValueError(f"request id {request_id!r} is already running")
        # NOTE: the engine knows each call by its own id: a caller's id reused right after an abort can
        # never receive the old request's outputs
        engine_id = f"{request_id}#{next(self._next_id)}"
        self._queues[engine_id] = (request_id, asyncio.Queue())
        self._engine_ids[request_id] = engine_id
        return engine_id

    async def _follow(self, engine_id: str) -> AsyncIterator[RequestOutput]:
        request_id, queue = self._queues[engine_id]
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, EngineDeadError):
                    finished = True  # nothing left to abort: the engine that held it is gone
                    raise output
                finished = output.finished
                yield output
        finally:
            self._queues.pop(engine_id, None)
            if self._engine_ids.get(request_id) == engine_id:
                del self._engine_ids[request_id]
            if not finished:  # the consumer went away (disconnect, cancel): release the blocks now
                self._send(AbortRequest(engine_id))

    def request_ids(self) -> list[str]:
        return list(self._engine_ids)

    def __len__(self) -> int:
        return len(self._queues)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            entry = self._queues.get(output.request_id)
            if entry is not None:
                output.request_id = entry[0]  # the caller's id, not the engine's
                entry[1].put_nowait(output)

    def fail_all(self, message: str) -> None:
        for _, queue in self._queues.values():
            queue.put_nowait(EngineDeadError(message))


class StatsPublisher:
    """How every engine client hands out its engine's stats: each step's (or, from replicas, each report's)
    kept for scheduler_stats() and handed to the listeners."""

    def __init__(self, stats: SchedulerStats) -> None:
        self._listeners: list[Callable[[StepStats], None]] = []
        self._stats = stats

    def add_stats_listener(self, fn: Callable[[StepStats], None]) -> None:
        self._listeners.append(fn)

    def scheduler_stats(self) -> SchedulerStats:
        return self._stats

    def _publish(self, stats: StepStats) -> None:
        """A broken listener (metrics) stops neither the others nor the engine."""
        self._stats = stats.scheduler
        for listener in self._listeners:
            try:
                listener(stats)
            except Exception:
                logger.exception("stats listener failed")


class RelayedEngineClient(StatsPublisher, ABC):
    """What the in-process AsyncEngine and the ProcessClient share: requests relayed through OutputStreams to
    an engine that steps elsewhere (a thread, a process), and the stats of its steps as they arrive.
    Subclasses say how a request is checked (`_validate`) and whether the engine runs (`is_alive`)."""

    def __init__(self, send: Callable[[AddRequest | AbortRequest | CacheCommand], None],
                 stats: SchedulerStats) -> None:
        super().__init__(stats)
        self._send_message = send
        self._streams = OutputStreams(send)
        self._commands: dict[int, asyncio.Future] = {}  # cache commands waiting for the engine's reply
        self._command_ids = itertools.count()

    @abstractmethod
    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError for a request the engine would refuse, before it is sent."""

    @abstractmethod
    def is_alive(self) -> bool: ...

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       cache_salt: str | None = None, tenant: str | None = None,
                       cache: CacheDirectives | None = None, stream: bool = True) -> AsyncIterator[RequestOutput]:
        # one engine: a restart could not go anywhere else, so `stream` changes nothing here
        self._validate(prompt_token_ids, params)
        if not self.is_alive():
            raise RuntimeError("the engine is not running")
        # closed with this generator, so an early close aborts the request at once
        async with contextlib.aclosing(self._streams.run(request_id, prompt_token_ids, params, cache_salt,
                                                         tenant, cache)) as outputs:
            async for output in outputs:
                yield output

    async def list_pins(self, tenant: str) -> PinList:
        return await self._command("list", tenant)

    async def erase_cache(self, tenant: str) -> CacheErased:
        return await self._command("erase", tenant)

    async def _command(self, op: str, tenant: str):
        if not self.is_alive():
            raise RuntimeError("the engine is not running")
        command_id = next(self._command_ids)
        future = self._commands[command_id] = asyncio.get_running_loop().create_future()
        try:
            self._send_message(CacheCommand(command_id, op, tenant))
            return await future
        finally:
            self._commands.pop(command_id, None)

    def _on_reply(self, reply: CommandReply) -> None:
        future = self._commands.get(reply.command_id)
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(EngineCommandError(reply.error))
        else:
            future.set_result(reply.result)

    def _fail_all(self, message: str) -> None:
        """The engine is gone: every request and command waiting on it fails with EngineDeadError."""
        self._streams.fail_all(message)
        for future in self._commands.values():
            if not future.done():
                future.set_exception(EngineDeadError(message))

    def abort(self, request_id: str) -> None:
        self._streams.abort(request_id)

    def num_unfinished(self) -> int:
        return len(self._streams)

    def request_ids(self) -> list[str]:
        return self._streams.request_ids()
