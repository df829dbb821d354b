"""Rows measured through HTTP: the real gateway in-process with `openai` AsyncOpenAI clients, and the
gateway alone in a subprocess over an instant engine stub (its own overhead); and a lean aiohttp client
(stream_chunks) for `bench serving`, which shares the server's cores."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from bench.driver import RequestTiming, RunResult, rss_mb
from bench.oracle import oracle_prefill_tokens
from bench.workloads import BenchRequest, Workload


async def _start(app):
    from aiohttp import web
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


def _through_gateway(engine, drive):
    """`drive(client, model)` against the real gateway: its aiohttp app in this process, `engine` on its thread."""
    from openai import AsyncOpenAI

    from gateway.app import create_app
    from gateway.settings import GatewaySettings, Settings

    settings = Settings(engine=engine.core.config, gateway=GatewaySettings(port=0, log_level="warning"))

    async def main():
        runner, port = await _start(create_app(settings, engine=engine))
        try:
            async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0,
                                   timeout=600) as client:
                return await drive(client, engine.model_name)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


async def _one(client, model: str, r: BenchRequest, extra_body: dict | None) -> RequestTiming:
    """Streams one request; TTFT is the first chunk that carries text (or the end, if none does)."""
    sent = time.monotonic()
    common = dict(model=model, max_tokens=r.max_tokens, temperature=0.0, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra_body)
    if r.messages is not None:
        stream = await client.chat.completions.create(messages=r.messages, **common)
    else:
        stream = await client.completions.create(prompt=r.text, **common)
    times, usage = [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text = choice.delta.content if hasattr(choice, "delta") else choice.text
            if text:
                times.append(time.monotonic())
    cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage and usage.prompt_tokens_details else 0
    return _timing(r, sent, times, usage.prompt_tokens if usage else 0, cached,
                   usage.completion_tokens if usage else len(times))


def _timing(r: BenchRequest, sent: float, times: list[float], prompt_tokens: int, cached_tokens: int,
            output_tokens: int) -> RequestTiming:
    """A streamed request's timing, now that it ended: `times` are when its chunks with text came."""
    end = time.monotonic()
    return RequestTiming(r.request_id, (times[0] if times else end) - sent, 0.0, end - sent, prompt_tokens,
                         cached_tokens, output_tokens, [b - a for a, b in zip(times, times[1:])])


async def stream_chunks(session, base_url: str, body: dict) -> AsyncIterator[dict]:
    """The parsed chunks of one streamed chat completion, read with aiohttp and json alone (as vLLM's own
    benchmark clients): a load generator on the server's cores should cost it little CPU, and the openai
    SDK's typed chunks cost about three times as much per chunk."""
    async with session.post(f"{base_url}/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                yield json.loads(line[6:])


async def _one_lean(session_url, model: str, r: BenchRequest, extra_body: dict | None) -> RequestTiming:
    """_one through stream_chunks (chat requests only)."""
    session, base_url = session_url
    body = {"model": model, "messages": r.messages, "max_tokens": r.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra_body or {})}
    sent, times, usage = time.monotonic(), [], None
    async for chunk in stream_chunks(session, base_url, body):
        usage = chunk.get("usage") or usage
        times.extend(time.monotonic() for choice in chunk.get("choices", ()) if choice["delta"].get("content"))
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return _timing(r, sent, times, usage.get("prompt_tokens", 0), cached, usage.get("completion_tokens", len(times)))


def lean_session():
    """The session of stream_chunks: a connection per request (llama-server closes idle keep-alive connections,
    which aiohttp would otherwise reuse and fail on)."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=600))


async def drive_lean(base_url: str, model: str, workload: Workload,
                     extra_body: dict | None = None) -> tuple[list[RequestTiming], float]:
    """_drive with the lean client of stream_chunks."""
    async with lean_session() as session:
        return await _drive((session, base_url), model, workload, extra_body, one=_one_lean)


async def _drive(client, model: str, workload: Workload, extra_body: dict | None = None,
                 one=_one) -> tuple[list[RequestTiming], float]:
    t0 = time.monotonic()
    done = {r.request_id: asyncio.Event() for r in workload.requests}

    async def user(r: BenchRequest) -> RequestTiming:
        if r.after is not None:
            await done[r.after].wait()
            await asyncio.sleep(r.think_s)
        else:
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.monotonic()))
        try:
            return await one(client, model, r, extra_body)
        finally:
            done[r.request_id].set()

    timings = await asyncio.gather(*(user(r) for r in workload.requests))
    return list(timings), time.monotonic() - t0


def run_gateway(core, workload: Workload, variant: str = "http-cache-on") -> RunResult:
    """The workload through the real gateway (aiohttp app in this process, engine on its thread)."""
    from engine.async_engine import AsyncEngine

    engine = AsyncEngine(core)
    prefill = [0]
    engine.add_stats_listener(lambda stats: prefill.__setitem__(0, prefill[0] + stats.num_prompt_tokens))
    timings, duration = _through_gateway(engine, lambda client, model: _drive(client, model, workload,
                                                                              {"ignore_eos": True}))
    pc = core.prefix_cache_stats()
    return RunResult(workload.name, variant, timings, duration, prefill[0],
                     oracle_prefill_tokens([r.prompt_token_ids for r in workload.requests], core.config.block_size),
                     pc.hits, pc.queries, pc.evictions_capacity, core.scheduler.num_preemptions, rss_mb(),
                     note="through HTTP + openai SDK")


async def _conversation(client, model: str, chat: int, system: str, users: list[str], api: str,
                        max_tokens: int) -> list[tuple[RequestTiming, int]]:
    """One chat's turns in sequence, kept as its API keeps a conversation; each turn's timing and request bytes."""
    history, previous, turns = [{"role": "system", "content": system}], None, []
    for turn, user in enumerate(users):
        sent, times, answer = time.monotonic(), [], []
        if api == "chat":
            history.append({"role": "user", "content": user})
            body = {"messages": history}
            stream = await client.chat.completions.create(
                model=model, messages=history, max_tokens=max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = (chunk.usage.prompt_tokens, chunk.usage.prompt_tokens_details.cached_tokens,
                             chunk.usage.completion_tokens)
                for choice in chunk.choices:
                    if choice.delta.content:
                        times.append(time.monotonic())
                        answer.append(choice.delta.content)
            history.append({"role": "assistant", "content": "".join(answer)})
        else:  # only the new message; the first turn carries the system prompt, which the server stores
            new = ([{"role": "system", "content": system}] if previous is None else []) + [{"role": "user",
                                                                                            "content": user}]
            body = {"input": new, "previous_response_id": previous}
            stream = await client.responses.create(model=model, input=new, previous_response_id=previous,
                                                   max_output_tokens=max_tokens, temperature=0.0, stream=True)
            async for event in stream:
                if event.type == "response.output_text.delta":
                    times.append(time.monotonic())
                elif event.type in ("response.completed", "response.incomplete"):
                    final = event.response
            previous = final.id
            usage = (final.usage.input_tokens, final.usage.input_tokens_details.cached_tokens,
                     final.usage.output_tokens)
        end = time.monotonic()
        timing = RequestTiming(f"chat-{chat}-turn-{turn}", (times[0] if times else end) - sent, 0.0, end - sent,
                               *usage, [b - a for a, b in zip(times, times[1:])])
        turns.append((timing, len(json.dumps(body).encode())))
    return turns


def run_conversations(core, chats: list[tuple[str, list[str]]], api: str, max_tokens: int) -> dict:
    """Concurrent chats through the real gateway (in this process), by chat completions or the Responses API."""
    from engine.async_engine import AsyncEngine

    async def drive(client, model: str):
        t0 = time.monotonic()
        per_chat = await asyncio.gather(*(_conversation(client, model, i, system, users, api, max_tokens)
                                          for i, (system, users) in enumerate(chats)))
        return per_chat, time.monotonic() - t0

    per_chat, duration = _through_gateway(AsyncEngine(core), drive)
    timings = [t for turns in per_chat for t, _ in turns]
    later = [t for turns in per_chat for t, _ in turns[1:]]
    row = RunResult("multiturn4", api, timings, duration, 0, 0).summary()
    row.pop("ttft_by_request_s")
    row["cached_share_later_turns"] = (sum(t.num_cached_tokens for t in later) /
                                       max(1, sum(t.num_prompt_tokens for t in later)))
    row["request_bytes_by_turn"] = [sum(turns[i][1] for turns in per_chat) / len(per_chat)
                                    for i in range(len(per_chat[0]))]
    return row


def transformers_cli() -> str | None:
    """The `transformers` CLI of this Python's environment (make runs .venv/bin/python, not on PATH)."""
    import shutil
    here = Path(sys.executable).parent / "transformers"
    return str(here) if here.is_file() else shutil.which("transformers")


def run_peer(model_path: str, workload: Workload, block_size: int = 16) -> RunResult:
    """The workload against `transformers serve --continuous-batching` (a subprocess), same clients.

    Not exercised on the machine this was written on (no fastapi/uvicorn there): treat a failure
    here as "not run", never as a figure."""
    import socket
    import urllib.request

    from openai import AsyncOpenAI

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([transformers_cli(), "serve", "--continuous-batching", "--host", "127.0.0.1", "--port",
                             str(port), "--dtype", "float32", "--device", "cpu", model_path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("transformers serve did not come up") from None
                time.sleep(1)

        async def main():
            async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0,
                                   timeout=600) as client:
                return await _drive(client, model_path, workload)

        timings, duration = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(30)
    prompts = [r.prompt_token_ids for r in workload.requests]
    return RunResult(workload.name, "peer-tf-serve", timings, duration, sum(map(len, prompts)),
                     oracle_prefill_tokens(prompts, block_size), note="transformers serve --continuous-batching; "
                     "prefill = all prompt tokens (unknown inside the peer)")


# ---- the gateway alone

def gateway_overhead(model_path: str, clients: int = 64, seconds: float = 5.0) -> dict:
    """Requests/s and latency of the gateway over an instant engine stub, 64 concurrent clients.

    The server runs in its own process (bench.stub_server); the clients (aiohttp, non-streaming chat
    completions of a short message) share the 2 cores with it, so this is a lower bound."""
    import aiohttp
    import numpy as np

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "bench.stub_server", model_path], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline().split()
        if len(line) != 2 or line[0] != "READY":
            return {"status": f"not run: stub server did not start ({' '.join(line) or 'no output'})"}
        url = f"http://127.0.0.1:{line[1]}/v1/chat/completions"
        body = {"model": "stub", "messages": [{"role": "user", "content": "Hello there, how are you?"}],
                "max_tokens": 1}

        async def main():
            latencies, errors = [], 0
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
                for _ in range(clients):  # warm-up: connections and the tokenizer's caches
                    async with session.post(url, json=body) as resp:
                        await resp.read()
                deadline = time.monotonic() + seconds

                async def client():
                    nonlocal errors
                    while time.monotonic() < deadline:
                        start = time.perf_counter()
                        async with session.post(url, json=body) as resp:
                            await resp.read()
                            errors += resp.status != 200
                        latencies.append(time.perf_counter() - start)

                start = time.monotonic()
                await asyncio.gather(*(client() for _ in range(clients)))
                elapsed = time.monotonic() - start
                loaded, latencies[:] = list(latencies), []
                deadline = time.monotonic() + min(seconds, 2.0)
                await client()  # one client alone: the latency the gateway adds to a request
                return loaded, list(latencies), errors, elapsed

        loaded, alone, errors, elapsed = asyncio.run(main())
        ms, alone_ms = np.array(loaded) * 1e3, np.array(alone) * 1e3
        p50, p99 = float(np.percentile(ms, 50)), float(np.percentile(ms, 99))
        a50, a99 = float(np.percentile(alone_ms, 50)), float(np.percentile(alone_ms, 99))
        return {"status": "ok", "clients": clients, "requests": len(loaded), "errors": errors,
                "requests_per_s": len(loaded) / elapsed, "latency_p50_ms": p50, "latency_p99_ms": p99,
                "alone_latency_p50_ms": a50, "alone_latency_p99_ms": a99,
                "summary": f"{len(loaded) / elapsed:.0f} req/s at {clients} clients (latency p50 {p50:.1f} ms / "
                           f"p99 {p99:.1f} ms, mostly queueing), one client alone p50 {a50:.2f} ms / p99 {a99:.2f} ms; "
                           f"{errors} errors (instant engine stub; client and server share the 2 cores)"}
    finally:
        proc.terminate()
        proc.wait(10)
