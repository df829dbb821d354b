"""`python -m gateway serve` as a real process: start-up, and graceful shutdown on SIGTERM."""
from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from tests.support.gateway_helpers import served

pytestmark = pytest.mark.server


@pytest.fixture
def server_process(tiny_llama_dir, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("sk-test: {tenant: tester}\n")
    with served("--model", str(tiny_llama_dir), "--num-kv-blocks", "512", "--shutdown-timeout-s", "1.5",
                "--api-keys-file", str(keys)) as proc:
        yield proc


async def test_sigterm_lets_in_flight_requests_finish_then_aborts_the_rest(server_process):
    base, headers = server_process.base_url, {"Authorization": "Bearer sk-test"}
    async with aiohttp.ClientSession(headers=headers) as session:
        model = (await (await session.get(f"{base}/models")).json())["data"][0]["id"]

        def body(max_tokens: int, n: int = 1) -> dict:
            return {"model": model, "messages": [{"role": "user", "content": "hello"}], "stream": True,
                    "max_tokens": max_tokens, "ignore_eos": True, "n": n}

        short = await session.post(f"{base}/chat/completions", json=body(40))
        # 8 x 4,000 tokens: more than the tiny model streams in the 1.5 s drain on an idle machine too (4,000 alone
        # took 1.2 s there, and the test failed wherever nothing else loaded the cores)
        long = await session.post(f"{base}/chat/completions", json=body(4000, n=8))
        assert short.status == long.status == 200
        await short.content.readline()
        await long.content.readline()
        server_process.send_signal(signal.SIGTERM)
        short_text = (await short.read()).decode()
        assert short_text.rstrip().endswith("data: [DONE]")  # in flight: allowed to finish
        assert '"finish_reason":"length"' in short_text
        long_text = (await long.read()).decode()  # still running after shutdown_timeout_s: told so, then ended
        assert long_text.rstrip().endswith('"code":"server_shutting_down"}}\n\ndata: [DONE]'), long_text[-300:]
        # the process exits cleanly; only then is a refused connection certain (while it drains, a kept-alive
        # connection may still get the 503 shutting_down answer)
        assert await asyncio.to_thread(server_process.wait, 30) == 0
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"{base}/models")
    log = server_process.log_text()
    assert "shutting down" in log and "aborted 1 requests" in log and "stopped" in log
    assert "sk-test" not in log and "hello" not in log  # no keys or prompts at INFO


async def test_a_second_sigint_during_the_drain_ends_the_requests_at_once(tiny_llama_dir):
    """Ctrl-C twice: the drain (600 s here) does not wait for the long request, which gets its terminal event."""
    with served("--model", str(tiny_llama_dir), "--num-kv-blocks", "512", "--shutdown-timeout-s", "600") as proc:
        async with aiohttp.ClientSession() as session:
            body = {"messages": [{"role": "user", "content": "hello"}], "stream": True, "max_tokens": 4000,
                    "ignore_eos": True, "n": 8}  # (32,000 tokens: seconds more than the two signals take)
            long = await session.post(f"{proc.base_url}/chat/completions", json=body)
            assert long.status == 200
            await long.content.readline()
            proc.send_signal(signal.SIGINT)
            while not any("shutting down" in line for line in proc.log_lines):
                await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            text = (await long.read()).decode()
            assert text.rstrip().endswith('"code":"server_shutting_down"}}\n\ndata: [DONE]'), text[-300:]
        assert await asyncio.to_thread(proc.wait, 60) == 0
    assert "second signal: ending the requests still running now" in proc.log_text()
