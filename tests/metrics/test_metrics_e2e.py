"""/metrics of a running server after a known workload, and a real Prometheus scraping it.

The workload runs on a tiny random-weight Llama with an 8-block KV pool (block size 16),
so every count below follows from the prefix cache's rules: a hit covers whole blocks
and at most len(prompt) - 1 tokens; a prefill of n tokens takes ceil(n / 16) blocks;
max_tokens=1 computes no output token, so only prompt blocks get cached.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.settings import ANONYMOUS_TENANT, load_settings
from tests.metrics.test_metrics_configs import DASHBOARD, dashboard_exprs, expand_grafana_variables, require_binary

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 8
PROMPT_A = list(range(10, 74))  # 64 tokens: 4 blocks
PROMPT_B = list(range(100, 227))  # 127 tokens: the whole pool (the context it sets is 128: 127 + 1 generated)
PROMPT_C = list(range(300, 308))  # 8 tokens: less than a block
# (prompt, max_tokens, queried, hit, evicted blocks) per request, in order:
WORKLOAD = [
    (PROMPT_A, 1, 64, 0, 0),  # caches A's 4 blocks
    (PROMPT_A, 1, 64, 48, 0),  # 3 blocks hit (the 4th holds the last prompt token, always computed)
    (PROMPT_B, 1, 127, 0, 4),  # needs all 8 blocks: A's 4 cached blocks are evicted
    (PROMPT_A, 1, 64, 0, 3),  # A is gone: B's partial last block (no hash) and 3 of its 7 cached blocks make room
    (PROMPT_C, 5, 8, 0, 1),  # every free block is cached: taking one evicts one
]
NUM_REQUESTS = len(WORKLOAD)
QUERIED = sum(w[2] for w in WORKLOAD)  # 327
HITS = sum(w[3] for w in WORKLOAD)  # 48
EVICTED = sum(w[4] for w in WORKLOAD)  # 8
CACHED_BLOCKS_AT_END = NUM_KV_BLOCKS - 1  # C's block holds no full block, so no hash


@pytest.fixture
async def server(aiohttp_client, tiny_llama_dir):
    settings = load_settings(
        None,
        engine_overrides=dict(model=str(tiny_llama_dir), block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS,
                              max_num_batched_tokens=512, device="cpu", threads=1, threads_batch=1),
    )
    return await aiohttp_client(create_app(settings))


async def run_workload(client) -> list[dict]:
    model = (await (await client.get("/v1/models")).json())["data"][0]["id"]
    responses = []
    for prompt, max_tokens, *_ in WORKLOAD:
        resp = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                         "temperature": 0})
        assert resp.status == 200, await resp.text()
        responses.append(await resp.json())
    return responses


async def scrape(client) -> dict[tuple[str, frozenset], float]:
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(await resp.text()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of every series of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


async def scrape_when_finished(client, count: int, timeout: float = 10.0) -> dict:
    # a response can reach the client a moment before the engine thread has reported its last step
    deadline = time.monotonic() + timeout
    while True:
        samples = await scrape(client)
        if total(samples, "prefixgate_requests_finished_total") >= count or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.02)


@pytest.mark.server
async def test_counters_and_histograms_after_a_known_workload(server):
    responses = await run_workload(server)
    usages = [r["usage"] for r in responses]
    assert [u["prompt_tokens"] for u in usages] == [len(w[0]) for w in WORKLOAD]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [w[3] for w in WORKLOAD]
    completion_tokens = [u["completion_tokens"] for u in usages]
    finish_reasons = [r["choices"][0]["finish_reason"] for r in responses]

    s = await scrape_when_finished(server, NUM_REQUESTS)
    assert total(s, "prefixgate_prefix_cache_queries_tokens_total") == QUERIED
    assert total(s, "prefixgate_prefix_cache_hits_tokens_total") == HITS
    assert total(s, "prefixgate_prefix_cache_lookups_total") == NUM_REQUESTS
    assert total(s, "prefixgate_prefix_cache_evictions_blocks_total", reason="capacity") == EVICTED
    assert total(s, "prefixgate_prefix_cache_evictions_blocks_total", reason="preemption") == 0
    assert total(s, "prefixgate_prefix_cache_cached_blocks") == CACHED_BLOCKS_AT_END
    assert total(s, "prefixgate_kv_cache_blocks") == NUM_KV_BLOCKS
    assert total(s, "prefixgate_kv_cache_usage_ratio") == 0
    assert total(s, "prefixgate_requests_running") == 0 and total(s, "prefixgate_requests_waiting") == 0
    assert total(s, "prefixgate_preemptions_total") == 0

    assert total(s, "prefixgate_prompt_tokens_computed_total") == QUERIED - HITS
    assert total(s, "prefixgate_prompt_tokens_total") == QUERIED
    assert total(s, "prefixgate_prompt_tokens_cached_total") == HITS
    assert total(s, "prefixgate_generation_tokens_total") == sum(completion_tokens)
    for reason in ("stop", "length", "abort", "error"):
        assert total(s, "prefixgate_requests_finished_total", finish_reason=reason) == finish_reasons.count(reason)

    # every request counted once in each histogram
    for histogram in ("e2e_request_latency_seconds", "request_queue_time_seconds", "time_to_first_token_seconds",
                      "request_prefill_time_seconds", "request_prompt_length_tokens",
                      "request_generation_length_tokens"):
        assert total(s, f"prefixgate_{histogram}_count") == NUM_REQUESTS, histogram
    assert total(s, "prefixgate_request_prompt_length_tokens_sum") == QUERIED
    assert total(s, "prefixgate_request_generation_length_tokens_sum") == sum(completion_tokens)
    prompt_buckets = [total(s, "prefixgate_request_prompt_length_tokens_bucket", le=le)
                      for le in ("5.0", "10.0", "100.0", "200.0")]
    assert prompt_buckets == [0, 1, 4, 5]
    assert total(s, "prefixgate_inter_token_latency_seconds_count") == sum(c - 1 for c in completion_tokens)

    # per tenant: without API keys every request is the anonymous tenant's
    assert total(s, "prefixgate_tenant_prefix_cache_queries_tokens_total", tenant=ANONYMOUS_TENANT) == QUERIED
    assert total(s, "prefixgate_tenant_prefix_cache_hits_tokens_total", tenant=ANONYMOUS_TENANT) == HITS
    assert total(s, "prefixgate_tenant_prefix_cache_queries_tokens_total", tenant="other") == 0

    assert total(s, "prefixgate_http_requests_total", route="/v1/completions", method="POST",
                 status="200") == NUM_REQUESTS
    assert total(s, "prefixgate_http_request_duration_seconds_count", route="/v1/completions",
                 method="POST") == NUM_REQUESTS
    assert total(s, "prefixgate_http_requests_total", route="/v1/models", method="GET", status="200") == 1


# ---- a real Prometheus


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrometheusNotReady(Exception):
    pass


class Prometheus:
    """A prometheus process on loopback scraping one target every second."""

    def __init__(self, binary: str, target: str, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": "prefixgate", "static_configs": [{"targets": [target]}]}]}
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self.args = [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={workdir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.process = await asyncio.create_subprocess_exec(*self.args, stdout=log, stderr=log)

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    async def query(self, session, expr: str) -> list[dict]:
        async with session.get(f"{self.url}/api/v1/query", params={"query": expr}) as resp:
            if resp.status == 503:  # listening, but its storage not ready yet (as /-/ready would say)
                raise PrometheusNotReady(await resp.text())
            body = await resp.json()
        assert resp.status == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    async def wait_for(self, session, expr: str, predicate, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.returncode is None, f"prometheus exited:\n{self.log()}"
            try:
                result = await self.query(session, expr)
                if predicate(result):
                    return result
            except (aiohttp.ClientConnectionError, PrometheusNotReady):  # not listening or not ready yet
                pass
            assert time.monotonic() < deadline, f"timed out waiting for {expr}\n{self.log()}"
            await asyncio.sleep(0.2)


def scalar(result: list[dict]) -> float:
    return float(result[0]["value"][1]) if result else math.nan


@pytest.fixture
async def prometheus(server, tmp_path):
    binary = require_binary("prometheus")
    prom = Prometheus(binary, f"127.0.0.1:{server.server.port}", tmp_path)
    await prom.start()
    try:
        yield prom
    finally:
        await prom.stop()


@pytest.mark.prometheus
async def test_every_dashboard_query_returns_data_from_a_real_prometheus(server, prometheus):
    async with aiohttp.ClientSession() as session:
        # a scrape before the workload, so rate() over the window sees the counters move
        await prometheus.wait_for(session, 'up{job="prefixgate"}', lambda r: scalar(r) == 1)
        await run_workload(server)
        await prometheus.wait_for(session, "sum(prefixgate_requests_finished_total)",
                                  lambda r: scalar(r) == NUM_REQUESTS)
        # series born during the workload (HTTP routes) need two samples before rate() sees them
        await prometheus.wait_for(session, "min(count_over_time(prefixgate_http_requests_total[1m]))",
                                  lambda r: scalar(r) >= 2)

        empty = []
        for expr in dashboard_exprs():
            query = expand_grafana_variables(expr)
            if not await prometheus.query(session, query):
                empty.append(query)
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

        hit_rate = ("sum(rate(prefixgate_prefix_cache_hits_tokens_total[1m])) / "
                    "sum(rate(prefixgate_prefix_cache_queries_tokens_total[1m]))")
        assert scalar(await prometheus.query(session, hit_rate)) == pytest.approx(HITS / QUERIED)
        ttft_p50 = ("histogram_quantile(0.5, sum by (le) "
                    "(rate(prefixgate_time_to_first_token_seconds_bucket[1m])))")
        assert 0 < scalar(await prometheus.query(session, ttft_p50)) < 60

        # the dashboard's variables (label_values(metric, label)) list values too
        for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
            if variable["type"] == "query":
                metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"]).groups()
                async with session.get(f"{prometheus.url}/api/v1/label/{label}/values",
                                       params={"match[]": metric}) as resp:
                    assert (await resp.json())["data"], variable["name"]
