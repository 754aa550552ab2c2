"""Prometheus metrics at /metrics: request latencies plus the engine's counters."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Engine counters that only grow, and readings that go up and down.
_COUNTERS = ("prompt_tokens", "generated_tokens", "forced_tokens", "prefix_cache_hit_tokens",
             "prefix_cache_queries", "prefix_cache_state_miss_tokens", "preemptions", "steps", "mask_rows",
             "mask_rows_on_demand", "mask_rows_refused",
             "draft_steps", "draft_tokens", "draft_lookups", "draft_lookups_kept",
             "draft_step_tokens", "draft_mask_rows", "closed_outputs")
_GAUGES = ("num_running", "num_waiting", "num_free_blocks", "num_cached_blocks", "num_blocks")
# Engine microsecond counters, exported in seconds.
_SECONDS = {"mask_time_us": "mask_time_seconds", "mask_wait_us": "mask_wait_seconds",
            "draft_mask_us": "draft_mask_seconds", "add_request_us": "add_request_seconds",
            "update_us": "update_seconds", "closing_us": "closing_seconds"}

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


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
        for name, exported in _SECONDS.items():
            if name in stats:
                family = CounterMetricFamily(f"guided_{exported}", f"engine counter {exported}")
                family.add_metric([], stats[name] / 1e6)
                yield family
        for name in _GAUGES:
            if name in stats:
                yield GaugeMetricFamily(f"guided_{name}", f"engine reading {name}",
                                        value=stats[name])
        yield from _derived(stats)


def _derived(stats: dict):
    """Ratios a dashboard wants without doing arithmetic on two series."""
    blocks = stats.get("num_blocks") or 0
    if blocks:
        used = blocks - stats.get("num_free_blocks", blocks)
        yield GaugeMetricFamily("guided_kv_cache_usage_ratio",
                                "share of KV blocks held by running or waiting sequences",
                                value=used / blocks)
    queries = stats.get("prefix_cache_queries") or 0
    yield GaugeMetricFamily("guided_prefix_cache_hit_ratio",
                            "prompt tokens served from the prefix cache / prompt tokens looked up",
                            value=stats.get("prefix_cache_hit_tokens", 0) / queries if queries else 0.0)
    drafted = stats.get("draft_steps") or 0
    yield GaugeMetricFamily("guided_draft_tokens_per_forward",
                            "tokens appended per speculative sequence-step (1 without speculation)",
                            value=stats.get("draft_step_tokens", 0) / drafted if drafted else 0.0)
    lookups = stats.get("draft_lookups") or 0
    yield GaugeMetricFamily("guided_draft_acceptance_ratio",
                            "looked-up draft tokens kept / looked up",
                            value=stats.get("draft_lookups_kept", 0) / lookups if lookups else 0.0)


class _RankCollector:
    """Per tensor-parallel rank: forward passes and their seconds."""

    def __init__(self, read_ranks):
        self.read_ranks = read_ranks

    def collect(self):
        steps = CounterMetricFamily("guided_tensor_parallel_steps", "forward passes run by each "
                                    "tensor-parallel rank", labels=["rank"])
        seconds = CounterMetricFamily("guided_tensor_parallel_forward_seconds", "seconds each "
                                      "tensor-parallel rank spent in forward passes (collectives "
                                      "included)", labels=["rank"])
        for rank, n, s in self.read_ranks():
            steps.add_metric([str(rank)], n)
            seconds.add_metric([str(rank)], s)
        yield steps
        yield seconds


class Metrics:
    def __init__(self, read_stats, read_ranks=None):
        """``read_ranks``: with tensor parallelism, (rank, steps, seconds) of every rank."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(read_stats))
        if read_ranks is not None:
            self.registry.register(_RankCollector(read_ranks))
        self.requests = Counter("guided_requests", "finished choices by endpoint, finish_reason and "
                                "HTTP status (499: the client went away)",
                                ["endpoint", "finish_reason", "status"], registry=self.registry)
        self.responses = Counter("guided_http_responses", "HTTP responses by path and status",
                                 ["path", "status"], registry=self.registry)
        self.ttft = Histogram("guided_time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("guided_inter_token_latency_seconds",
                                     "time between a choice's successive tokens",
                                     buckets=_ITL_BUCKETS, registry=self.registry)
        self.latency = Histogram("guided_request_latency_seconds", "whole-request latency",
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.grammar_compile = Histogram("guided_grammar_compile_seconds",
                                         "grammar compile time per request grammar (cache hits too)",
                                         buckets=_LATENCY_BUCKETS, registry=self.registry)

    def finished(self, endpoint: str, status: int, finish_reasons: list[str], latency: float) -> None:
        for reason in finish_reasons or ["none"]:
            self.requests.labels(endpoint, reason, str(status)).inc()
        self.latency.observe(latency)
