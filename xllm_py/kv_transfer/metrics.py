"""KVTransferMetrics: a KV worker's transfer counters, a prometheus_client Collector.

The worker counts under a lock (transfers finish on the transfer thread); the engine
registers the object into its one registry and /metrics reads it at scrape time. An
instance of TP > 1 has one worker per rank: rank 0 renders every rank's counters
(``transfer_families`` over their ``TransferSnapshot``s; the others' fetched over
WorkerService.GetTransferMetrics, parallel/rank_metrics.py).
Families (labels ``op`` = pull | push, ``rank`` = the TP rank whose worker moved the
bytes; a sum over ``rank`` is the instance's total):

- ``xllm_kv_transfer_bytes_total``    counter
- ``xllm_kv_transfer_blocks_total``   counter
- ``xllm_kv_transfer_seconds``        histogram (successful transfers)
- ``xllm_kv_transfer_failures_total`` counter (label ``reason`` = invalid_argument |
  timeout | denied | error)
"""
from __future__ import annotations

import bisect
import dataclasses
import threading
from collections import defaultdict
from typing import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

DEFAULT_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclasses.dataclass(frozen=True)
class TransferSnapshot:
    """One worker's counters at one moment (what GetTransferMetrics carries)."""

    buckets: tuple[float, ...] = DEFAULT_BUCKETS  # histogram upper bounds, ascending
    bytes_total: dict[str, int] = dataclasses.field(default_factory=dict)  # op ->
    blocks_total: dict[str, int] = dataclasses.field(default_factory=dict)
    failures_total: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    # op -> per-bucket counts (len(buckets) + 1, the last +Inf; not cumulative)
    hist_counts: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    hist_sum: dict[str, float] = dataclasses.field(default_factory=dict)


class KVTransferMetrics(Collector):
    def __init__(self, buckets: tuple[float, ...] = DEFAULT_BUCKETS, rank: int = 0) -> None:
        self.buckets = tuple(sorted(buckets))
        self.rank = rank  # the label value collect() gives these counters
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

    def snapshot(self) -> TransferSnapshot:
        """A consistent copy of every counter."""
        with self._lock:
            return TransferSnapshot(
                buckets=self.buckets, bytes_total=dict(self.bytes_total),
                blocks_total=dict(self.blocks_total), failures_total=dict(self.failures_total),
                hist_counts={op: list(c) for op, c in self._hist_counts.items()},
                hist_sum={op: self._hist_sum[op] for op in self._hist_counts})

    def collect(self) -> Iterator[Metric]:
        return transfer_families([(self.rank, self.snapshot())])

    def render(self) -> str:
        """These metrics alone as Prometheus text (tests, tools)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry).decode()


def transfer_families(snapshots: Sequence[tuple[int, TransferSnapshot]]) -> Iterator[Metric]:
    """The four families over the given (rank, snapshot) pairs, one series per rank and op."""
    by_rank = sorted(snapshots, key=lambda rs: rs[0])
    for name, doc, attr in (
            ("xllm_kv_transfer_bytes", "Bytes of KV cache moved by successful transfers.",
             "bytes_total"),
            ("xllm_kv_transfer_blocks", "KV blocks moved by successful transfers.",
             "blocks_total")):
        family = CounterMetricFamily(name, doc, labels=["op", "rank"])
        for rank, snap in by_rank:
            for op, v in sorted(getattr(snap, attr).items()):
                family.add_metric([op, str(rank)], v)
        yield family
    f = CounterMetricFamily("xllm_kv_transfer_failures", "Failed KV transfers.",
                            labels=["op", "reason", "rank"])
    for rank, snap in by_rank:
        for (op, reason), v in sorted(snap.failures_total.items()):
            f.add_metric([op, reason, str(rank)], v)
    yield f
    h = HistogramMetricFamily("xllm_kv_transfer_seconds", "Duration of successful KV transfers.",
                              labels=["op", "rank"])
    for rank, snap in by_rank:
        for op, counts in sorted(snap.hist_counts.items()):
            buckets, cum = [], 0
            for le, c in zip(snap.buckets, counts):
                cum += c
                buckets.append((floatToGoString(le), cum))
            buckets.append(("+Inf", cum + counts[-1]))
            h.add_metric([op, str(rank)], buckets, snap.hist_sum.get(op, 0.0))
    yield h
