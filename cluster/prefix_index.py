"""Which replica holds which block hash, and the routing choice made from it (no Ray here).

The view is built from the replicas' own KV events ("stored" / "removed" block hashes, through the
app's KV event log, kv_event_log.py), so it is what the replicas hold, not a guess from request text.
A short-lived memory of where a prefix was just sent covers the time before those events arrive.
"""
from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

RECENT_TTL_S = 10.0  # how long "just sent there" counts as held, while its events are on the way
DEFAULT_MEAN_LOAD_FACTOR = 1.25  # no replica is given more than this x the mean load (as KubeAI's CHWBL)
# a match covering less of the prompt than this share is not worth a busier replica (SGLang's cache_threshold)
MIN_MATCH_SHARE = 0.5


class RoutingReason(str, enum.Enum):
    PREFIX_MATCH = "prefix_match"  # the replica holding the longest prefix
    LOAD_GUARD = "load_guard"  # the best match was at the load bound: the best one under it instead
    NO_MATCH = "no_match"  # no replica holds the first block: least-loaded, then least cache
    SHORT_MATCH = "short_match"  # the longest match is under MIN_MATCH_SHARE of the prompt: least-loaded, then it


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    replica: str
    reason: RoutingReason
    matched_blocks: int


def load_bound(loads: dict[str, int], mean_load_factor: float) -> int:
    """The most requests one replica may run once the next one is placed: ceil(factor x the mean load),
    the new request counted (consistent hashing with bounded loads, Mirrokni et al. 2016). The least
    loaded replica is always under it, so some replica always is."""
    return math.ceil(mean_load_factor * (sum(loads.values()) + 1) / len(loads))


def choose_replica(block_hashes: Sequence[bytes], loads: dict[str, int],
                   matched: Callable[[str, Sequence[bytes]], int],
                   mean_load_factor: float = DEFAULT_MEAN_LOAD_FACTOR,
                   cache_sizes: dict[str, int] | None = None,
                   min_match_share: float = MIN_MATCH_SHARE) -> RoutingDecision:
    """The replica for a request: among those under the load bound (load_bound), the one holding the
    longest prefix, ties to the less loaded. A hot prefix thus spills to the next-best holder once its
    replica runs `mean_load_factor` x the mean, instead of queueing there. Misses go to the least
    loaded, and among those to the one holding the fewest blocks (as Ray's PrefixCacheAffinityRouter
    sends a miss to the replica with the least cache): prompts sent one at a time then spread over the
    replicas instead of all landing on the first. So does a request whose longest match covers less than
    `min_match_share` of its blocks (a new chat sharing only a short system prompt): it starts a history
    that its later turns follow, and a few cached blocks are not worth placing it on a busier replica."""
    sizes = cache_sizes or {}
    bound = load_bound(loads, mean_load_factor)
    under = [r for r in loads if loads[r] < bound]
    scores = {replica: matched(replica, block_hashes) for replica in loads}
    best = max(loads, key=lambda r: (scores[r], -loads[r]))
    chosen = max(under, key=lambda r: (scores[r], -loads[r], -sizes.get(r, 0)))
    short = scores[best] < min_match_share * len(block_hashes)
    if short or scores[chosen] == 0:
        least = min(under, key=lambda r: (loads[r], -scores[r], sizes.get(r, 0)))
        reason = (RoutingReason.NO_MATCH if scores[best] == 0 else
                  RoutingReason.SHORT_MATCH if short else RoutingReason.LOAD_GUARD)
        return RoutingDecision(least, reason, scores[least])
    reason = RoutingReason.PREFIX_MATCH if scores[chosen] == scores[best] else RoutingReason.LOAD_GUARD
    return RoutingDecision(chosen, reason, scores[chosen])


class PrefixIndex:
    """Block hashes held per replica, plus routing counters. Thread-safe: Ray's router runs on
    its own event loop thread, the cluster client on the gateway's."""

    def __init__(self, recent_ttl_s: float = RECENT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._live: dict[str, None] = {}  # the replicas Ray routes to now, in the order they came up
        # what each replica holds; a replica's events can arrive before Ray reports it live
        self._held: dict[str, set[bytes]] = {}
        self._dead: set[str] = set()  # gone for good (ids are never reused): late events must not revive them
        self._recent: dict[str, dict[bytes, float]] = {}  # replica -> block hash -> expiry
        self._recent_ttl_s = recent_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self.decisions: dict[RoutingReason, int] = dict.fromkeys(RoutingReason, 0)
        self.in_flight: dict[str, int] = {}  # requests this process has routed and not seen finish

    # ---- the replicas' view

    def set_replicas(self, replicas: Iterable[str]) -> None:
        """The replicas now up; one that was up and is not any more is dead: its blocks are dropped."""
        alive = dict.fromkeys(replicas)
        with self._lock:
            for replica in [r for r in self._live if r not in alive]:
                self._forget(replica)
            self._live = alive
            for replica in alive:
                self._held.setdefault(replica, set())
                self._recent.setdefault(replica, {})
                self.in_flight.setdefault(replica, 0)

    def drop_replica(self, replica: str) -> None:
        with self._lock:
            self._forget(replica)

    def _forget(self, replica: str) -> None:
        self._live.pop(replica, None)
        self._held.pop(replica, None)
        self._recent.pop(replica, None)
        self.in_flight.pop(replica, None)
        self._dead.add(replica)

    @property
    def replicas(self) -> list[str]:
        with self._lock:
            return list(self._live)

    @property
    def dead(self) -> set[str]:
        with self._lock:
            return set(self._dead)

    def apply_events(self, replica: str, events: Iterable[tuple[str, bytes]]) -> None:
        self.apply_log((replica, kind, block_hash) for kind, block_hash in events)

    def apply_log(self, events: Iterable[tuple[str, str, bytes]]) -> None:
        """(replica, "stored" | "removed", block hash) events, in the order the replicas made them."""
        with self._lock:
            for replica, kind, block_hash in events:
                if replica in self._dead:
                    continue
                held = self._held.setdefault(replica, set())
                if kind == "stored":
                    held.add(block_hash)
                else:
                    held.discard(block_hash)
                recent = self._recent.get(replica)
                if recent:
                    recent.pop(block_hash, None)  # the replica has spoken for this hash itself

    def load_snapshot(self, snapshot: dict[str, Iterable[bytes]]) -> None:
        """Every replica's whole cache at once (a gateway that starts, or fell behind the log)."""
        with self._lock:
            for replica, hashes in snapshot.items():
                if replica not in self._dead:
                    self._held[replica] = set(hashes)

    def sizes(self) -> dict[str, int]:
        """Blocks each live replica holds, as this index sees them."""
        with self._lock:
            return {r: len(self._held.get(r, ())) for r in self._live}

    def held(self, replica: str) -> set[bytes]:
        with self._lock:
            return set(self._held.get(replica, ()))

    # ---- routing

    def matched_blocks(self, replica: str, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of the request that `replica` holds (or was just sent)."""
        now = self._clock()
        with self._lock:
            held, recent = self._held.get(replica, set()), self._recent.get(replica, {})
            n = 0
            for block_hash in block_hashes:
                if block_hash not in held and recent.get(block_hash, 0.0) <= now:
                    break
                n += 1
            return n

    def choose(self, block_hashes: Sequence[bytes], candidates: Iterable[str],
               mean_load_factor: float = DEFAULT_MEAN_LOAD_FACTOR,
               loads: dict[str, int] | None = None) -> RoutingDecision:
        """`loads`: requests on each candidate (default: those this process routed and has not seen finish)."""
        with self._lock:
            loads = {r: self.in_flight.get(r, 0) if loads is None else loads[r] for r in candidates}
            # what each holds, and what was just sent there (its events are on the way)
            sizes = {r: len(self._held.get(r, ())) + len(self._recent.get(r, ())) for r in loads}
        return choose_replica(block_hashes, loads, self.matched_blocks, mean_load_factor, sizes)

    def reserve(self, replica: str, block_hashes: Sequence[bytes]) -> None:
        """Counts a chosen request against `replica` at once (so concurrent choices spread) and
        remembers the prefix there until the replica's own events speak for it."""
        expiry = self._clock() + self._recent_ttl_s
        with self._lock:
            if replica not in self._live:
                return
            self.in_flight[replica] += 1
            recent = self._recent[replica]
            for block_hash in block_hashes:
                recent[block_hash] = expiry
            if len(recent) > 4 * len(block_hashes) + 1024:  # bounded: sweep expired entries now and then
                for block_hash in [h for h, t in recent.items() if t <= expiry - self._recent_ttl_s]:
                    del recent[block_hash]

    def release(self, replica: str) -> None:
        """Undoes reserve() (the request went elsewhere, or finished)."""
        with self._lock:
            if self.in_flight.get(replica, 0) > 0:
                self.in_flight[replica] -= 1

    def count(self, reason: RoutingReason) -> None:
        with self._lock:
            self.decisions[reason] += 1


_INDEXES: dict[str, PrefixIndex] = {}
_INDEXES_LOCK = threading.Lock()


def index_for(name: str) -> PrefixIndex:
    """The one index of a Serve app in this process: Ray builds the router itself, so the router
    and the cluster client meet here, by the app's name."""
    with _INDEXES_LOCK:
        return _INDEXES.setdefault(name, PrefixIndex())
