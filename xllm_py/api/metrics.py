"""Prometheus metrics of the HTTP layer, registered into the process's registry (the
backend's `metrics_registry`) or, for a backend without one, a registry of the app's own
(two apps in one process do not collide). `/metrics` renders that registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
)
_TPOT_BUCKETS = (
    0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)

# Values of the `outcome` label of xllm_requests_total.
OUTCOME_SUCCESS = "success"
OUTCOME_INVALID = "invalid"  # 4xx
OUTCOME_UNAVAILABLE = "unavailable"  # 503: not ready / busy
OUTCOME_ERROR = "error"  # backend failure
OUTCOME_CANCELLED = "cancelled"  # client went away


class APIMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.ttft = Histogram(
            "xllm_time_to_first_token_seconds", "Time from arrival to the first output token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.tpot = Histogram(
            "xllm_time_per_output_token_seconds", "Mean time per output token after the first.",
            buckets=_TPOT_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "xllm_e2e_request_latency_seconds", "Time from arrival to the last output.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.requests = Counter(
            "xllm_requests", "HTTP generation requests by outcome.", ["outcome"],
            registry=self.registry,
        )

    def observe_finished(
        self, arrival_time: float, first_token_time: float | None, end_time: float,
        max_num_tokens: int,
    ) -> None:
        """Record latencies of a request that produced output (max_num_tokens: longest choice)."""
        self.e2e.observe(max(0.0, end_time - arrival_time))
        if first_token_time is None:
            return
        self.ttft.observe(max(0.0, first_token_time - arrival_time))
        if max_num_tokens > 1:
            self.tpot.observe(max(0.0, end_time - first_token_time) / (max_num_tokens - 1))

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()
