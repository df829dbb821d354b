"""Per-replica and routing series, read from the cluster client at scrape time.

Added to the gateway's registry (the gateway calls `register_metrics`), so one /metrics scrape of
the gateway shows every replica, each under its own `replica` label.
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cluster.prefix_index import RoutingReason
from metrics.prometheus import PREFIX

# every series name the collector exposes (counters with their _total suffix), for the dashboard's checks
SERIES = frozenset(f"{PREFIX}{name}" for name in (
    "replica_prefix_cache_queries_tokens_total", "replica_prefix_cache_hits_tokens_total",
    "replica_requests_running", "replica_cached_blocks", "router_index_blocks", "router_decisions_total",
    "router_retries_total", "replicas_up"))


class ClusterCollector(Collector):
    def __init__(self, client) -> None:
        self._client = client

    def collect(self):
        client, model = self._client, self._client.model_name
        snapshots = client.replica_snapshots()
        queries = CounterMetricFamily(f"{PREFIX}replica_prefix_cache_queries_tokens",
                                      "Prompt tokens looked up in a replica's prefix cache.",
                                      labels=["model_name", "replica"])
        hits = CounterMetricFamily(f"{PREFIX}replica_prefix_cache_hits_tokens",
                                   "Prompt tokens found in a replica's prefix cache.", labels=["model_name", "replica"])
        running = GaugeMetricFamily(f"{PREFIX}replica_requests_running", "Requests in a replica's running batch.",
                                    labels=["model_name", "replica"])
        cached = GaugeMetricFamily(f"{PREFIX}replica_cached_blocks", "Blocks holding a block hash, per replica.",
                                   labels=["model_name", "replica"])
        index = GaugeMetricFamily(f"{PREFIX}router_index_blocks", "Blocks this gateway's router believes a replica "
                                  "holds (from the KV event log; compare with replica_cached_blocks).",
                                  labels=["model_name", "replica"])
        for replica, blocks in sorted(client.index_blocks().items()):
            index.add_metric([model, replica], blocks)
        for replica, s in sorted(snapshots.items()):
            queries.add_metric([model, replica], s.prefix_cache.queries)
            hits.add_metric([model, replica], s.prefix_cache.hits)
            running.add_metric([model, replica], s.num_running)
            cached.add_metric([model, replica], s.prefix_cache.cached_blocks)
        decisions = CounterMetricFamily(f"{PREFIX}router_decisions",
                                        f"Requests routed, by reason ({', '.join(RoutingReason)}).",
                                        labels=["model_name", "reason"])
        for reason, n in client.routing_decisions().items():
            decisions.add_metric([model, reason], n)
        retries = CounterMetricFamily(f"{PREFIX}router_retries", "Requests retried on another replica after "
                                      "theirs failed before streaming.", labels=["model_name"])
        retries.add_metric([model], client.num_retries)
        up = GaugeMetricFamily(f"{PREFIX}replicas_up", "Engine replicas the router can reach.", labels=["model_name"])
        up.add_metric([model], client.replicas_up())
        yield from (queries, hits, running, cached, index, decisions, retries, up)
