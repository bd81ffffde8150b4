"""The service's Prometheus metrics (on prometheus_client, in the process's one registry,
which the HTTP layer registers into too: `ServiceBackend.metrics_registry`):

  xllm_service_requests_total{outcome}            client requests: ok, error, timeout
  xllm_service_instance_requests_total{instance,outcome}  the same, per instance served
  xllm_service_migrations_total{outcome}          moves off an evicted instance: ok, failed
  xllm_service_pd_decisions_total{path}           engine requests over prefill/decode
                                                  instances: pd (prompt on a prefill),
                                                  decode (prefilled on the decode)
  xllm_service_inflight_requests{instance}        sub-requests depending on an instance
  xllm_service_prefix_cached_blocks{instance}     from the engines' heartbeat cache events
  xllm_service_instances{state}                   registered instances by state
  xllm_service_slo_target_ms{target}              SLO_AWARE: the TTFT / TPOT target of a
                                                  request that states none (the operator's,
                                                  else derived from the latency profiles)

Counters are kept here (`outcomes`, ...; tests read them); gauges are read from their
owners when scraped.
"""
from __future__ import annotations

import collections
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

MIGRATION_OUTCOMES = ("failed", "ok")
PD_PATHS = ("decode", "pd")


class ServiceMetrics:
    def __init__(self, inflight: Callable[[], list[tuple[str, int]]],
                 prefix_blocks: Callable[[], list[tuple[str, int]]] | None = None,
                 instance_counts: Callable[[], dict[str, int]] | None = None,
                 slo_targets: Callable[[], tuple[float, float] | None] | None = None) -> None:
        self.outcomes: collections.Counter = collections.Counter()
        # (instance, outcome) -> requests; an instance counts every request it served
        self.instance_outcomes: collections.Counter = collections.Counter()
        self.migrations: collections.Counter = collections.Counter()  # "ok" / "failed"
        self.pd_decisions: collections.Counter = collections.Counter()  # "pd" / "decode"
        self._inflight = inflight
        self._prefix_blocks = prefix_blocks
        self._instance_counts = instance_counts
        self._slo_targets = slo_targets
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def count_outcome(self, instances: set[str], outcome: str) -> None:
        self.outcomes[outcome] += 1
        for name in instances:
            self.instance_outcomes[(name, outcome)] += 1

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def collect(self) -> Iterator[Metric]:
        """prometheus_client Collector."""
        requests = CounterMetricFamily("xllm_service_requests", "Requests by outcome",
                                       labels=["outcome"])
        for outcome, n in sorted(self.outcomes.items()):
            requests.add_metric([outcome], n)
        yield requests
        per_instance = CounterMetricFamily(
            "xllm_service_instance_requests", "Finished requests by instance and outcome",
            labels=["instance", "outcome"])
        for (name, outcome), n in sorted(self.instance_outcomes.items()):
            per_instance.add_metric([name, outcome], n)
        yield per_instance
        migrations = CounterMetricFamily(
            "xllm_service_migrations", "Requests moved off an evicted decode or MIX instance "
            "by MultiGenerations, by outcome", labels=["outcome"])
        for outcome in MIGRATION_OUTCOMES:
            migrations.add_metric([outcome], self.migrations[outcome])
        yield migrations
        decisions = CounterMetricFamily(
            "xllm_service_pd_decisions", "Engine requests over prefill and decode instances "
            "by path: pd (prompt on a prefill instance), decode (prefilled on the decode)",
            labels=["path"])
        for path in PD_PATHS:
            decisions.add_metric([path], self.pd_decisions[path])
        yield decisions
        inflight = GaugeMetricFamily("xllm_service_inflight_requests",
                                     "In-flight requests by instance", labels=["instance"])
        for name, n in self._inflight():
            inflight.add_metric([name], n)
        yield inflight
        if self._prefix_blocks is not None:
            blocks = GaugeMetricFamily(
                "xllm_service_prefix_cached_blocks", "Prefix-cache blocks an instance holds, "
                "as its heartbeats reported them", labels=["instance"])
            for name, n in self._prefix_blocks():
                blocks.add_metric([name], n)
            yield blocks
        if self._instance_counts is not None:
            instances = GaugeMetricFamily("xllm_service_instances",
                                          "Registered instances by state", labels=["state"])
            for state, n in sorted(self._instance_counts().items()):
                instances.add_metric([state], n)
            yield instances
        targets = self._slo_targets() if self._slo_targets is not None else None
        if targets is not None:
            slo = GaugeMetricFamily("xllm_service_slo_target_ms", "SLO_AWARE: the target of a "
                                    "request that states none, in ms (0: none)",
                                    labels=["target"])
            for name, ms in zip(("ttft", "tpot"), targets):
                slo.add_metric([name], ms)
            yield slo
