"""Prometheus series built from the engine's stats; the gateway serves them at /metrics."""
from metrics.prometheus import Metrics

__all__ = ["Metrics"]
