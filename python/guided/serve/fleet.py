"""`python -m guided.serve --replicas N`: N engine processes on loopback
ports behind vllm-router (PyPI; Rust), which keeps each conversation on the
replica whose prefix cache holds it (its cache_aware policy: the replica
whose past requests share the longest prefix with this one). With
``--router-policy kv_aware`` each replica publishes its prefix cache's
changes (serve/kv_events.py) and the router routes by what each replica
actually holds, evictions included. ``--metrics-port`` serves one Prometheus
view of the router and every replica (FleetMetrics).

This process only starts and watches: the replicas are `python -m
guided.serve` with the same options, the router listens on --host/--port.
SIGTERM or SIGINT stops them all; the replicas are also told to stop if this
process dies (PR_SET_PDEATHSIG), so none is left behind. A replica that
exits is logged and the router's health check takes it out; the others keep
serving. If the router exits, everything stops.

What the router does not do: move KV between replicas (a conversation that
lands on another replica recomputes its prompt there), or share the
Responses API's stored responses (each replica keeps its own: with several
replicas, send the conversation again rather than previous_response_id).
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..processes import die_with_parent, free_port

log = logging.getLogger("guided.serve.fleet")

#: options of this process that the replicas do not get
FLEET_OPTIONS = {"--replicas": True, "--router-policy": True, "--host": True, "--port": True,
                 "--kv-events-endpoint": True, "--kv-events-replay-endpoint": True,
                 "--metrics-port": True}


def replica_argv(argv: list[str]) -> list[str]:
    """The command line without the fleet's own options (``--x v`` or ``--x=v``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in FLEET_OPTIONS:
            skip = "=" not in arg and FLEET_OPTIONS[name]
            continue
        out.append(arg)
    return out


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def router_command() -> str:
    found = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not os.path.exists(found):
        raise SystemExit("--replicas needs vllm-router (pip install 'guided[fleet]'; make test installs it)")
    return found


class FleetMetrics:
    """One Prometheus view of the fleet (``--metrics-port``): the router's
    own metrics with ``source="router"``, and each replica's /metrics with
    ``replica="i"`` (and its URL), read at each scrape. A replica that does not
    answer is reported by ``guided_fleet_replica_up 0``."""

    def __init__(self, router_metrics: str, replica_urls: list[str]):
        self.sources = [({"source": "router"}, router_metrics)] + [
            ({"replica": str(i), "replica_url": url}, url + "/metrics")
            for i, url in enumerate(replica_urls)]

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        from prometheus_client.parser import text_string_to_metric_families

        merged: dict[str, object] = {}
        up = GaugeMetricFamily("guided_fleet_replica_up", "Whether the replica answered this scrape",
                               labels=["replica", "replica_url"])
        for labels, url in self.sources:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                if "replica" in labels:
                    up.add_metric([labels["replica"], labels["replica_url"]], 0)
                continue
            if "replica" in labels:
                up.add_metric([labels["replica"], labels["replica_url"]], 1)
            for family in text_string_to_metric_families(text):
                family.samples = [x._replace(labels={**x.labels, **labels}) for x in family.samples]
                into = merged.setdefault(family.name, family)
                if into is not family:
                    into.samples.extend(family.samples)
        yield up
        yield from merged.values()


@dataclass
class _KvEvents:
    replica_args: list[list[str]]   # per replica: where it publishes
    router_args: list[str]          # where the router reads them


def _kv_events(args, urls: list[str]) -> _KvEvents:
    """kv_aware: each replica publishes its prefix cache's changes (and
    replays missed ones) on two loopback ports; the router subscribes to all."""
    from ..engine import EngineConfig
    from ..model.loader import model_path
    from .app import served_names
    replica_args, router_args = [], []
    for url in urls:
        pub, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
        replica_args.append(["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay])
        router_args += ["--kv-event-source", f"{url}={pub}", "--kv-event-replay-source", f"{url}={replay}"]
    # the router indexes events under one model name: the one the replicas serve first
    name = served_names(args.served_model_name, args.model, model_path(args.model))[0]
    return _KvEvents(replica_args, router_args + [
        "--kv-event-block-size", str(EngineConfig.block_size), "--kv-event-model", name])


def run_fleet(args, argv: list[str]) -> None:
    router = router_command()
    ports = [free_port() for _ in range(args.replicas)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    rest = replica_argv(argv)
    events = _kv_events(args, urls) if args.router_policy == "kv_aware" else None
    env = dict(os.environ)
    # the replicas share this machine's cores: each one's torch threads and native kernel
    # threads (rust/threads/pool.rs, rayon's count) split them
    share = str(max(1, (os.cpu_count() or 1) // args.replicas))
    env.setdefault("OMP_NUM_THREADS", share)
    env.setdefault("RAYON_NUM_THREADS", share)
    procs: list[subprocess.Popen] = []

    def stop(signum=None, _frame=None, code: int = 0):
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 20
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        sys.exit(code)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for i, port in enumerate(ports):
        own = events.replica_args[i] if events else []
        procs.append(subprocess.Popen([sys.executable, "-m", "guided.serve", *rest, *own, "--host",
                                       "127.0.0.1", "--port", str(port)], env=env,
                                      preexec_fn=die_with_parent))
    log.info("starting %d replicas on %s", len(ports), ", ".join(urls))
    while not all(_healthy(u) for u in urls):
        if any(p.poll() is not None for p in procs):
            log.error("a replica exited while starting; stopping the fleet")
            stop(code=1)
        time.sleep(0.5)
    router_metrics_port = free_port()
    procs.append(subprocess.Popen(
        [router, "--worker-urls", *urls, "--policy", args.router_policy, "--host", args.host,
         "--port", str(args.port), *(events.router_args if events else []),
         # a replica that stops answering is out within seconds: two failed requests open its
         # circuit breaker (the router retries elsewhere), two failed health checks 3 s apart
         # take it out; a busy one has 5 s to answer a health check
         "--cb-failure-threshold", "2", "--health-check-interval-secs", "3", "--health-failure-threshold", "2",
         # the router's own Prometheus exporter, on a free loopback port (its default may be taken)
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(router_metrics_port),
         "--log-level", args.log_level.lower() if args.log_level.lower() in ("warning", "debug") else "info"],
        preexec_fn=die_with_parent))
    log.info("vllm-router (%s) on http://%s:%d/v1 in front of them", args.router_policy, args.host, args.port)
    if args.metrics_port:
        from prometheus_client import CollectorRegistry, start_http_server
        registry = CollectorRegistry()
        registry.register(FleetMetrics(f"http://127.0.0.1:{router_metrics_port}/metrics", urls))
        start_http_server(args.metrics_port, args.host, registry)
        log.info("the fleet's metrics (router and replicas) on http://%s:%d/metrics", args.host,
                 args.metrics_port)
    reported: set[int] = set()
    while True:
        time.sleep(1)
        if procs[-1].poll() is not None:
            log.error("vllm-router exited with %s; stopping the replicas", procs[-1].returncode)
            stop(code=1)
        for i, p in enumerate(procs[:-1]):
            if p.poll() is not None and i not in reported:
                reported.add(i)
                log.error("replica %d (%s) exited with %s; the router takes it out, the others keep "
                          "serving", i, urls[i], p.returncode)
