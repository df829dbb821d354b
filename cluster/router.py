"""Ray Serve request routers for the engine replicas.

`PrefixAffinityRouter` ranks replicas by how many leading blocks of the request each one holds
(from the replicas' KV events, see prefix_index.py), under a bound on each one's load; round robin, Ray's default
(power of two choices) and Ray's own `PrefixCacheAffinityRouter` are the baselines the benchmark
compares against. Ray builds a router inside each DeploymentHandle (in the gateway's process) and
calls choose_replicas on its own event loop thread.
"""
from __future__ import annotations

import itertools

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (  # not public either
    PrefixCacheAffinityRouter,
)
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter  # Ray's default; not public
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from cluster.prefix_index import DEFAULT_MEAN_LOAD_FACTOR, RoutingReason, index_for

BLOCK_HASHES_KWARG = "block_hashes"  # the request's block hashes, computed by the cluster client
TARGET_REPLICA_KWARG = "replica"  # a call meant for one replica (its cache snapshot, a tenant's pins)


def _block_hashes(pending_request: PendingRequest | None) -> list[bytes]:
    if pending_request is None:
        return []
    return list(pending_request.kwargs.get(BLOCK_HASHES_KWARG) or ())


class ReportsReplicas:
    """Mixin: tells the app's index which replicas are up (the gateway's /health, dropping a dead
    replica's blocks) and sends a call meant for one replica there, whatever the routing policy."""

    def initialize_state(self, index: str = "prefixgate", **kwargs) -> None:
        self._index = index_for(index)
        super().initialize_state(**kwargs)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get(TARGET_REPLICA_KWARG) if pending_request is not None else None
        if target is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        pending_request.routing_context.should_backoff = True  # a full (or gone) target: no busy retry loop
        return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._index.set_replicas(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.drop_replica(replica_id.unique_id)


class PrefixRanking(RequestRouter):
    def initialize_state(self, mean_load_factor: float = DEFAULT_MEAN_LOAD_FACTOR, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self._mean_load_factor = mean_load_factor
        self._chosen: dict[str, tuple[str, RoutingReason]] = {}  # internal request id -> (replica, why)

    def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Requests on each replica: Ray's queue length (what the replica reported, from every gateway, plus
        what this handle sent since), or this process's own count where Ray has none fresh."""
        loads = {}
        for r in replicas:
            queued = self.replica_queue_len_cache.get(r.replica_id)
            own = self._index.in_flight.get(r.replica_id.unique_id, 0)
            loads[r.replica_id.unique_id] = own if queued is None else max(queued, own)
        return loads

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        block_hashes = _block_hashes(pending_request)
        loads = self._loads(candidate_replicas)
        decision = self._index.choose(block_hashes, by_id, self._mean_load_factor, loads=loads)
        if pending_request is not None:
            request_id = pending_request.metadata.internal_request_id
            if request_id in self._chosen:  # chosen again (the first choice was full): undo that one
                self._index.release(self._chosen[request_id][0])
            self._chosen[request_id] = (decision.replica, decision.reason)
            self._index.reserve(decision.replica, block_hashes)
            # every replica is ranked below: if none takes it, all are full, so wait before asking again
            pending_request.routing_context.should_backoff = True
        first = by_id[decision.replica]
        # the rest by load: Ray tries them in order if the first one's queue is full
        rest = sorted((r for r in candidate_replicas if r is not first), key=lambda r: loads[r.replica_id.unique_id])
        return [[first], rest]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        chosen = self._chosen.get(pending_request.metadata.internal_request_id)
        if chosen is None:
            return
        replica, reason = chosen
        if replica != replica_id.unique_id:  # Ray fell back to a later rank: count it there
            self._index.release(replica)
            self._index.reserve(replica_id.unique_id, _block_hashes(pending_request))
            self._chosen[pending_request.metadata.internal_request_id] = (replica_id.unique_id, reason)
        if BLOCK_HASHES_KWARG in pending_request.kwargs:  # generate calls only
            self._index.count(reason)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._chosen.pop(internal_request_id, None) is not None:
            self._index.release(replica_id.unique_id)



class PrefixAffinityRouter(ReportsReplicas, PrefixRanking):
    """Ours: the longest held prefix among the replicas under the load bound."""


class RoundRobin(RequestRouter):

    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        start = next(self._turn) % len(ordered)
        return [[ordered[start]], ordered[start + 1:] + ordered[:start]]


class RoundRobinRouter(ReportsReplicas, RoundRobin):
    """Each request to the next replica in turn (a baseline of the benchmark)."""


class PowerOfTwoRouter(ReportsReplicas, PowerOfTwoChoicesRequestRouter):
    """Ray's default policy (two random replicas, the shorter queue wins), reporting its replicas."""


class RayPrefixCacheRouter(ReportsReplicas, PrefixCacheAffinityRouter):
    """Ray's own prefix router (a character prefix tree in a named actor; a weak match goes to the replica
    with the least cache) with Ray's defaults, a baseline of the benchmark. It reads a prompt's text from
    an argument's `prompt`; ours are token ids, each made one character so that its tree matches tokens."""

    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        prompt_token_ids = pending_request.args[1]
        return "".join(map(_token_char, prompt_token_ids))


def _token_char(token_id: int) -> str:
    code = token_id + 0x100
    return chr(code if code < 0xD800 else code + 0x800)  # around the surrogates, which are not characters
