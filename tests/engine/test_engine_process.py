"""The engine in its own process (the default of `serve`): no torch in the API process, supervision after a
kill -9 (in-flight requests end, /health turns red, a new engine starts warm from the disk tier, the server
gives up after --engine-restarts), a client disconnect releasing the engine's blocks, the cache commands
answered from the engine process, and /health and the level series following the engine's death at once.

The last three share one gateway and engine process (starting one is most of each test's cost); the kill -9
among them runs last and leaves a restarted engine behind."""
from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.test_prompt_caching_http import chat, client, details, get, system_prompt
from tests.support.gateway_helpers import REPO, LiveServer, ask, sdk_client, served, tiny_settings

SYSTEM = "You are a helpful assistant. Answer the question about the capital of France with care. " * 4


def test_the_api_side_imports_no_torch():
    code = ("import sys; import gateway.__main__, gateway.app, gateway.routes, engine.process_client, "
            "engine.client, metrics.prometheus; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'numba')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def health(session: aiohttp.ClientSession, base: str) -> tuple[int, dict]:
    async with session.get(base.removesuffix("/v1") + "/health") as resp:
        return resp.status, await resp.json()


async def wait_health(session, base: str, status: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        got, body = await health(session, base)
        if got == status:
            return body
        assert time.monotonic() < deadline, f"/health stayed {got} {body}"
        await asyncio.sleep(0.02)


def mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


async def chat_cached_tokens(session, base: str, model: str) -> int:
    body = {"model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]}
    async with session.post(f"{base}/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.server
async def test_kill_9_of_the_engine_fails_in_flight_requests_restarts_warm_then_gives_up(tiny_llama_dir, tmp_path):
    disk = tmp_path / "kv"
    with served("--model", str(tiny_llama_dir), "--num-kv-blocks", "512", "--kv-disk-dir", str(disk),
                "--engine-restarts", "1") as server:
        base = server.base_url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            _, first = await health(session, base)
            engine_pid = first["engine_pid"]
            assert "libtorch" not in mapped_libraries(server.pid) and "libtorch" in mapped_libraries(engine_pid)
            model = (await (await session.get(f"{base}/models")).json())["data"][0]["id"]
            assert await chat_cached_tokens(session, base, model) == 0
            deadline = time.monotonic() + 30  # the idle engine writes its cached blocks behind to the disk tier
            while not list(disk.rglob("*.kv")):
                assert time.monotonic() < deadline, "no block reached the disk tier"
                await asyncio.sleep(0.05)

            long = {"model": model, "messages": [{"role": "user", "content": "count"}], "max_tokens": 3000,
                    "ignore_eos": True, "temperature": 0}
            stream = await session.post(f"{base}/chat/completions", json={**long, "stream": True})
            assert stream.status == 200
            await stream.content.readline()  # the first event: it is streaming
            plain = asyncio.create_task(session.post(f"{base}/chat/completions", json=long))
            await asyncio.sleep(0.3)
            killed = time.monotonic()
            os.kill(engine_pid, signal.SIGKILL)

            body = await wait_health(session, base, 503, timeout=5)
            assert body["error"]["code"] == "engine_dead"
            text = (await asyncio.wait_for(stream.read(), 10)).decode()
            events = [line for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_dead"
            resp = await asyncio.wait_for(plain, 10)
            assert resp.status == 503 and (await resp.json())["error"]["code"] == "engine_dead"
            assert time.monotonic() - killed < 5  # none hung (the supervisor sees the exit at once)

            second = await wait_health(session, base, 200, timeout=90)
            assert second["engine_pid"] != engine_pid and second["engine_restarts"] == 1
            assert await chat_cached_tokens(session, base, model) > 0  # warm: read back from the disk tier

            os.kill(second["engine_pid"], signal.SIGKILL)  # past --engine-restarts: the server exits 1
            assert await asyncio.to_thread(server.wait, 60) == 1
        log = server.log_text()
    assert "giving up" in log and "capital of France" not in log


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # 512 blocks: the kill -9 test's two 1,500-token streams run side by side
    with LiveServer(tiny_settings(tiny_llama_dir, engine={"num_kv_blocks": 512}, engine_process=True)) as live:
        yield live


@pytest.mark.server
def test_a_disconnect_releases_the_engine_process_blocks(server):
    client = sdk_client(server)
    messages = ask("hello world")
    first = client.chat.completions.create(model=server.state.model_name, messages=messages, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model=server.state.model_name, messages=messages, max_tokens=4, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    vector = client.embeddings.create(model=server.state.model_name, input="hello world").data[0].embedding
    assert abs(sum(v * v for v in vector) - 1) < 1e-4  # pooled in the engine process, sent back with its step
    stream = client.chat.completions.create(model=server.state.model_name, messages=ask("count"), max_tokens=1500,
                                            extra_body={"ignore_eos": True}, stream=True)
    next(iter(stream))
    stream.close()  # the client goes away mid-stream
    server.wait_idle(timeout=15)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=messages, max_tokens=1)


@pytest.mark.server
def test_the_engine_process_answers_cache_commands(server):
    c = client(server)
    system = {"role": "system", "content": system_prompt(), "cache_control": {"type": "ephemeral"}}
    pinned = details(chat(c, [system, {"role": "user", "content": "hi"}]))["pinned_tokens"]
    assert [p["tokens"] for p in get(server, "/v1/cache", "none")["data"]] == [pinned]
    erased = httpx.delete(server.url + "/v1/cache").json()
    assert erased["pins"] == 1 and erased["blocks"] > 0
    assert get(server, "/v1/cache", "none")["data"] == []


# ---- /health and the level series after the engine process's death (last: it leaves a restarted engine)
LEVELS = ("prefixgate_requests_running", "prefixgate_requests_waiting", "prefixgate_kv_cache_usage_ratio")


async def levels(session: aiohttp.ClientSession) -> dict[str, float]:
    text = await (await session.get("/metrics")).text()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in LEVELS}


def wait_exited(pid: int) -> None:
    """Blocks (the event loop too) until the kernel has ended `pid`: nothing on the loop runs meanwhile, so the
    server can know of the death only by asking the kernel itself."""
    pidfd = os.pidfd_open(pid)
    try:
        assert select.select([pidfd], [], [], 30)[0], f"engine process {pid} still there 30 s after SIGKILL"
    finally:
        os.close(pidfd)


@pytest.mark.server
def test_kill_9_turns_health_red_and_the_levels_to_zero_at_once(server):
    """From the moment the kernel has ended the engine process (kill -9), /health is 503 and the running /
    waiting / KV-usage series read what an idle pool reads, not the dead engine's last step; after the restart
    they stay there until the new engine runs something."""
    server.call(_kill_9_turns_health_red_and_the_levels_to_zero(server), timeout=180)


async def _kill_9_turns_health_red_and_the_levels_to_zero(server: LiveServer) -> None:
    """On the server's own event loop, so that wait_exited blocks it as it would block a server."""
    engine = server.engine
    async with aiohttp.ClientSession(server.url) as session:
        body = {"model": engine.model_name, "messages": [{"role": "user", "content": "count"}], "max_tokens": 1500,
                "ignore_eos": True, "temperature": 0, "stream": True}
        streams = [await session.post("/v1/chat/completions", json=body) for _ in range(2)]
        for stream in streams:
            assert stream.status == 200 and (await stream.content.readline()).startswith(b"data: ")
        async with asyncio.timeout(30):  # a step with both running has reached /metrics
            while (before := await levels(session))["prefixgate_requests_running"] != 2:
                await asyncio.sleep(0.02)
        assert before["prefixgate_kv_cache_usage_ratio"] > 0

        dead_pid = engine.info.pid
        os.kill(dead_pid, signal.SIGKILL)
        wait_exited(dead_pid)
        assert not engine.is_alive()  # what /health reads, with no turn of the loop since the kernel's exit
        health = await session.get("/health")
        assert health.status == 503 and (await health.json())["error"]["code"] == "engine_dead"
        assert await levels(session) == dict.fromkeys(LEVELS, 0.0)
        for stream in streams:
            events = [line for line in (await stream.text()).splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "engine_dead"

        async with asyncio.timeout(120):  # the supervisor starts a new engine
            while (await session.get("/health")).status != 200:
                await asyncio.sleep(0.05)
        assert engine.info.pid != dead_pid
        assert await levels(session) == dict.fromkeys(LEVELS, 0.0)  # the new engine runs nothing yet
