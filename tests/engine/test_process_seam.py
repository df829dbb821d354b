"""The seam between the API process and the engine process: typed messages both ways (engine/messages.py),
errors crossing as type and message strings, and a message that cannot be read treated as the engine's death
(its requests fail with EngineDeadError, the supervisor starts a new engine)."""
from __future__ import annotations

import asyncio
import os
import pickle
from pathlib import Path

import pytest
import pytest_asyncio

from engine.client import EngineCommandError, EngineDeadError
from engine.config import EngineConfig
from engine.framing import HEADER
from engine.messages import EngineError, PinList, StepOutputs
from engine.process_client import ProcessClient
from engine.sampling_params import SamplingParams
from engine.stats import SchedulerStats, StepStats

# every test runs against one real engine process, started once for the module (its tests share its event loop)
pytestmark = [pytest.mark.server, pytest.mark.asyncio(loop_scope="module")]

LONG = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0)
PROMPT = list(range(20, 60))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=512, threads=1, threads_batch=1)
    engine = await ProcessClient.launch(config, max_restarts=3)
    engine.start()
    yield engine
    await engine.shutdown(timeout=0)


def inject(client: ProcessClient, payload: bytes) -> None:
    """Writes a frame of `payload` into the engine's outbound pipe, as if the engine had sent it: through the
    engine process's own write end (`python -m engine.engine_process IN_FD OUT_FD CONFIG`)."""
    pid = client.info.pid
    out_fd = int(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[4])
    fd = os.open(f"/proc/{pid}/fd/{out_fd}", os.O_WRONLY)
    try:
        os.write(fd, HEADER.pack(len(payload)) + payload)  # under PIPE_BUF: one write, never split by the engine's
    finally:
        os.close(fd)


async def wait_until(predicate, what: str) -> None:
    async with asyncio.timeout(120):
        while not predicate():
            await asyncio.sleep(0.02)


async def complete(client: ProcessClient, request_id: str) -> list:
    return [out async for out in client.generate(request_id, PROMPT, SHORT)]


@pytest.mark.parametrize("malformed", [
    b"\x80\x05not a pickle",  # fails to decode
    pickle.dumps(("step", [], StepStats(SchedulerStats()))),  # decodes, but no message the engine sends
], ids=["undecodable", "untyped"])
async def test_a_malformed_message_fails_the_waiting_requests_and_the_engine_restarts(client, malformed):
    first_pid, restarts = client.info.pid, len(client.restarts)  # the module's engine: earlier cases restarted it
    outputs = client.generate("long", PROMPT, LONG)
    assert not (await anext(outputs)).finished  # it runs

    inject(client, malformed)

    with pytest.raises(EngineDeadError, match="cannot be read"):
        async for _ in outputs:
            pass
    assert not client.is_alive()
    await wait_until(client.is_alive, "the supervisor to start a new engine")
    assert client.info.pid != first_pid and len(client.restarts) == restarts + 1
    answer = await complete(client, "after")
    assert answer[-1].finished and answer[-1].error is None and answer[-1].num_output_tokens == 3


async def test_a_cache_command_error_crosses_as_its_type_and_message(client):
    with pytest.raises(EngineCommandError, match="^ValueError: unknown cache command 'bogus'$") as raised:
        await client._command("bogus", "alice")
    assert raised.value.error == EngineError("ValueError", "unknown cache command 'bogus'")
    assert client.is_alive()  # a failed command fails its caller alone
    assert await client.list_pins("alice") == PinList([], 0)


async def test_the_reader_takes_the_engines_outbound_messages_only(client):
    """Once ready, the engine sends StepOutputs and CommandReply: a step reaches the stats listeners (and its
    outputs their requests); anything else, such as the tuple the engine once sent as it stopped, is refused."""
    steps: list[StepStats] = []
    client.add_stats_listener(steps.append)
    stats = StepStats(SchedulerStats(num_blocks=7, num_free_blocks=5))
    client._on_message(StepOutputs([], stats))
    assert steps == [stats] and client.scheduler_stats() is stats.scheduler
    with pytest.raises(TypeError, match="not a message the engine sends after it started: tuple"):
        client._on_message(("stopped",))
