"""Which queued request a prefill instance places next (`PDSchedulerConfig.prefill_order`).

  fcfs      arrival order.
  deadline  (default) a request with a TTFT target whose prompt can still be computed
            in time (now + the prefill work placed ahead of it + its own predicted
            prefill <= its arrival + target) goes first, earliest deadline first; the
            others, those without a target and those already too late (they miss
            whatever is done), follow in arrival order. Under a burst of long prompts
            FCFS makes every request behind the burst late; this keeps on time the ones
            that still can (`python benchmarks/bench_prefill_order.py`, the mixed
            workload of issue 16 on one prefill core at 2.4 req/s: 53% of long prompts in
            time FCFS, 76% by deadline).
            Without a latency profile (nothing to predict a prefill with) it is FCFS.

The predicted prefill is the instance's latency profile scaled by a moving average of
measured / predicted (`PrefillCostModel.observe`: the profile is a step's cost on a core
of its own; a shared machine runs slower). Pure Python: no torch, no gRPC.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from xllm_py.cluster.latency_profile import LatencyProfile

ORDERS = ("fcfs", "deadline")

# Measured/predicted correction: weight of a new observation, and its bounds (1/x .. x).
SCALE_ALPHA = 0.2
SCALE_MAX = 10.0


@dataclasses.dataclass
class Queued:
    """What the order needs of a queued request (kept in arrival order)."""
    deadline_s: float  # arrival + TTFT target on the loop's clock; inf: no target
    cost_s: float  # its predicted prefill


def pick(queued: Sequence[Queued], now_s: float, ahead_s: float) -> int:
    """Index of the request to place next under the deadline order (0: the oldest)."""
    best = -1
    for i, q in enumerate(queued):
        if math.isfinite(q.deadline_s) and now_s + ahead_s + q.cost_s <= q.deadline_s and (
                best < 0 or q.deadline_s < queued[best].deadline_s):
            best = i
    return max(best, 0)


class PrefillCostModel:
    """Predicted prefill time of a prompt on this instance, corrected by what it measures."""

    def __init__(self, profile: LatencyProfile) -> None:
        self.profile = profile
        self.scale = 1.0

    def predict_s(self, prompt_tokens: int) -> float:
        return self.profile.prefill_ms(prompt_tokens) / 1000.0 * self.scale

    def observe(self, prompt_tokens: int, measured_s: float) -> None:
        """A prompt computed alone took `measured_s` (its step times, not its wait)."""
        raw = self.profile.prefill_ms(prompt_tokens) / 1000.0
        if raw <= 0 or measured_s <= 0:
            return
        ratio = min(SCALE_MAX, max(1.0 / SCALE_MAX, measured_s / raw))
        self.scale += SCALE_ALPHA * (ratio - self.scale)
