"""One Serve app's KV events in order, so that every gateway sees every replica's cache.

Each replica pushes the block hashes its pool stored and removed (a few times a second, in order); each
gateway long-polls from its cursor and applies them to its own PrefixIndex. A gateway that starts late,
or whose cursor fell out of the bounded log, gets a snapshot of what every replica holds instead. Before
this log, a replica's events rode on its response streams to whichever gateway drained them next, so
each gateway missed the others' stores and evictions and a new one started blind.

The log is a named, detached Ray actor (an async actor: a waiting pull costs nothing), created by the
first replica or gateway that asks for it and removed with the app (`remove`).
"""
from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Sequence

NAMESPACE = "prefixgate"
MAX_EVENTS = 1 << 20  # ~50 MB of 32-byte hashes; a gateway further behind than this takes a snapshot

KvEvent = tuple[str, bytes]  # ("stored" | "removed", block hash)


class KvEventLog:
    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self._log: deque[tuple[str, str, bytes]] = deque()  # (replica, kind, block hash)
        self._first = 0  # sequence number of self._log[0]
        self._max_events = max_events
        self._held: dict[str, set[bytes]] = {}  # what each replica holds, for snapshots
        self._changed = asyncio.Event()

    async def push(self, replica: str, events: Sequence[KvEvent], reset: bool = False) -> None:
        """Appends `replica`'s events; `reset`: they are its whole cache (a replica that just started)."""
        held = self._held.setdefault(replica, set())
        if reset:
            self._log.extend((replica, "removed", block_hash) for block_hash in held)
            held.clear()
        for kind, block_hash in events:
            (held.add if kind == "stored" else held.discard)(block_hash)
            self._log.append((replica, kind, block_hash))
        while len(self._log) > self._max_events:
            self._log.popleft()
            self._first += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def pull(self, cursor: int | None, wait_s: float = 1.0
                   ) -> tuple[int, dict[str, list[bytes]] | None, list[tuple[str, str, bytes]]]:
        """(new cursor, snapshot, events): the events after `cursor`, waiting up to `wait_s` for some; or,
        for no cursor or one that fell out of the log, a snapshot of every replica's cache and no events."""
        if cursor is None or not self._first <= cursor <= self._end():  # (past the end: a log started anew)
            return self._end(), {r: list(held) for r, held in self._held.items()}, []
        if cursor >= self._end():
            try:
                await asyncio.wait_for(self._changed.wait(), wait_s)
            except TimeoutError:
                return cursor, None, []
        return self._end(), None, list(itertools.islice(self._log, cursor - self._first, None))

    async def forget(self, replicas: Sequence[str]) -> None:
        """Drops dead replicas' caches from future snapshots."""
        for replica in replicas:
            self._held.pop(replica, None)

    def _end(self) -> int:
        return self._first + len(self._log)


def actor_name(app: str) -> str:
    return f"kv-events::{app}"


def event_log(app: str):
    """The app's log, created on first use (detached: it outlives whichever process created it)."""
    import ray  # here, not at the top: the log itself (KvEventLog) runs and is tested without Ray

    actor = ray.remote(num_cpus=0)(KvEventLog)
    return actor.options(name=actor_name(app), namespace=NAMESPACE, get_if_exists=True,
                         lifetime="detached").remote()


def remove(app: str) -> None:
    """Kills the app's log (when the app is deleted); nothing if there is none."""
    import ray

    try:
        ray.kill(ray.get_actor(actor_name(app), namespace=NAMESPACE))
    except ValueError:
        pass
