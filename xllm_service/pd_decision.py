"""Conditional disaggregation and SLO-aware routing of a request over prefill and decode
instances (issue 16).

Per request, one of two paths:
  PD      the prompt is computed on a prefill instance, its KV pulled by the decode;
  DECODE  the decode instance computes the prompt itself: its scheduler runs decode
          tokens first and prompt chunks in the rest of each step's token budget, so the
          streams it runs keep going while it prefills (a long chunk still lengthens the
          steps it rides in: that is what the thresholds bound).

`PDDecider` (--disagg-decision CONDITIONAL, any policy): the uncached part of the prompt
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
profile is a step's cost on a core of its own; on a shared machine the clock runs slower),
and picks, in order: for a prompt whose uncached part is short (as above), the candidate
meeting both targets with the lowest TTFT, the DECODE path or a PD pair (an idle prefill
takes it: the decode's streams keep their pace), not the DECODE path of a decode holding
prompts back while a PD pair meets both (slo_defaults `decode_holding_ms`: a prompt
computed there has waited a third of its guard's hold limit for its first token; the
prompts held together go together, and stall its streams for as long); else the PD pair
meeting both with the lowest TTFT; else the candidate that misses least (sum of the
relative overshoots), a long prompt never on the DECODE path (its stall spirals: issue 16),
a short one only when it keeps the decode within its TPOT target (or without a prefill
instance). Targets: the request's `ttft_slo_ms`/`tpot_slo_ms`, else the service's
`--ttft-slo-ms`/`--tpot-slo-ms`, else what the instances' profiles support
(`SloRouter.stated`, xllm_py/cluster/slo_defaults.py); 0: none. Without a profile from
every instance it falls back to `PDDecider` with the policy (CACHE_AWARE).

Torch-free: the master imports it.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from typing import Callable, Sequence

from xllm_py.cluster import slo_defaults
from xllm_py.cluster.latency_profile import LatencyProfile, attn_pairs
from xllm_py.cluster.prefill_order import Queued, finish_s
from xllm_service.config import RouterConfig
from xllm_service.instance_table import InstanceInfo
from xllm_service.prefix_index import PrefixIndex, prompt_block_hashes
from xllm_service.router import LoadBalancePolicy, Path, Route, Router, policy_from_config
from xllm_service.sub_request import InstanceWork

logger = logging.getLogger(__name__)

# Measured/predicted correction: weight of a new observation, and its bounds (1/x .. x).
SCALE_ALPHA = 0.2
SCALE_MAX = 50.0

# Prompt tokens the service sent to a decode to compute over this many seconds give the
# rate at which it will likely get more while a new stream runs there (a burst of short
# prompts stalls every stream through its life, not only by those queued when it starts).
RECENT_LOCAL_S = 2.0

# Context assumed per sequence an instance reports running that the service did not send
# (another service's): the profile's context term needs a number.
DEFAULT_CTX_PER_SEQ = 512


class PrefixCache:
    """Cached prompt tokens per instance, from the heartbeat cache events (PrefixIndex),
    hashing the prompt once per block size."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def cached_tokens(self, info: InstanceInfo, prompt: Sequence[int],
                      chains: dict[int, list[int]]) -> int:
        bs = info.meta.block_size
        if not prompt or bs <= 0 or not self.index.num_cached_blocks(info.name):
            return 0
        if bs not in chains:
            chains[bs] = prompt_block_hashes(prompt, bs)
        # The engine computes the last prompt token even on a full hit (its logits).
        return min(self.index.matched_blocks(info.name, chains[bs]) * bs, len(prompt) - 1)


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


@dataclasses.dataclass(frozen=True)
class Prediction:
    route: Route
    ttft_ms: float
    tpot_ms: float

    def miss(self, ttft_slo_ms: float, tpot_slo_ms: float) -> float:
        """Relative overshoot of the targets (0: meets both; a 0 target: none)."""
        m = 0.0
        if ttft_slo_ms > 0:
            m += max(0.0, self.ttft_ms / ttft_slo_ms - 1.0)
        if tpot_slo_ms > 0:
            m += max(0.0, self.tpot_ms / tpot_slo_ms - 1.0)
        return m


class SloPredictor:
    """TTFT and TPOT of a request on a candidate, from the instances' profiles and what
    they are doing now (the service's requests there; heartbeat running count)."""

    def __init__(self, config: RouterConfig, work: Callable[[str], InstanceWork],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.work = work
        self.clock = clock
        # decode -> (sent at, prompt tokens) of the prompts sent to it to compute itself
        self._local: dict[str, collections.deque[tuple[float, int]]] = {}
        self._profiles: dict[str, tuple[dict, LatencyProfile | None]] = {}
        # (instance, "ttft" | "tpot") -> measured / predicted, a moving average
        self._scale: dict[tuple[str, str], float] = {}

    def scale(self, name: str, what: str) -> float:
        return self._scale.get((name, what), 1.0)

    def observe(self, route: Route, ttft_ms: float | None, tpot_ms: float | None) -> None:
        """Correct the instances' predictions by what a request measured: the profile is
        the cost of a step on a core of its own; a shared machine, or a model the profile
        under-fits, runs slower. TTFT corrects the instance that computed the prompt,
        TPOT the one that decoded it."""
        pred_ttft, pred_tpot = route.predicted
        if not route.corrects_ttft:
            ttft_ms = None
        if route.is_pd and ttft_ms is not None:  # the overhead is not the profile's to scale
            overhead = self.config.pd_overhead_ms
            pred_ttft, ttft_ms = pred_ttft - overhead, max(0.0, ttft_ms - overhead)
        for name, what, pred, meas in ((route.target.name, "ttft", pred_ttft, ttft_ms),
                                       (route.serving.name, "tpot", pred_tpot, tpot_ms)):
            if meas is None or pred <= 0:
                continue
            ratio = meas / (pred / self.scale(name, what))  # against the raw profile
            ratio = min(SCALE_MAX, max(1.0 / SCALE_MAX, ratio))  # (a measured 0: the floor)
            old = self._scale.get((name, what))
            self._scale[(name, what)] = ratio if old is None else (
                old + SCALE_ALPHA * (ratio - old))

    def note_local(self, decode: str, tokens: int) -> None:
        """The service sent `tokens` prompt tokens to `decode` to compute itself."""
        self._local.setdefault(decode, collections.deque()).append((self.clock(), tokens))

    def recent_local_rate(self, decode: str) -> float:
        """Prompt tokens a second sent to `decode` to compute itself, over RECENT_LOCAL_S."""
        sent = self._local.get(decode)
        if not sent:
            return 0.0
        since = self.clock() - RECENT_LOCAL_S
        while sent and sent[0][0] < since:
            sent.popleft()
        return sum(n for _, n in sent) / RECENT_LOCAL_S

    def holding(self, decode: InstanceInfo) -> bool:
        """Whether `decode` holds back prompts it computes itself: one the service sent it
        has waited a third of its TPOT guard's hold limit for its first token (slo_defaults
        `decode_holding_ms`, from its profile: the guard waits for its streams to save up;
        a prompt sent now would wait too, and go in a burst)."""
        profile = self.profile(decode)
        limit = slo_defaults.decode_holding_ms(profile) if profile is not None else 0.0
        pending = self.work(decode.name).pending_prompts  # oldest first
        return bool(limit and pending and (self.clock() - pending[0][0]) * 1000.0 >= limit)

    def profile(self, info: InstanceInfo) -> LatencyProfile | None:
        """The profile `info` registers (parsed once per registration: an engine registers
        its own again as its steps correct it)."""
        raw = info.meta.latency_profile
        cached = self._profiles.get(info.name)
        if cached is None or cached[0] != raw:
            try:
                parsed = LatencyProfile.from_dict(raw) if raw else None
            except ValueError:
                parsed = None
            cached = self._profiles[info.name] = (raw, parsed)
        return cached[1]

    def _state(self, info: InstanceInfo) -> tuple[InstanceWork, int, int]:
        """(the service's work there, decoding sequences, their context tokens)."""
        w = self.work(info.name)
        seqs, ctx = w.decoding_seqs, w.decoding_ctx_tokens
        others = max(0, info.load.running - seqs)
        ctx += others * (ctx // seqs if seqs else DEFAULT_CTX_PER_SEQ)
        return w, seqs + others, ctx

    def _prefill_ttft_ms(self, info: InstanceInfo, profile: LatencyProfile, work: InstanceWork,
                         uncached: int, own_pairs: int, ttft_slo_ms: float) -> float:
        """TTFT of a prompt sent now to prefill instance `info`, which takes its queue in
        deadline order (xllm_py/cluster/prefill_order.py; the service's prompts there, each
        whole as if not started): an on-time prompt does not wait behind late ones."""
        scale = self.scale(info.name, "ttft")
        now = self.clock()

        def queued(sent_s: float, tokens: int, slo_ms: float, pairs: int | None = None) -> Queued:
            return Queued(sent_s + slo_ms / 1000.0 if slo_ms > 0 else math.inf,
                          profile.prefill_ms(tokens, pairs=pairs) / 1000.0 * scale)

        queue = [queued(*p) for p in work.pending_prompts]
        queue.append(queued(now, uncached, ttft_slo_ms, own_pairs))
        return (finish_s(queue, len(queue) - 1, now) - now) * 1000.0

    def predict(self, route: Route, prompt_len: int, uncached: int,
                max_tokens: int, ttft_slo_ms: float = 0.0) -> Prediction | None:
        decode = route.serving
        pd = self.profile(decode)
        pp = self.profile(route.target)
        if pd is None or pp is None:
            return None
        work_d, seqs_d, ctx_d = self._state(decode)
        queued_d = work_d.pending_prefill_tokens
        own_pairs = attn_pairs(prompt_len - uncached, uncached)
        # whether this prompt waits behind others where it is computed (its TTFT then
        # corrects nothing: Route.corrects_ttft)
        if route.is_pd:
            work_p = self.work(route.target.name)
            waited = bool(work_p.pending_prompts)
            ttft = self._prefill_ttft_ms(route.target, pp, work_p, uncached, own_pairs,
                                         ttft_slo_ms)
            local, local_pairs = queued_d, work_d.pending_prefill_pairs
        else:
            local_pairs = work_d.pending_prefill_pairs + own_pairs
            ttft = pd.prefill_ms(queued_d + uncached, seqs_d, ctx_d, local_pairs)
            local = queued_d + uncached
            waited = bool(queued_d)
        # The prompt tokens the decode computes stall every stream it runs; a stream halfway
        # through its output absorbs the stall over the half it has left, at most one
        # prompt chunk per step (a token's cost: its own and the keys it attends to).
        # Those it will likely get meanwhile count too: the recent rate over this
        # stream's life (one decode step a token).
        per_token = (pd.prefill_ms_per_token
                     + pd.prefill_ms_per_kpair * local_pairs / max(1, local) / 1000)
        step = pd.decode_step_ms(seqs_d + 1, ctx_d + prompt_len)
        life_s = max_tokens * step * self.scale(decode.name, "tpot") / 1000.0
        coming = self.recent_local_rate(decode.name) * life_s
        stall = per_token * min((local + coming) / max(1, max_tokens // 2),
                                pd.prompt_chunk(seqs_d + 1))
        tpot = step + stall
        if route.is_pd:  # (scaled in the queue's order)
            ttft += self.config.pd_overhead_ms
        else:
            ttft *= self.scale(route.target.name, "ttft")
        tpot *= self.scale(decode.name, "tpot")
        return Prediction(dataclasses.replace(route, predicted=(ttft, tpot),
                                              corrects_ttft=not waited), ttft, tpot)


class SloRouter:
    """SLO_AWARE's choice of path and instances over prefill and decode instances
    (module docstring); `policy` picks when predictions are missing."""

    def __init__(self, config: RouterConfig, predictor: SloPredictor, decider: PDDecider,
                 policy: LoadBalancePolicy) -> None:
        self.config = config
        self.predictor = predictor
        self.decider = decider
        self.policy = policy
        self._derived_key: list = []
        self._derived = (0.0, 0.0)
        self._last = (self.config.ttft_slo_ms or 0.0, self.config.tpot_slo_ms or 0.0)

    def stated(self, prefills: Sequence[InstanceInfo],
               decodes: Sequence[InstanceInfo]) -> tuple[float, float]:
        """The service's (TTFT, TPOT) targets in ms over these instances: the operator's
        (--ttft-slo-ms / --tpot-slo-ms), else what their latency profiles support
        (xllm_py/cluster/slo_defaults.py; 0 while an instance has none)."""
        ttft, tpot = self.config.ttft_slo_ms, self.config.tpot_slo_ms
        if ttft is None or tpot is None:
            key = [(i.name, i.meta.latency_profile) for i in (*prefills, *decodes)]
            if key != self._derived_key:
                pd = [self.predictor.profile(i) for i in decodes]
                pp = [self.predictor.profile(i) for i in prefills] or pd
                whole = decodes and None not in pd and None not in pp
                derived = ((slo_defaults.ttft_target_ms(pp), slo_defaults.tpot_target_ms(pd))
                           if whole else (0.0, 0.0))
                if whole and derived != self._derived:
                    logger.info("SLO targets from the latency profiles: TTFT %.0f ms, TPOT "
                                "%.1f ms", *derived)
                self._derived, self._derived_key = derived, key
            ttft = self._derived[0] if ttft is None else ttft
            tpot = self._derived[1] if tpot is None else tpot
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
        uncached = {i.name: len(prompt) - self.decider.cache.cached_tokens(i, prompt, chains)
                    for i in (*prefills, *decodes)}
        local: list[Prediction] = []
        remote: list[Prediction] = []
        for d in decodes:
            if self.config.conditional or not prefills:
                local.append(self.predictor.predict(Route(d, on_decode=True), len(prompt),
                                                    uncached[d.name], max_tokens, ttft_slo))
            for p in prefills:
                remote.append(self.predictor.predict(Route(p, d), len(prompt),
                                                     uncached[p.name], max_tokens, ttft_slo))
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
