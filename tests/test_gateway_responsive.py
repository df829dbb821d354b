"""The engine steps on its own thread: HTTP answers while a step is still running."""
from __future__ import annotations

import asyncio
import threading

from tests.test_gateway_http import chat, client, engine_of, make_client  # noqa: F401  (fixtures)


async def test_health_and_models_answer_while_a_step_is_in_progress(client):  # noqa: F811
    engine = engine_of(client)
    in_step, release = threading.Event(), threading.Event()

    def blocking_step():
        in_step.set()
        release.wait(30)  # the step cannot end before the test says so

    engine.step_hook = blocking_step
    pending = asyncio.ensure_future(client.post("/v1/chat/completions", json=chat(client)))
    assert await asyncio.to_thread(in_step.wait, 30)
    health = await client.get("/health")
    models = await client.get("/v1/models")
    assert not release.is_set() and in_step.is_set()  # both answered while the step was still running
    assert health.status == 200 and models.status == 200
    engine.step_hook = None
    release.set()
    assert (await pending).status == 200
