"""Prometheus series built from the engine's stats dataclasses and the gateway's HTTP timings.

One small class per group of series; `Metrics` owns them and the registry. Every
engine series carries `model_name`, bound once at construction, so `on_step` only
does dict-free arithmetic and `inc`/`set`/`observe` calls (prometheus_client is
thread-safe; our own last-seen values are touched under one lock).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.stats import FinishedRequestStats, PrefixCacheStats, SchedulerStats, StepStats

PREFIX = "prefixgate_"
OTHER_TENANT = "other"
FINISH_REASONS = ("stop", "length", "abort", "error")
PIN_RELEASE_REASONS = ("expired", "pressure", "erased")
PIN_REFUSALS = ("tenant_quota", "pool_quota", "not_cached")

# Seconds: from a cached short prompt's TTFT on a GPU to a long CPU generation.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)
INTER_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)
# a stream lasts as long as its generation: long CPU generations run for many minutes
HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                300.0, 600.0, 1200.0, 1800.0, 3600.0)


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to and including max_value (token counts)."""
    buckets: list[int] = []
    magnitude = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * magnitude
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        magnitude *= 10


TOKEN_BUCKETS = one_two_five_buckets(2**15)


class _Delta:
    """Turns a cumulative value into counter increments (keeps the last value seen)."""

    __slots__ = ("_counter", "_last")

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._last = 0

    def update(self, cumulative: int) -> None:
        delta = cumulative - self._last
        if delta < 0:  # the source restarted from zero: its whole value is new
            delta = cumulative
        if delta:
            self._counter.inc(delta)
        self._last = cumulative


class PrefixCacheMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        queries = Counter(f"{PREFIX}prefix_cache_queries_tokens_total",
                          "Prompt tokens looked up in the prefix cache.", labels, registry=registry)
        hits = Counter(f"{PREFIX}prefix_cache_hits_tokens_total",
                       "Prompt tokens found in the prefix cache (not computed).", labels, registry=registry)
        lookups = Counter(f"{PREFIX}prefix_cache_lookups_total",
                          "Prefix cache lookups (one per admitted request).", labels, registry=registry)
        evictions = Counter(f"{PREFIX}prefix_cache_evictions_blocks_total",
                            "Cached blocks whose hash was dropped, by reason.", ["model_name", "reason"],
                            registry=registry)
        self.cached_blocks = Gauge(f"{PREFIX}prefix_cache_cached_blocks",
                                   "Blocks currently holding a registered block hash.", labels,
                                   registry=registry).labels(model_name)
        self.usage = Gauge(f"{PREFIX}kv_cache_usage_ratio",
                           "Fraction of KV blocks referenced, by running requests or by pinned prefixes.", labels,
                           registry=registry).labels(model_name)
        self._queries = _Delta(queries.labels(model_name))
        self._hits = _Delta(hits.labels(model_name))
        self._lookups = _Delta(lookups.labels(model_name))
        self._evicted_capacity = _Delta(evictions.labels(model_name, "capacity"))
        self._evicted_preemption = _Delta(evictions.labels(model_name, "preemption"))
        self._evicted_spill = _Delta(evictions.labels(model_name, "spill"))
        self._evicted_erase = _Delta(evictions.labels(model_name, "erase"))
        self._regrets = _Delta(Counter(f"{PREFIX}prefix_cache_regrets_blocks_total",
                                       "Evicted blocks asked for again soon after (a bounded ghost list of "
                                       "recently evicted hashes), not served by any tier.", labels,
                                       registry=registry).labels(model_name))
        self.disk = DiskTierMetrics(registry, model_name)

    def update(self, stats: PrefixCacheStats) -> None:
        self._queries.update(stats.queries)
        self._hits.update(stats.hits)
        self._lookups.update(stats.requests)
        self._evicted_capacity.update(stats.evictions_capacity)
        self._evicted_preemption.update(stats.evictions_preemption)
        self._evicted_spill.update(stats.evictions_spill)
        self._evicted_erase.update(stats.evictions_erase)
        self._regrets.update(stats.regrets)
        self.disk.update(stats)
        self.cached_blocks.set(stats.cached_blocks)
        self.usage.set(stats.usage)


class DiskTierMetrics:
    """The disk tier of the prefix cache; every series exists (at 0) without one, so dashboards stay whole."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]

        def counter(name: str, doc: str) -> _Delta:
            return _Delta(Counter(f"{PREFIX}{name}", doc, labels, registry=registry).labels(model_name))

        self._hits = counter("prefix_cache_disk_hits_tokens_total",
                             "Prompt tokens loaded from the disk tier instead of computed (part of the hits).")
        self._writes = counter("kv_disk_writes_blocks_total", "Blocks written to the disk tier.")
        self._evictions = counter("kv_disk_evictions_blocks_total", "Block files dropped by the disk tier's LRU.")
        self._corrupt = counter("kv_disk_corrupt_blocks_total",
                                "Block files that failed a check (checksum, model, tokens): deleted, never served.")
        self._dropped = counter("kv_disk_dropped_spills_blocks_total",
                                "Evicted blocks not spilled: the disk writer was too far behind, or "
                                "backing off after a failed write.")
        write_errors = Counter(f"{PREFIX}kv_disk_write_errors_total",
                               "Block writes to the disk tier that failed, by reason (no_space, permission, io); "
                               "the block is lost to the tier, the request never fails.", ["model_name", "reason"],
                               registry=registry)
        self._write_errors = {reason: _Delta(write_errors.labels(model_name, reason))
                              for reason in ("no_space", "permission", "io")}
        self.files = Gauge(f"{PREFIX}kv_disk_blocks", "Block files in the disk tier.", labels,
                           registry=registry).labels(model_name)
        self.bytes = Gauge(f"{PREFIX}kv_disk_bytes", "Bytes of block files in the disk tier.", labels,
                           registry=registry).labels(model_name)

    def update(self, stats: PrefixCacheStats) -> None:
        self._hits.update(stats.disk_hits)
        if stats.disk is None:
            return
        self._writes.update(stats.disk.writes)
        self._evictions.update(stats.disk.evictions)
        self._corrupt.update(stats.disk.corrupt)
        self._dropped.update(stats.disk.dropped_spills)
        for reason, delta in self._write_errors.items():
            delta.update(stats.disk.write_errors.get(reason, 0))
        self.files.set(stats.disk.files)
        self.bytes.set(stats.disk.bytes)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.running = Gauge(f"{PREFIX}requests_running", "Requests in the running batch.", labels,
                             registry=registry).labels(model_name)
        self.waiting = Gauge(f"{PREFIX}requests_waiting", "Requests waiting to be scheduled.", labels,
                             registry=registry).labels(model_name)
        self.num_blocks = Gauge(f"{PREFIX}kv_cache_blocks", "KV blocks in the pool.", labels,
                                registry=registry).labels(model_name)
        self.num_free_blocks = Gauge(f"{PREFIX}kv_cache_free_blocks",
                                     "KV blocks in the free queue (empty, or cached and hittable).", labels,
                                     registry=registry).labels(model_name)
        self._preemptions = _Delta(Counter(f"{PREFIX}preemptions_total",
                                           "Running requests preempted (by recompute) to free blocks.",
                                           labels, registry=registry).labels(model_name))
        self._steps = _Delta(Counter(f"{PREFIX}engine_steps_total", "Engine steps run.", labels,
                                     registry=registry).labels(model_name))

    def update(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.num_blocks.set(stats.num_blocks)
        self.num_free_blocks.set(stats.num_free_blocks)
        self._preemptions.update(stats.num_preemptions)
        self._steps.update(stats.num_steps)


class TokenMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.prompt_computed = Counter(f"{PREFIX}prompt_tokens_computed_total",
                                       "Prompt tokens prefilled by the model (recomputation included).",
                                       labels, registry=registry).labels(model_name)
        self.generation = Counter(f"{PREFIX}generation_tokens_total", "Tokens generated.", labels,
                                  registry=registry).labels(model_name)
        self.prompt = Counter(f"{PREFIX}prompt_tokens_total",
                              "Prompt tokens of finished sequences (n sequences: n times usage.prompt_tokens).", labels,
                              registry=registry).labels(model_name)
        self.prompt_cached = Counter(f"{PREFIX}prompt_tokens_cached_total",
                                     "Prompt tokens of finished sequences served from the prefix cache "
                                     "(one sequence: usage.prompt_tokens_details.cached_tokens).", labels,
                                     registry=registry).labels(model_name)

    def on_step(self, stats: StepStats) -> None:
        if stats.num_prompt_tokens:
            self.prompt_computed.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation.inc(stats.num_generation_tokens)

    def on_finished(self, request: FinishedRequestStats) -> None:
        self.prompt.inc(request.num_prompt_tokens)
        self.prompt_cached.inc(request.num_cached_tokens)


class RequestMetrics:
    """Token latencies per step; per finished request: outcome, end-to-end latency and lengths."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        finished = Counter(f"{PREFIX}requests_finished_total",
                           "Finished requests by finish_reason (stop and length are successes).",
                           ["model_name", "finish_reason"], registry=registry)
        self.finished = {reason: finished.labels(model_name, reason) for reason in FINISH_REASONS}

        def histogram(name: str, doc: str, buckets: Iterable[float]):
            return Histogram(f"{PREFIX}{name}", doc, labels, buckets=tuple(buckets),
                             registry=registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first output token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
                             INTER_TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first output token.",
                                 LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First output token to finish (requests that "
                                "produced a token).", LATENCY_BUCKETS)
        self.prompt_len = histogram("request_prompt_length_tokens", "Prompt length of finished requests.",
                                    TOKEN_BUCKETS)
        self.generation_len = histogram("request_generation_length_tokens",
                                        "Output tokens of finished requests.", TOKEN_BUCKETS)

    def on_step(self, stats: StepStats) -> None:
        """Token latencies when they happen (a long stream's TTFT must not wait for its end)."""
        for ttft in stats.ttfts:
            self.ttft.observe(ttft)
        for prefill_time in stats.prefill_times:
            self.prefill.observe(prefill_time)
        for latency in stats.inter_token_latencies:
            self.itl.observe(latency)

    def on_finished(self, request: FinishedRequestStats) -> None:
        counter = self.finished.get(request.finish_reason)
        if counter is not None:
            counter.inc()
        self.e2e.observe(request.e2e_latency)
        self.queue.observe(request.queue_time)
        if request.num_output_tokens:
            self.decode.observe(request.e2e_latency - request.ttft)
        self.prompt_len.observe(request.num_prompt_tokens)
        self.generation_len.observe(request.num_output_tokens)


class TenantMetrics:
    """Per-tenant cache counters; unconfigured tenants share one `other` label (bounded cardinality)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, tenants: Iterable[str]) -> None:
        labels = ["model_name", "tenant"]
        queries = Counter(f"{PREFIX}tenant_prefix_cache_queries_tokens_total",
                          "Prompt tokens looked up in the prefix cache, by tenant.", labels, registry=registry)
        hits = Counter(f"{PREFIX}tenant_prefix_cache_hits_tokens_total",
                       "Prompt tokens found in the prefix cache, by tenant.", labels, registry=registry)
        evictions = Counter(f"{PREFIX}tenant_prefix_cache_evictions_blocks_total",
                            "Cached blocks evicted, by the tenant that cached them.", labels, registry=registry)
        regrets = Counter(f"{PREFIX}tenant_prefix_cache_regrets_blocks_total",
                          "Evicted blocks asked for again soon after, by the tenant that cached them.", labels,
                          registry=registry)
        disk_hits = Counter(f"{PREFIX}tenant_prefix_cache_disk_hits_tokens_total",
                            "Prompt tokens read back from the disk tier (part of the hits), by tenant.", labels,
                            registry=registry)
        writes = Counter(f"{PREFIX}tenant_prefix_cache_write_tokens_total",
                         "Prompt tokens computed and written to the prefix cache (usage's cache_write_tokens), "
                         "by tenant.", labels, registry=registry)
        names = [*dict.fromkeys(tenants), OTHER_TENANT]
        self._disk_hits = {t: disk_hits.labels(model_name, t) for t in names}
        self._writes = {t: writes.labels(model_name, t) for t in names}
        self._queries = {t: queries.labels(model_name, t) for t in names}
        self._hits = {t: hits.labels(model_name, t) for t in names}
        self._evictions = {t: evictions.labels(model_name, t) for t in names}
        self._regrets = {t: regrets.labels(model_name, t) for t in names}

    def bucket(self, tenant: str | None) -> str:
        return tenant if tenant in self._queries else OTHER_TENANT

    def on_step(self, stats: StepStats) -> None:
        for tenant, (queries, hits) in stats.tenant_cache.items():
            name = self.bucket(tenant)
            if queries:
                self._queries[name].inc(queries)
            if hits:
                self._hits[name].inc(hits)
        for tenant, blocks in stats.tenant_evictions.items():
            if blocks:
                self._evictions[self.bucket(tenant)].inc(blocks)
        for tenant, blocks in stats.tenant_regrets.items():
            if blocks:
                self._regrets[self.bucket(tenant)].inc(blocks)
        for request in stats.finished:  # counted when the request ends, as its usage reports them
            name = self.bucket(request.tenant)
            if request.num_disk_cached_tokens:
                self._disk_hits[name].inc(request.num_disk_cached_tokens)
            if request.num_cache_write_tokens:
                self._writes[name].inc(request.num_cache_write_tokens)


class PinMetrics:
    """Pinned prefixes (cache_control): what they hold, in all and by tenant, and why pins end or are refused.
    Tenants outside the configured ones share the `other` label."""

    def __init__(self, registry: CollectorRegistry, model_name: str, tenants: Iterable[str]) -> None:
        self._pins = Gauge(f"{PREFIX}pins", "Pinned prefixes now.", ["model_name"],
                           registry=registry).labels(model_name)
        self._blocks = Gauge(f"{PREFIX}pinned_blocks", "KV blocks held by pinned prefixes (never evicted while "
                             "pinned).", ["model_name"], registry=registry).labels(model_name)
        self._max_blocks = Gauge(f"{PREFIX}max_pinned_blocks", "KV blocks pins may hold at most "
                                 "(--max-pinned-fraction of the pool).", ["model_name"],
                                 registry=registry).labels(model_name)
        released = Counter(f"{PREFIX}pins_released_total", "Pins released, by reason: expired (TTL), pressure "
                           "(a request could not run otherwise), erased (DELETE /v1/cache).",
                           ["model_name", "reason"], registry=registry)
        self._released = {r: _Delta(released.labels(model_name, r)) for r in PIN_RELEASE_REASONS}
        tenant_blocks = Gauge(f"{PREFIX}tenant_pinned_blocks", "KV blocks held by the tenant's pins.",
                              ["model_name", "tenant"], registry=registry)
        expiries = Counter(f"{PREFIX}tenant_pin_expiries_total", "The tenant's pins that expired (TTL not renewed "
                           "by a hit).", ["model_name", "tenant"], registry=registry)
        refused = Counter(f"{PREFIX}tenant_pins_refused_total", "Breakpoints not pinned, by tenant and the quota "
                          "they would have exceeded.", ["model_name", "tenant", "reason"], registry=registry)
        self._names = [*dict.fromkeys(tenants), OTHER_TENANT]
        self._tenant_blocks = {t: tenant_blocks.labels(model_name, t) for t in self._names}
        self._expiries = {t: expiries.labels(model_name, t) for t in self._names}
        self._refused = {(t, r): refused.labels(model_name, t, r) for t in self._names for r in PIN_REFUSALS}
        self._lock = threading.Lock()

    def _bucket(self, tenant: str | None) -> str:
        return tenant if tenant in self._tenant_blocks else OTHER_TENANT

    def on_step(self, stats: StepStats) -> None:
        cache = stats.scheduler.prefix_cache
        self._pins.set(cache.pins)
        self._blocks.set(cache.pinned_blocks)
        self._max_blocks.set(cache.max_pinned_blocks)
        blocks = dict.fromkeys(self._names, 0)
        for tenant, num in cache.tenant_pinned_blocks.items():
            blocks[self._bucket(tenant)] += num
        for tenant, num in blocks.items():
            self._tenant_blocks[tenant].set(num)
        with self._lock:
            for reason, delta in self._released.items():
                delta.update(cache.pins_released.get(reason, 0))
        for tenant, num in stats.tenant_pin_expiries.items():
            self._expiries[self._bucket(tenant)].inc(num)
        for (tenant, reason), num in stats.tenant_pin_refusals.items():
            self._refused[self._bucket(tenant), reason].inc(num)


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(f"{PREFIX}http_requests_total", "HTTP requests by route, method and status.",
                                ["route", "method", "status"], registry=registry)
        self.duration = Histogram(f"{PREFIX}http_request_duration_seconds",
                                  "HTTP request handling time (to the end of the response body).",
                                  ["route", "method"], buckets=HTTP_BUCKETS, registry=registry)

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.duration.labels(route, method).observe(seconds)


class AdmissionMetrics:
    """What the gateway's admission holds, read at scrape time (the gateway owns the counts)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.sequences = Gauge(f"{PREFIX}admission_sequences",
                               "Sequences admitted and not finished: running or waiting in the engine.",
                               labels, registry=registry).labels(model_name)
        self.capacity = Gauge(f"{PREFIX}admission_capacity_sequences",
                              "Sequences admission lets in at once (max_num_seqs + max_waiting_requests); "
                              "beyond it, 429.", labels, registry=registry).labels(model_name)

    def watch(self, sequences: Callable[[], float], capacity: int) -> None:
        self.sequences.set_function(sequences)
        self.capacity.set(capacity)


class ResponseStoreMetrics:
    """The Responses API's stored responses, read at scrape time (the gateway owns the store: any object with
    num_stored, num_dropped, num_pending and num_lost)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._model_name = model_name
        self._store: Any = None
        registry.register(self)

    def watch(self, store: Any) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        families = (
            (GaugeMetricFamily, "responses_stored", "Responses kept for previous_response_id (at most "
             "--responses-store-max a tenant), those waiting for the database included.", "num_stored"),
            (CounterMetricFamily, "responses_store_dropped", "Stored responses dropped, least recently used first, "
             "to stay within --responses-store-max.", "num_dropped"),
            (GaugeMetricFamily, "responses_store_pending", "Stored responses the database could not take yet, kept "
             "in this gateway's memory and written again every second.", "num_pending"),
            (CounterMetricFamily, "responses_store_lost", "Responses answered as stored that no database took: "
             "dropped beyond the waiting puts' bound, or still waiting when the gateway stopped.", "num_lost"))
        for family, name, documentation, field in families:
            metric = family(f"{PREFIX}{name}", documentation, labels=["model_name"])
            metric.add_metric([self._model_name], getattr(self._store, field, 0))
            yield metric


# our family (less PREFIX) -> vLLM's names for it: the series vLLM's Grafana dashboards, KEDA rules and the Gateway
# API Inference Extension read (ITL twice: vLLM renamed time_per_output_token, and gpu_cache_usage to kv_cache_usage)
VLLM_NAMES = {
    "requests_running": ("vllm:num_requests_running",), "requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prompt_tokens": ("vllm:prompt_tokens",), "generation_tokens": ("vllm:generation_tokens",),
    "prefix_cache_queries_tokens": ("vllm:prefix_cache_queries",),
    "prefix_cache_hits_tokens": ("vllm:prefix_cache_hits",),
    "preemptions": ("vllm:num_preemptions",), "requests_finished": ("vllm:request_success",),
    "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "request_prompt_length_tokens": ("vllm:request_prompt_tokens",),
    "request_generation_length_tokens": ("vllm:request_generation_tokens",),
}
VLLM_SUCCESS = ("stop", "length", "abort")  # vLLM's request_success counts these (its label: finished_reason)


def _vllm_labels(labels: dict[str, str]) -> dict[str, str]:
    return {("finished_reason" if key == "finish_reason" else key): value for key, value in labels.items()}


class _Exposition:
    """What /metrics shows of a registry, read in one pass a scrape: its families without the `_created` twin that
    prometheus-client adds to every counter and histogram (a second series per series, which nothing here reads;
    prometheus_client.disable_created_metrics() would change the whole process), and with `vllm_names` each family
    of VLLM_NAMES again under vLLM's names (one count kept, two names shown): a dashboard or autoscaler built for
    vLLM reads them unchanged."""

    def __init__(self, registry: CollectorRegistry, vllm_names: bool) -> None:
        self._registry = registry
        self._vllm_names = vllm_names

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
            if self._vllm_names and family.name.startswith(PREFIX):
                yield from _under_vllm_names(family)


def _under_vllm_names(family: Metric) -> Iterator[Metric]:
    for name in VLLM_NAMES.get(family.name.removeprefix(PREFIX), ()):
        renamed = Metric(name, f"{family.documentation} ({family.name}, under vLLM's name)", family.type)
        renamed.samples = [s._replace(name=name + s.name[len(family.name):], labels=_vllm_labels(s.labels))
                           for s in family.samples if s.labels.get("finish_reason", "stop") in VLLM_SUCCESS]
        yield renamed


class Metrics:
    """All of prefixgate's series in one registry (its own by default, so apps in one process don't clash)."""

    def __init__(self, model_name: str, tenants: list[str], registry: CollectorRegistry | None = None,
                 vllm_names: bool = True) -> None:
        """vllm_names: the series vLLM also exports, again under vLLM's names (VLLM_NAMES)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.prefix_cache = PrefixCacheMetrics(self.registry, model_name)
        self.scheduler = SchedulerMetrics(self.registry, model_name)
        self.tokens = TokenMetrics(self.registry, model_name)
        self.requests = RequestMetrics(self.registry, model_name)
        self.tenants = TenantMetrics(self.registry, model_name, tenants)
        self.pins = PinMetrics(self.registry, model_name, tenants)
        self.http = HttpMetrics(self.registry)
        self.admission = AdmissionMetrics(self.registry, model_name)
        self.responses = ResponseStoreMetrics(self.registry, model_name)
        self.threads = Gauge(f"{PREFIX}engine_threads", "CPU compute threads of the engine's steps, by kind of step "
                             "(decode: decode-only steps; prefill: steps with a prefill chunk).",
                             ["model_name", "kind"], registry=self.registry)
        if registry is None:  # process_* series (memory, CPU, fds) only in a registry we own
            ProcessCollector(registry=self.registry)
        self._lock = threading.Lock()  # the _Delta last-seen values, if steps ever come from two threads
        self._exposed = _Exposition(self.registry, vllm_names)

    def on_step(self, stats: StepStats) -> None:
        """Called on the engine thread after every step."""
        with self._lock:
            self.scheduler.update(stats.scheduler)
            self.prefix_cache.update(stats.scheduler.prefix_cache)
        self.tokens.on_step(stats)
        self.requests.on_step(stats)
        self.tenants.on_step(stats)
        self.pins.on_step(stats)
        self.set_threads(stats.threads)  # (a live re-check may change the decode count: engine/threads.py)
        for request in stats.finished:
            self.tokens.on_finished(request)
            self.requests.on_finished(request)

    def set_threads(self, threads: tuple[int, int] | None) -> None:
        """The engine's thread budget (engine/threads.py); None (not a CPU engine): no series."""
        if threads is not None:
            self.threads.labels(self.model_name, "decode").set(threads[0])
            self.threads.labels(self.model_name, "prefill").set(threads[1])

    def on_http(self, route: str, method: str, status: int, seconds: float) -> None:
        """route is the route template (e.g. "/v1/chat/completions"), never the raw path: bounded labels."""
        self.http.observe(route, method, status, seconds)

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its Content-Type."""
        return generate_latest(self._exposed), CONTENT_TYPE_LATEST
