"""One engine replica: a Ray Serve deployment wrapping one AsyncEngine (its own KV pool and cache).

Every item a replica streams back carries what its engine reported since the previous item (token
counts, finished requests, latencies, the latest scheduler snapshot) for the gateway's metrics. Its KV
events go to the app's KV event log instead (kv_event_log.py), which every gateway follows: a cache
is shared by all of them, not only by the one whose request changed it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import ray.exceptions
from ray import serve

from cluster.kv_event_log import event_log
from cluster.prefix_index import DEFAULT_MEAN_LOAD_FACTOR
from cluster.report_buffer import ReportBuffer
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.messages import CacheDirectives
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import StepStats


logger = logging.getLogger("prefixgate.cluster")
Report = tuple[str, StepStats]  # a replica's id and what its engine did since its previous report
PUSH_INTERVAL_S = 0.05  # how often a replica sends its KV events to the log (the gateways' lag behind it)


class EngineReplica:
    """The deployment's class (see `deployment()`): one AsyncEngine per replica actor."""

    async def __init__(self, config: EngineConfig, app: str) -> None:
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.engine = AsyncEngine.from_config(config)
        pool = self.engine.core.kv.pool
        pool.kv_events = []  # opt in: the routers' view is built from these
        self.reports = ReportBuffer(self.engine.scheduler_stats())
        self.engine.add_stats_listener(self.reports.on_step)
        self._app = app
        self._log = event_log(app)
        # what the pool holds before the engine runs (blocks read back for pins kept on disk)
        await self._log.push.remote(self.replica, [("stored", h) for h in pool.cached], reset=True)
        self.engine.start()
        self._pusher = asyncio.create_task(self._push_kv_events())

    async def _push_kv_events(self) -> None:
        """Sends the engine's KV events to the log, in order, every PUSH_INTERVAL_S."""
        while True:
            await asyncio.sleep(PUSH_INTERVAL_S)
            events = self.reports.take_kv_events()
            if not events:
                continue
            try:
                await self._log.push.remote(self.replica, events)
            except ray.exceptions.RayActorError:  # the log's actor died: a new log gets this whole cache
                logger.warning("replica %s: the KV event log is gone; starting a new one", self.replica)
                self._log = event_log(self._app)
                await self._log.push.remote(self.replica, [("stored", h) for h in self._cached()], reset=True)

    def _cached(self) -> list[bytes]:
        """The pool's block hashes, read while the engine thread may change them (retried until a pass
        sees no change; each pass takes microseconds)."""
        while True:
            try:
                return list(self.engine.core.kv.pool.cached)
            except RuntimeError:  # the dict changed size during the pass
                continue

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       cache_salt: str | None = None, tenant: str | None = None,
                       block_hashes: list[bytes] | None = None,
                       cache: CacheDirectives | None = None) -> AsyncIterator[tuple[Report, RequestOutput]]:
        """`block_hashes` is read by the router only."""
        async for output in self.engine.generate(request_id, prompt_token_ids, params,
                                                 cache_salt=cache_salt, tenant=tenant, cache=cache):
            yield self._report(), output

    def __call__(self, request) -> dict:
        """An HTTP request through Serve's proxy (the app's route_prefix, e.g. /engine): this replica's info.
        The proxy's /-/healthz, which KubeRay's readiness probes ask, fails until some app has a route."""
        return self.info()

    def info(self) -> dict:
        """What the gateway needs to know before the first request."""
        engine = self.engine
        return {"replica": self.replica, "model_name": engine.model_name, "max_model_len": engine.max_model_len,
                "eos_token_ids": sorted(engine.tokenizer.eos_token_ids), "vocab_size": engine.core.vocab_size,
                "block_size": engine.config.block_size, "hash_algo": engine.config.hash_algo.value}

    def _report(self) -> Report:
        return self.replica, self.reports.take()

    def cache_snapshot(self, replica: str) -> tuple[Report, set[bytes]]:
        """The block hashes this replica's pool holds, with the report up to this moment (exact when
        the replica is idle: the engine thread changes the map while it steps). `replica` routes the call."""
        assert replica == self.replica, "the router sent a targeted call to the wrong replica"
        return self._report(), set(self._cached())

    async def cache_command(self, replica: str, op: str, tenant: str) -> tuple[Report, object]:
        """A tenant's pins ("list") or the erasure of its cache ("erase") on this replica; `replica` routes
        the call."""
        assert replica == self.replica, "the router sent a targeted call to the wrong replica"
        result = await (self.engine.list_pins(tenant) if op == "list" else self.engine.erase_cache(tenant))
        return self._report(), result

    def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError("the engine loop is not running")

    async def __del__(self) -> None:
        self._pusher.cancel()
        await self.engine.shutdown(timeout=1.0)
        try:
            await self._log.forget.remote([self.replica])
        except ray.exceptions.RayActorError:  # the app and its log are going away together
            pass


def deployment(config: EngineConfig, num_replicas: int, router: str, *, index: str,
               mean_load_factor: float, max_ongoing_requests: int, num_cpus: float = 0.0, memory_gb: float = 0.0):
    """The bound Serve application: `num_replicas` engines behind `router` (a RequestRouter class path).
    `num_cpus` / `memory_gb`: what Ray reserves for each replica, so that it places one per worker that
    has that much (0: no reservation, replicas may share a machine)."""
    from ray.serve.config import RequestRouterConfig

    kwargs = {"index": index}
    if router.endswith("PrefixAffinityRouter"):
        kwargs["mean_load_factor"] = mean_load_factor
    router_config = RequestRouterConfig(request_router_class=router, request_router_kwargs=kwargs)
    replica = serve.deployment(EngineReplica, name="engine", num_replicas=num_replicas,
                               max_ongoing_requests=max_ongoing_requests, request_router_config=router_config,
                               health_check_period_s=2.0, health_check_timeout_s=10.0,
                               ray_actor_options=_actor_resources(num_cpus, memory_gb))
    return replica.bind(config, index)


def _actor_resources(num_cpus: float, memory_gb: float) -> dict:
    resources: dict = {"num_cpus": num_cpus}
    if memory_gb:
        resources["memory"] = int(memory_gb * 2**30)
    return resources


def build_app(args: dict):
    """Serve's application builder (`import_path: cluster.replica:build_app` in a Serve config, as
    the KubeRay manifest uses): `args` holds `replicas`, `router`, `mean_load_factor`, `app_name`,
    `num_cpus` and `memory_gb` per replica (default: `threads` CPUs, no memory reservation) and any
    EngineConfig field."""
    args = dict(args)
    replicas = int(args.pop("replicas", 2))
    router = args.pop("router", "cluster.router:PrefixAffinityRouter")
    factor = float(args.pop("mean_load_factor", DEFAULT_MEAN_LOAD_FACTOR))
    index = args.pop("app_name", "prefixgate")
    num_cpus = args.pop("num_cpus", None)
    memory_gb = float(args.pop("memory_gb", 0))
    config = EngineConfig(**args)
    num_cpus = float(config.threads or 1) if num_cpus is None else float(num_cpus)
    return deployment(config, replicas, router, index=index, mean_load_factor=factor,
                      max_ongoing_requests=max(config.max_num_seqs * 4, 8), num_cpus=num_cpus, memory_gb=memory_gb)
