"""A replica's report buffer: what its engine did since the last item it streamed back, and its KV events since
the last push to the app's KV event log. Plain Python (no Ray), so its tests run in the fast lane."""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.stats import SchedulerStats, StepStats

if TYPE_CHECKING:
    from cluster.kv_event_log import KvEvent


class ReportBuffer:
    """Merges the engine's per-step stats (engine thread) until the next item goes out, and its KV events
    until the next push to the log (event loop)."""

    def __init__(self, first: SchedulerStats) -> None:
        self._lock = threading.Lock()
        self._stats = StepStats(first)
        self._kv_events: list[KvEvent] = []

    def on_step(self, stats: StepStats) -> None:
        with self._lock:
            self._kv_events.extend(stats.kv_events)
            # the events go to the log alone: every gateway follows it, not only the one that gets this report
            self._stats = self._stats.merge(replace(stats, kv_events=[]))

    def take(self) -> StepStats:
        """What the engine did since the previous take, with its latest scheduler snapshot."""
        with self._lock:
            taken, self._stats = self._stats, StepStats(self._stats.scheduler)
            return taken

    def take_kv_events(self) -> list[KvEvent]:
        with self._lock:
            taken, self._kv_events = self._kv_events, []
            return taken


def later_snapshot(held: SchedulerStats | None, stats: SchedulerStats) -> SchedulerStats:
    """The later of a replica's two scheduler snapshots, by its engine's steps. Its reports reach a gateway on the
    streams of separate requests, so an older one may arrive after a newer; kept, its counters would drop, which
    the metrics read as an engine restart, adding their whole value again. (A replica's steps only grow: a
    replica whose engine failed is replaced by a new one, with its own id.)"""
    return stats if held is None or stats.num_steps >= held.num_steps else held
