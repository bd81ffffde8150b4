"""SLO_AWARE's predictions: the TTFT and TPOT of a request on a candidate path from the
instances' latency profiles and what they are doing now (the model: pd_decision.py's
docstring), corrected by what requests measure.

Torch-free: the master imports it.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Callable

from xllm_py.cluster import slo_defaults
from xllm_py.cluster.latency_profile import LatencyProfile, attn_pairs
from xllm_py.cluster.prefill_order import Queued, finish_s
from xllm_service.config import RouterConfig
from xllm_service.instance_table import InstanceInfo
from xllm_service.router import Route
from xllm_service.sub_request import InstanceWork

# Measured/predicted correction: weight of a new observation, and its bounds. A profile is
# what the instance measured of itself on a core of its own: a shared machine runs it
# slower, by any factor, but nothing runs it much faster. A measure under the prediction
# says the prediction counted work that did not come (streams, prompts sent after it); a
# scale taught by that would call the instance fast, and every stream would go there.
SCALE_ALPHA = 0.2
SCALE_MAX = 50.0
SCALE_MIN = 0.5
# A scale fades back to 1 with this half-life while nothing new is measured. A measure over
# the prediction may also say the prediction missed load (streams sent there after it): a
# scale taught by a flood sends nothing there any more, so no measure would correct it. A
# machine that is slow stays corrected: each stream that ends there measures it again.
SCALE_HALF_LIFE_S = 20.0

# Prompt tokens the service sent to a decode to compute over this many seconds give the
# rate at which it will likely get more while a new stream runs there (a burst of short
# prompts stalls every stream through its life, not only by those queued when it starts).
RECENT_LOCAL_S = 2.0

# Context assumed per sequence an instance reports running that the service did not send
# (another service's): the profile's context term needs a number.
DEFAULT_CTX_PER_SEQ = 512


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
        # name -> what `_registered` returns
        self._profiles: dict[str, tuple] = {}
        # (instance, "ttft" | "tpot") -> measured / predicted, a moving average
        self._scale: dict[tuple[str, str], tuple[float, float]] = {}  # (value, when)
        self._pairs_seen: set[tuple[str, str]] = set()  # (prefill, decode) that handed over

    def scale(self, name: str, what: str) -> float:
        entry = self._scale.get((name, what))
        if entry is None:
            return 1.0
        value, when = entry
        return 1.0 + (value - 1.0) * 0.5 ** (max(0.0, self.clock() - when) / SCALE_HALF_LIFE_S)

    def observe(self, route: Route, ttft_ms: float | None, tpot_ms: float | None) -> None:
        """Correct the instances' predictions by what a request measured: the profile is
        the cost of a step on a core of its own; a shared machine, or a model the profile
        under-fits, runs slower. TTFT corrects the instance that computed the prompt,
        TPOT the one that decoded it."""
        pred_ttft, pred_tpot = route.predicted
        pair = (route.target.name, route.serving.name)
        if route.is_pd and pair not in self._pairs_seen:
            # A pair's first hand-over also opens its channels and transfer links, so it is
            # not the prefill's speed: taken as such, one slow first request would make
            # every later long prompt look late there, none would go there again, and
            # nothing would correct it back.
            self._pairs_seen.add(pair)
            ttft_ms = None
        if not route.corrects_ttft:
            ttft_ms = None
        if route.is_pd and ttft_ms is not None:  # the overhead is not the profile's to scale
            overhead = self.config.pd_overhead_ms
            pred_ttft, ttft_ms = pred_ttft - overhead, max(0.0, ttft_ms - overhead)
        for name, what, pred, meas, used in (
                (route.target.name, "ttft", pred_ttft, ttft_ms, route.scales[0]),
                (route.serving.name, "tpot", pred_tpot, tpot_ms, route.scales[1])):
            if meas is None or pred <= 0:
                continue
            ratio = meas / (pred / used)  # against the raw profile
            ratio = min(SCALE_MAX, max(SCALE_MIN, ratio))  # (a measured 0: the floor)
            old = self.scale(name, what) if (name, what) in self._scale else None
            self._scale[(name, what)] = (ratio if old is None else
                                         old + SCALE_ALPHA * (ratio - old), self.clock())

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
        return self._registered(info)[1]

    def first_profile(self, info: InstanceInfo) -> LatencyProfile | None:
        """The first profile this incarnation of `info` registered (what it measured at
        start-up; None while it registers none): what the service states its targets by,
        while the engines' own corrections move the predictions (self_profile.py
        `ProfileCorrector`)."""
        return self._registered(info)[3]

    def _registered(self, info: InstanceInfo) -> tuple:
        """(raw, parsed, incarnation, first parsed) of what `info` registers now."""
        raw, incarnation = info.meta.latency_profile, info.incarnation_id
        cached = self._profiles.get(info.name)
        if cached is None or cached[0] != raw or cached[2] != incarnation:
            try:
                parsed = LatencyProfile.from_dict(raw) if raw else None
            except ValueError:
                parsed = None
            kept = cached is not None and cached[2] == incarnation and parsed is not None
            first = cached[3] if kept and cached[3] is not None else parsed
            cached = self._profiles[info.name] = (raw, parsed, incarnation, first)
        return cached

    def _state(self, info: InstanceInfo) -> tuple[InstanceWork, int, int]:
        """(the service's work there, decoding sequences, their context tokens)."""
        w = self.work(info.name)
        seqs, ctx = w.decoding_seqs, w.decoding_ctx_tokens
        others = max(0, info.load.running - seqs)
        ctx += others * (ctx // seqs if seqs else DEFAULT_CTX_PER_SEQ)
        return w, seqs + others, ctx

    def _prefill_ttft_ms(self, profile: LatencyProfile, work: InstanceWork, uncached: int,
                         own_pairs: int, ttft_slo_ms: float, scale: float) -> float:
        """TTFT of a prompt sent now to the prefill instance of `profile` and `work`, its
        times scaled by `scale`, which takes its queue in deadline order
        (xllm_py/cluster/prefill_order.py; the service's prompts there, each whole as if
        not started): an on-time prompt does not wait behind late ones."""
        now = self.clock()

        def queued(sent_s: float, tokens: int, slo_ms: float, pairs: int | None = None) -> Queued:
            return Queued(sent_s + slo_ms / 1000.0 if slo_ms > 0 else math.inf,
                          profile.prefill_ms(tokens, pairs=pairs) / 1000.0 * scale)

        queue = [queued(*p) for p in work.pending_prompts]
        queue.append(queued(now, uncached, ttft_slo_ms, own_pairs))
        return (finish_s(queue, len(queue) - 1, now) - now) * 1000.0

    def predict(self, route: Route, prompt_len: int, uncached: int,
                max_tokens: int, ttft_slo_ms: float = 0.0,
                load_ms: float = 0.0) -> Prediction | None:
        """`load_ms`: what loading the cached part from the KV tiers costs where it is
        computed (their registered per-block costs), added to its TTFT."""
        decode = route.serving
        pd = self.profile(decode)
        pp = self.profile(route.target)
        if pd is None or pp is None:
            return None
        work_d, seqs_d, ctx_d = self._state(decode)
        # (each read once: a scale fades with the clock, and the route keeps what was used)
        ttft_scale = self.scale(route.target.name, "ttft")
        tpot_scale = self.scale(decode.name, "tpot")
        queued_d = work_d.pending_prefill_tokens
        own_pairs = attn_pairs(prompt_len - uncached, uncached)
        # whether this prompt waits behind others where it is computed (its TTFT then
        # corrects nothing: Route.corrects_ttft)
        if route.is_pd:
            work_p = self.work(route.target.name)
            waited = bool(work_p.pending_prompts)
            ttft = self._prefill_ttft_ms(pp, work_p, uncached, own_pairs, ttft_slo_ms,
                                         ttft_scale)
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
        life_s = max_tokens * step * tpot_scale / 1000.0
        coming = self.recent_local_rate(decode.name) * life_s
        stall = per_token * min((local + coming) / max(1, max_tokens // 2),
                                pd.prompt_chunk(seqs_d + 1))
        tpot = step + stall
        if route.is_pd:  # (scaled in the queue's order)
            ttft += self.config.pd_overhead_ms
        else:
            ttft *= ttft_scale
        ttft += load_ms
        tpot *= tpot_scale
        if not route.is_pd and seqs_d:
            work = per_token * local * ttft_scale
            ttft, tpot = _guarded(pd, ttft, tpot, step * tpot_scale, work)
        return Prediction(dataclasses.replace(route, predicted=(ttft, tpot),
                                              scales=(ttft_scale, tpot_scale),
                                              corrects_ttft=not waited), ttft, tpot)


def _guarded(profile: LatencyProfile, ttft_ms: float, tpot_ms: float, step_ms: float,
             work_ms: float) -> tuple[float, float]:
    """(TTFT, TPOT) of the DECODE path on a decode whose TPOT guard (its registered target
    G, hold limit H) binds: prompts then get the time its streams save under G, a
    share 1 - step / G of it, and the streams keep G; the prompt taking longer than H
    goes anyway, at the pace predicted without the guard (`work_ms`: the prompt tokens'
    own compute there, the queued ones' included)."""
    g, hold = profile.prompt_tpot_target_ms, profile.prompt_hold_max_ms
    if g <= 0 or tpot_ms <= g:
        return ttft_ms, tpot_ms
    share = 1.0 - step_ms / g
    guarded = work_ms / share if share > 0 else math.inf
    if hold > 0 and guarded > hold:
        return max(ttft_ms, hold), tpot_ms
    return guarded, g
