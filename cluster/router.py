"""Ray Serve request routers for the engine replicas.

`PrefixAffinityRouter` ranks replicas by how many leading blocks of the request each one holds
(from the replicas' KV events, see prefix_index.py), with a load guard; `RoundRobinRouter` is
the baseline the benchmark compares against. Ray builds a router inside each DeploymentHandle
(in the gateway's process) and calls choose_replicas on its own event loop thread.
"""
from __future__ import annotations

import itertools

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter  # Ray's default; not public
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from cluster.prefix_index import DEFAULT_MAX_LOAD_SPREAD, RoutingReason, index_for

BLOCK_HASHES_KWARG = "block_hashes"  # the request's block hashes, computed by the cluster client
TARGET_REPLICA_KWARG = "replica"  # a call meant for one replica (its cache snapshot)


def _block_hashes(pending_request: PendingRequest | None) -> list[bytes]:
    if pending_request is None:
        return []
    return list(pending_request.kwargs.get(BLOCK_HASHES_KWARG) or ())


class ReportsReplicas:
    """Mixin: tells the app's index which replicas are up (the gateway's /health, dropping a dead
    replica's blocks), whatever the routing policy."""

    def initialize_state(self, index: str = "prefixgate", **kwargs) -> None:
        self._index = index_for(index)
        super().initialize_state(**kwargs)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._index.set_replicas(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.drop_replica(replica_id.unique_id)


class PrefixAffinityRouter(ReportsReplicas, RequestRouter):
    def initialize_state(self, index: str = "prefixgate", max_load_spread: int = DEFAULT_MAX_LOAD_SPREAD,
                         **kwargs) -> None:
        super().initialize_state(index=index, **kwargs)
        self._max_load_spread = max_load_spread
        self._chosen: dict[str, tuple[str, RoutingReason]] = {}  # internal request id -> (replica, why)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        target = pending_request.kwargs.get(TARGET_REPLICA_KWARG) if pending_request is not None else None
        if target is not None:
            return [[by_id[target]]] if target in by_id else []
        block_hashes = _block_hashes(pending_request)
        decision = self._index.choose(block_hashes, by_id, self._max_load_spread)
        if pending_request is not None:
            request_id = pending_request.metadata.internal_request_id
            if request_id in self._chosen:  # chosen again (the first choice was full): undo that one
                self._index.release(self._chosen[request_id][0])
            self._chosen[request_id] = (decision.replica, decision.reason)
            self._index.reserve(decision.replica, block_hashes)
        first = by_id[decision.replica]
        # the rest by load: Ray tries them in order if the first one's queue is full
        rest = sorted((r for r in candidate_replicas if r is not first),
                      key=lambda r: self._index.in_flight.get(r.replica_id.unique_id, 0))
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



class RoundRobinRouter(ReportsReplicas, RequestRouter):
    """Each request to the next replica in turn (a baseline of the benchmark)."""

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


class PowerOfTwoRouter(ReportsReplicas, PowerOfTwoChoicesRequestRouter):
    """Ray's default policy (two random replicas, the shorter queue wins), reporting its replicas."""
