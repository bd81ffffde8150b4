"""Conditional disaggregation and SLO-aware routing of a request over prefill and decode
instances.

Per request, one of two paths:
  PD      the prompt is computed on a prefill instance, its KV pulled by the decode;
  DECODE  the decode instance computes the prompt itself: its scheduler runs decode
          tokens first and prompt chunks in the rest of each step's token budget, so the
          streams it runs keep going while it prefills (a long chunk still lengthens the
          steps it rides in: that is what the thresholds bound).

`PDDecider` (disagg_decision CONDITIONAL, any policy): the uncached part of the prompt
on the chosen decode (its prefix cache, from heartbeat cache events) at most
`local_prefill_max_tokens` -> DECODE; else, when the least busy prefill instance still has
`prefill_busy_tokens` prompt tokens queued (the service's own requests there) and the
decode has none queued -> DECODE (prefill overloaded); else PD.

`SloRouter` (--load-balance-policy SLO_AWARE): every instance registered a latency profile
(xllm_py.cluster.latency_profile: step cost from prompt tokens, decoding sequences and
their context). For each candidate, the decode path on each decode and PD on each
(prefill, decode) pair, it predicts
  TTFT  on the decode: the prompt tokens queued ahead there + the prompt's uncached
          tokens, in chunks of its step budget, each chunk in a step with the sequences
          it decodes; on a prefill: when the prompt would be computed with the service's
          prompts queued there taken in the prefill's deadline order
          (xllm_py/cluster/prefill_order.py `finish_s`: late ones go last, a short one
          ahead of long ones with time to spare), + `pd_overhead_ms` (KV pull and the
          hand-over, not scaled); scaled (below);
  TPOT  = one decode step of the decode's sequences plus this one, with their context
          + the prompt tokens the decode computes while this request runs (queued ones,
          its own on the DECODE path, and those it will likely get meanwhile: the rate
          the service sent it prompts at over the last RECENT_LOCAL_S, over this
          request's max_tokens steps), spread over half its max_tokens steps (a stream
          running there, halfway through its output, takes that stall too),
each scaled by a moving average of measured / predicted per instance (`observe`: the
profile is a step's cost on a core of its own; on a shared machine the clock runs slower);
on the DECODE path of a decode whose TPOT guard binds (the TPOT above the target it
registered), the guard's pace instead (slo_predictor.py `_guarded`: the streams keep its
target, the prompt gets the time they save under it, up to its hold limit). It picks, in
order: for a prompt whose uncached part is short (as above), the candidate meeting both
targets with the lowest TTFT, the DECODE path or a PD pair (an idle prefill takes it: the
decode's streams keep their pace), not the DECODE path of a decode holding
prompts back while a PD pair meets both (slo_defaults `decode_holding_ms`: a prompt
computed there has waited a third of its guard's hold limit for its first token; the
prompts held together go together, and stall its streams for as long); else the PD pair
meeting both with the lowest TTFT; else (the prefills are behind) the DECODE path of a
long prompt meeting both (an idle decode, or one whose guard fits it in); else the
candidate that misses least (sum of the relative overshoots), a long prompt never on the
DECODE path (its stall spirals), a short one only when it keeps the decode
within its TPOT target (or without a prefill instance). Targets: the request's
`ttft_slo_ms`/`tpot_slo_ms`, else the service's `--ttft-slo-ms`/`--tpot-slo-ms`, else what
the profiles the instances registered first support (`SloRouter.stated`,
xllm_py/cluster/slo_defaults.py); 0: none. Without a profile from
every instance it falls back to `PDDecider` with the policy (CACHE_AWARE).

Torch-free: the master imports it.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

from xllm_py.cluster import slo_defaults
from xllm_service.config import RouterConfig
from xllm_service.instance_table import InstanceInfo
from xllm_service.prefix_index import PrefixIndex, load_ms, prompt_block_hashes
from xllm_service.router import LoadBalancePolicy, Path, Route, Router, policy_from_config
from xllm_service.slo_predictor import Prediction, SloPredictor
from xllm_service.sub_request import InstanceWork

logger = logging.getLogger(__name__)

class PrefixCache:
    """Cached prompt tokens per instance, from the heartbeat cache events (PrefixIndex),
    hashing the prompt once per block size."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def cached_tokens(self, info: InstanceInfo, prompt: Sequence[int],
                      chains: dict[int, list[int]]) -> int:
        return self.lookup(info, prompt, chains)[0]

    def lookup(self, info: InstanceInfo, prompt: Sequence[int],
               chains: dict[int, list[int]]) -> tuple[int, float]:
        """(prompt tokens `info` computes none of: in its pool or its KV tiers, the ms
        loading those from the tiers costs it)."""
        bs = info.meta.block_size
        if not prompt or bs <= 0:
            return 0, 0.0
        if bs not in chains:
            chains[bs] = prompt_block_hashes(prompt, bs)
        pool, below = self.index.matched(info, chains[bs])
        # The engine computes the last prompt token even on a full hit (its logits).
        return min((pool + sum(below.values())) * bs, len(prompt) - 1), load_ms(info, below)


@dataclasses.dataclass(frozen=True)
class Decision:
    on_decode: bool
    reason: str


class PDDecider:
    """The thresholds of conditional disaggregation (module docstring)."""

    def __init__(self, config: RouterConfig, cache: PrefixCache,
                 work: Callable[[str], InstanceWork]) -> None:
        self.config = config
        self.cache = cache
        self.work = work

    def decide(self, prompt: Sequence[int], decode: InstanceInfo,
               prefills: Sequence[InstanceInfo]) -> Decision:
        uncached = len(prompt) - self.cache.cached_tokens(decode, prompt, {})
        limit = self.config.local_prefill_max_tokens
        if uncached <= limit:
            return Decision(True, f"{uncached} uncached prompt tokens on {decode.name} "
                                  f"<= {limit}")
        if not prefills:
            return Decision(True, "no prefill instance")
        queued = min(self.work(p.name).pending_prefill_tokens for p in prefills)
        busy = self.config.prefill_busy_tokens
        if busy and queued >= busy and not self.work(decode.name).pending_prefill_tokens:
            return Decision(True, f"prefill busy ({queued} prompt tokens queued >= {busy})")
        return Decision(False, f"{uncached} uncached prompt tokens on {decode.name} > {limit}")


class SloRouter:
    """SLO_AWARE's choice of path and instances over prefill and decode instances
    (module docstring); `policy` picks when predictions are missing."""

    def __init__(self, config: RouterConfig, predictor: SloPredictor, decider: PDDecider,
                 policy: LoadBalancePolicy) -> None:
        self.config = config
        self.predictor = predictor
        self.decider = decider
        self.policy = policy
        self._derived = (0.0, 0.0)  # the targets last derived (logged when they change)
        self._last = (self.config.ttft_slo_ms or 0.0, self.config.tpot_slo_ms or 0.0)

    def stated(self, prefills: Sequence[InstanceInfo],
               decodes: Sequence[InstanceInfo]) -> tuple[float, float]:
        """The service's (TTFT, TPOT) targets in ms over these instances: the operator's
        (--ttft-slo-ms / --tpot-slo-ms), else what the latency profiles they registered
        first support (xllm_py/cluster/slo_defaults.py; 0 while an instance has none)."""
        ttft, tpot = self.config.ttft_slo_ms, self.config.tpot_slo_ms
        if ttft is None or tpot is None:
            pd = [self.predictor.first_profile(i) for i in decodes]
            pp = [self.predictor.first_profile(i) for i in prefills] or pd
            whole = decodes and None not in pd and None not in pp
            derived = ((slo_defaults.ttft_target_ms(pp), slo_defaults.tpot_target_ms(pd))
                       if whole else (0.0, 0.0))
            if whole and derived != self._derived:
                logger.info("SLO targets from the latency profiles: TTFT %.0f ms, TPOT "
                            "%.1f ms", *derived)
            self._derived = derived
            ttft = derived[0] if ttft is None else ttft
            tpot = derived[1] if tpot is None else tpot
        return ttft, tpot

    def targets(self, request: object) -> tuple[float, float]:
        """The request's targets: its own, else the service's (`stated`, over the
        instances it last routed over)."""
        ttft = getattr(request, "ttft_slo_ms", None)
        tpot = getattr(request, "tpot_slo_ms", None)
        return (self._last[0] if ttft is None else float(ttft),
                self._last[1] if tpot is None else float(tpot))

    def route(self, request: object, prefills: Sequence[InstanceInfo],
              decodes: Sequence[InstanceInfo]) -> Route:
        prompt = list(getattr(request, "prompt_token_ids", None) or [])
        sampling = getattr(request, "sampling", None)
        max_tokens = int(getattr(sampling, "max_tokens", None) or 16)
        self._last = self.stated(prefills, decodes)
        ttft_slo, tpot_slo = self.targets(request)
        chains: dict[int, list[int]] = {}
        found = {i.name: self.decider.cache.lookup(i, prompt, chains) for i in (*prefills, *decodes)}
        uncached = {name: len(prompt) - cached for name, (cached, _) in found.items()}
        loading = {name: ms for name, (_, ms) in found.items()}
        local: list[Prediction] = []
        remote: list[Prediction] = []
        for d in decodes:
            if self.config.conditional or not prefills:
                local.append(self.predictor.predict(Route(d, on_decode=True), len(prompt),
                                                    uncached[d.name], max_tokens, ttft_slo,
                                                    loading[d.name]))
            for p in prefills:
                remote.append(self.predictor.predict(Route(p, d), len(prompt),
                                                     uncached[p.name], max_tokens, ttft_slo,
                                                     loading[p.name]))
        if any(x is None for x in (*local, *remote)):
            return self._fallback(request, prompt, prefills, decodes)

        def meets(x: Prediction) -> bool:
            return x.miss(ttft_slo, tpot_slo) == 0.0

        def by_ttft(xs: list[Prediction]) -> Prediction:
            return min(xs, key=lambda x: (x.ttft_ms, x.tpot_ms, x.route.instance_names))

        limit = self.config.local_prefill_max_tokens
        ok_remote = [x for x in remote if meets(x)]
        short_ok = [x for x in local if uncached[x.route.target.name] <= limit and meets(x)]
        short = [x for x in short_ok
                 if not (ok_remote and self.predictor.holding(x.route.target))]
        if short:
            best = by_ttft(short + ok_remote)
            return self._chosen(best, "short prompt" + ("" if best.route.on_decode
                                                        else ", prefill idle"),
                                ttft_slo, tpot_slo, uncached)
        if ok_remote:  # (a short prompt here: every decode meeting it holds prompts)
            return self._chosen(by_ttft(ok_remote), "short prompt, decode holding prompts"
                                if short_ok else "long prompt", ttft_slo, tpot_slo, uncached)
        # No PD pair meets both (the prefills are behind): a long prompt on a decode that
        # meets both, its TPOT guard keeping the streams there within their target.
        long_ok = [x for x in local if uncached[x.route.target.name] > limit and meets(x)]
        if long_ok:
            return self._chosen(by_ttft(long_ok), "long prompt, prefill behind", ttft_slo,
                                tpot_slo, uncached)
        # Missing anyway: a long prompt stays off the decode (its prefill would stall the
        # streams there, and their TPOT, which then misses more targets: a spiral), and so
        # does a short one that would take the decode past its TPOT target (that miss is
        # every running stream's, a TTFT miss on the prefill only this request's).
        fallback = [*remote, *(x for x in local if uncached[x.route.target.name] <= limit
                               and (tpot_slo <= 0 or x.tpot_ms <= tpot_slo))]
        best = min(fallback or local, key=lambda x: (x.miss(ttft_slo, tpot_slo), x.ttft_ms,
                                                     x.route.instance_names))
        return self._chosen(best, "no candidate meets the targets", ttft_slo, tpot_slo, uncached)

    def _chosen(self, x: Prediction, why: str, ttft_slo: float, tpot_slo: float,
                uncached: dict[str, int]) -> Route:
        if x.route.on_decode:
            self.predictor.note_local(x.route.target.name, uncached[x.route.target.name])
        reason = (f"SLO_AWARE {why}: predicted TTFT {x.ttft_ms:.0f} ms, TPOT "
                  f"{x.tpot_ms:.1f} ms (targets {ttft_slo:.0f}/{tpot_slo:.0f} ms)")
        return dataclasses.replace(x.route, reason=reason)

    def _fallback(self, request: object, prompt: list[int], prefills: Sequence[InstanceInfo],
                  decodes: Sequence[InstanceInfo]) -> Route:
        decode = self.policy.select(decodes, request)
        if self.config.conditional or not prefills:
            decision = self.decider.decide(prompt, decode, prefills)
        else:
            decision = Decision(False, "PD always")
        if decision.on_decode:
            return Route(decode, on_decode=True, reason=decision.reason + " (no profile)")
        return Route(self.policy.select(prefills, request), decode,
                     reason=decision.reason + " (no profile)")


def build_router(config: RouterConfig, schedulable: Callable, inflight: Callable[[str], int],
                 work: Callable[[str], InstanceWork], index: PrefixIndex) -> Router:
    """The service's Router for `config`: its policy, and the path decision it asks for."""
    policy = policy_from_config(config, inflight, index)
    decider = PDDecider(config, PrefixCache(index), work)
    slo = (SloRouter(config, SloPredictor(config, work), decider, policy)
           if config.slo_aware else None)
    return Router(schedulable, policy, decider if config.conditional and slo is None else None,
                  slo)


__all__ = ["Decision", "PDDecider", "Path", "Prediction", "PrefixCache", "SloPredictor",
           "SloRouter", "build_router"]
