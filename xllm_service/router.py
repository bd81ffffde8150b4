"""Routing: which instance (MIX) or which (prefill, decode) pair serves a request.

Policies plug in behind `LoadBalancePolicy.select`: RR, LEAST_LOAD and CACHE_AWARE (the
longest cached prompt prefix, from the engines' heartbeat cache events, within a load
bound). Over prefill and decode instances the Router also decides the path (`Path`): PD
always (disagg_decision ALWAYS), or per request (CONDITIONAL: a `decider`, see
pd_decision.py); SLO_AWARE (an `slo` router, pd_decision.py) picks path and instances from
predicted TTFT and TPOT, and CACHE_AWARE picks among MIX instances.
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import itertools
from typing import Callable, Sequence

from xllm_py.config import InstanceRole
from xllm_service.config import RouterConfig
from xllm_service.instance_table import InstanceInfo
from xllm_service.prefix_index import PrefixIndex, prompt_block_hashes


class LoadBalancePolicy(abc.ABC):
    name = ""

    @abc.abstractmethod
    def select(self, candidates: Sequence[InstanceInfo], request: object = None) -> InstanceInfo:
        """Pick one of `candidates` (never empty)."""


class RoundRobinPolicy(LoadBalancePolicy):
    name = "RR"

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count] = {}

    def select(self, candidates: Sequence[InstanceInfo], request: object = None) -> InstanceInfo:
        ordered = sorted(candidates, key=lambda i: i.name)
        key = ",".join(i.name for i in ordered)
        counter = self._counters.setdefault(key, itertools.count())
        return ordered[next(counter) % len(ordered)]


class LeastLoadPolicy(LoadBalancePolicy):
    """Fewest requests in flight: the service's own count (exact, immediate) plus the
    instance's last heartbeat (waiting queue, KV usage) for load that other services sent."""
    name = "LEAST_LOAD"

    def __init__(self, inflight: Callable[[str], int], kv_usage_weight: float = 4.0) -> None:
        self.inflight = inflight
        self.kv_usage_weight = kv_usage_weight

    def load(self, info: InstanceInfo) -> float:
        return (self.inflight(info.name) + info.load.waiting
                + self.kv_usage_weight * info.load.kv_usage)

    def select(self, candidates: Sequence[InstanceInfo], request: object = None) -> InstanceInfo:
        return min(candidates, key=lambda info: (self.load(info), info.name))


class CacheAwarePolicy(LeastLoadPolicy):
    """The instance holding the longest cached prefix of the prompt (its prefill skips
    those blocks; a decode needs fewer pulled), in its pool or its KV tiers (its own, or
    the store it shares), among those whose load is within `max_imbalance` of the least
    loaded; ties go to the longer prefix in the pool, then by load."""
    name = "CACHE_AWARE"

    def __init__(self, inflight: Callable[[str], int], index: PrefixIndex,
                 max_imbalance: float = 4.0, kv_usage_weight: float = 4.0) -> None:
        super().__init__(inflight, kv_usage_weight)
        self.index = index
        self.max_imbalance = max_imbalance

    def select(self, candidates: Sequence[InstanceInfo], request: object = None) -> InstanceInfo:
        prompt = getattr(request, "prompt_token_ids", None)
        loads = {info.name: self.load(info) for info in candidates}
        floor = min(loads.values())
        chains: dict[int, list[int]] = {}  # block size -> the prompt's hash chain

        def hits(info: InstanceInfo) -> tuple[int, int]:
            """(-tokens not computed there, pool or KV tiers; -of them in its pool)."""
            bs = info.meta.block_size
            if not prompt or bs <= 0:
                return 0, 0
            if bs not in chains:
                chains[bs] = prompt_block_hashes(prompt, bs)
            pool, below = self.index.matched(info, chains[bs])
            return -(pool + sum(below.values())) * bs, -pool * bs

        eligible = [i for i in candidates if loads[i.name] <= floor + self.max_imbalance]
        return min(eligible, key=lambda i: (*hits(i), loads[i.name], i.name))


def make_policy(name: str, inflight: Callable[[str], int], index: PrefixIndex | None = None,
                config: RouterConfig = RouterConfig()) -> LoadBalancePolicy:
    """The policy called `name`; its tuning from `config` (its load_balance_policy is
    not read: see `policy_from_config`)."""
    name = name.upper()
    if name in ("RR", "ROUND_ROBIN"):
        return RoundRobinPolicy()
    if name in ("LEAST_LOAD", "LL"):
        return LeastLoadPolicy(inflight, config.kv_usage_weight)
    if name in ("CACHE_AWARE", "PREFIX", "SLO_AWARE"):  # SLO_AWARE: over MIX instances
        return CacheAwarePolicy(inflight, index or PrefixIndex(), config.max_imbalance,
                                config.kv_usage_weight)
    raise ValueError(f"unknown load balance policy {name!r}; expected RR, LEAST_LOAD, "
                     "CACHE_AWARE or SLO_AWARE")


def policy_from_config(config: RouterConfig, inflight: Callable[[str], int],
                       index: PrefixIndex | None = None) -> LoadBalancePolicy:
    return make_policy(config.load_balance_policy, inflight, index, config)


class Path(str, enum.Enum):
    """How a request is served (xllm_service_pd_decisions_total{path} counts PD and
    DECODE, the two outcomes of the disaggregation decision)."""
    MIX = "mix"        # one MIX instance
    PD = "pd"          # prompt on a prefill instance, KV to the decode instance
    DECODE = "decode"  # a decode instance prefills the prompt itself (chunked, in its
    #                    decode batches) and generates: served whole, as MIX serves


@dataclasses.dataclass(frozen=True)
class Route:
    target: InstanceInfo              # where the request is sent (MIX, PREFILL or DECODE)
    decode: InstanceInfo | None = None  # PD: the decode instance
    on_decode: bool = False           # DECODE path: `target` is a decode serving it whole
    reason: str = ""                  # why this path (the request log line)
    # SLO_AWARE: the predicted (TTFT, TPOT) in ms, which the measured ones correct
    predicted: tuple[float, float] | None = None
    # SLO_AWARE: whether its measured TTFT corrects the prediction: not after a wait in a
    # prefill's queue, which its deadline order and later arrivals set (a late prompt
    # waits for every one that can still make it), not the instance's speed; nor after
    # prompts queued on the decode (a prompt arriving with a long one there: a scale
    # taught by that wait sends no prompt there again, so nothing would ever correct it)
    corrects_ttft: bool = True
    # SLO_AWARE: the (TTFT, TPOT) scales `predicted` was computed with (they fade: the
    # measure is held against the prediction as it was made)
    scales: tuple[float, float] = (1.0, 1.0)

    @property
    def is_pd(self) -> bool:
        return self.decode is not None

    @property
    def path(self) -> Path:
        return Path.PD if self.is_pd else Path.DECODE if self.on_decode else Path.MIX

    @property
    def on_decode_role(self) -> bool:
        """Generated on a DECODE instance (PD or DECODE path): it is split into
        single-sequence subs and migrates to another decode."""
        return self.is_pd or self.on_decode

    @property
    def serving(self) -> InstanceInfo:
        """The instance generating the tokens."""
        return self.decode if self.decode is not None else self.target

    @property
    def instance_names(self) -> tuple[str, ...]:
        return (self.target.name,) + ((self.decode.name,) if self.decode else ())


class NoInstanceError(Exception):
    """No schedulable instance: the message says why (for a 503)."""


class Router:
    """`decider`: conditional disaggregation (None: PD always); `slo`: SLO_AWARE's choice
    over prefill and decode instances (it decides the path itself). Either lets a decode
    serve requests whole when no prefill instance is registered."""

    def __init__(self, schedulable: Callable[[InstanceRole], list[InstanceInfo]],
                 policy: LoadBalancePolicy, decider=None, slo=None) -> None:
        self.schedulable = schedulable
        self.policy = policy
        self.decider = decider
        self.slo = slo

    @property
    def conditional(self) -> bool:
        """The path is decided per request (a decode may serve a request whole)."""
        return self.decider is not None or (self.slo is not None
                                            and self.slo.config.conditional)

    def _candidates(self, exclude: Sequence[str]) -> tuple[list[InstanceInfo], ...]:
        def of(*roles: InstanceRole) -> list[InstanceInfo]:
            return [i for r in roles for i in self.schedulable(r) if i.name not in exclude]
        return (of(InstanceRole.PREFILL), of(InstanceRole.DECODE),
                of(InstanceRole.MIX, InstanceRole.DEFAULT))

    def unavailable_reason(self, exclude: Sequence[str] = ()) -> str | None:
        """Why no request could be routed now, or None. Selects nothing (a readiness probe
        must not advance round robin)."""
        prefills, decodes, mixes = self._candidates(exclude)
        if (prefills and decodes) or mixes or (decodes and self.conditional):
            return None
        if prefills:
            return "a prefill instance is registered but no decode instance is"
        if decodes:
            return "a decode instance is registered but no prefill instance is"
        return "no engine instance is registered with this service"

    def route(self, request: object = None, exclude: Sequence[str] = ()) -> Route:
        prefills, decodes, mixes = self._candidates(exclude)
        if decodes and (prefills or (self.conditional and not mixes)):
            if self.slo is not None:
                return self.slo.route(request, prefills, decodes)
            decode = self.policy.select(decodes, request)
            if self.decider is not None:
                prompt = getattr(request, "prompt_token_ids", None) or []
                decision = self.decider.decide(prompt, decode, prefills)
                if decision.on_decode:
                    return Route(decode, on_decode=True, reason=decision.reason)
                return Route(self.policy.select(prefills, request), decode,
                             reason=decision.reason)
            return Route(self.policy.select(prefills, request), decode, reason="PD always")
        if mixes:
            return Route(self.policy.select(mixes, request))
        raise NoInstanceError(self.unavailable_reason(exclude))

    def targets(self, request: object) -> tuple[float, float]:
        """The request's TTFT/TPOT targets in ms (0: none): its own, else SLO_AWARE's
        service defaults."""
        if self.slo is not None:
            return self.slo.targets(request)
        return (float(getattr(request, "ttft_slo_ms", None) or 0.0),
                float(getattr(request, "tpot_slo_ms", None) or 0.0))

    def stated_targets(self) -> tuple[float, float] | None:
        """SLO_AWARE: the service's (TTFT, TPOT) targets over the instances registered now
        (the operator's, else derived from their profiles); None: no SLO routing."""
        if self.slo is None:
            return None
        prefills, decodes, _ = self._candidates(())
        return self.slo.stated(prefills, decodes)

    def measured_scale(self, name: str, what: str) -> float:
        """SLO_AWARE: measured over predicted `what` ("ttft" or "tpot") on instance `name`
        (a moving average; 1.0: no measurement, or no SLO routing)."""
        return self.slo.predictor.scale(name, what) if self.slo is not None else 1.0

    def observe(self, route: Route, ttft_ms: float | None, tpot_ms: float | None) -> None:
        """A request's measured TTFT/TPOT (SLO_AWARE corrects its predictions by them)."""
        if self.slo is not None and route.predicted is not None:
            self.slo.predictor.observe(route, ttft_ms, tpot_ms)

    def route_decode(self, request: object = None, exclude: Sequence[str] = ()) -> InstanceInfo:
        """A DECODE instance to take over a PD request that already generated tokens
        (migration off a dead decode)."""
        _, decodes, _ = self._candidates(exclude)
        if not decodes:
            raise NoInstanceError("no other decode instance is registered")
        return self.policy.select(decodes, request)

    def route_mix(self, request: object = None, exclude: Sequence[str] = ()) -> InstanceInfo:
        """A MIX instance to take over a MIX request that already generated tokens
        (migration off a dead MIX instance). Not a (prefill, decode) pair even when one is
        registered: the request resumes with MultiGenerations, which no PREFILL serves."""
        _, _, mixes = self._candidates(exclude)
        if not mixes:
            raise NoInstanceError("no other MIX instance is registered")
        return self.policy.select(mixes, request)
