"""The engine's Prometheus metrics on prometheus_client: one CollectorRegistry per engine
process (`AsyncEngine.metrics_registry`) that every component registers into, rendered by
`generate_latest` at GET /metrics. No exposition text is written by hand.

Registered into it:
  - the HTTP layer's request metrics (`xllm_py.api.metrics.APIMetrics`, by `build_app`);
  - the engine's own gauges and counters, read from `LLMEngine.stats()` at scrape time
    (`EngineStatsCollector`, by `AsyncEngine`);
  - in a cluster, the KV worker's transfer metrics (`KVTransferCollector`, by the
    ClusterNode) and the PD scheduler's (it registers into the same registry).
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from xllm_py.kv_transfer.metrics import KVTransferMetrics

# name, kind, key of LLMEngine.stats(), help. Names as they have always been exposed.
_ENGINE_STATS = (
    ("xllm_requests_running", "gauge", "running", "Requests in the running batch"),
    ("xllm_requests_waiting", "gauge", "waiting", "Requests waiting to be scheduled"),
    ("xllm_kv_cache_blocks_used", "gauge", "kv_blocks_used",
     "KV blocks referenced by live requests"),
    ("xllm_kv_cache_blocks_total", "gauge", "kv_blocks_total", "KV blocks in the pool"),
    ("xllm_prefix_cache_hit_tokens_total", "counter", "prefix_hit_tokens",
     "Prompt tokens served from the prefix cache"),
    ("xllm_generation_tokens_total", "counter", "generated_tokens", "Tokens generated"),
    ("xllm_engine_step_failures_total", "counter", "step_failures",
     "Engine steps that raised (every request of the step failed)"),
)


class EngineStatsCollector(Collector):
    """The engine's scheduler and KV cache state, read at scrape time from `engine.stats()`
    (a dict; read from the HTTP loop while the engine thread runs, as before)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def describe(self) -> Iterator[Metric]:
        """The families without reading the engine (it may not be running yet)."""
        return self._families({})

    def collect(self) -> Iterator[Metric]:
        return self._families(self._engine.stats())

    @staticmethod
    def _families(stats: dict) -> Iterator[Metric]:
        for name, kind, key, help_ in _ENGINE_STATS:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, help_, value=stats.get(key, 0))


class KVTransferCollector(Collector):
    """The KV worker's transfer metrics (label `op` = pull | push), from its
    KVTransferMetrics at scrape time. A bridge: once KVTransferMetrics registers
    prometheus_client metrics itself (kv_transfer is another owner's), this goes."""

    def __init__(self, metrics: KVTransferMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        with m._lock:  # a consistent snapshot of all four families
            bytes_total = sorted(m.bytes_total.items())
            blocks_total = sorted(m.blocks_total.items())
            failures = sorted(m.failures_total.items())
            hist = sorted((op, list(c), m._hist_sum[op]) for op, c in m._hist_counts.items())
        b = CounterMetricFamily("xllm_kv_transfer_bytes",
                                "Bytes of KV cache moved by successful transfers.", labels=["op"])
        for op, v in bytes_total:
            b.add_metric([op], v)
        yield b
        k = CounterMetricFamily("xllm_kv_transfer_blocks",
                                "KV blocks moved by successful transfers.", labels=["op"])
        for op, v in blocks_total:
            k.add_metric([op], v)
        yield k
        f = CounterMetricFamily("xllm_kv_transfer_failures", "Failed KV transfers.",
                                labels=["op", "reason"])
        for (op, reason), v in failures:
            f.add_metric([op, reason], v)
        yield f
        h = HistogramMetricFamily("xllm_kv_transfer_seconds",
                                  "Duration of successful KV transfers.", labels=["op"])
        for op, counts, total_seconds in hist:
            buckets, cum = [], 0
            for le, c in zip(m.buckets, counts):
                cum += c
                buckets.append((floatToGoString(le), cum))
            buckets.append(("+Inf", cum + counts[-1]))
            h.add_metric([op], buckets, total_seconds)
        yield h
