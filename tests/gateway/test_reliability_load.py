"""Load: a CI-sized soak (bench/soak.py) with disconnects, aborts and failing steps, and an overload
at 10x the admission capacity: nothing lost, nothing leaked, excess refused fast."""
from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from bench.engine_faults import set_step_hook
from bench.soak import SoakParams, run_soak
from gateway.app import create_app
from gateway.state import STATE
from tests.support.gateway_helpers import is_error_body, tiny_settings
from tests.gateway.test_gateway_http import chat, sse_events, wait_released

SOAK = SoakParams(requests=2000, concurrency=72, seed=7)


@pytest.mark.slow  # a benchmark run: 2,000 requests
async def test_soak_nothing_lost_nothing_leaked(tiny_llama_dir):
    report = await run_soak(str(tiny_llama_dir), SOAK)
    print("\n".join(["soak:", *report.lines()]))
    o = report.outcomes
    assert report.sent == SOAK.requests
    assert report.lost == 0, o  # every request: completed, an error object, a 429 or the client's own leave
    assert report.leak_error is None  # no block referenced, every block in the free queue
    assert o["completed"] > SOAK.requests // 4
    assert o["disconnected"] > SOAK.requests // 20
    assert report.step_failures > 0 and o["error:500:engine_error"] + o["error:stream:engine_error"] > 0
    assert report.aborts_sent > 0 and o["error:503:aborted"] + o["error:stream:aborted"] > 0
    assert report.evictions > 0 and report.preemptions > 0  # the tiny pool really was under pressure
    # memory: the last third may not hold more than the first; allocator noise stays within a few MB
    assert report.rss_growth_mb < 16, report.rss_mb
    assert report.py_blocks_growth < 0.02, report.py_blocks


async def test_overload_10x_capacity_gets_fast_429s(aiohttp_client, tiny_llama_dir):
    settings = tiny_settings(tiny_llama_dir, engine={"max_num_seqs": 4}, max_waiting_requests=4)
    client = await aiohttp_client(create_app(settings))
    state = client.app[STATE]
    engine, admission = state.engine, state.admission
    capacity = admission.capacity
    peak = {"in_flight": 0, "waiting": 0}

    def slow_step() -> None:  # every accepted request needs >= 30 steps of >= 20 ms: >= 0.6 s
        time.sleep(0.02)
        peak["waiting"] = max(peak["waiting"], len(engine.core.scheduler.waiting))

    set_step_hook(engine, slow_step)
    proc = psutil.Process()
    rss_before = proc.memory_info().rss
    start = time.monotonic()
    finished: dict[int, tuple[int, float]] = {}

    async def one(i: int) -> None:
        body = chat(client, f"request {i}", max_tokens=30, ignore_eos=True, stream=i % 2 == 0)
        resp = await client.post("/v1/chat/completions", json=body)
        peak["in_flight"] = max(peak["in_flight"], admission.in_flight)
        if resp.status == 200:
            events = await sse_events(resp) if body["stream"] else [await resp.json()]
            assert events[-1] == "[DONE]" or events[-1]["choices"][0]["finish_reason"] == "length"
        else:
            assert resp.status == 429 and is_error_body(await resp.json())
            assert resp.headers["Retry-After"]
        finished[i] = (resp.status, time.monotonic() - start)

    await asyncio.gather(*(one(i) for i in range(10 * capacity)))
    statuses = [s for s, _ in finished.values()]
    accepted = [t for s, t in finished.values() if s == 200]
    rejected = [t for s, t in finished.values() if s == 429]
    print(f"\noverload: {len(statuses)} requests at capacity {capacity}: {len(accepted)} accepted, "
          f"{len(rejected)} x 429 (last 429 at {max(rejected, default=0):.3f}s, first accepted done at "
          f"{min(accepted, default=0):.3f}s)")
    assert len(statuses) == 10 * capacity and set(statuses) <= {200, 429}
    assert len(accepted) == capacity and len(rejected) == 9 * capacity
    assert max(rejected) < min(accepted)  # every 429 came back before the first accepted one finished
    assert peak["in_flight"] <= capacity and peak["waiting"] <= settings.gateway.max_waiting_requests
    assert proc.memory_info().rss - rss_before < 32 * 2**20
    set_step_hook(engine, None)
    await wait_released(engine)
    assert (await client.post("/v1/chat/completions", json=chat(client))).status == 200
