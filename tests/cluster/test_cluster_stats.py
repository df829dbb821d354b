"""The replicas' stats reach the gateway whole: each replica sends its engine's StepStats as they are, and
the cluster client publishes them, with the replicas' scheduler stats merged, through the path every engine
client uses. /metrics and /v1/cache/stats show free blocks, regrets, disk hits and tenant regrets (tiny
model, 2 replicas on a local Ray Serve)."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray", reason="the cluster extra is not installed (make test installs it)")
from ray import serve  # noqa: E402

from cluster.client import ClusterEngine  # noqa: E402
from cluster.replica import ReportBuffer, deployment  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.stats import PrefixCacheStats, SchedulerStats, StepStats  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.settings import ApiKey, GatewaySettings, Settings  # noqa: E402

APP = "test-cluster-stats"
BLOCKS = 9  # per replica: the third prompt of a family evicts the first one's own blocks
ALICE = {"Authorization": "Bearer key-a"}


def test_a_replica_report_is_its_engine_steps_merged_without_kv_events():
    reports = ReportBuffer(SchedulerStats(num_blocks=BLOCKS, num_free_blocks=BLOCKS))
    latest = SchedulerStats(num_blocks=BLOCKS, num_free_blocks=7, prefix_cache=PrefixCacheStats(regrets=2))
    reports.on_step(StepStats(SchedulerStats(num_free_blocks=9), num_prompt_tokens=8, ttfts=[0.1],
                              kv_events=[("stored", b"h1")], tenant_regrets={"alice": 1}))
    reports.on_step(StepStats(latest, num_generation_tokens=1, kv_events=[("removed", b"h1")],
                              tenant_regrets={"alice": 1}))

    taken = reports.take()

    assert taken == StepStats(latest, num_prompt_tokens=8, num_generation_tokens=1, ttfts=[0.1],
                              tenant_regrets={"alice": 2})
    assert reports.take_kv_events() == [("stored", b"h1"), ("removed", b"h1")]
    assert reports.take() == StepStats(latest)  # nothing since: the latest snapshot alone


@pytest.fixture(scope="module")
def engine_config(tiny_llama_dir, tmp_path_factory) -> EngineConfig:
    # one disk folder for both replicas: the first to lock it has a disk tier, the other has none
    return EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=BLOCKS, max_model_len=32,
                        max_num_seqs=1, threads=1, threads_batch=1,
                        kv_disk_dir=str(tmp_path_factory.mktemp("kv-disk")))


@pytest.fixture(scope="module")
def cluster(engine_config):
    ray.init(num_cpus=2, include_dashboard=False, namespace="prefixgate-tests", log_to_driver=False)
    serve.start(proxy_location="Disabled")  # the gateway is the HTTP face; no port to share with other tests
    try:
        handle = serve.run(deployment(engine_config, 2, "cluster.router:PrefixAffinityRouter", index=APP,
                                      mean_load_factor=1.25, max_ongoing_requests=16), name=APP, route_prefix=None)
        yield asyncio.run(ClusterEngine.connect(handle, engine_config, index=APP, num_replicas=2))
    finally:
        serve.shutdown()
        ray.shutdown()


def family(head: int, seed: int) -> list[int]:
    """Prompts of one family share their first 4 of 6 blocks, so the router keeps the family on one replica."""
    return list(range(head, head + 16)) + [(seed * 37 + i * 11) % 400 + 20 for i in range(8)]


def samples(metrics_text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(metrics_text) for s in family.samples}


@pytest.mark.ray
async def test_metrics_and_cache_stats_show_every_replicas_free_blocks_regrets_and_disk_hits(cluster, engine_config,
                                                                                            aiohttp_client):
    settings = Settings(engine_config, GatewaySettings(api_keys=(ApiKey("key-a", "alice"),), salt_secret="test"))
    client = await aiohttp_client(create_app(settings, engine=cluster))

    async def complete(prompt: list[int]) -> None:
        body = {"model": cluster.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        resp = await client.post("/v1/completions", json=body, headers=ALICE)
        assert resp.status == 200, await resp.text()

    # one family per replica (two misses at once go to both); then two more prompts of each family evict its
    # first prompt's tail, which comes back from the disk tier on one replica and is a regret on the other
    for seed in (0, 1, 2, 0):
        await asyncio.gather(complete(family(470, seed)), complete(family(490, seed)))
    truth: dict[str, SchedulerStats] = {}

    async def idle_reports() -> bool:  # an idle replica's latest report: every block free again
        await cluster.replica_caches()
        truth.update(cluster.replica_snapshots())
        return len(truth) == 2 and all(s.num_free_blocks == BLOCKS and s.num_running == 0 for s in truth.values())

    async with asyncio.timeout(60):
        while not await idle_reports():
            await asyncio.sleep(0.2)

    caches = [s.prefix_cache for s in truth.values()]
    regrets, disk_hits = sum(c.regrets for c in caches), sum(c.disk_hits for c in caches)
    # the first prompt's 5th block, evicted: a regret where there is no disk tier, 4 tokens read back where there is
    assert (regrets, disk_hits) == (1, 4)
    disk = next(c.disk for c in caches if c.disk is not None)
    stats = await (await client.get("/v1/cache/stats", headers=ALICE)).json()
    assert stats["kv_blocks"]["total"] == stats["kv_blocks"]["free"] == 2 * BLOCKS
    assert stats["disk"] == {"blocks": disk.files, "bytes": disk.bytes}
    got = samples(await (await client.get("/metrics")).text())
    assert got["prefixgate_kv_cache_free_blocks", ()] == 2 * BLOCKS
    assert got["prefixgate_prefix_cache_regrets_blocks_total", ()] == regrets
    assert got["prefixgate_tenant_prefix_cache_regrets_blocks_total", (("tenant", "alice"),)] == regrets
    assert got["prefixgate_prefix_cache_disk_hits_tokens_total", ()] == disk_hits
