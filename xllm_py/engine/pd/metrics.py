"""PDMetrics: the PD scheduler's Prometheus metrics (prometheus_client).

  xllm_pd_transfer_failures_total  counter  PD hand-overs that failed (transfer, link or
                                            decode take-over)
  xllm_pd_linked_instances         gauge    peer instances linked for KV transfer

They live in the registry given (the engine's: its /metrics renders them), or in their
own (unit tests).
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class PDMetrics:
    def __init__(self, num_linked: Callable[[], int],
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.transfer_failures = Counter(
            "xllm_pd_transfer_failures",
            "PD hand-overs that failed (transfer, link or decode take-over)",
            registry=self.registry)
        self.linked_instances = Gauge("xllm_pd_linked_instances",
                                      "Peer instances linked for KV transfer",
                                      registry=self.registry)
        self.linked_instances.set_function(lambda: float(num_linked()))

    def render(self) -> str:
        return generate_latest(self.registry).decode()
