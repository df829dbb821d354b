"""The engine process: `python -m engine.engine_process IN OUT CONFIG`, started by ProcessClient.

Its main thread runs the step loop (scheduler, KV cache manager, model, sampler), so the compiled CPU
kernels always run on the thread that first ran them; the API process does HTTP. Messages are the
dataclasses of engine/messages.py, pickled over two ZeroMQ IPC sockets: adds, aborts and cache commands in;
EngineInfo (or StartFailed) once, then one StepOutputs per engine step and a CommandReply per command out.
"""
from __future__ import annotations

import base64
import ctypes
import logging
import os
import pickle
import signal
import sys

import zmq

from engine.config import EngineConfig
from engine.messages import EngineInfo, Inbound, Outbound, StartFailed

logger = logging.getLogger("prefixgate.engine")

class _SocketInbox:
    def __init__(self, socket: zmq.Socket) -> None:
        self._socket = socket
        self._parent = os.getppid()

    def receive(self, timeout: float) -> list[Inbound]:
        if timeout and not self._socket.poll(int(timeout * 1000)):
            if os.getppid() != self._parent:  # the API process is gone: nobody will read our outputs
                raise SystemExit(0)
            return []
        messages = []
        while True:
            try:
                messages.append(pickle.loads(self._socket.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return messages


def main(argv: list[str]) -> int:
    inbox_address, outbox_address, config_b64 = argv
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process leads the stop
    logging.basicConfig(level=os.environ.get("PREFIXGATE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s [engine] %(message)s")
    config: EngineConfig = pickle.loads(base64.b64decode(config_b64))
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(inbox_address)
    outbox.connect(outbox_address)

    def send(message: Outbound) -> None:
        outbox.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        core = _load(config)
    except Exception as exc:  # a setting it cannot start with: one line for the operator, no traceback
        logger.debug("engine start-up failed", exc_info=True)
        send(StartFailed(f"{exc}"))
        outbox.close(linger=2000)
        return 2
    send(_info(core))
    stopping = False

    def on_term(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    from engine.step_loop import StepLoop
    StepLoop(core, _SocketInbox(inbox), send, send).run(lambda: stopping)
    core.close()  # the disk tier keeps the cache for the next start
    outbox.close(linger=2000)
    return 0


def _load(config: EngineConfig):
    from engine.core import EngineCore
    return EngineCore(config)


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
        pass  # elsewhere the idle loop's parent check ends it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
