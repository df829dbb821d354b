"""The engine the gateway talks to when the engines are Ray Serve replicas.

Same interface as AsyncEngine (generate / abort / is_alive / stats listeners / tokenizer ...),
so gateway routes do not know which one they have. It hashes each prompt with the engine's own
block hash and the tenant's salt and hands the hashes to the router, follows the app's KV event
log into the router's index, feeds the replicas' reports into the gateway's metrics, and retries
on another replica a request whose replica died before the client was sent anything.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import ray.exceptions
from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle

from cluster.kv_event_log import event_log
from cluster.prefix_index import PrefixIndex, index_for
from cluster.replica import Report
from cluster.report_buffer import later_snapshot
from engine.client import StatsPublisher
from engine.config import EngineConfig, HashAlgo
from engine.kv.hashing import hash_full_blocks
from engine.messages import CacheDirectives, CacheErased, PinList
from engine.model.loader import resolve_model_path
from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams, validate_prompt
from engine.stats import SchedulerStats
from engine.tokenizer import load_tokenizer

logger = logging.getLogger("prefixgate.cluster")

# a replica that died or cannot be reached: the request may go to another one if nothing streamed yet
REPLICA_FAILURES = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
RETRY_BACKOFF_S = 0.2  # times the attempt: Ray's routers learn of a death a moment after the caller does
FOLLOW_WAIT_S = 1.0  # a pull of the KV event log waits this long for events
COMMAND_TIMEOUT_S = 60.0  # a tenant's pins or erasure, on every replica


class ClusterEngine(StatsPublisher):
    def __init__(self, handle: DeploymentHandle, config: EngineConfig, info: dict, tokenizer, model_path: Path,
                 app: str, num_replicas: int, max_attempts: int = 3) -> None:
        super().__init__(SchedulerStats())
        self._handle = handle
        self._app = app
        self._index: PrefixIndex = index_for(app)
        self._follower: asyncio.Task | None = None
        self._forgotten: set[str] = set()  # dead replicas the log was told to drop
        self.num_replicas = num_replicas  # as deployed; replicas_up says how many answer now
        # admission counts sequences across every replica
        self.config = config.replace(max_num_seqs=config.max_num_seqs * num_replicas)
        self._block_size = info["block_size"]  # the replicas' own: hashes must match theirs
        self._hash_algo = HashAlgo(info["hash_algo"])
        self.tokenizer = tokenizer
        self.model_name = info["model_name"]
        self.max_model_len = info["max_model_len"]
        self._vocab_size = info["vocab_size"]
        self._max_attempts = max_attempts
        self._streams: dict[str, object] = {}  # request id -> its replica response stream
        self._served_by: dict[str, str] = {}  # request id -> replica, once it streamed
        self._snapshots: dict[str, SchedulerStats] = {}  # replica -> its latest scheduler stats
        self._started = False
        self.num_retries = 0
        self.threads = None  # each replica chooses its own
        self.model_path = model_path

    @classmethod
    async def connect(cls, handle: DeploymentHandle, config: EngineConfig, *, index: str,
                      num_replicas: int) -> "ClusterEngine":
        """Waits for one replica to answer (this also builds the handle's router in this process)."""
        info = await handle.info.remote()
        path = resolve_model_path(config.model, config.model_cache_dir)
        tokenizer = await asyncio.to_thread(load_tokenizer, Path(path), set(info["eos_token_ids"]))
        return cls(handle, config, info, tokenizer, Path(path), index, num_replicas)

    # ---- lifecycle (the gateway's cleanup_ctx calls these)

    def start(self) -> None:
        self._started = True
        try:
            self._follow()
        except RuntimeError:  # no event loop yet: the first request starts following
            pass

    def _follow(self) -> None:
        """Follows the KV event log on the running loop (again, if the loop it followed on has gone)."""
        loop = asyncio.get_running_loop()
        if self._follower is None or self._follower.done() or self._follower.get_loop() is not loop:
            self._follower = loop.create_task(self._follow_kv_events())

    async def shutdown(self, timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        self._started = False
        if self._follower is not None and not self._follower.get_loop().is_closed():
            self._follower.cancel()
        self._follower = None

    async def _follow_kv_events(self) -> None:
        """Applies the app's KV event log to the router's index: every replica's stores and evictions,
        whichever gateway's request made them; a snapshot first, and whenever this gateway fell behind."""
        log, cursor = event_log(self._app), None
        while True:
            try:
                cursor, snapshot, events = await log.pull.remote(cursor, FOLLOW_WAIT_S)
            except REPLICA_FAILURES as exc:  # the log's actor died: a new one, from a snapshot
                logger.warning("the KV event log is unreachable (%s); following a new one", type(exc).__name__)
                await asyncio.sleep(1.0)
                log, cursor = event_log(self._app), None
                continue
            if snapshot is not None:
                self._index.load_snapshot(snapshot)
            self._index.apply_log(events)
            if dead := self._index.dead - self._forgotten:
                self._forgotten |= dead
                log.forget.remote(sorted(dead))

    def is_alive(self) -> bool:
        return self._started and self.replicas_up() > 0

    def replicas_up(self) -> int:
        return len(self._index.replicas)

    def health_details(self) -> dict:
        return {"replicas_up": self.replicas_up(), "replicas": self.num_replicas}

    # ---- requests

    def block_hashes(self, prompt_token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        """The prompt's block hashes exactly as a replica's engine computes them (salt included)."""
        return hash_full_blocks(prompt_token_ids, self._block_size, cache_salt=cache_salt, algo=self._hash_algo)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_token_ids, params, self._vocab_size, self.max_model_len, self.tokenizer.eos_token_ids)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       cache_salt: str | None = None, tenant: str | None = None,
                       cache: CacheDirectives | None = None, stream: bool = True) -> AsyncIterator[RequestOutput]:
        """`stream=False` (a non-streamed response): the outputs are held back until the request finished,
        so a replica that dies midway costs a retry from the start on another one, not the request."""
        self.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        if not self.is_alive():
            raise RuntimeError("no engine replica is running")
        self._follow()
        block_hashes = self.block_hashes(prompt_token_ids, cache_salt)
        method = self._handle.options(stream=True).generate
        for attempt in range(1, self._max_attempts + 1):
            outputs = method.remote(request_id, prompt_token_ids, params, cache_salt=cache_salt, tenant=tenant,
                                    block_hashes=block_hashes, cache=cache)
            self._streams[request_id] = outputs
            held: list[RequestOutput] = []
            given = finished = False  # given: the caller has had an output (a retry would repeat it)
            try:
                async for report, output in outputs:
                    self._on_report(report)
                    self._served_by[request_id] = report[0]
                    finished = output.finished
                    if stream:
                        given = True
                        yield output
                    else:
                        held.append(output)
                for output in held:
                    yield output
                return
            except RequestCancelledError:  # abort(): end like an aborted engine request
                finished = True
                yield RequestOutput(request_id, [], "", None, len(prompt_token_ids), 0, 0, finished=True,
                                    finish_reason=FinishReason.ABORT)
                return
            except REPLICA_FAILURES as exc:
                if given or attempt == self._max_attempts:
                    finished = True
                    yield _replica_failed(request_id, len(prompt_token_ids), exc, given)
                    return
                self.num_retries += 1
                logger.warning("request %s: replica failed before the client had any output (%s); retrying",
                               request_id, type(exc).__name__)
            finally:
                self._streams.pop(request_id, None)
                self._served_by.pop(request_id, None)
                if not finished:  # the consumer went away: cancelling the stream aborts it on the replica
                    outputs.cancel()
            await asyncio.sleep(RETRY_BACKOFF_S * attempt)

    async def list_pins(self, tenant: str) -> PinList:
        """Every live replica's pins of the tenant (a prefix is pinned where its requests ran); blocks add
        over replicas, as the metric's levels do."""
        lists = await self._broadcast("list", tenant)
        return PinList([pin for listed in lists for pin in listed.pins], sum(listed.num_blocks for listed in lists))

    async def erase_cache(self, tenant: str) -> CacheErased:
        total = CacheErased()
        for erased in await self._broadcast("erase", tenant):
            total.blocks += erased.blocks
            total.disk_blocks += erased.disk_blocks
            total.disk_blocks_kept += erased.disk_blocks_kept
            total.pins += erased.pins
        return total

    async def _broadcast(self, op: str, tenant: str) -> list:
        if not self.is_alive():
            raise RuntimeError("no engine replica is running")
        async with asyncio.timeout(COMMAND_TIMEOUT_S):  # a replica that dies meanwhile is never routed to
            answers = await asyncio.gather(*(self._handle.cache_command.remote(replica=r, op=op, tenant=tenant)
                                             for r in self._index.replicas))
        results = []
        for report, result in answers:
            self._on_report(report)
            results.append(result)
        return results

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.cancel()

    def request_ids(self) -> list[str]:
        return list(self._streams)

    def served_by(self, request_id: str) -> str | None:
        """The replica streaming this request now (None before its first output)."""
        return self._served_by.get(request_id)

    def num_unfinished(self) -> int:
        return len(self._streams)

    # ---- stats

    def register_metrics(self, registry) -> None:
        """Per-replica and routing series in the gateway's registry."""
        from cluster.metrics import ClusterCollector

        registry.register(ClusterCollector(self))

    def replica_snapshots(self) -> dict[str, SchedulerStats]:
        """The latest scheduler stats of each replica now up."""
        live = set(self._index.replicas)
        return {r: s for r, s in self._snapshots.items() if r in live}

    def index_blocks(self) -> dict[str, int]:
        """Blocks the router's index believes each live replica holds (replica_snapshots() has the truth)."""
        return self._index.sizes()

    def routing_decisions(self) -> dict[str, int]:
        return {reason.value: n for reason, n in self._index.decisions.items()}

    async def replica_caches(self) -> dict[str, set[bytes]]:
        """Each live replica's cached block hashes, asked of each (the router's index reaches the same
        sets once the replicas' latest events went through the KV event log)."""
        replicas = self._index.replicas
        answers = await asyncio.gather(*(self._handle.cache_snapshot.remote(replica=r) for r in replicas))
        caches: dict[str, set[bytes]] = {}
        for report, cached in answers:
            self._on_report(report)
            caches[report[0]] = cached
        return caches

    def _on_report(self, report: Report) -> None:
        """A replica's steps since its previous report, published as any engine's step is, with the
        scheduler stats of the whole cluster: the counters of every replica ever seen (they never go down
        when one dies), the levels of those up."""
        replica, stats = report
        self._snapshots[replica] = later_snapshot(self._snapshots.get(replica), stats.scheduler)
        live = set(self._index.replicas)
        merged = SchedulerStats.merged([s for r, s in self._snapshots.items() if r in live],
                                       gone=[s for r, s in self._snapshots.items() if r not in live])
        self._publish(replace(stats, scheduler=merged))


def _replica_failed(request_id: str, num_prompt_tokens: int, exc: BaseException, given: bool) -> RequestOutput:
    where = "while streaming" if given else "on every retry"
    return RequestOutput(request_id, [], "", None, num_prompt_tokens, 0, 0, finished=True,
                         finish_reason=FinishReason.ERROR,
                         error=f"the engine replica failed {where} ({type(exc).__name__})")
