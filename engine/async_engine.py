"""The engine in process, behind asyncio: the step loop runs on its own thread; deltas come back through
queues. An EngineClient (engine/client.py) for offline use and tests; `serve` runs the engine in its own
process instead (engine/process_client.py)."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading

from engine.client import RelayedEngineClient
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.messages import CommandReply, Inbound, StepOutputs
from engine.model.gguf_loader import WEIGHTS_NAME
from engine.sampling_params import SamplingParams
from engine.step_loop import StepLoop

logger = logging.getLogger("prefixgate.engine")


class _ThreadInbox:
    """Messages from the event loop (or any thread) to the engine thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()

    def put(self, message: Inbound | None) -> None:
        """None only wakes the loop (to see that it should stop)."""
        if message is not None:
            self._queue.put(message)
        self._wake.set()

    def receive(self, timeout: float) -> list[Inbound]:
        if timeout and self._queue.empty():
            self._wake.wait(timeout)
        self._wake.clear()
        messages = []
        while not self._queue.empty():
            messages.append(self._queue.get_nowait())
        return messages


class AsyncEngine(RelayedEngineClient):
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.config = core.config
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.model_name = served_name(core)
        self.model_path = core.model_path
        budget = core.thread_budget
        self.threads = (budget.threads, budget.threads_batch) if budget is not None else None
        self._inbox = _ThreadInbox()
        super().__init__(self._inbox.put, core.scheduler_stats())
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
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        self._streams.abort_all()
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        if self._thread is None or not self._thread.is_alive():
            await asyncio.to_thread(self.core.close)  # the disk tier keeps the cache for the next start
        self._fail_all("the engine stopped")  # nobody may wait on a stopped engine

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._failed is None and not self._stopping

    def health_details(self) -> dict:
        return {}

    # ---- requests

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.core.validate(prompt_token_ids, params)

    # ---- the engine thread

    def _run(self) -> None:
        try:
            StepLoop(self.core, self._inbox, self._emit, self._reply).run(lambda: self._stopping)
        except BaseException as exc:  # the loop itself broke (not a step): /health turns red
            self._failed = exc
            logger.exception("engine loop died")
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail_all, f"engine loop died: {exc!r}")
            raise

    def _reply(self, reply: CommandReply) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_reply, reply)

    def _emit(self, step: StepOutputs) -> None:
        self._publish(step.stats)  # before the outputs, so a client never sees its answer before /metrics does
        if step.outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._streams.deliver, step.outputs)


def served_name(core: EngineCore) -> str:
    if core.config.model in ("", "default"):
        from engine.model.default_model import DEFAULT_MODEL_NAME
        return DEFAULT_MODEL_NAME
    weights = core.model_path / WEIGHTS_NAME
    if weights.is_symlink():  # a GGUF file's directory in the cache: the file's own name, not the cache's key
        return weights.resolve().stem
    return core.model_path.name
