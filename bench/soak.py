"""Soak: many concurrent requests at a real gateway over loopback, with faults, until nothing is left.

    python -m bench.soak [--requests 20000 --concurrency 128 ...]

A tiny KV pool forces evictions and preemptions; the mix has streams, n > 1, clients that
disconnect at random points, explicit engine aborts and engine steps that raise. At the end
every request must have an outcome (completed, an error object, a 429, or the client's own
disconnect), no KV block may stay referenced and the memory of the last third of the run must
not exceed the first third's by more than a tolerance. Without --model it builds the tiny
random-weight Llama the tests use.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from aiohttp import web

from bench.engine_faults import assert_blocks_released, set_step_hook
from bench.tiny_models import build_tiny_model
from engine.config import EngineConfig
from gateway.app import IN_FLIGHT, create_app
from gateway.settings import GatewaySettings, Settings
from gateway.state import STATE

ERROR_KEYS = {"message", "type", "param", "code"}
LOST = ("hung", "malformed")  # outcomes that mean a request was lost or answered wrongly


@dataclass(frozen=True, slots=True)
class SoakParams:
    requests: int = 2000
    concurrency: int = 72  # client tasks; above max_num_seqs + max_waiting_requests some get 429
    stream_fraction: float = 0.5
    disconnect_fraction: float = 0.2  # clients that go away at a random point
    abort_every_s: float = 0.05  # how often the engine aborts one random running request
    n_fraction: float = 0.1  # requests with n = 2 or 3
    step_failure_rate: float = 0.02  # engine steps that raise
    retry_backoff_s: float = 0.2  # a client's pause after a 429
    max_tokens: int = 8
    num_kv_blocks: int = 24  # tiny: running requests preempt each other, cached prefixes get evicted
    block_size: int = 16
    max_num_seqs: int = 16
    max_waiting_requests: int = 48
    request_timeout_s: float = 60.0  # a request without an outcome by then counts as hung
    seed: int = 0


@dataclass(slots=True)
class SoakReport:
    params: SoakParams
    # completed | error:<status or "stream">:<code> | rejected_429 | disconnected | hung | malformed
    outcomes: Counter = field(default_factory=Counter)
    step_failures: int = 0
    aborts_sent: int = 0
    evictions: int = 0
    preemptions: int = 0
    hit_rate: float = 0.0
    leak_error: str | None = None  # assert_blocks_released's message, None when every block came back
    rss_mb: list[float] = field(default_factory=list)  # after each third of the requests
    py_blocks: list[int] = field(default_factory=list)  # sys.getallocatedblocks() after each third
    wall_s: float = 0.0

    @property
    def sent(self) -> int:
        return sum(self.outcomes.values())

    @property
    def lost(self) -> int:
        return sum(self.outcomes[k] for k in LOST)

    @property
    def rss_growth_mb(self) -> float:
        return self.rss_mb[-1] - self.rss_mb[0] if len(self.rss_mb) >= 2 else 0.0

    @property
    def py_blocks_growth(self) -> float:
        return (self.py_blocks[-1] - self.py_blocks[0]) / self.py_blocks[0] if len(self.py_blocks) >= 2 else 0.0

    def lines(self) -> list[str]:
        o = self.outcomes
        errors = {k: v for k, v in sorted(o.items()) if k.startswith("error:")}
        return [
            f"requests sent       {self.sent} in {self.wall_s:.1f}s ({self.sent / max(self.wall_s, 1e-9):.0f}/s), "
            f"concurrency {self.params.concurrency}",
            f"completed           {o['completed']}",
            f"error objects       {sum(errors.values())} {errors}",
            f"429 rejected        {o['rejected_429']}",
            f"client disconnects  {o['disconnected']}",
            f"lost (hung/bad)     {self.lost} (hung {o['hung']}, malformed {o['malformed']})",
            f"faults injected     {self.step_failures} failed steps, {self.aborts_sent} engine aborts sent",
            f"evictions           {self.evictions} blocks; preemptions {self.preemptions}; "
            f"hit rate {self.hit_rate:.1%}",
            f"blocks leaked       {0 if self.leak_error is None else self.leak_error}",
            f"RSS after thirds    {', '.join(f'{m:.1f}' for m in self.rss_mb)} MB "
            f"(growth first->last {self.rss_growth_mb:+.1f} MB)",
            f"python heap blocks  {', '.join(map(str, self.py_blocks))} (growth {self.py_blocks_growth:+.1%})",
        ]


def settings_for(model: str, p: SoakParams) -> Settings:
    engine = EngineConfig(model=model, block_size=p.block_size, num_kv_blocks=p.num_kv_blocks,
                          max_num_seqs=p.max_num_seqs, max_model_len=256, max_num_batched_tokens=256,
                          seed=p.seed)
    gateway = GatewaySettings(host="127.0.0.1", port=0, max_waiting_requests=p.max_waiting_requests,
                              max_tokens_limit=p.max_tokens, salt_secret="soak", log_level="warning",
                              engine_process=False)  # in process: the soak injects step failures
    return Settings(engine, gateway)


async def run_soak(model: str, p: SoakParams) -> SoakReport:
    """Starts the gateway on a loopback port in this event loop, drives it, tears it down."""
    app = create_app(settings_for(model, p))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        return await _drive(app, f"http://{host}:{port}", p)
    finally:
        await runner.cleanup()


async def _drive(app: web.Application, base: str, p: SoakParams) -> SoakReport:
    state = app[STATE]
    engine = state.engine
    report = SoakReport(p)
    set_step_hook(engine, _failing_step_hook(p, report))
    rng = random.Random(p.seed)
    workload = _Workload(engine.tokenizer, state.model_name, p, rng)
    proc = psutil.Process()
    thirds = {p.requests // 3, 2 * p.requests // 3}
    start = time.monotonic()
    next_index = 0
    done = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal next_index, done
        while next_index < p.requests:
            spec = workload.request()
            next_index += 1
            outcome = await _one(session, base, spec, p.request_timeout_s)
            if outcome == "rejected_429":
                await asyncio.sleep(p.retry_backoff_s)  # a polite client backs off before its next request
            report.outcomes[outcome] += 1
            done += 1
            if done in thirds:
                report.rss_mb.append(_rss_mb(proc))
                report.py_blocks.append(sys.getallocatedblocks())

    aborter = asyncio.create_task(_abort_randomly(engine, p, rng, report))
    connector = aiohttp.TCPConnector(limit=p.concurrency)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.gather(*(client(session) for _ in range(p.concurrency)))
    finally:
        aborter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await aborter
        set_step_hook(engine, None)
    report.wall_s = time.monotonic() - start
    await _settle(app, engine, report)
    report.rss_mb.append(_rss_mb(proc))
    report.py_blocks.append(sys.getallocatedblocks())
    stats = engine.scheduler_stats()
    report.evictions = stats.prefix_cache.evictions_capacity
    report.preemptions = stats.num_preemptions
    report.hit_rate = stats.prefix_cache.hit_rate
    return report


def _failing_step_hook(p: SoakParams, report: SoakReport):
    rng = random.Random(p.seed + 1)  # the engine thread's own generator

    def hook() -> None:
        if rng.random() < p.step_failure_rate:
            report.step_failures += 1
            raise RuntimeError("soak: injected step failure")
    return hook


async def _abort_randomly(engine: Any, p: SoakParams, rng: random.Random, report: SoakReport) -> None:
    while True:
        await asyncio.sleep(p.abort_every_s)
        running = engine.request_ids()
        if running:
            engine.abort(rng.choice(running))
            report.aborts_sent += 1


async def _settle(app: web.Application, engine: Any, report: SoakReport, timeout: float = 10.0) -> None:
    """Waits until the gateway and the engine hold nothing, then checks that every block came back."""
    deadline = time.monotonic() + timeout
    state = app[STATE]
    while True:
        try:
            assert not app[IN_FLIGHT].tasks, f"{len(app[IN_FLIGHT].tasks)} handlers still running"
            assert state.admission.in_flight == 0, f"admission still counts {state.admission.in_flight}"
            assert engine.num_unfinished() == 0, f"{engine.num_unfinished()} engine requests unfinished"
            assert_blocks_released(engine)
            report.leak_error = None
            break
        except AssertionError as exc:
            report.leak_error = str(exc) or "assertion failed"
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    gc.collect()


@dataclass(frozen=True, slots=True)
class RequestSpec:
    path: str
    body: dict[str, Any]
    stream: bool
    disconnect_after: float | None  # seconds (non-stream) or events (stream) before the client leaves


class _Workload:
    """A few shared prefixes (so the cache hits and evicts) with random suffixes."""

    def __init__(self, tokenizer: Any, model: str, p: SoakParams, rng: random.Random) -> None:
        self.model, self.p, self.rng = model, p, rng
        vocab = tokenizer.vocab_size
        self.prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))] for _ in range(6)]
        self.vocab = vocab

    def request(self) -> RequestSpec:
        rng, p = self.rng, self.p
        stream = rng.random() < p.stream_fraction
        n = rng.choice((2, 3)) if rng.random() < p.n_fraction else 1
        common = {"model": self.model, "max_tokens": rng.randint(1, p.max_tokens), "n": n, "stream": stream,
                  "ignore_eos": rng.random() < 0.5, "temperature": rng.choice((0, 0.8))}
        if rng.random() < 0.7:
            prompt = rng.choice(self.prefixes) + [rng.randrange(3, self.vocab) for _ in range(rng.randint(1, 40))]
            path, body = "/v1/completions", {**common, "prompt": prompt}
        else:
            words = " ".join(rng.choice(("cache", "block", "prefix", "hello", "world")) for _ in range(8))
            path, body = "/v1/chat/completions", {**common, "messages": [
                {"role": "system", "content": "soak system prompt " * 4}, {"role": "user", "content": words}]}
        disconnect = None
        if rng.random() < p.disconnect_fraction:
            disconnect = float(rng.randint(1, 4)) if stream else rng.uniform(0.0, 0.3)
        return RequestSpec(path, body, stream, disconnect)


async def _one(session: aiohttp.ClientSession, base: str, spec: RequestSpec, timeout: float) -> str:
    try:
        async with asyncio.timeout(timeout):
            if spec.disconnect_after is not None and not spec.stream:
                return await _leave_early(session, base, spec)
            async with session.post(base + spec.path, json=spec.body) as resp:
                return await _classify(resp, spec)
    except TimeoutError:
        return "hung"
    except aiohttp.ClientError:
        return "malformed"  # the server closed a connection it should have answered on


async def _leave_early(session: aiohttp.ClientSession, base: str, spec: RequestSpec) -> str:
    """A non-streaming client that gives up after a random delay (if the answer is not there yet)."""
    async def call() -> str:
        async with session.post(base + spec.path, json=spec.body) as resp:
            return await _classify(resp, spec)

    task = asyncio.create_task(call())
    done, _ = await asyncio.wait({task}, timeout=spec.disconnect_after)
    if done:
        return task.result()
    task.cancel()  # drops the connection: the server cancels the handler and aborts the engine requests
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return "disconnected"


async def _classify(resp: aiohttp.ClientResponse, spec: RequestSpec) -> str:
    if resp.status != 200:
        body = await resp.json(content_type=None)
        if not _is_error(body):
            return "malformed"
        if resp.status == 429:
            return "rejected_429"
        return f"error:{resp.status}:{body['error']['code']}"
    if not spec.stream:
        body = await resp.json()
        ok = len(body.get("choices", ())) == spec.body["n"] and all(c["finish_reason"] in ("stop", "length")
                                                         for c in body["choices"])
        return "completed" if ok else "malformed"
    events = 0
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            return "completed"
        event = json.loads(data)
        if "error" in event:
            return f"error:stream:{event['error']['code']}" if _is_error(event) else "malformed"
        events += 1
        if spec.disconnect_after is not None and events >= spec.disconnect_after:
            resp.close()  # the client goes away mid-stream
            return "disconnected"
    return "malformed"  # the stream ended without [DONE] or an error event


def _is_error(body: Any) -> bool:
    return (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)
            and set(body["error"]) == ERROR_KEYS and isinstance(body["error"]["message"], str))


def _rss_mb(proc: psutil.Process) -> float:
    gc.collect()
    return proc.memory_info().rss / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: a tiny random-weight Llama)")
    for f in dataclasses.fields(SoakParams):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    parser.add_argument("--max-rss-growth-mb", type=float, default=64.0, help="fail above this growth")
    args = parser.parse_args(argv)
    params = SoakParams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SoakParams)})
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("prefixgate.engine").setLevel(logging.CRITICAL)  # the injected failures log tracebacks
    logging.getLogger("gateway").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_tiny_model(Path(tmp), "llama"))
        import uvloop

        report = uvloop.run(run_soak(model, params))
    for line in report.lines():
        print(line)
    failed = report.lost or report.leak_error or report.rss_growth_mb > args.max_rss_growth_mb
    print("FAIL" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
