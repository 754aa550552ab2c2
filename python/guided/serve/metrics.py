"""Prometheus metrics at /metrics: request latencies plus the engine's counters."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Engine counters that only grow, and readings that go up and down.
_COUNTERS = ("prompt_tokens", "generated_tokens", "forced_tokens", "prefix_cache_hit_tokens",
             "prefix_cache_queries", "preemptions", "steps")
_GAUGES = ("num_running", "num_waiting", "num_free_blocks", "num_cached_blocks", "num_blocks")


class _EngineCollector:
    def __init__(self, read_stats):
        self.read_stats = read_stats

    def collect(self):
        stats = self.read_stats()
        for name in _COUNTERS:
            if name in stats:
                family = CounterMetricFamily(f"guided_{name}", f"engine counter {name}")
                family.add_metric([], stats[name])
                yield family
        for name in _GAUGES:
            if name in stats:
                yield GaugeMetricFamily(f"guided_{name}", f"engine reading {name}",
                                        value=stats[name])


class Metrics:
    def __init__(self, read_stats):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(read_stats))
        self.requests = Counter("guided_requests", "finished requests by endpoint and reason",
                                ["endpoint", "finish_reason"], registry=self.registry)
        self.ttft = Histogram("guided_time_to_first_token_seconds", "time to first token",
                              registry=self.registry)
        self.latency = Histogram("guided_request_latency_seconds", "whole-request latency",
                                 registry=self.registry)
