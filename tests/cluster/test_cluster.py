"""Engine replicas on a local Ray Serve, behind the prefix-affinity router (tiny models, 2 replicas).

One Ray instance for the whole run's Ray tests, all in this module (starting Ray is the slow part), and
two Serve apps on it: the one most tests share, and one with a disk tier and a small pool for the stats
test. The replica-killing test runs last.
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray", reason="the cluster extra is not installed (make test installs it)")
from ray import serve  # noqa: E402

from cluster.client import ClusterEngine  # noqa: E402
from cluster.replica import deployment  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.stats import SchedulerStats  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.auth import Tenant  # noqa: E402
from gateway.settings import ApiKey, GatewaySettings, Settings  # noqa: E402
from tests.support.gateway_helpers import served  # noqa: E402

pytestmark = pytest.mark.ray
APP = "test-cluster"
BLOCK = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def engine_config(tiny_llama_dir) -> EngineConfig:
    # max_num_seqs=1: a replica runs one request at a time, so others wait on it (the kill test)
    return EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK, num_kv_blocks=48, max_model_len=160,
                        max_num_seqs=1, threads=1, threads_batch=1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PROXY_PORT = _free_port()


@pytest.fixture(scope="module")
def serve_instance():
    ray.init(num_cpus=2, include_dashboard=False, namespace="prefixgate-tests", log_to_driver=False)
    try:
        # Serve's proxy on, as on KubeRay (whose readiness probes ask it): the gateway is still the HTTP face
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": PROXY_PORT})
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def cluster(serve_instance, engine_config):
    handle = serve.run(deployment(engine_config, 2, "cluster.router:PrefixAffinityRouter", index=APP,
                                  mean_load_factor=1.25, max_ongoing_requests=16), name=APP, route_prefix="/engine")
    client = asyncio.run(ClusterEngine.connect(handle, engine_config, index=APP, num_replicas=2))
    client.start()
    return client


@pytest.fixture(autouse=True)
def started(request):
    if "cluster" in request.fixturenames:  # a gateway test's cleanup stops the client; start it again
        request.getfixturevalue("cluster").start()


async def _run(client: ClusterEngine, request_id: str, prompt: list[int], params: SamplingParams = GREEDY,
               salt: str | None = None, stream: bool = True) -> list:
    return [out async for out in client.generate(request_id, prompt, params, cache_salt=salt, stream=stream)]


async def _wait_for(predicate, what: str, timeout: float = 90.0, detail=lambda: "", poll_s: float = 0.1) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(poll_s)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}{detail()}") from None


def _prompt(seed: int, n: int = 24) -> list[int]:
    return [(seed * 37 + i * 11) % 400 + 20 for i in range(n)]


def test_the_client_refuses_what_a_replica_would_refuse(cluster, engine_config):
    """The client checks a request as the replicas' engine does, before it routes anything."""
    vocab = cluster._vocab_size
    bad = {"the prompt is empty": ([], GREEDY),
           "token ids must be in": ([vocab], GREEDY),
           "exceeds the context length": (_prompt(1, engine_config.max_model_len), GREEDY),
           "logit_bias token ids must be in": (_prompt(1), SamplingParams(max_tokens=4, logit_bias={vocab: 1.0}))}
    for message, (prompt, params) in bad.items():
        with pytest.raises(ValueError, match=message):
            cluster.validate(prompt, params)


async def test_requests_sharing_a_prefix_land_on_the_replica_that_holds_it(cluster):
    a, b = _prompt(1), _prompt(2)
    # together: the router spreads the two misses over both replicas (one request each)
    await asyncio.gather(_run(cluster, "a0", a + [7]), _run(cluster, "b0", b + [7]))
    for i in range(1, 4):  # later turns of each prefix, interleaved
        out_a = await _run(cluster, f"a{i}", a + [7 + i])
        out_b = await _run(cluster, f"b{i}", b + [7 + i])
        assert out_a[-1].num_cached_tokens == 24 and out_b[-1].num_cached_tokens == 24
    caches = await cluster.replica_caches()
    hashes_a, hashes_b = cluster.block_hashes(a, None), cluster.block_hashes(b, None)
    holders_a = [r for r, held in caches.items() if hashes_a[0] in held]
    holders_b = [r for r, held in caches.items() if hashes_b[0] in held]
    assert len(holders_a) == 1 and len(holders_b) == 1 and holders_a != holders_b
    assert cluster.routing_decisions()["prefix_match"] >= 6


def test_serves_proxy_answers_the_health_route_kuberay_probes(cluster):
    """KubeRay's readiness probe of a RayService pod asks Serve's proxy on :8000/-/healthz, which fails while
    the proxy is disabled (as the manifest once had it) or no app has a route (route_prefix null, as it
    also had): no pod ever became a serve endpoint. With a route, the proxy is healthy and the route answers
    with a replica's info."""
    with urllib.request.urlopen(f"http://127.0.0.1:{PROXY_PORT}/-/healthz", timeout=30) as resp:
        assert resp.status == 200 and resp.read() == b"success"
    with urllib.request.urlopen(f"http://127.0.0.1:{PROXY_PORT}/engine", timeout=30) as resp:
        assert json.load(resp)["model_name"] == cluster.model_name


async def test_router_view_converges_to_the_replicas_caches_after_evictions(cluster):
    # 48 blocks per replica; 16 prompts of 7 blocks (and their answers) evict many of them
    await asyncio.gather(*(_run(cluster, f"evict{i}", _prompt(100 + i, 28)) for i in range(16)))
    caches = await cluster.replica_caches()
    assert len(caches) == 2
    await _wait_for(lambda: all(cluster._index.held(r) == held for r, held in caches.items()),
                    "the index to reach the replicas' caches through the KV event log")
    stats = cluster.replica_snapshots()
    assert sum(s.prefix_cache.evictions_capacity for s in stats.values()) > 0


@pytest.fixture
def gateway_settings(engine_config) -> Settings:
    keys = (ApiKey("key-a", "alice", salt="salt-a"), ApiKey("key-b", "bob", salt="salt-b"))
    return Settings(engine_config, GatewaySettings(api_keys=keys, salt_secret="test"))


async def test_a_copied_cache_salt_never_crosses_tenants_across_replicas(cluster, gateway_settings,
                                                                         aiohttp_client):
    client = await aiohttp_client(create_app(gateway_settings, engine=cluster))
    prompt = _prompt(300, 40)

    async def cached_tokens(key: str) -> int:
        body = {"model": cluster.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0,
                "cache_salt": "shared"}
        resp = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert resp.status == 200, await resp.text()
        return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached_tokens("key-a") == 0
    assert await cached_tokens("key-a") == 36  # alice hits her own prefix (9 full blocks of 40 tokens)
    # bob sends the same prompt with the same body salt: never alice's blocks, on any replica
    assert await cached_tokens("key-b") == 0
    assert await cached_tokens("key-b") == 36
    caches = await cluster.replica_caches()
    alice = cluster.block_hashes(prompt, Tenant("alice", "salt-a").cache_salt("shared"))
    bob = cluster.block_hashes(prompt, Tenant("bob", "salt-b").cache_salt("shared"))
    assert alice[0] != bob[0]
    assert sum(alice[0] in held for held in caches.values()) == 1
    assert sum(bob[0] in held for held in caches.values()) == 1


async def test_gateway_health_and_metrics_show_the_replicas(cluster, gateway_settings, aiohttp_client):
    client = await aiohttp_client(create_app(gateway_settings, engine=cluster))
    body = {"model": cluster.model_name, "prompt": _prompt(700), "max_tokens": 3, "temperature": 0}
    resp = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer key-a"})
    assert resp.status == 200, await resp.text()
    health = await (await client.get("/health")).json()
    assert health == {"status": "ok", "replicas_up": 2, "replicas": 2}
    text = await (await client.get("/metrics")).text()
    for replica in cluster.replica_snapshots():
        assert f'prefixgate_replica_prefix_cache_hits_tokens_total{{model_name="{cluster.model_name}",' \
               f'replica="{replica}"}}' in text
    assert 'prefixgate_router_decisions_total{model_name="' in text
    assert 'prefixgate_replicas_up{model_name="' in text
    # the replicas' per-step latencies reach the gateway's histograms
    assert f'prefixgate_time_to_first_token_seconds_count{{model_name="{cluster.model_name}"}} 1.0' in text
    assert f'prefixgate_inter_token_latency_seconds_count{{model_name="{cluster.model_name}"}} 2.0' in text


def _index_sizes(metrics_text: str) -> dict[str, int]:
    return {replica: int(float(n)) for replica, n in
            re.findall(r'prefixgate_router_index_blocks\{model_name="[^"]*",replica="([^"]+)"\} (\S+)', metrics_text)}


@pytest.mark.server
async def test_two_gateways_attached_to_one_app_share_its_cache_and_stored_responses(cluster, engine_config,
                                                                                    aiohttp_client, tmp_path):
    """A second gateway process (`python -m cluster serve --attach`, started after the first one cached a
    prompt) sees every replica's cache through the KV event log: a prompt cached through either gateway
    is a hit through the other, for a tenant whose salt both derive from one salt secret. Given one
    `--responses-db` file (one host), each continues and reads the other's stored responses."""
    db = str(tmp_path / "responses.sqlite3")
    settings = Settings(engine_config, GatewaySettings(api_keys=(ApiKey("key-c", "carol"),), salt_secret="shared",
                                                       responses_db=db))
    first = await aiohttp_client(create_app(settings, engine=cluster))
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"key-c": {"tenant": "carol"}}))
    gcs = ray.get_runtime_context().gcs_address

    async def cached_tokens(post, prompt: list[int]) -> int:
        body = {"model": cluster.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        status, answer = await post(body)
        assert status == 200, answer
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def via_first(body):
        resp = await first.post("/v1/completions", json=body, headers={"Authorization": "Bearer key-c"})
        return resp.status, await resp.json()

    one, two = _prompt(900, 40), _prompt(901, 40)
    assert await cached_tokens(via_first, one) == 0
    with served("--attach", "--address", gcs, "--app-name", APP, "--model", engine_config.model,
                "--api-keys-file", str(keys), "--salt-secret", "shared", "--responses-db", db,
                module="cluster") as second:
        def via_second(body):
            request = urllib.request.Request(f"{second.base_url}/completions", data=json.dumps(body).encode(),
                                             headers={"Authorization": "Bearer key-c",
                                                      "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as resp:
                return resp.status, json.load(resp)

        def second_metrics() -> str:
            with urllib.request.urlopen(second.base_url.removesuffix("/v1") + "/metrics", timeout=30) as resp:
                return resp.read().decode()

        async def post_second(body):
            return await asyncio.to_thread(via_second, body)

        async def views_agree() -> None:  # both gateways' indexes have caught up with the replicas
            # the first gateway's by block hash: with a full cache a request's stores and evictions keep the counts
            truth = await cluster.replica_caches()
            for _ in range(600):
                second_view = _index_sizes(await asyncio.to_thread(second_metrics))
                if {r: cluster._index.held(r) for r in truth} == truth and second_view == {
                        r: len(held) for r, held in truth.items()}:
                    return
                await asyncio.sleep(0.1)
            raise AssertionError(f"the gateways' indexes never reached the replicas' caches {truth}")

        await views_agree()  # from the log's snapshot: the second gateway started after `one` was cached
        assert await cached_tokens(post_second, one) == 36
        assert await cached_tokens(post_second, two) == 0
        await views_agree()  # from the log's events
        assert await cached_tokens(via_first, two) == 36
        decisions = re.findall(r'prefixgate_router_decisions_total\{model_name="[^"]*",reason="(\w+)"\} (\S+)',
                               await asyncio.to_thread(second_metrics))
        assert dict(decisions)["prefix_match"] == "1.0"

        # a conversation begun through the first gateway, continued and read back through the second
        def second_json(method: str, path: str, body: dict | None = None) -> dict:
            request = urllib.request.Request(f"{second.base_url}{path}", method=method,
                                             data=None if body is None else json.dumps(body).encode(),
                                             headers={"Authorization": "Bearer key-c",
                                                      "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as resp:
                return json.load(resp)

        turn = {"model": cluster.model_name, "max_output_tokens": 4, "temperature": 0}
        resp = await first.post("/v1/responses", json={**turn, "input": "Remember the word tangerine."},
                                headers={"Authorization": "Bearer key-c"})
        assert resp.status == 200, await resp.text()
        opening = await resp.json()
        await views_agree()  # the second gateway routes the next turn to the replica that holds the first
        follow = await asyncio.to_thread(second_json, "POST", "/responses", {
            **turn, "input": "Which word?", "previous_response_id": opening["id"]})
        assert await asyncio.to_thread(second_json, "GET", f"/responses/{opening['id']}") == opening
        resp = await first.get(f"/v1/responses/{follow['id']}", headers={"Authorization": "Bearer key-c"})
        assert resp.status == 200 and await resp.json() == follow
    assert follow["previous_response_id"] == opening["id"]
    # the first turn's prompt leads the second's, and its full blocks are read from the replica's cache
    opened, usage = opening["usage"]["input_tokens"], follow["usage"]
    assert opened // BLOCK * BLOCK <= usage["input_tokens_details"]["cached_tokens"] < usage["input_tokens"]


# ---- the replicas' stats reach the gateway whole: each replica sends its engine's StepStats as they are, and the
# cluster client publishes them, with the replicas' scheduler stats merged, through the path every engine client
# uses (the merge itself: test_cluster_stats.py)
STATS_APP = "test-cluster-stats"
STATS_BLOCKS = 9  # per replica: the third prompt of a family evicts the first one's own blocks
ALICE = {"Authorization": "Bearer key-a"}


@pytest.fixture(scope="module")
def stats_config(tiny_llama_dir, tmp_path_factory) -> EngineConfig:
    # one disk folder for both replicas: the first to lock it has a disk tier, the other has none
    return EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=STATS_BLOCKS, max_model_len=32,
                        max_num_seqs=1, threads=1, threads_batch=1,
                        kv_disk_dir=str(tmp_path_factory.mktemp("kv-disk")))


@pytest.fixture
def stats_cluster(serve_instance, stats_config):
    handle = serve.run(deployment(stats_config, 2, "cluster.router:PrefixAffinityRouter", index=STATS_APP,
                                  mean_load_factor=1.25, max_ongoing_requests=16), name=STATS_APP, route_prefix=None)
    yield asyncio.run(ClusterEngine.connect(handle, stats_config, index=STATS_APP, num_replicas=2))
    serve.delete(STATS_APP)  # its replicas stop before the next test, which kills one of the other app's


def _family(head: int, seed: int) -> list[int]:
    """Prompts of one family share their first 4 of 6 blocks, so the router keeps the family on one replica."""
    return list(range(head, head + 16)) + [(seed * 37 + i * 11) % 400 + 20 for i in range(8)]


def _samples(metrics_text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(metrics_text) for s in family.samples}


async def test_metrics_and_cache_stats_show_every_replicas_free_blocks_regrets_and_disk_hits(stats_cluster,
                                                                                            stats_config,
                                                                                            aiohttp_client):
    cluster = stats_cluster
    settings = Settings(stats_config, GatewaySettings(api_keys=(ApiKey("key-a", "alice"),), salt_secret="test"))
    client = await aiohttp_client(create_app(settings, engine=cluster))

    async def complete(prompt: list[int]) -> None:
        body = {"model": cluster.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        resp = await client.post("/v1/completions", json=body, headers=ALICE)
        assert resp.status == 200, await resp.text()

    # one family per replica (two misses at once go to both); then two more prompts of each family evict its
    # first prompt's tail, which comes back from the disk tier on one replica and is a regret on the other
    for seed in (0, 1, 2, 0):
        await asyncio.gather(complete(_family(470, seed)), complete(_family(490, seed)))
    truth: dict[str, SchedulerStats] = {}

    async def idle_reports() -> bool:  # an idle replica's latest report: every block free again
        await cluster.replica_caches()
        truth.update(cluster.replica_snapshots())
        return len(truth) == 2 and all(s.num_free_blocks == STATS_BLOCKS and s.num_running == 0
                                       for s in truth.values())

    async with asyncio.timeout(60):
        while not await idle_reports():
            await asyncio.sleep(0.2)

    caches = [s.prefix_cache for s in truth.values()]
    regrets, disk_hits = sum(c.regrets for c in caches), sum(c.disk_hits for c in caches)
    # the first prompt's 5th block, evicted: a regret where there is no disk tier, 4 tokens read back where there is
    assert (regrets, disk_hits) == (1, 4)
    disk = next(c.disk for c in caches if c.disk is not None)
    stats = await (await client.get("/v1/cache/stats", headers=ALICE)).json()
    assert stats["kv_blocks"]["total"] == stats["kv_blocks"]["free"] == 2 * STATS_BLOCKS
    assert stats["disk"] == {"blocks": disk.files, "bytes": disk.bytes}
    got = _samples(await (await client.get("/metrics")).text())
    assert got["prefixgate_kv_cache_free_blocks", ()] == 2 * STATS_BLOCKS
    assert got["prefixgate_prefix_cache_regrets_blocks_total", ()] == regrets
    assert got["prefixgate_tenant_prefix_cache_regrets_blocks_total", (("tenant", "alice"),)] == regrets
    assert got["prefixgate_prefix_cache_disk_hits_tokens_total", ()] == disk_hits


async def test_killing_a_replica_loses_no_request_that_had_not_streamed(cluster):
    """Streamed requests that had sent nothing, and every non-streamed one (held back until it finished,
    so restarted from the start), are retried on the live replica; only a stream already under way fails."""
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    streamed_before_kill: set[str] = set()
    results: dict[str, list] = {}

    async def run(request_id: str, prompt: list[int], stream: bool) -> None:
        results[request_id] = await _run(cluster, request_id, prompt, params, stream=stream)

    ids = [f"kill{i}" for i in range(6)]
    buffered = set(ids[::2])
    # all six at once: with one running request per replica, each replica runs one and queues two
    tasks = [asyncio.create_task(run(rid, _prompt(500 + i, 12), rid not in buffered)) for i, rid in enumerate(ids)]

    def generating_buffered() -> str | None:  # a non-streamed request midway: its outputs must be thrown away
        for task in tasks:  # a request that failed before it was sent would be waited for in vain
            if task.done() and task.exception() is not None:
                raise task.exception()
        if not set(cluster.request_ids()) | set(results) >= set(ids):  # all sent (the first may have ended)
            return None
        return next((rid for rid in sorted(buffered) if cluster.served_by(rid)), None)

    await _wait_for(generating_buffered, "every request sent and a non-streamed one generating", poll_s=0.005,
                    detail=lambda: f" (in flight: {sorted(cluster.request_ids())}; done: {sorted(results)})")
    victim = cluster.served_by(generating_buffered())
    streamed_before_kill.update(rid for rid in ids if cluster.served_by(rid) and rid not in buffered)
    _kill_replica(victim)
    async with asyncio.timeout(120):  # nothing hangs
        await asyncio.gather(*tasks)
    for rid in ids:
        last = results[rid][-1]
        if rid in streamed_before_kill and last.finish_reason == "error":
            assert "replica failed while streaming" in last.error
            continue
        assert last.finish_reason == "length" and last.num_output_tokens == 120, (rid, last)
        assert len([t for out in results[rid] for t in out.new_token_ids]) == 120  # nothing given twice
    assert cluster.num_retries >= 1
    assert victim not in cluster._index.replicas and not cluster._index.held(victim)
    await _wait_for(lambda: cluster.replicas_up() == 2, "serve to replace the replica")


def _kill_replica(replica: str) -> None:
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::") and actor["name"].endswith(replica):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            return
    raise AssertionError(f"no actor for replica {replica}")
