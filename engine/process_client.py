"""The engine in its own process, supervised: the EngineClient that `serve` uses by default.

The API process (this side) spawns `python -m engine.engine_process`, sends it adds and aborts, and reads one
message per engine step. When the engine process dies (kill -9, out of memory), every request waiting on it ends at
once with EngineDeadError, is_alive() turns False, the published stats drop to an idle pool's (no request running or
waiting, no block used), and a new engine process starts, up to `max_restarts` within `restart_window_s`; past that
`on_fatal` is called (the gateway exits non-zero, so a supervisor above it takes over). A message from the engine
that cannot be read (a corrupt frame, a pickle that does not load, or none of engine/messages.py's outbound types)
counts as a death: the engine process is killed and the same happens. Messages cross in frames over two pipes
(engine/framing.py): the event loop reads the engine's as they arrive and writes ours without ever blocking. Each
engine incarnation gets fresh pipes, so no message meant for a dead engine reaches its successor. The death is seen
through a pidfd, the kernel's own exit notification: is_alive() polls it, so /health is 503 from the moment the
process is gone, before asyncio's child watcher (a thread's waitpid, then a callback on the loop) tells the
supervisor. Importing this module loads no torch.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import pickle
import select
import sys
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path

from engine import heap
from engine.client import RelayedEngineClient
from engine.config import EngineConfig
from engine.framing import Frames, FramingError, LoopPipes, encode, pipe
from engine.messages import CommandReply, EngineInfo, Inbound, StartFailed, StepOutputs
from engine.sampling_params import SamplingParams, validate_prompt
from engine.stats import SchedulerStats, StepStats
from engine.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("prefixgate.engine")


class EngineStartError(ValueError):
    """The engine process could not start with these settings (its one-line reason)."""


class _Incarnation:
    """One engine process and its two pipes."""

    def __init__(self, process: asyncio.subprocess.Process, pipes: LoopPipes) -> None:
        self.process = process
        self.pipes = pipes  # adds, aborts and cache commands in; step messages and command replies out
        self.dead = False  # its death was handled: requests failed, stats zeroed
        self._loop = asyncio.get_running_loop()
        self._pidfd = _pidfd(process.pid)
        self._exit_poll = select.poll()
        if self._pidfd is not None:
            self._exit_poll.register(self._pidfd, select.POLLIN)

    def exited(self) -> bool:
        """The kernel has ended the process (its pidfd is readable); False where there is no pidfd."""
        return bool(self._exit_poll.poll(0))

    def on_exit(self, callback: Callable[[], None]) -> None:
        """`callback` runs on this loop once, as soon as the process has ended."""
        if self._pidfd is None:
            return

        def fire() -> None:
            self._loop.remove_reader(self._pidfd)
            callback()

        self._loop.add_reader(self._pidfd, fire)

    def close(self) -> None:
        self.pipes.close()
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            self._exit_poll.unregister(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None


class ProcessClient(RelayedEngineClient):
    def __init__(self, config: EngineConfig, info: EngineInfo, tokenizer: Tokenizer, incarnation: _Incarnation, *,
                 max_restarts: int = 3, restart_window_s: float = 600.0,
                 on_fatal: Callable[[], None] | None = None) -> None:
        self.config = config
        self.info = info
        self.tokenizer = tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.on_fatal = on_fatal
        self.restarts: deque[float] = deque()  # monotonic times of restarts within the window
        self._engine = incarnation
        super().__init__(self._send, SchedulerStats(num_blocks=info.num_blocks))
        self._alive = False
        self._stopping = False
        self._tasks: list[asyncio.Task] = []

    @classmethod
    async def launch(cls, config: EngineConfig, **options) -> "ProcessClient":
        """Starts the engine process and waits until its model is loaded (EngineStartError if it cannot)."""
        incarnation, info = await _spawn(config)
        tokenizer = await asyncio.to_thread(_load_tokenizer, info)
        return cls(config, info, tokenizer, incarnation, **options)

    # ---- lifecycle

    def start(self) -> None:
        self._alive = True
        self._tasks = [asyncio.create_task(self._supervise())]
        self._listen(self._engine)

    async def shutdown(self, timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._streams and loop.time() < deadline and self._alive:
            await asyncio.sleep(0.05)
        self._streams.abort_all()
        self._stopping = True
        process = self._engine.process
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()  # the step loop ends, the disk tier flushes
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._alive = False
        self._fail_all("the engine stopped")
        self._engine.close()

    def is_alive(self) -> bool:
        return self._alive and not self._stopping and not self._engine.exited()

    @property
    def model_path(self) -> Path:
        return Path(self.info.model_path)

    @property
    def threads(self) -> tuple[int, int] | None:
        return (self.info.threads, self.info.threads_batch) if self.info.threads is not None else None

    def health_details(self) -> dict:
        return {"engine_pid": self.info.pid, "engine_restarts": len(self.restarts)}

    # ---- requests

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_token_ids, params, self.info.vocab_size, self.max_model_len,
                        frozenset(self.info.eos_token_ids))

    # ---- messages and supervision

    def _send(self, message: Inbound) -> None:
        if self._alive:
            self._engine.pipes.send(encode(message))  # a gone engine's are dropped: _supervise fails its requests

    def _listen(self, engine: _Incarnation) -> None:
        engine.pipes.listen(partial(self._on_frames, engine))
        engine.on_exit(partial(self._on_death, engine, "the engine process died"))

    def _on_frames(self, engine: _Incarnation, frames: Frames) -> None:
        """Hands on the engine's messages; one it cannot read ends the engine, whose supervisor restarts it."""
        try:
            for payload in frames:
                if engine.dead:  # sent before it died, read after: its requests have failed, its stats are stale
                    engine.pipes.pause()
                    return
                self._on_message(pickle.loads(payload))
        except Exception:
            logger.exception("engine process %d sent a message that cannot be read; killing it", engine.process.pid)
            engine.pipes.pause()
            self._on_death(engine, "the engine process sent a message that cannot be read")
            with contextlib.suppress(ProcessLookupError):
                engine.process.kill()  # _supervise sees it exit, and restarts it

    def _on_message(self, message: object) -> None:
        match message:
            case StepOutputs(outputs, stats):
                self._publish(stats)  # before the outputs: a client never sees its answer before /metrics
                self._streams.deliver(outputs)
            case CommandReply():
                self._on_reply(message)
            case _:
                raise TypeError(f"not a message the engine sends after it started: {type(message).__name__}")

    def _on_death(self, engine: _Incarnation, reason: str) -> None:
        """is_alive() turns False, the stats drop to an idle pool's, then every request and command waiting
        on the engine fails: in one go, so no caller learns of the death before /health and /metrics do."""
        if engine.dead or self._stopping:
            return
        engine.dead = True
        self._alive = False
        logger.error("engine process %d is gone (%s); failing its %d requests", engine.process.pid, reason,
                     len(self._streams))
        self._publish(idle_stats(self.info.num_blocks))
        self._fail_all(reason)

    async def _supervise(self) -> None:
        while True:
            code = await self._engine.process.wait()
            if self._stopping:
                return
            logger.error("engine process %d exited with code %s", self.info.pid, code)
            self._on_death(self._engine, f"the engine process died (exit code {code})")  # without a pidfd
            self._engine.close()
            if not self._may_restart():
                logger.error("engine process died %d times within %.0fs; giving up", len(self.restarts) + 1,
                             self.restart_window_s)
                if self.on_fatal is not None:
                    self.on_fatal()
                return
            await self._restart()

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > self.restart_window_s:
            self.restarts.popleft()
        return len(self.restarts) < self.max_restarts

    async def _restart(self) -> None:
        self.restarts.append(time.monotonic())
        logger.warning("starting a new engine process (restart %d of at most %d within %.0fs)",
                       len(self.restarts), self.max_restarts, self.restart_window_s)
        while True:
            try:
                self._engine, self.info = await _spawn(self.config)
                break
            except EngineStartError as exc:  # it started before with the same settings: try again
                logger.error("engine restart failed: %s", exc)
                if not self._may_restart():
                    if self.on_fatal is not None:
                        self.on_fatal()
                    return
                self.restarts.append(time.monotonic())
        self._listen(self._engine)
        self._alive = True
        logger.info("engine process %d is serving again", self.info.pid)


def idle_stats(num_blocks: int) -> StepStats:
    """What an engine that runs nothing reports: no request running or waiting, every block free."""
    return StepStats(SchedulerStats(num_blocks=num_blocks, num_free_blocks=num_blocks))


def _load_tokenizer(info: EngineInfo) -> Tokenizer:
    tokenizer = load_tokenizer(Path(info.model_path), set(info.eos_token_ids))
    # parsing tokenizer.json leaves its freed temporaries in the C heap: 35 MiB of the API process's idle
    # memory on a 49k-token vocabulary (docs/speed.md#idle-memory)
    heap.trim()
    return tokenizer


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux 5.3+: the supervisor's wait() alone sees the exit
        return None


async def _spawn(config: EngineConfig) -> tuple[_Incarnation, EngineInfo]:
    """A new engine process on fresh pipes; returns once it is ready (EngineStartError if it fails)."""
    engine_reads, to_engine = pipe()
    from_engine, engine_writes = pipe()
    env = {**os.environ, "PREFIXGATE_LOG_LEVEL": logging.getLevelName(logging.getLogger().getEffectiveLevel())}
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "engine.engine_process", str(engine_reads), str(engine_writes),
            base64.b64encode(pickle.dumps(config)).decode(), env=env, pass_fds=(engine_reads, engine_writes))
    except BaseException:
        for fd in (to_engine, from_engine):
            os.close(fd)
        raise
    finally:
        os.close(engine_reads)  # the engine's ends: with them closed here, its exit reads as end of file
        os.close(engine_writes)
    incarnation = _Incarnation(process, LoopPipes(to_engine, from_engine))
    logger.info("engine process %d: loading model %s", process.pid, config.model)
    first = asyncio.get_running_loop().create_future()

    def take_first(frames: Frames) -> None:
        try:
            payload = next(frames, None)
        except FramingError as exc:
            payload = exc
        if payload is not None:
            incarnation.pipes.pause()  # the frames after it wait for ProcessClient.start()
            first.set_result(payload)

    incarnation.pipes.listen(take_first)
    exited = asyncio.ensure_future(process.wait())
    await asyncio.wait({first, exited}, return_when=asyncio.FIRST_COMPLETED)
    if not first.done():
        first.cancel()
        incarnation.close()
        raise EngineStartError(f"the engine process exited (code {process.returncode}) before it was ready")
    exited.cancel()
    info = _ready(first.result())
    if isinstance(info, str):
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        incarnation.close()
        raise EngineStartError(info)
    logger.info("engine process %d ready: %s, context %d tokens, %d KV blocks, threads %s (decode) / %s (prefill)",
                info.pid, info.model_name, info.max_model_len, info.num_blocks, info.threads, info.threads_batch)
    return incarnation, info


def _ready(data: bytes | FramingError) -> EngineInfo | str:
    """The engine process's first message: its EngineInfo, or why it did not start."""
    try:
        if isinstance(data, FramingError):
            raise data
        message = pickle.loads(data)
    except Exception as exc:
        return f"the engine process's first message cannot be read ({exc!r})"
    match message:
        case EngineInfo():
            return message
        case StartFailed(reason):
            return reason
        case _:
            return f"the engine process's first message is a {type(message).__name__}, not its EngineInfo"
