"""The engine steps on its own thread: HTTP answers while a step is still running."""
from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest

from bench.engine_faults import set_step_hook
from tests.gateway.test_gateway_http import chat, client, engine_of, make_client  # noqa: F401  (fixtures)


async def test_health_and_models_answer_while_a_step_is_in_progress(client):  # noqa: F811
    engine = engine_of(client)
    in_step, release = threading.Event(), threading.Event()

    def blocking_step():
        in_step.set()
        release.wait(30)  # the step cannot end before the test says so

    set_step_hook(engine, blocking_step)
    pending = asyncio.ensure_future(client.post("/v1/chat/completions", json=chat(client)))
    assert await asyncio.to_thread(in_step.wait, 30)
    health = await client.get("/health")
    models = await client.get("/v1/models")
    assert not release.is_set() and in_step.is_set()  # both answered while the step was still running
    assert health.status == 200 and models.status == 200
    set_step_hook(engine, None)
    release.set()
    assert (await pending).status == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_a_client_that_stops_reading_is_dropped_and_its_blocks_released(make_client, monkeypatch,  # noqa: F811
                                                                              path):
    """Model a reader that stopped: after the first event every write waits for a drain that never comes. (A
    Responses stream held its admission slot until the socket closed, until 2026-12-01.)"""
    from aiohttp import web

    from tests.gateway.test_gateway_http import wait_released

    client = await make_client(stream_write_timeout_s=0.2)
    engine = engine_of(client)
    original_write = web.StreamResponse.write
    writes = 0

    async def stalled_write(self, data):
        nonlocal writes
        writes += 1
        if writes > 1:
            await asyncio.Event().wait()  # the socket buffer is full and the client reads nothing
        await original_write(self, data)

    reasons = []
    engine.add_stats_listener(lambda stats: reasons.extend(f.finish_reason for f in stats.finished))
    monkeypatch.setattr(web.StreamResponse, "write", stalled_write)
    body = chat(client, stream=True, max_tokens=3000, ignore_eos=True)
    if path == "/v1/responses":
        body = {"model": body["model"], "input": "hi", "stream": True, "max_output_tokens": 3000, "ignore_eos": True}
    resp = await client.post(path, json=body)
    assert resp.status == 200
    with pytest.raises(aiohttp.ClientPayloadError):  # the server closed the connection mid-stream
        await asyncio.wait_for(resp.read(), 30)
    await wait_released(engine)
    assert reasons == ["abort"]  # dropped long before its 3000 tokens: the request was aborted
    monkeypatch.setattr(web.StreamResponse, "write", original_write)
    assert (await client.post("/v1/chat/completions", json=chat(client))).status == 200
