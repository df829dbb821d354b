"""metrics.Metrics fed with synthetic engine stats: exact values in the exposition text."""
from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.stats import FinishedRequestStats, PrefixCacheStats, SchedulerStats, StepStats
from metrics import Metrics
from metrics.prometheus import HTTP_BUCKETS, TOKEN_BUCKETS, one_two_five_buckets

MODEL = "tiny-llama"


def scrape(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def step(queries=0, hits=0, lookups=0, ev_cap=0, ev_pre=0, cached_blocks=0, usage=0.0, running=0, waiting=0,
         preemptions=0, steps=0, num_blocks=64, **step_fields) -> StepStats:
    cache = PrefixCacheStats(queries=queries, hits=hits, requests=lookups, evictions_capacity=ev_cap,
                             evictions_preemption=ev_pre, cached_blocks=cached_blocks, usage=usage)
    scheduler = SchedulerStats(num_running=running, num_waiting=waiting, num_preemptions=preemptions,
                               num_steps=steps, num_blocks=num_blocks, prefix_cache=cache)
    return StepStats(scheduler=scheduler, **step_fields)


def finished(request_id="r", *, reason="stop", prompt=64, cached=48, output=4, tenant=None) -> FinishedRequestStats:
    return FinishedRequestStats(
        request_id=request_id, tenant=tenant, finish_reason=reason, num_prompt_tokens=prompt,
        num_cached_tokens=cached, num_output_tokens=output, queue_time=0.003, ttft=0.023,
        e2e_latency=0.4, inter_token_latencies=[0.1] * max(output - 1, 0))


def test_one_two_five_buckets():
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert TOKEN_BUCKETS[-1] == 20000 and len(TOKEN_BUCKETS) == 14


def test_cumulative_scheduler_stats_become_counter_increments():
    metrics = Metrics(MODEL, tenants=[])
    metrics.on_step(step(queries=64, hits=0, lookups=1, steps=1))
    metrics.on_step(step(queries=128, hits=48, lookups=2, steps=2, cached_blocks=4, usage=0.25, running=1,
                         waiting=3))
    metrics.on_step(step(queries=128, hits=48, lookups=2, ev_cap=3, ev_pre=1, preemptions=2, steps=3,
                         cached_blocks=2, usage=0.5, running=2, waiting=1))
    s = scrape(metrics)
    assert value(s, "prefixgate_prefix_cache_queries_tokens_total") == 128
    assert value(s, "prefixgate_prefix_cache_hits_tokens_total") == 48
    assert value(s, "prefixgate_prefix_cache_lookups_total") == 2
    assert value(s, "prefixgate_prefix_cache_evictions_blocks_total", reason="capacity") == 3
    assert value(s, "prefixgate_prefix_cache_evictions_blocks_total", reason="preemption") == 1
    assert value(s, "prefixgate_preemptions_total") == 2
    assert value(s, "prefixgate_engine_steps_total") == 3
    # gauges hold the last snapshot
    assert value(s, "prefixgate_prefix_cache_cached_blocks") == 2
    assert value(s, "prefixgate_kv_cache_usage_ratio") == 0.5
    assert value(s, "prefixgate_requests_running") == 2
    assert value(s, "prefixgate_requests_waiting") == 1
    assert value(s, "prefixgate_kv_cache_blocks") == 64


def test_cumulative_counter_that_restarts_counts_its_new_value():
    metrics = Metrics(MODEL, tenants=[])
    metrics.on_step(step(queries=100))
    metrics.on_step(step(queries=30))  # a restarted source: 30 new tokens, counters never go down
    assert value(scrape(metrics), "prefixgate_prefix_cache_queries_tokens_total") == 130


def test_token_counters_per_step_and_per_finished_request():
    metrics = Metrics(MODEL, tenants=[])
    metrics.on_step(step(num_prompt_tokens=64))
    metrics.on_step(step(num_prompt_tokens=16, num_generation_tokens=1))
    metrics.on_step(step(num_generation_tokens=2, finished=[finished(prompt=64, cached=48, output=3)]))
    s = scrape(metrics)
    assert value(s, "prefixgate_prompt_tokens_computed_total") == 80
    assert value(s, "prefixgate_generation_tokens_total") == 3
    assert value(s, "prefixgate_prompt_tokens_total") == 64
    assert value(s, "prefixgate_prompt_tokens_cached_total") == 48


def test_histograms_count_every_finished_request():
    metrics = Metrics(MODEL, tenants=[])
    requests = [finished("a", output=4), finished("b", reason="length", output=1, prompt=3000),
                finished("c", reason="abort", output=0), finished("d", reason="error", output=0)]
    metrics.on_step(step(finished=requests[:2]))
    metrics.on_step(step(finished=requests[2:]))
    s = scrape(metrics)
    for reason in ("stop", "length", "abort", "error"):
        assert value(s, "prefixgate_requests_finished_total", finish_reason=reason) == 1
    assert value(s, "prefixgate_e2e_request_latency_seconds_count") == 4
    assert value(s, "prefixgate_e2e_request_latency_seconds_sum") == pytest.approx(1.6)
    assert value(s, "prefixgate_request_queue_time_seconds_count") == 4
    assert value(s, "prefixgate_request_prompt_length_tokens_count") == 4
    assert value(s, "prefixgate_request_generation_length_tokens_count") == 4
    # token latencies come from the steps that produced the tokens, not from finished requests
    assert value(s, "prefixgate_time_to_first_token_seconds_count") == 0
    assert value(s, "prefixgate_inter_token_latency_seconds_count") == 0
    # bucket placement of the prompt lengths 64, 3000, 64, 64: cumulative counts per upper bound
    bucket = "prefixgate_request_prompt_length_tokens_bucket"
    assert [value(s, bucket, le=le) for le in ("50.0", "100.0", "2000.0", "5000.0", "+Inf")] == [0, 3, 3, 4, 4]


def test_tenant_label_only_for_configured_tenants():
    metrics = Metrics(MODEL, tenants=["acme", "globex"])
    metrics.on_step(step(tenant_cache={"acme": (64, 48), "mallory-1": (10, 0), "mallory-2": (20, 16)}))
    metrics.on_step(step(tenant_cache={"acme": (16, 0), "": (5, 0)}))
    s = scrape(metrics)
    queries = "prefixgate_tenant_prefix_cache_queries_tokens_total"
    hits = "prefixgate_tenant_prefix_cache_hits_tokens_total"
    assert value(s, queries, tenant="acme") == 80
    assert value(s, hits, tenant="acme") == 48
    assert value(s, queries, tenant="globex") == 0  # configured tenants exist from the start
    assert value(s, queries, tenant="other") == 35
    assert value(s, hits, tenant="other") == 16
    tenants = {dict(labels)["tenant"] for name, labels in s if name == queries}
    assert tenants == {"acme", "globex", "other"}


def test_token_latencies_are_observed_by_the_step_that_produced_them():
    metrics = Metrics(MODEL, tenants=[])
    metrics.on_step(step(ttfts=[0.5, 0.25], prefill_times=[0.2, 0.1]))  # two first tokens, nobody finished
    s = scrape(metrics)
    assert value(s, "prefixgate_time_to_first_token_seconds_count") == 2
    assert value(s, "prefixgate_time_to_first_token_seconds_sum") == pytest.approx(0.75)
    assert value(s, "prefixgate_request_prefill_time_seconds_sum") == pytest.approx(0.3)
    metrics.on_step(step(inter_token_latencies=[0.01, 0.02, 0.03]))
    s = scrape(metrics)
    assert value(s, "prefixgate_inter_token_latency_seconds_count") == 3
    assert value(s, "prefixgate_inter_token_latency_seconds_sum") == pytest.approx(0.06)
    assert value(s, "prefixgate_time_to_first_token_seconds_count") == 2


def test_tenant_evictions_when_the_engine_reports_them():
    metrics = Metrics(MODEL, tenants=["acme"])
    metrics.on_step(step(tenant_evictions={"acme": 2, "x": 1, "y": 3}, tenant_regrets={"acme": 1, "x": 2}))
    s = scrape(metrics)
    evictions = "prefixgate_tenant_prefix_cache_evictions_blocks_total"
    assert value(s, evictions, tenant="acme") == 2
    assert value(s, evictions, tenant="other") == 4
    regrets = "prefixgate_tenant_prefix_cache_regrets_blocks_total"
    assert value(s, regrets, tenant="acme") == 1 and value(s, regrets, tenant="other") == 2


def test_the_thread_gauge_follows_the_engines_steps():
    """Set at start-up, then by each step's stats: the engine's live re-check may move its decode count."""
    metrics = Metrics(MODEL, tenants=[])
    metrics.set_threads((1, 2))
    metrics.on_step(step())  # a step without counts (not a CPU engine's) leaves the series alone
    assert value(scrape(metrics), "prefixgate_engine_threads", kind="decode") == 1
    metrics.on_step(step(threads=(2, 2)))
    s = scrape(metrics)
    assert value(s, "prefixgate_engine_threads", kind="decode") == 2
    assert value(s, "prefixgate_engine_threads", kind="prefill") == 2


def test_tenant_cache_writes_and_disk_reads_when_requests_finish():
    from engine.stats import FinishedRequestStats

    def finished(tenant: str, disk: int, written: int) -> FinishedRequestStats:
        return FinishedRequestStats("r", tenant, "stop", 100, disk, 1, 0.0, 0.1, 0.2,
                                    num_disk_cached_tokens=disk, num_cache_write_tokens=written)

    metrics = Metrics(MODEL, tenants=["acme"])
    metrics.on_step(step(finished=[finished("acme", 32, 64), finished("x", 0, 16)]))
    s = scrape(metrics)
    assert value(s, "prefixgate_tenant_prefix_cache_write_tokens_total", tenant="acme") == 64
    assert value(s, "prefixgate_tenant_prefix_cache_write_tokens_total", tenant="other") == 16
    assert value(s, "prefixgate_tenant_prefix_cache_disk_hits_tokens_total", tenant="acme") == 32
    assert value(s, "prefixgate_tenant_prefix_cache_disk_hits_tokens_total", tenant="other") == 0


def test_evictions_by_every_reason_regrets_and_the_disk_tier():
    from engine.stats import DiskTierStats

    metrics = Metrics(MODEL, tenants=[])
    s = scrape(metrics)
    assert value(s, "prefixgate_kv_disk_blocks") == 0  # exported without a disk tier too
    cache = PrefixCacheStats(evictions_capacity=1, evictions_preemption=2, evictions_spill=3, evictions_erase=4,
                             regrets=5, disk_hits=32,
                             disk=DiskTierStats(files=7, bytes=700, writes=9, dropped_spills=1, evictions=2, corrupt=1,
                                                write_errors={"no_space": 3}))
    metrics.on_step(StepStats(SchedulerStats(prefix_cache=cache)))
    s = scrape(metrics)
    evictions = "prefixgate_prefix_cache_evictions_blocks_total"
    assert [value(s, evictions, reason=r) for r in ("capacity", "preemption", "spill", "erase")] == [1, 2, 3, 4]
    assert value(s, "prefixgate_prefix_cache_regrets_blocks_total") == 5
    assert value(s, "prefixgate_prefix_cache_disk_hits_tokens_total") == 32
    assert value(s, "prefixgate_kv_disk_blocks") == 7 and value(s, "prefixgate_kv_disk_bytes") == 700
    assert value(s, "prefixgate_kv_disk_writes_blocks_total") == 9
    assert value(s, "prefixgate_kv_disk_evictions_blocks_total") == 2
    assert value(s, "prefixgate_kv_disk_corrupt_blocks_total") == 1
    assert value(s, "prefixgate_kv_disk_dropped_spills_blocks_total") == 1
    assert value(s, "prefixgate_kv_disk_write_errors_total", reason="no_space") == 3
    assert value(s, "prefixgate_kv_disk_write_errors_total", reason="permission") == 0


def test_http_requests_by_route_method_status():
    metrics = Metrics(MODEL, tenants=[])
    metrics.on_http("/v1/chat/completions", "POST", 200, 0.5)
    metrics.on_http("/v1/chat/completions", "POST", 200, 0.25)
    metrics.on_http("/v1/chat/completions", "POST", 400, 0.001)
    metrics.on_http("/health", "GET", 200, 0.001)
    s = scrape(metrics)

    def http(name, **labels):
        return s[(name, frozenset(labels.items()))]

    assert http("prefixgate_http_requests_total", route="/v1/chat/completions", method="POST", status="200") == 2
    assert http("prefixgate_http_requests_total", route="/v1/chat/completions", method="POST", status="400") == 1
    assert http("prefixgate_http_requests_total", route="/health", method="GET", status="200") == 1
    duration = "prefixgate_http_request_duration_seconds"
    assert http(f"{duration}_count", route="/v1/chat/completions", method="POST") == 3
    assert http(f"{duration}_sum", route="/v1/chat/completions", method="POST") == pytest.approx(0.751)


def test_each_metrics_has_its_own_registry_and_series_names_are_prefixed():
    first, second = Metrics(MODEL, tenants=[]), Metrics(MODEL, tenants=[])  # no duplicate-series error
    first.on_step(step(queries=10))
    assert value(scrape(second), "prefixgate_prefix_cache_queries_tokens_total") == 0
    names = {name for name, _ in scrape(first)}
    assert all(name.startswith(("prefixgate_", "process_", "vllm:")) for name in names)
    shared = CollectorRegistry()
    Metrics(MODEL, tenants=[], registry=shared)  # a registry given by the caller gets our series only
    assert shared.get_sample_value("prefixgate_prefix_cache_queries_tokens_total", {"model_name": MODEL}) == 0
    assert shared.get_sample_value("process_cpu_seconds_total") is None


def test_on_step_from_many_threads_loses_nothing():
    metrics = Metrics(MODEL, tenants=[])
    per_thread, threads = 500, 4

    def work():
        for _ in range(per_thread):
            metrics.on_step(step(num_prompt_tokens=1, num_generation_tokens=2, tenant_cache={"x": (1, 1)},
                                 finished=[finished()]))

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    s = scrape(metrics)
    total = per_thread * threads
    assert value(s, "prefixgate_prompt_tokens_computed_total") == total
    assert value(s, "prefixgate_generation_tokens_total") == 2 * total
    assert value(s, "prefixgate_e2e_request_latency_seconds_count") == total
    assert value(s, "prefixgate_tenant_prefix_cache_hits_tokens_total", tenant="other") == total


def test_no_created_twin_series():
    metrics = Metrics(MODEL, tenants=["a"])
    metrics.on_step(step(queries=10, finished=[finished()]))
    metrics.on_http("/health", "GET", 200, 0.001)
    body = metrics.render()[0].decode()
    assert "prefixgate_prefix_cache_queries_tokens_total" in body and "_bucket" in body
    assert "_created" not in body
    # only our exposition: prometheus-client's own switch (process-wide) is left alone
    plain = CollectorRegistry()
    Counter("plain", "x", registry=plain).inc()
    assert "plain_created" in generate_latest(plain).decode()


def test_http_duration_buckets_reach_past_two_minutes():
    metrics = Metrics(MODEL, tenants=[])
    metrics.on_http("/v1/chat/completions", "POST", 200, 900.0)  # a 15-minute stream
    s = scrape(metrics)
    bucket = "prefixgate_http_request_duration_seconds_bucket"
    labels = {"route": "/v1/chat/completions", "method": "POST"}
    assert s[(bucket, frozenset({**labels, "le": "600.0"}.items()))] == 0
    assert s[(bucket, frozenset({**labels, "le": "1200.0"}.items()))] == 1
    assert max(HTTP_BUCKETS) >= 3600


def test_admission_gauges_read_the_live_count():
    metrics = Metrics(MODEL, tenants=[])
    held = [0]
    metrics.admission.watch(lambda: held[0], capacity=40)
    assert value(scrape(metrics), "prefixgate_admission_sequences") == 0
    held[0] = 7
    s = scrape(metrics)
    assert value(s, "prefixgate_admission_sequences") == 7
    assert value(s, "prefixgate_admission_capacity_sequences") == 40


def test_the_response_store_is_read_at_scrape_time():
    from gateway.response_store import ResponseStore, Stored

    metrics = Metrics(MODEL, tenants=[])
    assert value(scrape(metrics), "prefixgate_responses_stored") == 0
    store = ResponseStore(max_responses=2)
    metrics.responses.watch(store)
    for n in range(3):
        store.put(Stored("alice", {"id": f"resp_{n}"}, [], []))
    store.num_pending, store.num_lost = 4, 5  # (the waiting puts' count, gateway/response_store_pending.py)
    s = scrape(metrics)
    assert value(s, "prefixgate_responses_stored") == 2
    assert value(s, "prefixgate_responses_store_dropped_total") == 1
    assert value(s, "prefixgate_responses_store_pending") == 4
    assert value(s, "prefixgate_responses_store_lost_total") == 5


def test_the_series_vllm_exports_show_under_vllms_names_too():
    """Dashboards, KEDA rules and the Gateway API Inference Extension built for vLLM read its names: the same
    values, finish reasons as its finished_reason (errors are no success there); off, none of them."""
    metrics = Metrics(MODEL, tenants=[])
    metrics.on_step(step(queries=128, hits=48, lookups=2, usage=0.5, running=2, waiting=3, preemptions=1,
                         ttfts=[0.02], inter_token_latencies=[0.01],
                         finished=[finished(reason="stop"), finished(reason="error"), finished(reason="length")]))
    s = scrape(metrics)
    assert value(s, "vllm:num_requests_waiting") == 3 and value(s, "vllm:num_requests_running") == 2
    assert value(s, "vllm:kv_cache_usage_perc") == value(s, "vllm:gpu_cache_usage_perc") == 0.5
    assert value(s, "vllm:prefix_cache_hits_total") == 48 and value(s, "vllm:prefix_cache_queries_total") == 128
    assert value(s, "vllm:num_preemptions_total") == 1 and value(s, "vllm:prompt_tokens_total") == 3 * 64
    assert {labels: v for (name, labels), v in s.items() if name == "vllm:request_success_total"} == {
        frozenset({"model_name": MODEL, "finished_reason": reason}.items()): count
        for reason, count in (("stop", 1), ("length", 1), ("abort", 0))}
    for ours, theirs in (("time_to_first_token_seconds", "time_to_first_token_seconds"),
                         ("inter_token_latency_seconds", "time_per_output_token_seconds"),
                         ("e2e_request_latency_seconds", "e2e_request_latency_seconds"),
                         ("request_decode_time_seconds", "request_decode_time_seconds"),
                         ("request_prompt_length_tokens", "request_prompt_tokens")):
        for suffix in ("_count", "_sum"):
            assert value(s, f"vllm:{theirs}{suffix}") == value(s, f"prefixgate_{ours}{suffix}") > 0
    assert value(s, "prefixgate_request_decode_time_seconds_sum") == pytest.approx(3 * (0.4 - 0.023))
    assert not [name for name, _ in scrape(Metrics(MODEL, tenants=[], vllm_names=False)) if name.startswith("vllm:")]
