"""Health and metrics that follow the engine process: from the moment the kernel has ended it (kill -9),
/health is 503 and the running / waiting / KV-usage series read what an idle pool reads, not the dead engine's
last step; after the restart they stay there until the new engine runs something."""
from __future__ import annotations

import asyncio
import json
import os
import select
import signal

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.state import STATE
from tests.support.gateway_helpers import tiny_settings

pytestmark = pytest.mark.server  # a real engine process, killed

LEVELS = ("prefixgate_requests_running", "prefixgate_requests_waiting", "prefixgate_kv_cache_usage_ratio")


async def levels(client) -> dict[str, float]:
    text = await (await client.get("/metrics")).text()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in LEVELS}


def wait_exited(pid: int) -> None:
    """Blocks (the event loop too) until the kernel has ended `pid`: nothing on the loop runs meanwhile, so the
    server can know of the death only by asking the kernel itself."""
    pidfd = os.pidfd_open(pid)
    try:
        assert select.select([pidfd], [], [], 30)[0], f"engine process {pid} still there 30 s after SIGKILL"
    finally:
        os.close(pidfd)


async def test_kill_9_turns_health_red_and_the_levels_to_zero_at_once(aiohttp_client, tiny_llama_dir):
    client = await aiohttp_client(create_app(tiny_settings(tiny_llama_dir, engine={"num_kv_blocks": 512}, engine_process=True)))
    engine = client.app[STATE].engine
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "count"}], "max_tokens": 1500,
            "ignore_eos": True, "temperature": 0, "stream": True}
    streams = [await client.post("/v1/chat/completions", json=body) for _ in range(2)]
    for stream in streams:
        assert stream.status == 200 and (await stream.content.readline()).startswith(b"data: ")
    async with asyncio.timeout(30):  # a step with both running has reached /metrics
        while (before := await levels(client))["prefixgate_requests_running"] != 2:
            await asyncio.sleep(0.02)
    assert before["prefixgate_kv_cache_usage_ratio"] > 0

    dead_pid = engine.info.pid
    os.kill(dead_pid, signal.SIGKILL)
    wait_exited(dead_pid)
    assert not engine.is_alive()  # what /health reads, with no turn of the loop since the kernel's exit
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["error"]["code"] == "engine_dead"
    assert await levels(client) == dict.fromkeys(LEVELS, 0.0)
    for stream in streams:
        events = [line for line in (await stream.text()).splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "engine_dead"

    async with asyncio.timeout(120):  # the supervisor starts a new engine
        while (await client.get("/health")).status != 200:
            await asyncio.sleep(0.05)
    assert engine.info.pid != dead_pid
    assert await levels(client) == dict.fromkeys(LEVELS, 0.0)  # the new engine runs nothing yet
