"""The engine process: `python -m engine.engine_process IN_FD OUT_FD CONFIG`, started by ProcessClient.

Its main thread runs the step loop (scheduler, KV cache manager, model, sampler), so the compiled CPU
kernels always run on the thread that first ran them; the API process does HTTP. Messages are the
dataclasses of engine/messages.py, pickled in frames (engine/framing.py) over two pipes the API process made:
adds, aborts and cache commands in; EngineInfo (or StartFailed) once, then one StepOutputs per engine step and a
CommandReply per command out. The loop itself writes each message and reads the inbound pipe at step boundaries
(waiting on it while idle): no I/O thread.
"""
from __future__ import annotations

import base64
import contextlib
import ctypes
import logging
import os
import pickle
import select
import signal
import sys
import time

from engine.config import EngineConfig
from engine.framing import READ_BYTES, FrameDecoder, PipeWriter, encode
from engine.messages import EngineInfo, Inbound, Outbound, StartFailed

logger = logging.getLogger("prefixgate.engine")

MAX_PENDING_BYTES = 16 << 20  # outputs the API process has not read yet: past this the loop waits for it
CLOSE_WAIT_S = 2.0  # at exit, how long the last messages may take to reach the API process


class _PipeSeam:
    """The engine's ends of the two pipes: the step loop's inbox (engine/step_loop.py's Inbox) and its `send`."""

    def __init__(self, inbound_fd: int, outbound_fd: int) -> None:
        os.set_blocking(inbound_fd, False)
        self._inbound = inbound_fd
        self._frames = FrameDecoder()
        self._out = PipeWriter(outbound_fd)

    def send(self, message: Outbound) -> None:
        """Writes at once what the pipe takes; BrokenPipeError if the API process is gone."""
        self._out.write(encode(message))
        if self._out.pending > MAX_PENDING_BYTES:  # back-pressure: no step until the API process catches up
            self._wait(None, for_input=False)

    def receive(self, timeout: float) -> list[Inbound]:
        self._out.flush()
        if timeout:
            self._wait(time.monotonic() + timeout)
        return self._read()

    def close(self) -> None:
        """Waits a bounded time for the pending messages to reach the API process."""
        with contextlib.suppress(BrokenPipeError):
            self._wait(time.monotonic() + CLOSE_WAIT_S, for_input=False)
        os.close(self._out.fd)

    def _wait(self, deadline: float | None, *, for_input: bool = True) -> None:
        """Flushes the pending output while it waits for a message to arrive (`for_input`) or, if not, for every
        pending byte to be written; at most until `deadline` (monotonic; None: no limit)."""
        while True:
            flushed = self._out.flush()
            if flushed and not for_input:
                return
            poll = select.poll()
            if for_input:
                poll.register(self._inbound, select.POLLIN)
            if not flushed:
                poll.register(self._out.fd, select.POLLOUT)
            timeout_ms = None if deadline is None else max(0.0, deadline - time.monotonic()) * 1000
            events = poll.poll(timeout_ms)
            if timeout_ms == 0 or any(fd == self._inbound for fd, _ in events):
                return

    def _read(self) -> list[Inbound]:
        while True:
            try:
                data = os.read(self._inbound, READ_BYTES)
            except BlockingIOError:
                break
            if not data:
                raise BrokenPipeError("the API process closed its end of the inbound pipe")
            self._frames.feed(data)
        messages = []
        while (payload := self._frames.next_frame()) is not None:
            messages.append(pickle.loads(payload))
        return messages


def main(argv: list[str]) -> int:
    inbound_fd, outbound_fd, config_b64 = argv
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process leads the stop
    logging.basicConfig(level=os.environ.get("PREFIXGATE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s [engine] %(message)s")
    config: EngineConfig = pickle.loads(base64.b64decode(config_b64))
    seam = _PipeSeam(int(inbound_fd), int(outbound_fd))
    try:
        core = _load(config)
    except Exception as exc:  # a setting it cannot start with: one line for the operator, no traceback
        logger.debug("engine start-up failed", exc_info=True)
        seam.send(StartFailed(f"{exc}"))
        seam.close()
        return 2
    seam.send(_info(core))
    stopping = False

    def on_term(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    from engine.step_loop import StepLoop
    try:
        StepLoop(core, seam, seam.send, seam.send).run(lambda: stopping)
    except BrokenPipeError:  # the API process is gone: nobody will read our outputs
        logger.warning("the API process has gone; the engine stops")
    core.close()  # the disk tier keeps the cache for the next start
    seam.close()
    return 0


def _load(config: EngineConfig):
    from engine.core import EngineCore
    return EngineCore(config, prefill_compile=True)


def _info(core) -> EngineInfo:
    from engine.async_engine import served_name
    budget = core.thread_budget
    return EngineInfo(served_name(core), str(core.model_path), core.max_model_len, core.vocab_size, core.num_blocks,
                      sorted(core.tokenizer.eos_token_ids), budget.threads if budget else None,
                      budget.threads_batch if budget else None, os.getpid())


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when the API process dies (kill -9 included)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the end of file on the inbound pipe ends it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
