"""PDMetrics: the PD scheduler's Prometheus metrics (prometheus_client).

  xllm_pd_transfer_failures_total  counter  PD hand-overs that failed (transfer, link or
                                            decode take-over)
  xllm_pd_linked_instances         gauge    peer instances linked for KV transfer
  xllm_pd_pulls_sent_total         counter  decode: SendPullSignal calls (it had room)
  xllm_pd_pulls_answered_total     counter  decode: pulls a prefill answered
  xllm_pd_pulls_failed_total       counter  decode: pulls that failed (prefill unreachable)
  xllm_pd_pulls_received_total     counter  prefill: pulls it answered
  xllm_pd_offline_handed_total     counter  prefill: offline requests handed on pulls
  xllm_pd_prefill_pending          gauge    prefill side: requests not handed over yet
  xllm_pd_decode_open              gauge    decode side: placements not decoding yet
  xllm_pd_duty{state}              gauge    elastic: 1 for the duty state it is in

They live in the registry given (the engine's: its /metrics renders them), or in their
own (unit tests).
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class PDMetrics:
    def __init__(self, num_linked: Callable[[], int],
                 registry: CollectorRegistry | None = None) -> None:
        """The sides' gauges come with `watch_sides` once they exist."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.transfer_failures = Counter(
            "xllm_pd_transfer_failures",
            "PD hand-overs that failed (transfer, link or decode take-over)",
            registry=self.registry)
        self.linked_instances = Gauge("xllm_pd_linked_instances",
                                      "Peer instances linked for KV transfer",
                                      registry=self.registry)
        self.linked_instances.set_function(lambda: float(num_linked()))
        pulls = (("pulls_sent", "Offline-work pulls sent to prefills (decode)"),
                 ("pulls_answered", "Offline-work pulls a prefill answered (decode)"),
                 ("pulls_failed", "Offline-work pulls that failed (decode)"),
                 ("pulls_received", "Offline-work pulls answered (prefill)"),
                 ("offline_handed", "Offline requests handed to pulling decodes (prefill)"))
        for attr, help_ in pulls:
            setattr(self, attr, Counter(f"xllm_pd_{attr}", help_, registry=self.registry))

    def watch_sides(self, pending: Callable[[], tuple[int, int]],
                    duty: Callable[[], str] | None, duty_states: tuple[str, ...]) -> None:
        """`pending()`: (prefill side's requests not handed over, decode side's open
        placements); `duty()`: an elastic instance's duty state, one of `duty_states`."""
        for i, (name, help_) in enumerate((
                ("xllm_pd_prefill_pending", "Requests the prefill side has not handed over"),
                ("xllm_pd_decode_open", "Placements the decode side holds, not decoding yet"))):
            gauge = Gauge(name, help_, registry=self.registry)
            gauge.set_function(lambda i=i: float(pending()[i]))
        if duty is not None:
            states = Gauge("xllm_pd_duty", "Elastic instance: 1 for its duty state",
                           ["state"], registry=self.registry)
            for state in duty_states:
                states.labels(state).set_function(lambda state=state: float(duty() == state))

    def render(self) -> str:
        return generate_latest(self.registry).decode()
