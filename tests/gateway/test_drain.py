"""A drain that says goodbye: requests still running when it ends get their terminal event (a chat stream an
error event `server_shutting_down` and `[DONE]`, a Responses stream `error` and `response.failed`, a request
that is not streamed a 503 with Retry-After), their blocks are released, and /health answers 503 `draining`
from the drain's first moment. (The SIGTERM path through `serve` is test_gateway_cli.py's.)"""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from bench.engine_faults import assert_blocks_released, set_step_hook
from engine.config import EngineConfig
from gateway.app import IN_FLIGHT, create_app
from gateway.settings import GatewaySettings, Settings
from gateway.state import STATE

RETRY_AFTER_S = 3


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), block_size=16, num_kv_blocks=320)
    settings = Settings(config, GatewaySettings(salt_secret="test", engine_process=False, retry_after_s=RETRY_AFTER_S))
    client = await aiohttp_client(create_app(settings))
    set_step_hook(client.app[STATE].engine, lambda: time.sleep(0.005))  # the long requests outlast the drain
    return client


def long_chat(client, **fields) -> dict:
    return {"model": client.app[STATE].model_name, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3000, "ignore_eos": True, **fields}


async def data_events(resp, limit: int | None = None) -> list:
    """The `data:` payloads ("[DONE]" kept as text), up to `limit`."""
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            if limit is not None and len(events) == limit:
                break
    return events


async def test_requests_running_at_the_drains_end_get_their_terminal_event(client):
    chat_stream = await client.post("/v1/chat/completions", json=long_chat(client, stream=True))
    responses_stream = await client.post("/v1/responses", json={
        "model": client.app[STATE].model_name, "input": "the", "max_output_tokens": 3000, "stream": True,
        "temperature": 0})  # greedy on this input, the tiny model runs 400 tokens and more without its EOS
    assert len(await data_events(chat_stream, limit=2)) == 2
    assert [e["type"] for e in await data_events(responses_stream, limit=2)] == ["response.created",
                                                                                 "response.in_progress"]
    whole = asyncio.ensure_future(client.post("/v1/chat/completions", json=long_chat(client)))
    await asyncio.sleep(0.2)  # running, not done

    drain = asyncio.ensure_future(client.app[IN_FLIGHT].drain(timeout=0.5))
    await asyncio.sleep(0)  # the drain has begun
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["error"]["code"] == "draining"
    assert health.headers["Retry-After"] == str(RETRY_AFTER_S)

    assert await drain == 3  # all three still running at the deadline
    resp = await whole
    assert resp.status == 503 and resp.headers["Retry-After"] == str(RETRY_AFTER_S)
    assert (await resp.json())["error"]["code"] == "server_shutting_down"
    events = await data_events(chat_stream)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down"
    assert all("error" not in e for e in events[:-2])
    events = await data_events(responses_stream)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "server_shutting_down"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_shutting_down"
    assert all(e["type"] not in ("response.completed", "response.incomplete") for e in events)

    engine = client.app[STATE].engine
    core = getattr(engine, "core", engine)
    for _ in range(600):  # the aborts reach the engine's own thread after the streams close (slow when loaded)
        if engine.num_unfinished() == 0 and not core.requests:
            break
        await asyncio.sleep(0.05)
    assert_blocks_released(engine)


async def test_a_request_that_ends_within_the_drain_is_untouched(client):
    short = asyncio.ensure_future(client.post("/v1/chat/completions", json=long_chat(client, max_tokens=3)))
    await asyncio.sleep(0.05)
    assert await client.app[IN_FLIGHT].drain(timeout=30) == 0
    resp = await short
    assert resp.status == 200 and (await resp.json())["choices"][0]["finish_reason"] == "length"
    refused = await client.post("/v1/chat/completions", json=long_chat(client))
    assert refused.status == 503 and (await refused.json())["error"]["code"] == "shutting_down"


async def test_a_second_signal_ends_a_long_drain_at_once(client):
    """`ending` (a second Ctrl-C) brings the drain's deadline to now: a stream still running gets its terminal
    event, and the drain returns without waiting out its 600 s."""
    stream = await client.post("/v1/chat/completions", json=long_chat(client, stream=True))
    assert len(await data_events(stream, limit=2)) == 2
    in_flight = client.app[IN_FLIGHT]
    drain = asyncio.ensure_future(in_flight.drain(timeout=600))
    await asyncio.sleep(0.2)
    assert not drain.done()
    in_flight.ending.set()
    assert await asyncio.wait_for(drain, 30) == 1
    events = await data_events(stream)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down"
