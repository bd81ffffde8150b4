"""RoleAssigner: the master's side of elastic prefill/decode (`--elastic-pd on`).

Every `interval_s`, on the elected master only: the instances as the registry sees them
(the duty each acknowledged, its profile, its queues) and the demand this service
measured (`DemandWindow`) go to the ElasticPolicy (elastic_policy.py); each flip it
decides is written to etcd as the instance's assignment (cluster/role_assignment.py,
the epoch one above the last), logged with the predictions behind it, and counted.
The instance follows it and acknowledges it in its registration, which every replica
routes by; nothing else changes in routing.

A master that takes office reads every assignment first (epochs, pins), so it continues
from them; the flip times it did not see count as now (no instance flips again within
`min_dwell_s` of a takeover). It reads them again every round: an operator pins or
unpins an instance in etcd. A follower replica writes nothing.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from xllm_py.cluster.etcd_client import EtcdClient, EtcdError
from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.cluster.role_assignment import (ROLE_PREFIX, RoleAssignment, RoleAssignmentError,
                                             name_of_role_key, role_key)
from xllm_service.elastic_policy import Demand, ElasticPolicy, Flip, InstanceView
from xllm_service.instance_table import InstanceInfo

logger = logging.getLogger(__name__)

DIRECTIONS = ("decode_to_prefill", "prefill_to_decode")
# The part of the demand window also reported alone (`Demand.recent`): a load that rises
# shows there first.
RECENT_SHARE = 0.5
# Requests enough to measure a demand alone: a Poisson count of n has a relative error of
# 1 / sqrt(n), 18% here, within what the decision's hysteresis absorbs (nothing moves
# while the split keeps the load, a gain must hold for `hold_s`). Where the recent part
# holds this many, the shortest trailing span that does (at least RECENT_MIN_S) is the
# demand: a load that turns is then seen within a few seconds on both sides (the side it
# left too, whose old demand in the longer window would hold its instances there for the
# whole window; the streams running on a decode that flips finish on it, so none needs to
# stay a decode for them). With fewer, the longer window smooths.
RECENT_SAMPLES = 30
RECENT_MIN_S = 1.0


class DemandWindow:
    """The requests this service routed in the last `window_s`: their rate, mean prompt
    and asked output tokens; at a rate that gives RECENT_SAMPLES requests within less
    than half the window, those of the shortest trailing span (at least RECENT_MIN_S)
    that holds that many."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 local_prompt_max_tokens: int | None = None) -> None:
        """`local_prompt_max_tokens`: the router's local_prefill_max_tokens (None: every
        prompt may be computed on a decode), for Demand.local_share."""
        self.window_s = window_s
        self.clock = clock
        self.local_prompt_max_tokens = local_prompt_max_tokens
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque()

    def add(self, prompt_tokens: int, output_tokens: int) -> None:
        self._samples.append((self.clock(), prompt_tokens, output_tokens))

    def snapshot(self) -> Demand:
        """The whole window's demand, its last `RECENT_SHARE` in `recent`; or the recent
        requests' alone where they are enough (class doc)."""
        now = self.clock()
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        span = self.window_s * RECENT_SHARE
        last = [s for s in self._samples if s[0] >= now - span]
        if len(last) >= RECENT_SAMPLES:
            t = min(last[-RECENT_SAMPLES][0], now - RECENT_MIN_S)
            return self._demand([s for s in last if s[0] >= t], now - t)
        # A lull in the last part is no demand there: an empty Demand() would carry the
        # dataclass's default prompt length into the prediction.
        recent = self._demand(last, span) if last else None
        return dataclasses.replace(self._demand(self._samples, self.window_s), recent=recent)

    def _demand(self, samples: Sequence[tuple[float, int, int]], span_s: float) -> Demand:
        n = len(samples)
        if n == 0:
            return Demand()
        tokens = sum(s[1] for s in samples)
        limit = self.local_prompt_max_tokens
        short = tokens if limit is None else sum(s[1] for s in samples if s[1] <= limit)
        return Demand(rate=n / span_s, prompt_tokens=tokens / n,
                      output_tokens=sum(s[2] for s in samples) / n, samples=n,
                      prompt_sq_tokens=sum(s[1] * s[1] for s in samples) / n,
                      local_share=short / tokens if tokens else 1.0)


class ElasticMetrics:
    """xllm_service_role_flips_total{direction}, xllm_service_role_seconds_total{role}
    (instance-seconds served in each duty, elastic instances), and
    xllm_service_elastic_predicted_attainment{split="current"|"best"}."""

    def __init__(self) -> None:
        self.flips: collections.Counter = collections.Counter()
        self.role_seconds: collections.Counter = collections.Counter()
        self.predicted: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        flips = CounterMetricFamily("xllm_service_role_flips", "Elastic instances' role "
                                    "flips the master decided", labels=["direction"])
        for d in DIRECTIONS:
            flips.add_metric([d], self.flips[d])
        yield flips
        seconds = CounterMetricFamily("xllm_service_role_seconds", "Seconds elastic "
                                      "instances served in each role", labels=["role"])
        for role in ("PREFILL", "DECODE", "MIX"):
            seconds.add_metric([role], self.role_seconds[role])
        yield seconds
        predicted = GaugeMetricFamily("xllm_service_elastic_predicted_attainment",
                                      "Predicted SLO attainment of the current split and "
                                      "of the best one", labels=["split"])
        for split, value in sorted(self.predicted.items()):
            predicted.add_metric([split], value)
        yield predicted


class RoleAssigner:
    def __init__(self, etcd: EtcdClient, instances: Callable[[], Sequence[InstanceInfo]],
                 is_master: Callable[[], bool], demand: DemandWindow,
                 stated_targets: Callable[[], tuple[float, float] | None],
                 policy: ElasticPolicy, metrics: ElasticMetrics,
                 clock: Callable[[], float] = time.monotonic,
                 decodes_prefill: Callable[[], bool] = lambda: True,
                 measured_scale: Callable[[str, str], float] = lambda name, what: 1.0) -> None:
        """`decodes_prefill()`: the router sends prompts to decodes too (conditional);
        `measured_scale(name, "ttft" | "tpot")`: the router's measured over predicted
        times of an instance (its profile corrected by them)."""
        self.etcd = etcd
        self.instances = instances
        self.is_master = is_master
        self.demand = demand
        self.stated_targets = stated_targets
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self.decodes_prefill = decodes_prefill
        self.measured_scale = measured_scale
        self.assignments: dict[str, RoleAssignment] = {}
        self.last_flip_s: dict[str, float] = {}
        self._in_office = False
        self._last_round_s: float | None = None

    async def take_office(self) -> None:
        """Read every assignment (a new master continues from them)."""
        await self.read_assignments()
        now = self.clock()
        for name in self.assignments:
            self.last_flip_s[name] = now
        self.policy.started_s = now
        self._in_office = True
        logger.info("elastic PD: master continues from %d role assignment(s)",
                    len(self.assignments))

    async def read_assignments(self) -> None:
        """Every round: what etcd holds wins (an operator pins or unpins an instance
        there, another master wrote while this one could not reach etcd)."""
        kvs, _ = await self.etcd.get_prefix(ROLE_PREFIX)
        assignments = {}
        for kv in kvs:
            name = name_of_role_key(kv.key)
            try:
                assignment = RoleAssignment.from_json(kv.value)
            except RoleAssignmentError as exc:
                logger.warning("ignoring %s: %s", kv.key, exc)
                continue
            if name is not None:
                assignments[name] = assignment
        self.assignments = assignments

    def views(self, now: float) -> list[InstanceView]:
        out = []
        for info in self.instances():
            if not info.schedulable:
                continue
            meta = info.meta
            assignment = self.assignments.get(info.name)
            pending = (meta.elastic and assignment is not None
                       and assignment.epoch > meta.duty_epoch)
            role = assignment.role if pending else info.role
            profile = (LatencyProfile.from_dict(meta.latency_profile)
                       if meta.latency_profile else None)
            out.append(InstanceView(
                info.name, role, meta.elastic, profile, info.load.waiting, info.load.running,
                age_s=now - info.registered_s,
                pinned=assignment is not None and assignment.pinned, pending=pending,
                last_flip_s=self.last_flip_s.get(info.name, -math.inf),
                ttft_scale=self.measured_scale(info.name, "ttft"),
                tpot_scale=self.measured_scale(info.name, "tpot")))
        return out

    async def round(self) -> list[Flip]:
        """One decision (the master only); the flips written."""
        if not self.is_master():
            self._in_office = False
            return []
        if not self._in_office:
            await self.take_office()
        else:
            await self.read_assignments()
        now = self.clock()
        views = self.views(now)
        self._count_time(now, views)
        flips = self.policy.decide(now, views, self.demand.snapshot(), self.stated_targets(),
                                   self.decodes_prefill())
        if self.policy.last is not None:
            current, best = self.policy.last
            self.metrics.predicted.update(current=current.attainment, best=best.attainment)
        done = []
        for flip in flips:
            if not self.is_master():
                break
            epoch = self._epoch(flip.name) + 1
            assignment = RoleAssignment(flip.new, epoch)
            await self.etcd.put(role_key(flip.name), assignment.to_json())
            self.assignments[flip.name] = assignment
            self.last_flip_s[flip.name] = now
            if flip.current is None:
                logger.info("elastic PD: %s assigned %s (epoch %d); split %dP/%dD predicted "
                            "TTFT %.0f ms, TPOT %.1f ms, attainment %.2f", flip.name,
                            flip.new.value, epoch, *flip.split, flip.predicted.ttft_ms,
                            flip.predicted.tpot_ms, flip.predicted.attainment)
            else:
                self.metrics.flips[flip.direction] += 1
                logger.info("elastic PD: flip %s %s (epoch %d) to %dP/%dD: predicted TTFT "
                            "%.0f -> %.0f ms, TPOT %.1f -> %.1f ms, attainment %.2f -> %.2f",
                            flip.name, flip.direction, epoch, *flip.split,
                            flip.current.ttft_ms, flip.predicted.ttft_ms,
                            flip.current.tpot_ms, flip.predicted.tpot_ms,
                            flip.current.attainment, flip.predicted.attainment)
            done.append(flip)
        return done

    def _epoch(self, name: str) -> int:
        """The last epoch of `name`: assigned here, or acknowledged (another master's)."""
        known = self.assignments.get(name)
        acked = next((i.meta.duty_epoch for i in self.instances() if i.name == name), 0)
        return max(known.epoch if known is not None else 0, acked)

    def _count_time(self, now: float, views: Sequence[InstanceView]) -> None:
        if self._last_round_s is not None:
            elapsed = now - self._last_round_s
            for v in views:
                if v.elastic and not v.pending:
                    self.metrics.role_seconds[v.role.value] += elapsed
        self._last_round_s = now

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.round()
            except EtcdError as exc:  # (the next round reads and writes again)
                logger.warning("elastic PD round failed: %s", exc)
                self._in_office = False
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("elastic PD round failed")
            await asyncio.sleep(interval_s)
