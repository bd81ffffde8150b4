"""ElasticPolicy: which elastic instances should serve prefill and which decode (pure:
no etcd, no clock; every call takes `now`, so the unit tests drive it with a fake one).

The prediction (`predict`), for a split of P prefill-capable and D decode-capable
instances under the demand the master measured (arrival rate, mean prompt and output
tokens), from the instances' registered latency profiles corrected by the router's
measured over predicted times (at most SCALE_MAX either way), averaged:
  - each side's work in instances: prefill, the rate times one prompt's time; decode,
    the output tokens per second over what one decode delivers within the TPOT target
    (the most streams whose step stays within it, over that step); each the larger of
    the whole window's and its recent part's (a rising load is seen early), or the
    recent requests' alone where they are enough to measure it (elastic.DemandWindow);
  - each side's load: its work over its instances times the utilisation it can run at
    within its target (decode: `utilization`; prefill: also where the M/D/1 wait keeps
    TTFT within its target); the decodes' spare time counts at half as prompt servers
    where the service sends prompts to decodes (conditional disaggregation), for no
    more than the short prompts' share of the work (Demand.local_share);
  - attainment: 1 while the busier side's load is within 1, else 1 / load (the share of
    the demand the bottleneck serves in time). TTFT and TPOT are predicted too, for the
    log: TTFT with the prompts queued now, TPOT with the streams running now.
  Steady-state capacity, not the live queues, decides: a backlog clears where it sits
  (a flipped instance finishes its old side's work), and chasing it overshoots.

The decision (`decide`), one round:
  - an elastic instance without an assignment (it serves MIX) and with a profile is
    assigned at once, to the split predicted best (no load yet: half and half);
  - otherwise, while the current split keeps the load (load <= 1), nothing moves
    (hysteresis: a stable load does not flap). When it does not, the target is the
    nearest split that does (the fewest flips), else the nearest within the margin of
    the least load; when its attainment beats the current one's by the factor
    1 + `margin` in every round for `hold_s` over the current load (a burst must last
    that long to be acted on; the larger the overload, the shorter), up to `max_step`
    instances move toward it per round, each round on while the gain holds;
  - never: an instance without a profile (its costs are unknown), a pinned one, one
    whose last assignment it has not acknowledged yet, one flipped less than
    `min_dwell_s` ago, one registered less than `warmup_s` ago; nor below one
    prefill-capable and one decode-capable instance, nor below `min_share` of the fleet
    on a side (a reserve for the next turn of the load); nor on a demand of fewer than
    `min_samples` requests, or measured in the first `warmup_s` after the policy
    started (cold-start samples: a new master, instances just up).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from xllm_py.cluster import slo_defaults
from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.config import InstanceRole
from xllm_service.config import ElasticConfig

P, D, M = InstanceRole.PREFILL, InstanceRole.DECODE, InstanceRole.MIX
SCALE_MAX = 3.0  # the most a measured correction scales a profile, either way


@dataclasses.dataclass(frozen=True)
class InstanceView:
    """One schedulable instance as the decision sees it."""
    name: str
    role: InstanceRole          # the duty it serves (acknowledged), or is assigned (pending)
    elastic: bool               # follows assignments (started MIX in a cluster)
    profile: LatencyProfile | None
    waiting: int = 0            # prompts queued (heartbeat)
    running: int = 0            # streams (heartbeat)
    age_s: float = math.inf     # since it registered
    pinned: bool = False
    pending: bool = False       # assigned, not acknowledged yet
    last_flip_s: float = -math.inf
    ttft_scale: float = 1.0     # measured over predicted prompt times (the router's)
    tpot_scale: float = 1.0     # ... decode steps

    @property
    def corrected(self) -> LatencyProfile | None:
        """The profile with its prompt and step costs scaled by what was measured
        (bounded: one slow request does not resize the fleet)."""
        if self.profile is None:
            return None
        t = min(SCALE_MAX, max(1 / SCALE_MAX, self.ttft_scale))
        d = min(SCALE_MAX, max(1 / SCALE_MAX, self.tpot_scale))
        p = self.profile
        return dataclasses.replace(
            p, prefill_base_ms=p.prefill_base_ms * t,
            prefill_ms_per_token=p.prefill_ms_per_token * t,
            prefill_ms_per_kpair=p.prefill_ms_per_kpair * t, decode_base_ms=p.decode_base_ms * d,
            decode_ms_per_seq=p.decode_ms_per_seq * d,
            decode_ms_per_ctx_token=p.decode_ms_per_ctx_token * d)

    @property
    def movable(self) -> bool:
        return self.elastic and not self.pinned and self.profile is not None


@dataclasses.dataclass(frozen=True)
class Demand:
    rate: float = 0.0               # requests per second
    prompt_tokens: float = 512.0    # mean
    output_tokens: float = 128.0    # mean (max_tokens asked)
    samples: int = 0
    prompt_sq_tokens: float = 0.0   # mean of the squares (attention; 0: the mean's square)
    # Of the prompt tokens, the share in prompts short enough for the router to compute on
    # a decode with room (its local_prefill_max_tokens): only those a decode's spare time
    # serves (a longer one goes to a decode only when every prefill is behind).
    local_share: float = 1.0
    # The last part of the window alone: each side is sized for the larger of the two,
    # so a load that rises is acted on before the window has filled with it.
    recent: "Demand | None" = None


@dataclasses.dataclass(frozen=True)
class Prediction:
    ttft_ms: float
    tpot_ms: float
    attainment: float
    load: float = 0.0   # the busier side's work over what it serves within its target


@dataclasses.dataclass(frozen=True)
class Flip:
    name: str
    old: InstanceRole
    new: InstanceRole
    split: tuple[int, int]          # (prefills, decodes) after the decision
    current: Prediction | None      # None: an initial assignment
    predicted: Prediction

    @property
    def direction(self) -> str:
        return f"{self.old.value.lower()}_to_{self.new.value.lower()}"


def _mean(profiles: Sequence[LatencyProfile], fn) -> float:
    return sum(fn(p) for p in profiles) / len(profiles)


# Of a decode's spare time, the share counted as a prompt server: the router gives a
# decode a prompt only while its streams keep their TPOT, a long one only when the
# prefills are behind.
DECODE_PROMPT_SHARE = 0.5


def _prefill_utilization(per_prompt_ms: float, ttft_target_ms: float, cap: float) -> float:
    """The utilisation at which a prompt's M/D/1 wait, s * rho / (2 (1 - rho)), plus its
    own time s still meets the TTFT target (at most `cap`)."""
    if ttft_target_ms <= 0:
        return cap
    k = ttft_target_ms / max(per_prompt_ms, 1e-9) - 1.0
    if k <= 0:
        return 0.05  # one prompt alone misses the target: any load is too much
    return min(cap, 2 * k / (1 + 2 * k))


@dataclasses.dataclass(frozen=True)
class _Work:
    prefill: float          # instances busy computing the prompts, all the time
    decode: float           # decodes running the streams at the TPOT target, all the time
    per_prompt_ms: float
    step: tuple[float, float] = (0.0, 0.0)  # (a, c): a decode step of b streams, a + c b ms


def _work(profiles: Sequence[LatencyProfile], demand: Demand, tpot_target: float) -> _Work:
    lp, lo = max(1, round(demand.prompt_tokens)), max(1.0, demand.output_tokens)
    # A decode step costs a + c * b for b streams; the most streams whose step meets the
    # TPOT target deliver b_max / (a + c * b_max) tokens per ms.
    a, c = _step_cost(profiles, lp + lo / 2)
    b_max = max(1.0, (tpot_target - a) / c) if tpot_target > 0 and c > 0 else 64.0
    per_decode = b_max / (a + c * b_max)
    # a prompt's attention grows with its square: the spread of lengths adds to the mean's
    spread = max(0.0, demand.prompt_sq_tokens - lp * lp) / 2 / 1000
    per_prompt = _mean(profiles, lambda p: p.prefill_ms(lp) + p.prefill_ms_per_kpair * spread)
    return _Work(demand.rate * per_prompt / 1000, demand.rate * lo / 1000 / per_decode,
                 per_prompt, (a, c))


def _step_cost(profiles: Sequence[LatencyProfile], ctx: float) -> tuple[float, float]:
    """(a, c) of a decode step of b streams of `ctx` tokens of context: a + c * b ms."""
    return (_mean(profiles, lambda p: p.decode_base_ms),
            _mean(profiles, lambda p: p.decode_ms_per_seq + p.decode_ms_per_ctx_token * ctx))


def predict(prefills: int, decodes: int, profiles: Sequence[LatencyProfile], demand: Demand,
            queued: int, streams: int, targets: tuple[float, float],
            decodes_prefill: bool = True, utilization: float = 0.85) -> Prediction:
    """Predicted TTFT, TPOT, attainment and load of `prefills` / `decodes` instances of
    these `profiles` (averaged), with `queued` prompts waiting on the prefills and
    `streams` running on the decodes now (TTFT and TPOT only); `decodes_prefill`: the
    service also sends prompts to decodes with spare time (conditional disaggregation)."""
    if prefills <= 0 or decodes <= 0 or not profiles:
        return Prediction(math.inf, math.inf, 0.0, math.inf)
    ttft_target, tpot_target = targets
    works = [_work(profiles, d, tpot_target) for d in (demand, demand.recent) if d is not None]
    work = _Work(max(w.prefill for w in works), max(w.decode for w in works),
                 max(w.per_prompt_ms for w in works))
    rho_d = work.decode / decodes
    spare = max(0.0, 1.0 - rho_d / utilization)
    credit = decodes * spare * DECODE_PROMPT_SHARE if decodes_prefill else 0.0
    # The servers share the prompts in proportion: the decodes' part must stay within the
    # short prompts' share of the work, credit / (prefills + credit) <= share.
    share = min((d.local_share for d in (demand, demand.recent) if d is not None), default=1.0)
    if share < 1.0:
        credit = min(credit, prefills * share / (1.0 - share))
    servers = prefills + credit
    rho_p = work.prefill / servers
    load = max(rho_p / _prefill_utilization(work.per_prompt_ms, ttft_target, utilization),
               rho_d / utilization)
    # TTFT, TPOT (the log): the queue now shared over the servers, then the M/D/1 wait;
    # the streams per decode by Little's law at x tokens per ms each decode owes,
    # b = x * (a + c * b), or those running now where more.
    per_prompt = works[0].per_prompt_ms
    wait = per_prompt * rho_p / (2 * max(1.0 - rho_p, 0.02))
    ttft = queued * per_prompt / servers + per_prompt + wait
    lo = max(1.0, demand.output_tokens)
    a, c = works[0].step
    x = demand.rate * lo / 1000 / decodes
    b = max(x * a / max(1.0 - x * c, 0.02), streams / decodes, 1.0)
    attainment = 1.0 if load <= 1.0 else 1.0 / load
    return Prediction(ttft, a + c * b, attainment, load)


class ElasticPolicy:
    def __init__(self, config: ElasticConfig = ElasticConfig(), started_s: float = 0.0) -> None:
        self.config = config
        self.started_s = started_s
        self._better_since: tuple[int, float] | None = None  # (direction sign, since)
        self.last: tuple[Prediction, Prediction] | None = None  # (current, best)

    def targets(self, views: Sequence[InstanceView],
                stated: tuple[float, float] | None) -> tuple[float, float]:
        """The service's stated targets, else what the profiles support."""
        if stated and stated[0] > 0 and stated[1] > 0:
            return stated
        profiles = [v.profile for v in views if v.profile is not None]
        return slo_defaults.ttft_target_ms(profiles), slo_defaults.tpot_target_ms(profiles)

    def decide(self, now: float, views: Sequence[InstanceView], demand: Demand,
               stated: tuple[float, float] | None = None,
               decodes_prefill: bool = True) -> list[Flip]:
        """The flips of one round at `now`; `decodes_prefill`: the router sends prompts to
        decodes too (predict)."""
        profiles = [v.corrected for v in views if v.profile is not None and v.role in (P, D)]
        profiles = profiles or [v.corrected for v in views if v.profile is not None]
        if not profiles:
            return []
        targets = self.targets(views, stated)
        fixed_p = sum(1 for v in views if v.role is P and not v.movable)
        fixed_d = sum(1 for v in views if v.role is D and not v.movable)
        movable = [v for v in views if v.movable]
        queued = sum(v.waiting for v in views if v.role is P)
        streams = sum(v.running for v in views if v.role is D)
        unassigned = [v for v in movable if v.role is M]
        n = fixed_p + fixed_d + sum(1 for v in movable if v.role in (P, D) or v in unassigned)

        def score(p: int) -> Prediction:
            return predict(p, n - p, profiles, demand, queued, streams, targets,
                           decodes_prefill, self.config.utilization)

        def target(lo: int, hi: int, around: float) -> tuple[int, Prediction]:
            """The split nearest `around` that keeps the load, else nearest within the
            margin of the least load (an overloaded fleet's loads differ little across
            splits: no run to an extreme for a noise-sized gain)."""
            options = [(p, score(p)) for p in range(lo, hi + 1)]
            bound = max(1.0, min(o[1].load for o in options) * (1 + self.config.margin))
            return min((o for o in options if o[1].load <= bound),
                       key=lambda o: (abs(o[0] - around), o[1].load))

        if unassigned:
            return self._initial(views, unassigned, n, target)
        cur_p = sum(1 for v in views if v.role is P)
        cur_d = sum(1 for v in views if v.role is D)
        if cur_p + cur_d != n or cur_p == 0 or cur_d == 0:
            return []
        current = score(cur_p)
        floor = max(1, int(n * self.config.min_share))
        lo, hi = max(floor, fixed_p), n - max(floor, fixed_d)
        if hi < lo:  # (the fixed instances leave no room for the reserve)
            lo, hi = max(1, fixed_p), n - max(1, fixed_d)
        target_p, predicted = (cur_p, current) if current.load <= 1.0 else target(lo, hi, cur_p)
        self.last = (current, predicted)
        if (target_p == cur_p or not self._gains(current, predicted)
                or demand.samples < self.config.min_samples
                or now - self.started_s < self.config.warmup_s):
            self._better_since = None
            return []
        sign = 1 if target_p > cur_p else -1
        if self._better_since is None or self._better_since[0] != sign:
            self._better_since = (sign, now)
        # Held once (the rounds after keep moving while the gain holds), for less the
        # larger the overload: a load twice what the split serves is no noise, and each
        # second of it leaves streams that miss their TPOT to the end.
        if now - self._better_since[1] < self.config.hold_s / max(1.0, current.load):
            return []
        old, new = (D, P) if sign > 0 else (P, D)
        ready = sorted((v for v in movable if v.role is old and not v.pending
                        and v.age_s >= self.config.warmup_s
                        and now - v.last_flip_s >= self.config.min_dwell_s),
                       key=lambda v: (v.running if old is D else v.waiting, v.name))
        chosen = ready[:min(abs(target_p - cur_p), self.config.max_step)]
        if not chosen:
            return []
        moved_p = cur_p + sign * len(chosen)
        after = score(moved_p)
        return [Flip(v.name, old, new, (moved_p, n - moved_p), current, after) for v in chosen]

    def _gains(self, current: Prediction, predicted: Prediction) -> bool:
        """`predicted` beats `current` by the margin, relatively (an overloaded fleet's
        attainments are all small, and a flip still multiplies its goodput)."""
        if predicted.attainment <= 0:
            return False
        return predicted.attainment >= current.attainment * (1 + self.config.margin)

    def _initial(self, views, unassigned, n, target) -> list[Flip]:
        """Assign every unassigned elastic instance at once: keep what the assigned ones
        serve, choose the split predicted best for the rest."""
        assigned_p = sum(1 for v in views if v.role is P)
        assigned_d = sum(1 for v in views if v.role is D)
        floor = max(1, int(n * self.config.min_share))
        lo, hi = max(floor, assigned_p), n - max(floor, assigned_d)
        if hi < lo:
            lo, hi = max(1, assigned_p), n - max(1, assigned_d)
        if hi < lo:
            return []
        target_p, predicted = target(lo, hi, n / 2)
        to_p = target_p - assigned_p
        flips = []
        for i, v in enumerate(sorted(unassigned, key=lambda v: v.name)):
            new = P if i < to_p else D
            flips.append(Flip(v.name, M, new, (target_p, n - target_p), None, predicted))
        return flips
