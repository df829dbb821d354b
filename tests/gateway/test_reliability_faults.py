"""Faults and limits: a failing step fails only its batch, hung and slow clients cannot hold the
engine, every configured bound answers with a clear OpenAI error; engine bugs found by fuzzing."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
import torch

from bench.engine_faults import set_step_hook
from engine.sampling import Sampler
from engine.sampling_params import SamplingParams
from gateway.app import create_app
from gateway.state import STATE
from tests.support.gateway_helpers import is_error_body, tiny_settings
from tests.gateway.test_gateway_http import assert_error, chat, engine_of, model_of, sse_events, wait_released


@pytest.fixture
async def make(aiohttp_client, tiny_llama_dir):
    async def go(engine: dict | None = None, **gateway):
        return await aiohttp_client(create_app(tiny_settings(tiny_llama_dir, engine=engine, **gateway)))
    return go


# ---- a failing model step (the single-request case is in test_gateway_http.py)

async def test_failed_step_fails_its_whole_batch_and_the_engine_keeps_serving(make):
    client = await make()
    engine = engine_of(client)
    steps = iter(range(10_000))

    def hook() -> None:  # slow enough that all six requests share step 4
        if next(steps) == 4:
            raise RuntimeError("injected")
        time.sleep(0.002)

    set_step_hook(engine, hook)

    async def one(i: int) -> str:
        body = chat(client, f"batch member {i}", max_tokens=40, ignore_eos=True, stream=i % 2 == 0)
        resp = await client.post("/v1/chat/completions", json=body)
        if body["stream"]:
            events = await sse_events(resp)
            assert resp.status == 200 and events[-1] == "[DONE]" and is_error_body(events[-2])
            return events[-2]["error"]["code"]
        assert_error(resp.status, await resp.json(), 500, type_="server_error")
        return (await resp.json())["error"]["code"]

    codes = await asyncio.gather(*(one(i) for i in range(6)))  # all six run in the batch of step 4
    assert codes == ["engine_error"] * 6
    assert (await client.get("/health")).status == 200
    results = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(client, f"after {i}"))
                                     for i in range(4)))
    assert [r.status for r in results] == [200] * 4
    await wait_released(engine)


# ---- clients that do not read

def _hung_stream(port: int, body: dict) -> socket.socket:
    """A client that sends a streaming request, then never reads (with a tiny receive window)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


async def test_hung_and_slow_clients_cannot_hold_the_engine(make):
    client = await make(engine={"max_model_len": 2048})
    engine = engine_of(client)
    body = chat(client, "never read", max_tokens=800, ignore_eos=True, stream=True, logprobs=True, top_logprobs=5)
    hung = [_hung_stream(client.port, body) for _ in range(3)]
    slow = await client.post("/v1/chat/completions", json=body)
    assert slow.status == 200
    await slow.content.read(100)  # then it reads nothing more for a while
    await asyncio.sleep(0.2)
    started = time.monotonic()
    results = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(client, f"other {i}", max_tokens=8))
                                     for i in range(8)))
    assert [r.status for r in results] == [200] * 8
    assert time.monotonic() - started < 20
    # the readers that never read: the engine generated their tokens anyway and freed their blocks
    deadline = time.monotonic() + 120  # a bound on a hang: 4 x 800 tokens take longer on a loaded machine
    while engine.num_unfinished() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert engine.core.requests == {}
    for sock in hung:
        sock.close()
    slow.close()
    await wait_released(engine)
    deadline = time.monotonic() + 10  # their handlers see the closed sockets and give their slots back
    while client.app[STATE].admission.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert client.app[STATE].admission.in_flight == 0


# ---- limits: every bound from the config, a clear 400 (413 for the body) in OpenAI's shape

LIMITS = dict(max_body_bytes=2048, max_prompt_tokens=32, max_tokens_limit=8, max_n=2, max_stop_sequences=2,
              max_messages=3, max_prompts=2, max_top_logprobs=3)


@pytest.mark.parametrize("path, change, status, param", [
    ("chat", {"messages": [{"role": "user", "content": "x" * 3000}]}, 413, None),
    ("chat", {"messages": [{"role": "user", "content": "the cat " * 30}]}, 400, "messages"),
    ("completions", {"prompt": list(range(33))}, 400, "prompt"),
    ("chat", {"max_tokens": 9}, 400, "max_tokens"),
    ("chat", {"max_completion_tokens": 9}, 400, "max_completion_tokens"),  # (the field sent)
    ("completions", {"max_tokens": 9}, 400, "max_tokens"),
    ("chat", {"n": 3}, 400, "n"),
    ("chat", {"stop": ["a", "b", "c"]}, 400, "stop"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}] * 4}, 400, "messages"),
    ("completions", {"prompt": ["a", "b", "c"]}, 400, "prompt"),
    ("chat", {"logprobs": True, "top_logprobs": 4}, 400, "top_logprobs"),
    ("completions", {"logprobs": 4}, 400, "logprobs"),
])
async def test_configured_limits(make, path, change, status, param):
    client = await make(**LIMITS)
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    base = chat(client) if path == "chat" else {"model": model_of(client), "prompt": "the cat", "max_tokens": 2}
    resp = await client.post(url, json={**base, **change})
    assert_error(resp.status, await resp.json(), status, param=param)
    assert (await client.post(url, json=base)).status == 200  # within every limit


async def test_completions_default_max_tokens_respects_the_limit(make):
    client = await make(max_tokens_limit=4)  # the route's default of 16 is capped too
    body = {"model": model_of(client), "prompt": "the cat", "ignore_eos": True}
    out = await (await client.post("/v1/completions", json=body)).json()
    assert out["usage"]["completion_tokens"] == 4


async def test_extreme_sampling_values_do_not_fail_the_batch(make):
    """temperature 5e-324 or top_p 5e-324 once broke the engine's sampler, and so every request sharing
    the step; the engine treats them as their greedy equivalents."""
    client = await make()
    engine = engine_of(client)
    bodies = [chat(client, "a", temperature=5e-324), chat(client, "b", top_p=5e-324, temperature=1.0),
              chat(client, "c", temperature=1e-40), chat(client, "d", temperature=1.0, max_tokens=8)]
    results = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
    assert [r.status for r in results] == [200] * 4
    greedy = await (await client.post("/v1/chat/completions", json=chat(client, "a", temperature=0))).json()
    assert (await results[0].json())["choices"][0]["message"] == greedy["choices"][0]["message"]
    await wait_released(engine)


def test_engine_sampler_tiny_temperature_is_greedy():
    logits = torch.randn(2, 64)
    out = Sampler()(logits, [SamplingParams(temperature=1e-40)] * 2, [None, None])
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_engine_sampler_tiny_top_p_keeps_the_top_token():
    logits = torch.randn(2, 64)
    out = Sampler()(logits, [SamplingParams(top_p=5e-324)] * 2, [None, None])
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
