"""Prometheus metrics of an engine's KV tiers, read at scrape time from its TierStack (and
the engine side's counters, passed as a function): per tier the blocks read (hits), the
blocks looked for and not found (misses), bytes and seconds of loads, blocks written;
the store's failed calls, the writer's dropped blocks, the tokens loaded into the pool."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from xllm_py.kv_tiers.stack import TierStack

_PER_TIER = (
    ("xllm_kv_tier_hit_blocks", "hits", "KV blocks read from the tier into the pool"),
    ("xllm_kv_tier_miss_blocks", "misses", "KV blocks looked for in the tier and not found"),
    ("xllm_kv_tier_load_bytes", "bytes", "Bytes of KV read from the tier"),
    ("xllm_kv_tier_load_seconds", "load_s", "Seconds spent reading KV from the tier"),
    ("xllm_kv_tier_written_blocks", "written", "KV blocks written to the tier"),
)


class TierCollector(Collector):
    def __init__(self, stack: TierStack, engine_counts: Callable[[], dict[str, float]]) -> None:
        self._stack = stack
        self._engine_counts = engine_counts

    def collect(self) -> Iterator[Metric]:
        stack = self._stack
        for name, field, doc in _PER_TIER:
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier in stack.tiers:
                family.add_metric([tier], getattr(stack.counters[tier], field))
            yield family
        used = GaugeMetricFamily("xllm_kv_tier_used_bytes", "Bytes the tier holds",
                                 labels=["tier"])
        for tier in ("host", "disk"):
            t = getattr(stack, tier)
            if t is not None:
                used.add_metric([tier], t.used_bytes)
        yield used
        yield CounterMetricFamily("xllm_kv_store_errors", "Store calls that failed or "
                                  "timed out (the prompt was computed)",
                                  value=stack.store.num_errors if stack.store else 0)
        yield CounterMetricFamily("xllm_kv_disk_corrupt_blocks", "Disk tier files that failed "
                                  "their check (a miss; the file removed)",
                                  value=stack.disk.num_corrupt if stack.disk else 0)
        yield CounterMetricFamily("xllm_kv_disk_write_errors", "Disk tier writes that failed "
                                  "(full or read-only disk)",
                                  value=stack.disk.num_write_errors if stack.disk else 0)
        yield CounterMetricFamily("xllm_kv_tier_dropped_blocks", "Blocks not written: the "
                                  "tier writer's queue was full", value=stack.num_dropped_blocks)
        counts = self._engine_counts()
        yield CounterMetricFamily("xllm_kv_tier_loaded_tokens", "Prompt tokens loaded from the "
                                  "tiers instead of computed", value=counts.get("loaded_tokens", 0))
        yield CounterMetricFamily("xllm_kv_tier_lookups", "Prompts looked up below the pool",
                                  value=counts.get("lookups", 0))
