"""Which queued request a prefill instance places next (`PDSchedulerConfig.prefill_order`).

  fcfs      arrival order.
  deadline  (default) the requests with a TTFT target whose prompt can still be computed
            in time (now + the prefill work placed ahead of it + its own predicted
            prefill <= its arrival + target), less the longest of them wherever, taken
            in deadline order, one would be late (Moore-Hodgson: the most on time);
            of those, the shortest that can go first with all the others still on time
            goes first (a short prompt does not wait behind a long one with time to
            spare), else the earliest deadline. The others, those without a target and
            those too late (they miss whatever is done), follow in arrival order.
            Under a burst of long prompts FCFS makes every request behind the burst
            late; this keeps on time the ones that still can
            (`python benchmarks/bench_prefill_order.py`, a mixed workload on
            one prefill core at 2.4 req/s: long prompts in time FCFS 47%, deadline
            order 74%; the short ones sent there 64% and 100%).
            Without a latency profile (nothing to predict a prefill with) it is FCFS.

`finish_s` predicts from the same order when a request sent now would be computed: the
service's SLO_AWARE router uses it for a prefill's TTFT.

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
    """Index of the request to place next under the deadline order (0: the oldest).

    The requests that can still make their deadline, in deadline order from
    `now_s + ahead_s`; where one would finish late, the longest of those so far leaves
    the set (Moore-Hodgson: the most requests on time from the queue as it stands). Of
    the set, the shortest one that can go first with every other still on time goes
    first: a short prompt does not wait behind a long one that has time to spare."""
    start = now_s + ahead_s
    feasible = sorted((i for i, q in enumerate(queued)
                       if math.isfinite(q.deadline_s) and start + q.cost_s <= q.deadline_s),
                      key=lambda i: (queued[i].deadline_s, i))
    kept: list[int] = []
    t = start
    for i in feasible:
        kept.append(i)
        t += queued[i].cost_s
        if t > queued[i].deadline_s:
            drop = max(kept, key=lambda j: (queued[j].cost_s, j))
            kept.remove(drop)
            t -= queued[drop].cost_s
    if not kept:
        return 0
    for first in sorted(kept, key=lambda j: (queued[j].cost_s, queued[j].deadline_s, j)):
        if _on_time(queued, start, first, kept):
            return first
    return kept[0]


def _on_time(queued: Sequence[Queued], start: float, first: int, kept: list[int]) -> bool:
    """Whether `first`, then the rest of `kept` in deadline order, all make their deadlines."""
    t = start
    for i in (first, *(j for j in kept if j != first)):
        t += queued[i].cost_s
        if t > queued[i].deadline_s:
            return False
    return True


def finish_s(queued: Sequence[Queued], index: int, now_s: float,
             max_picks: int = 64) -> float:
    """When `queued[index]`, the latest arrival, is predicted computed, the prefill taking
    the queue one request at a time in the deadline order from `now_s`, the first of the
    others already under way (a prompt is not preempted; it is counted whole). The
    service predicts a request's TTFT at a prefill instance so. Past `max_picks` picks
    the rest is taken as done in one go (a bound on the work of a long queue)."""
    rest = list(queued)
    t = now_s
    for n in range(max_picks):
        if n == 0 and len(rest) > 1:  # under way: one of the others
            others = rest[:index] + rest[index + 1:]
            i = pick(others, t, 0.0)
            i += i >= index
        else:
            i = pick(rest, t, 0.0)
        t += rest[i].cost_s
        if i == index:
            return t
        index -= i < index
        del rest[i]
    return t + sum(q.cost_s for q in rest)


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
