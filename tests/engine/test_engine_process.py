"""The engine in its own process (the default of `serve`): no torch in the API process, supervision after a
kill -9 (in-flight requests end, /health turns red, a new engine starts warm from the disk tier, the server
gives up after --engine-restarts), and a client disconnect releasing the engine's blocks."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest

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


@pytest.mark.server
def test_a_disconnect_releases_the_engine_process_blocks(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir, engine_process=True)) as server:
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
