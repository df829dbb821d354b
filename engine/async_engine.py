"""The engine behind asyncio: the step loop runs on its own thread; deltas come back through queues."""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling import SamplingParams
from engine.stats import SchedulerStats, StepStats

logger = logging.getLogger("prefixgate.engine")


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.config = core.config
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.model_name = _served_name(core)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", Request) | ("abort", id), from any thread
        self._wake = threading.Event()
        self._queues: dict[str, _Stream] = {}  # engine request id -> its caller's stream
        self._engine_ids: dict[str, str] = {}  # caller's request id -> engine request id, while it runs
        self._next_id = itertools.count()
        self._listeners: list[Callable[[StepStats], None]] = []
        self._stats = core.scheduler_stats()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._failed: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(EngineCore(config))

    # ---- lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="prefixgate-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Let running requests finish for up to `timeout` seconds, abort the rest, stop the thread."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._queues and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for engine_id in list(self._queues):
            self._send(("abort", engine_id))
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        if self._thread is None or not self._thread.is_alive():
            await asyncio.to_thread(self.core.close)  # the disk tier keeps the cache for the next start
        self._fail_waiting("the engine stopped")  # nobody may wait on a stopped engine

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._failed is None and not self._stopping

    # ---- requests

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       cache_salt: str | None = None, tenant: str | None = None) -> AsyncIterator[RequestOutput]:
        self.core.validate(prompt_token_ids, params)
        if request_id in self._engine_ids:
            raise ValueError(f"request id {request_id!r} is already running")
        if not self.is_alive():
            raise RuntimeError("the engine is not running")
        # NOTE: the engine knows each call by its own id: a caller's id reused right after an abort can
        # never receive the old request's outputs
        engine_id = f"{request_id}#{next(self._next_id)}"
        request = Request(engine_id, prompt_token_ids, params, cache_salt=cache_salt, tenant=tenant)
        if params.structured is not None:  # compiled here, off the engine thread: running requests never wait
            request.matcher = await asyncio.to_thread(self.core.grammars.matcher, params.structured)
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[engine_id] = _Stream(request_id, outputs)
        self._engine_ids[request_id] = engine_id
        self._send(("add", request))
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.finished
                yield output
        finally:
            self._queues.pop(engine_id, None)
            if self._engine_ids.get(request_id) == engine_id:
                del self._engine_ids[request_id]
            if not finished:  # the consumer went away (disconnect, cancel): release the blocks now
                self._send(("abort", engine_id))

    def abort(self, request_id: str) -> None:
        engine_id = self._engine_ids.get(request_id)
        if engine_id is not None:
            self._send(("abort", engine_id))

    def add_stats_listener(self, fn: Callable[[StepStats], None]) -> None:
        self._listeners.append(fn)

    def scheduler_stats(self) -> SchedulerStats:
        return self._stats

    def num_unfinished(self) -> int:
        return len(self._queues)

    def request_ids(self) -> list[str]:
        """The callers' ids of the requests running now."""
        return list(self._engine_ids)

    # ---- the engine thread

    def _send(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.core.has_unfinished():
                    self._publish(self.core.take_stats())  # aborts leave no step behind: report them now
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outputs, stats = self.core.step()
                self._publish(stats)  # before the outputs, so a client never sees its answer before /metrics does
                self._deliver(outputs)
            self._drain_inbox()  # aborts sent by shutdown() while the last step ran
        except BaseException as exc:  # the loop itself broke (not a step): /health turns red
            self._failed = exc
            logger.exception("engine loop died")
            self._fail_all(f"engine loop died: {exc!r}")
            raise

    def _publish(self, stats: StepStats) -> None:
        self._stats = stats.scheduler
        for listener in self._listeners:
            try:
                listener(stats)
            except Exception:  # a broken listener (metrics) must not take the engine down
                logger.exception("stats listener failed")

    def _fail_all(self, message: str) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_waiting, message)

    def _fail_waiting(self, message: str) -> None:
        for stream in list(self._queues.values()):
            stream.queue.put_nowait(_error_output(stream.request_id, message))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(payload)
            else:
                self._abort(payload)

    def _add(self, request: Request) -> None:
        try:
            self.core.add_request(request)
        except Exception as exc:  # a request the engine refuses fails alone
            if not isinstance(exc, ValueError):
                logger.exception("adding request %s failed", request.request_id)
            self._deliver([_error_output(request.request_id, str(exc), request.num_prompt_tokens)])

    def _abort(self, engine_id: str) -> None:
        try:
            output = self.core.abort(engine_id)
        except Exception as exc:
            logger.exception("aborting request %s failed", engine_id)
            output = _error_output(engine_id, f"abort failed: {exc!r}")
        if output is not None:
            self._deliver([output])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._queues.get(output.request_id)
            if stream is not None:
                output.request_id = stream.request_id  # the caller's id, not the engine's
                stream.queue.put_nowait(output)


@dataclass(slots=True)
class _Stream:
    request_id: str  # the caller's
    queue: asyncio.Queue


def _error_output(request_id: str, message: str, num_prompt_tokens: int = 0) -> RequestOutput:
    """The final output of a request that ends without running: rejected, or its engine stopped."""
    return RequestOutput(request_id, [], "", None, num_prompt_tokens, 0, 0, finished=True,
                         finish_reason="error", error=message)


def _served_name(core: EngineCore) -> str:
    if core.config.model in ("", "default"):
        from engine.model.default_model import DEFAULT_MODEL_NAME
        return DEFAULT_MODEL_NAME
    return core.model_path.name
