"""The observability configs: prometheus.yml (promtool), Grafana provisioning, the dashboard, compose.yaml.

Docker cannot run here, so compose.yaml is checked by parsing it and by looking
up every local file it (and the Dockerfile) refers to.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import engine.stats
from engine.stats import SchedulerStats, StepStats
from metrics import Metrics
from metrics.prometheus import PIN_RELEASE_REASONS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs/grafana/dashboards/prefixgate.json"
PROMETHEUS_CONFIG = ROOT / "configs/prometheus.yml"


def require_binary(name: str) -> str:
    """Path of a tool the test needs; a missing one fails under CI and skips elsewhere."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if path is None:
        message = f"{name} not found (Debian package `prometheus`; `make test` installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def expand_grafana_variables(expr: str) -> str:
    """$__rate_interval and friends become 1m; dashboard variables ($model_name, ${tenant}) match anything."""
    def value(match: re.Match) -> str:
        return "1m" if match.group(1).startswith("__") else ".*"
    return re.sub(r"\$\{?(\w+)\}?", value, expr)


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


@pytest.mark.prometheus
def test_promtool_check_config():
    promtool = require_binary("promtool")
    result = subprocess.run([promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.prometheus
def test_every_dashboard_expr_is_valid_promql(tmp_path):
    promtool = require_binary("promtool")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": expand_grafana_variables(expr)}
        for i, expr in enumerate(dashboard_exprs())]}]}
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_only_uses_series_that_metrics_exposes():
    metrics = Metrics("m", tenants=[])
    metrics.on_http("/health", "GET", 200, 0.001)  # HTTP series appear with their first labels
    exposed = {line.split("{")[0].split(" ")[0] for line in metrics.render()[0].decode().splitlines()
               if line and not line.startswith("#")}
    from cluster.metrics import SERIES  # the per-replica panels' series, from the cluster client's collector
    exposed |= SERIES
    used = {name for expr in dashboard_exprs() for name in re.findall(r"prefixgate_\w+", expr)}
    assert used and used <= exposed, sorted(used - exposed)


def _filled(cls, keys: dict[str, int]):
    """A stats dataclass with every field set: numbers non-zero, dicts holding `keys`, nested stats filled too."""
    values = {}
    for f in dataclasses.fields(cls):
        kind = str(f.type)
        if "Stats" in kind:
            values[f.name] = _filled(getattr(engine.stats, kind.split("|")[0].strip()), keys)
        elif kind.startswith("dict"):
            values[f.name] = dict(keys)
        else:
            values[f.name] = 0.5 if kind == "float" else 3
    return cls(**values)


def test_cluster_wide_series_are_taken_with_max_not_sum():
    """Behind the cluster mode's gateways each gateway shows the series read from the scheduler's snapshot (levels,
    and the cache, preemption, disk and pin counters) for the whole cluster, where the rest (tokens computed,
    latencies, per-tenant lookups) are each gateway's own share: a dashboard that sums the first over gateway pods
    counts them once a pod. So they are aggregated with max (on one gateway the same figure), and a fallback joined
    with `or` is one `on()` it, not a series of its own beside the others."""
    metrics = Metrics("m", tenants=["alice"])
    keys = {"alice": 2, "no_space": 1, "permission": 1, "io": 1, **{reason: 1 for reason in PIN_RELEASE_REASONS}}
    metrics.on_step(StepStats(scheduler=_filled(SchedulerStats, keys)))  # a snapshot alone: no step's own counts
    snapshot = {line.split("{")[0] for line in metrics.render()[0].decode().splitlines()
                if line.startswith("prefixgate_") and float(line.rsplit(" ", 1)[1]) > 0}
    assert {"prefixgate_requests_running", "prefixgate_prefix_cache_hits_tokens_total",
            "prefixgate_pins_released_total", "prefixgate_kv_disk_writes_blocks_total"} <= snapshot
    assert "prefixgate_prompt_tokens_computed_total" not in snapshot
    for expr in dashboard_exprs():
        for name in re.findall(r"\bsum(?: by \([^)]*\) )?\((?:rate\()?(prefixgate_\w+)", expr):
            assert name not in snapshot, f"sum over gateways of {name}: {expr}"
        assert " or label_replace" not in expr, expr


def test_dashboard_has_the_panels_and_variables():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    titles = {p["title"] for p in panels}
    for title in ("Prefix cache hit rate", "Cached vs computed prompt tokens/s", "Evictions/s by reason",
                  "Time to first token", "Inter-token latency", "End-to-end request latency", "Queue time",
                  "KV cache usage", "Requests running / waiting", "Preemptions/s", "Throughput tokens/s",
                  "Per-tenant hit rate"):
        assert title in titles
    ttft = next(p for p in panels if p["title"] == "Time to first token")
    assert [t["legendFormat"] for t in ttft["targets"]] == ["p50", "p90", "p99"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "model_name", "tenant"}
    assert dashboard["uid"] == "prefixgate"


def test_compose_services_images_and_healthchecks():
    services = compose()["services"]
    assert set(services) == {"prefixgate", "postgres", "prometheus", "grafana"}
    command = services["prefixgate"]["command"]  # stored responses in the compose file's Postgres
    assert command[command.index("--responses-db") + 1].startswith("postgresql://prefixgate:prefixgate@postgres:5432/")
    assert services["prefixgate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    for name, service in services.items():
        assert service["healthcheck"]["test"], name
    assert "/health" in " ".join(services["prefixgate"]["healthcheck"]["test"])
    assert "/root/.cache/prefixgate" in [v.split(":")[1] for v in services["prefixgate"]["volumes"]]


def test_compose_references_files_that_exist():
    spec = compose()
    named_volumes = set(spec.get("volumes") or {})
    for name, service in spec["services"].items():
        if "build" in service:
            context = ROOT / (service["build"] if isinstance(service["build"], str) else service["build"]["context"])
            assert (context / "Dockerfile").is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name}: {source}"
            else:
                assert source in named_volumes, f"{name}: undeclared volume {source}"


def test_dockerfile_copies_paths_that_exist():
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source


def test_prometheus_and_grafana_point_at_the_compose_services():
    services = compose()["services"]
    target = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"][0]["static_configs"][0]["targets"][0]
    host, port = target.split(":")
    assert host in services and f"{port}:{port}" in services[host]["ports"]
    assert "./configs/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]

    provisioning = ROOT / "configs/grafana/provisioning"
    datasource = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((provisioning / "dashboards/dashboards.yml").read_text())["providers"][0]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["./configs/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./configs/grafana/provisioning"] == "/etc/grafana/provisioning"
