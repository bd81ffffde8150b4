"""KVTransferMetrics: a KV worker's transfer counters, a prometheus_client Collector.

The worker counts under a lock (transfers finish on the transfer thread); the engine
registers the object into its one registry and /metrics reads it at scrape time.
Families (label ``op`` = pull | push):

- ``xllm_kv_transfer_bytes_total``    counter
- ``xllm_kv_transfer_blocks_total``   counter
- ``xllm_kv_transfer_seconds``        histogram (successful transfers)
- ``xllm_kv_transfer_failures_total`` counter (label ``reason`` = invalid_argument | timeout | error)
"""
from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

DEFAULT_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KVTransferMetrics(Collector):
    def __init__(self, buckets: tuple[float, ...] = DEFAULT_BUCKETS) -> None:
        self.buckets = tuple(sorted(buckets))
        self._lock = threading.Lock()
        self.bytes_total: dict[str, int] = defaultdict(int)
        self.blocks_total: dict[str, int] = defaultdict(int)
        self.failures_total: dict[tuple[str, str], int] = defaultdict(int)
        self._hist_counts: dict[str, list[int]] = {}
        self._hist_sum: dict[str, float] = defaultdict(float)

    def observe_success(self, op: str, num_bytes: int, num_blocks: int, seconds: float) -> None:
        with self._lock:
            self.bytes_total[op] += num_bytes
            self.blocks_total[op] += num_blocks
            counts = self._hist_counts.setdefault(op, [0] * (len(self.buckets) + 1))
            counts[bisect.bisect_left(self.buckets, seconds)] += 1
            self._hist_sum[op] += seconds

    def observe_failure(self, op: str, reason: str) -> None:
        with self._lock:
            self.failures_total[(op, reason)] += 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # a consistent snapshot of all four families
            bytes_total = sorted(self.bytes_total.items())
            blocks_total = sorted(self.blocks_total.items())
            failures = sorted(self.failures_total.items())
            hist = sorted((op, list(c), self._hist_sum[op]) for op, c in self._hist_counts.items())
        for name, doc, values in (
                ("xllm_kv_transfer_bytes", "Bytes of KV cache moved by successful transfers.", bytes_total),
                ("xllm_kv_transfer_blocks", "KV blocks moved by successful transfers.", blocks_total)):
            family = CounterMetricFamily(name, doc, labels=["op"])
            for op, v in values:
                family.add_metric([op], v)
            yield family
        f = CounterMetricFamily("xllm_kv_transfer_failures", "Failed KV transfers.", labels=["op", "reason"])
        for (op, reason), v in failures:
            f.add_metric([op, reason], v)
        yield f
        h = HistogramMetricFamily("xllm_kv_transfer_seconds", "Duration of successful KV transfers.",
                                  labels=["op"])
        for op, counts, total_seconds in hist:
            buckets, cum = [], 0
            for le, c in zip(self.buckets, counts):
                cum += c
                buckets.append((floatToGoString(le), cum))
            buckets.append(("+Inf", cum + counts[-1]))
            h.add_metric([op], buckets, total_seconds)
        yield h

    def render(self) -> str:
        """These metrics alone as Prometheus text (tests, tools)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry).decode()
