"""The engine's Prometheus metrics on prometheus_client: one CollectorRegistry per engine
process (`AsyncEngine.metrics_registry`) that every component registers into, rendered by
`generate_latest` at GET /metrics. No exposition text is written by hand.

Registered into it:
  - the HTTP layer's request metrics (`xllm_py.api.metrics.APIMetrics`, by `build_app`);
  - the engine's own gauges and counters, read from `LLMEngine.stats()` at scrape time
    (`EngineStatsCollector`, by `AsyncEngine`);
  - in a cluster, the KV worker's transfer metrics (`KVTransferMetrics` is a collector,
    registered by the ClusterNode) and the PD scheduler's (it registers into the same registry).
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
    ("xllm_prompt_steps_held_total", "counter", "prompt_steps_held",
     "Steps that held waiting prompts back to keep the streams within "
     "prompt_tpot_target_ms"),
    ("xllm_offline_requests_waiting", "gauge", "offline_waiting",
     "Offline requests waiting to start or to be recomputed"),
    ("xllm_offline_requests_running", "gauge", "offline_running",
     "Offline requests in the running batch"),
    ("xllm_offline_requests_preempted", "gauge", "offline_preempted",
     "Offline requests out of the batch for online work (suspended with their KV, or "
     "preempted for recompute)"),
    ("xllm_offline_preemptions_total", "counter", "offline_preemptions",
     "Offline requests whose KV went to other work (recomputed later)"),
    ("xllm_offline_suspensions_total", "counter", "offline_suspensions",
     "Offline requests taken out of the batch for online work, their KV kept"),
)


class EngineStatsCollector(Collector):
    """The engine's scheduler and KV cache state, read at scrape time from `engine.stats()`
    (a dict; read from the HTTP loop while the engine thread runs, as before)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def describe(self) -> Iterator[Metric]:
        """The families without reading the engine (it may not be running yet)."""
        yield from self._families({})
        yield self._held({})
        yield from self._speculation(None)

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._engine.stats())
        yield self._held(self._engine.scheduler.kv.held_blocks())
        yield from self._speculation(self._engine.speculator)

    @staticmethod
    def _speculation(speculator) -> Iterator[Metric]:
        """Speculative decoding's guesses (engine/spec_decode/), per method: proposed,
        accepted, the sequence-steps that verified some, and how many each kept."""
        for name, key, help_ in (
                ("xllm_spec_decode_proposed_tokens_total", "proposed", "Tokens guessed"),
                ("xllm_spec_decode_accepted_tokens_total", "accepted",
                 "Guessed tokens the model agreed with (emitted without a step of their own)"),
                ("xllm_spec_decode_verify_steps_total", "verify_steps",
                 "Sequence-steps that verified guesses")):
            family = CounterMetricFamily(name, help_, labels=["method"])
            for method, stats in (speculator.stats.items() if speculator else ()):
                family.add_metric([method], getattr(stats, key))
            yield family
        yield _acceptance_lengths(speculator)

    @staticmethod
    def _held(held: dict[str, int]) -> Metric:
        """Blocks live requests hold per attention type (a hybrid model's sliding-window
        layers hold only their window: engine/hybrid_kv.py)."""
        family = GaugeMetricFamily(
            "xllm_kv_cache_blocks_held", "KV blocks held by live requests, by the attention "
            "type of the layers they serve", labels=["attention"])
        for kind, n in held.items():
            family.add_metric([kind], n)
        return family

    @staticmethod
    def _families(stats: dict) -> Iterator[Metric]:
        for name, kind, key, help_ in _ENGINE_STATS:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, help_, value=stats.get(key, 0))


# Buckets of the acceptance length: 0 .. SpeculativeConfig.MAX_TOKENS guesses kept.
_ACCEPTANCE_BUCKETS = tuple(range(16))


def _acceptance_lengths(speculator) -> Metric:
    """Guesses kept per verify step, a histogram per method (mean + 1: the tokens a
    speculating sequence emits per step)."""
    family = HistogramMetricFamily(
        "xllm_spec_decode_acceptance_length",
        "Guesses kept per sequence-step that verified guesses", labels=["method"])
    for method, stats in (speculator.stats.items() if speculator else ()):
        counts = stats.acceptance_lengths
        buckets, total = [], 0
        for le in _ACCEPTANCE_BUCKETS:
            total += counts.get(le, 0)
            buckets.append((str(float(le)), total))
        buckets.append(("+Inf", sum(counts.values())))
        family.add_metric([method], buckets, sum_value=sum(n * c for n, c in counts.items()))
    return family
