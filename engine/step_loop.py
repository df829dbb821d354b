"""The engine's step loop, whatever carries its messages: adds, aborts and cache commands come in through an
inbox; each step's StepOutputs go out through `emit`, each command's CommandReply through `reply`
(engine/messages.py). The engine process runs it on its main thread; the in-process AsyncEngine on a thread
of its own."""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from engine.core import EngineCore
from engine.grammar import StructuredMatcher
from engine.outputs import FinishReason, RequestOutput
from engine.request import Request
from engine.messages import AddRequest, CacheCommand, CommandReply, EngineError, Inbound, StepOutputs

logger = logging.getLogger("prefixgate.engine")

IDLE_WAIT_S = 0.5  # an idle loop wakes this often to report stats
COMPILE_POLL_S = 0.002  # while a grammar compiles, the idle loop looks for it this often


@dataclass(slots=True)
class _Compiling:
    add: AddRequest
    matcher: Future = field(repr=False)


class Inbox(Protocol):
    def receive(self, timeout: float) -> list[Inbound]:
        """What arrived; waits up to `timeout` seconds (0: not at all) while nothing has."""


Emit = Callable[[StepOutputs], None]
Reply = Callable[[CommandReply], None]


class StepLoop:
    def __init__(self, core: EngineCore, inbox: Inbox, emit: Emit, reply: Reply) -> None:
        self.core = core
        self.inbox = inbox
        self.emit = emit
        self.reply = reply
        # grammars compile off the step loop: running requests never wait for a new request's schema
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="prefixgate-grammar")
        self._compiling: dict[str, _Compiling] = {}

    def run(self, stopping: Callable[[], bool]) -> None:
        """Steps while there is work; an idle loop waits on the inbox and reports stats now and then."""
        busy = False
        while not stopping():
            self._take(self.inbox.receive(0 if busy else COMPILE_POLL_S if self._compiling else IDLE_WAIT_S))
            self._admit_compiled()
            if not self.core.has_unfinished():
                try:
                    self.core.idle(just_idle=busy)  # pins expire; the disk tier catches up, off the step path
                except Exception:  # housekeeping that fails loses its own work, never the engine (as a step)
                    logger.exception("idle housekeeping failed")
                busy = False
                self._emit([])  # aborts leave no step behind: report them now
                continue
            busy = True
            self.emit(StepOutputs(*self.core.step()))
        self._take(self.inbox.receive(0))  # aborts sent while the last step ran
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    def _emit(self, outputs: list[RequestOutput]) -> None:
        self.emit(StepOutputs(outputs, self.core.take_stats()))

    def _take(self, messages: list[Inbound]) -> None:
        for message in messages:
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, CacheCommand):
                self._command(message)
            else:
                self._abort(message.request_id)

    def _command(self, command: CacheCommand) -> None:
        try:
            reply = CommandReply(command.command_id, self.core.cache_command(command))
        except Exception as exc:  # a failed command fails its caller alone
            logger.exception("cache command %s failed", command.op)
            reply = CommandReply(command.command_id, error=EngineError.of(exc))
        self.reply(reply)
        self._emit([])  # an erase shows in the metrics at once

    def _add(self, add: AddRequest) -> None:
        if add.params.structured is not None:
            future = self._grammar_pool.submit(self.core.grammars.matcher, add.params.structured)
            self._compiling[add.request_id] = _Compiling(add, future)
            return
        self._admit(add, None)

    def _admit_compiled(self) -> None:
        for request_id, compiling in list(self._compiling.items()):
            if not compiling.matcher.done():
                continue
            del self._compiling[request_id]
            try:
                matcher = compiling.matcher.result()
            except Exception as exc:  # an invalid schema fails its request alone
                self._reject(compiling.add, exc)
                continue
            self._admit(compiling.add, matcher)

    def _admit(self, add: AddRequest, matcher: StructuredMatcher | None) -> None:
        request = Request(add.request_id, add.prompt_token_ids, add.params, cache_salt=add.cache_salt,
                          tenant=add.tenant, arrival_time=add.arrival_time, cache=add.cache)
        request.matcher = matcher
        try:
            self.core.add_request(request)
        except Exception as exc:  # a request the engine refuses fails alone
            self._reject(add, exc)

    def _reject(self, add: AddRequest, exc: Exception) -> None:
        if not isinstance(exc, ValueError):
            logger.error("adding request %s failed", add.request_id, exc_info=exc)
        self._emit([unrun_output(add.request_id, FinishReason.ERROR, len(add.prompt_token_ids), str(exc))])

    def _abort(self, request_id: str) -> None:
        if (compiling := self._compiling.pop(request_id, None)) is not None:
            compiling.matcher.cancel()
            output = unrun_output(request_id, FinishReason.ABORT, len(compiling.add.prompt_token_ids))
        else:
            try:
                output = self.core.abort(request_id)
            except Exception as exc:
                logger.exception("aborting request %s failed", request_id)
                output = unrun_output(request_id, FinishReason.ERROR, error=f"abort failed: {exc!r}")
        if output is not None:
            self._emit([output])


def unrun_output(request_id: str, finish_reason: str, num_prompt_tokens: int = 0,
                 error: str | None = None) -> RequestOutput:
    """The final output of a request that ends without running: rejected, or aborted before it was admitted."""
    return RequestOutput(request_id, [], "", None, num_prompt_tokens, 0, 0, finished=True,
                         finish_reason=finish_reason, error=error)
