"""Conditional disaggregation and SLO_AWARE routing (xllm_service/pd_decision.py): the
latency profile, the predictor, the decider's thresholds, SLO_AWARE's order of choice,
and the backend serving and migrating a request on the DECODE path."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest

from xllm_py.api.backend import GenerateRequest
from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.cluster.latency_profile import LatencyProfile, attn_pairs
from xllm_py.config import InstanceRole
from xllm_service.config import RouterConfig
from xllm_py.engine.block_pool import hash_block_tokens
from xllm_py.engine.cache_events import hash_to_bytes
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.sampling_params import SamplingParams
from xllm_service.backend import MIN_PACED_TOKENS, ServiceBackend
from xllm_service.slo_predictor import SCALE_HALF_LIFE_S, SCALE_MIN
from xllm_service.instance_table import InstanceInfo, InstanceState, LoadInfo
from xllm_service.pd_decision import (PDDecider, PrefixCache, SloPredictor, SloRouter,
                                      build_router)
from xllm_service.prefix_index import PrefixIndex
from xllm_service.router import LeastLoadPolicy, Path, Route
from xllm_service.sub_request import InstanceWork, SubPhase, SubRequest, SubRequests
from tests.unit.service.test_service_relay import FakeEngines, feed, gen, take

# 1 ms a step + 0.1 ms a prompt token; a decode step 2 ms + 1 ms a sequence
PROFILE = dict(prefill_base_ms=1.0, prefill_ms_per_token=0.1, decode_base_ms=2.0,
               decode_ms_per_seq=1.0, decode_ms_per_ctx_token=0.0,
               max_num_batched_tokens=1000)


def inst(name: str, role: InstanceRole, profile: dict | None = PROFILE, running: int = 0,
         addr: str = "127.0.0.1:1") -> InstanceInfo:
    meta = InstanceMeta(name=name, type=role, rpc_address=addr, block_size=4,
                        latency_profile=dict(profile or {}), incarnation_id="i-" + name)
    return InstanceInfo(meta, InstanceState.ACTIVE, 0.0, load=LoadInfo(running=running))


def no_work(name: str) -> InstanceWork:
    return InstanceWork()


def prefill_queue(*prompts: int) -> InstanceWork:
    """The service's prompts queued on a prefill, sent long ago without a TTFT target."""
    return InstanceWork(pending_prefill_tokens=sum(prompts),
                        pending_prefill_pairs=sum(attn_pairs(0, n) for n in prompts),
                        pending_prompts=tuple((0.0, n, 0.0) for n in prompts))


# ---------------------------------------------------------------- the profile
def test_profile_reads_the_simulator_time_model_json_and_predicts_chunked_prefill():
    sim = {k: v for k, v in PROFILE.items() if k != "max_num_batched_tokens"}
    sim["source"] = {"cpu": "x"}  # the simulator's provenance: ignored
    p = LatencyProfile.from_dict(json.loads(json.dumps(sim)))
    assert p.max_num_batched_tokens == 2048
    p = LatencyProfile.from_dict(PROFILE)
    assert p.prefill_ms(500) == pytest.approx(1 + 50)
    # 2500 tokens with 10 decoding seqs: chunks of 990 (990, 990, 520), each a decode step
    step = lambda n: 2 + 0.1 * n + 10  # noqa: E731
    assert p.prefill_ms(2500, 10, 0) == pytest.approx(2 * step(990) + step(520))
    assert p.decode_step_ms(4, 0) == pytest.approx(6)
    assert p.prefill_ms(0) == 0 and p.step_ms(0, 0, 0) == 0


@pytest.mark.parametrize("bad, match", [
    ({"prefill_base_ms": 1}, "lacks"),
    ({**PROFILE, "decode_ms_per_seq": -1}, "decode_ms_per_seq must be a number >= 0"),
    ({**PROFILE, "prefill_ms_per_token": "x"}, "prefill_ms_per_token"),
    ({**PROFILE, "max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({**PROFILE, "max_prefill_tokens_while_decoding": -1}, "max_prefill_tokens_while_decoding"),
    ([1, 2], "JSON object")])
def test_bad_profiles_are_refused_with_the_reason(bad, match):
    with pytest.raises(ValueError, match=match):
        LatencyProfile.from_dict(bad)


def test_profile_travels_in_the_instance_meta_json():
    meta = inst("d", InstanceRole.DECODE).meta
    assert InstanceMeta.from_json(meta.to_json()).latency_profile == PROFILE
    with pytest.raises(ValueError, match="latency_profile"):
        InstanceMeta.from_dict({"name": "a", "type": "DECODE", "latency_profile": [1]})


# ---------------------------------------------------------------- the predictor
def test_predictor_adds_queued_prompts_pd_overhead_and_prefill_interference():
    work = {"p": InstanceWork(pending_prefill_tokens=1000, pending_prompts=((0.0, 1000, 0.0),)),
            "d": InstanceWork(pending_prefill_tokens=0, decoding_seqs=3, decoding_ctx_tokens=0)}
    pred = SloPredictor(RouterConfig(pd_overhead_ms=20), lambda n: work.get(n, InstanceWork()),
                        clock=lambda: 0.0)
    p, d = inst("p", InstanceRole.PREFILL), inst("d", InstanceRole.DECODE)
    pd = pred.predict(Route(p, d), prompt_len=200, uncached=200, max_tokens=10)
    # prefill: the queued prompt (1 + 100), then this one (1 + 20); + 20
    assert pd.ttft_ms == pytest.approx(101 + 21 + 20)
    assert pd.tpot_ms == pytest.approx(2 + 4)  # a step of 3 + 1 sequences
    local = pred.predict(Route(d, on_decode=True), prompt_len=200, uncached=200, max_tokens=10)
    assert local.ttft_ms == pytest.approx(2 + 20 + 3)  # one chunk in a step with 3 decodes
    assert local.tpot_ms == pytest.approx(6 + 0.1 * 200 / 5)  # its prompt over half of 10
    # a running count from the heartbeat above the service's own adds sequences
    busy = inst("d", InstanceRole.DECODE, running=7)
    assert pred.predict(Route(busy, on_decode=True), 200, 200, 10).tpot_ms == pytest.approx(10 + 4)
    # an instance without a profile: no prediction
    assert pred.predict(Route(inst("p0", InstanceRole.PREFILL, None), d), 200, 200, 10) is None


def test_prefill_ttft_follows_the_prefills_deadline_order():
    """A prefill takes its queue in deadline order (xllm_py/cluster/prefill_order.py): a
    prompt that can make its target does not wait for queued ones already late; one
    without a target waits for all."""
    now = 100.0
    late = (now - 0.95, 5000, 1000.0)  # 505 ms of prefill due in 50 ms: late
    due = (now - 0.1, 100, 1000.0)  # 11 ms due in 0.9 s
    work = {"p": InstanceWork(pending_prompts=(late, due))}
    pred = SloPredictor(RouterConfig(pd_overhead_ms=0), lambda n: work.get(n, InstanceWork()),
                        clock=lambda: now)
    p, d = inst("p", InstanceRole.PREFILL), inst("d", InstanceRole.DECODE)
    # `due` (the shorter) first, then this one (21 ms); `late` after both
    assert pred.predict(Route(p, d), 200, 200, 10, ttft_slo_ms=1000).ttft_ms == \
        pytest.approx(11 + 21)
    assert pred.predict(Route(p, d), 200, 200, 10).ttft_ms == pytest.approx(11 + 505 + 21)
    # arrival order when no target is set anywhere (FCFS)
    work["p"] = InstanceWork(pending_prompts=((now - 1, 5000, 0.0), (now - 0.5, 100, 0.0)))
    assert pred.predict(Route(p, d), 200, 200, 10).ttft_ms == pytest.approx(505 + 11 + 21)


def test_tpot_counts_the_prompts_recently_sent_to_the_decode():
    """A stream on a decode takes the stall of the prompts the decode will likely get while
    it runs: the rate of those recently sent there (a burst of short prompts)."""
    clock = [50.0]
    work = {"d": InstanceWork(pending_prefill_tokens=0, decoding_seqs=3)}
    pred = SloPredictor(RouterConfig(), lambda n: work.get(n, InstanceWork()),
                        clock=lambda: clock[0])
    d = inst("d", InstanceRole.DECODE)
    route = Route(d, on_decode=True)
    # a step of 3 + 1 sequences (6 ms) + its own 100 tokens over half its 10 steps
    assert pred.predict(route, 100, 100, 10).tpot_ms == pytest.approx(6 + 0.1 * 100 / 5)
    pred.note_local("d", 1000)  # 500 tokens/s over 2 s: 30 more in its 10 steps of 6 ms
    assert pred.recent_local_rate("d") == pytest.approx(500)
    assert pred.predict(route, 100, 100, 10).tpot_ms == pytest.approx(6 + 0.1 * 130 / 5)
    clock[0] += 2.5  # out of the window
    assert pred.recent_local_rate("d") == 0
    assert pred.predict(route, 100, 100, 10).tpot_ms == pytest.approx(6 + 0.1 * 100 / 5)


def test_slo_router_notes_the_prompts_it_sends_to_a_decode():
    p, d = inst("p", InstanceRole.PREFILL), inst("d", InstanceRole.DECODE)
    r = slo_router({}, local_prefill_max_tokens=256, ttft_slo_ms=1000, tpot_slo_ms=50)
    assert r.route(req(100), [p], [d]).path is Path.DECODE
    assert r.predictor.recent_local_rate("d") == pytest.approx(100 / 2.0)
    assert r.route(req(900), [p], [d]).path is Path.PD  # not noted
    assert r.predictor.recent_local_rate("d") == pytest.approx(100 / 2.0)


def test_prompt_cap_beside_decodes_lengthens_ttft_and_bounds_the_stall():
    """An instance capping prompt tokens per step while decoding
    (--max-prefill-tokens-while-decoding): its prompts take more, shorter steps beside
    decodes; the stall on a stream is at most one capped chunk a step."""
    capped = {**PROFILE, "max_prefill_tokens_while_decoding": 50}
    p = LatencyProfile.from_dict(capped)
    assert p.prompt_chunk(0) == 1000 and p.prompt_chunk(3) == 50
    assert p.prefill_ms(500) == pytest.approx(1 + 50)  # alone: the whole budget
    assert p.prefill_ms(120, 3, 0) == pytest.approx(2 * (2 + 5 + 3) + (2 + 2 + 3))
    work = {"d": InstanceWork(decoding_seqs=3), "d2": InstanceWork(decoding_seqs=3)}
    pred = SloPredictor(RouterConfig(), lambda n: work.get(n, InstanceWork()))
    d = inst("d", InstanceRole.DECODE, capped)
    local = pred.predict(Route(d, on_decode=True), prompt_len=2000, uncached=2000, max_tokens=10)
    assert local.ttft_ms == pytest.approx(40 * (2 + 5 + 3))  # 40 chunks of 50
    assert local.tpot_ms == pytest.approx(6 + 0.1 * 50)  # not 0.1 * 2000 / 5
    uncapped = inst("d2", InstanceRole.DECODE)
    assert pred.predict(Route(uncapped, on_decode=True), 2000, 2000, 10).tpot_ms == \
        pytest.approx(6 + 0.1 * 2000 / 5)


def test_prompt_attention_term_is_quadratic_in_the_prompt_and_counts_the_cached_keys():
    quad = {**PROFILE, "prefill_ms_per_kpair": 2.0}  # 2 ms per 1000 (token, key) pairs
    p = LatencyProfile.from_dict(quad)
    assert attn_pairs(0, 4) == 10 and attn_pairs(6, 4) == 34 and attn_pairs(3, 0) == 0
    assert p.prefill_ms(500) == pytest.approx(1 + 50 + 2 * 500 * 501 / 2 / 1000)
    assert LatencyProfile.from_dict(PROFILE).prefill_ms_per_kpair == 0  # older profiles
    work = {"p": prefill_queue(1000)}
    pred = SloPredictor(RouterConfig(pd_overhead_ms=0), lambda n: work.get(n, InstanceWork()))
    pp, d = inst("pq", InstanceRole.PREFILL, quad), inst("dq", InstanceRole.DECODE, quad)
    work["pq"] = work.pop("p")
    # 200 uncached tokens after 100 cached: 200*100 + 200*201/2 pairs, + the queue's
    x = pred.predict(Route(pp, d), prompt_len=300, uncached=200, max_tokens=10)
    assert x.ttft_ms == pytest.approx(101 + 21 + 2 * (500_500 + 20_000 + 20_100) / 1000)
    # on the decode path, each prompt token stalls the streams by its cost with its keys
    local = pred.predict(Route(d, on_decode=True), prompt_len=300, uncached=300, max_tokens=10)
    per_token = 0.1 + 2 * (300 * 301 / 2) / 300 / 1000
    assert local.tpot_ms == pytest.approx(2 + 1 + per_token * 300 / 5)
    with pytest.raises(ValueError, match="prefill_ms_per_kpair"):
        LatencyProfile.from_dict({**PROFILE, "prefill_ms_per_kpair": -1})


def test_instance_work_counts_prompts_not_yet_computed_and_the_sequences_decoding():
    subs = SubRequests()
    p, d = inst("p", InstanceRole.PREFILL), inst("d", InstanceRole.DECODE)
    from xllm_py.rpc.convert import EngineRequestSpec
    from xllm_py.sampling_params import SamplingParams

    def add(rid: str, route: Route, prompt: int, phase: SubPhase | None = None) -> SubRequest:
        spec = EngineRequestSpec(rid, rid, [1] * prompt, SamplingParams())
        sub = SubRequest(rid, 0, route, asyncio.Queue(), spec)
        subs.add(sub)
        if phase is not None:
            sub.transition(phase)
        return sub

    add("a", Route(p, d), 100)                                   # on the prefill
    add("b", Route(p, d), 50, SubPhase.FIRST_RELAYED).generated.extend([1, 2])  # decoding
    add("c", Route(d, on_decode=True), 30)                      # prefilled on d
    assert subs.work("p") == InstanceWork(100, 0, 0, 100 * 101 // 2, ((0.0, 100, 0.0),))
    assert subs.work("d") == InstanceWork(30, 3, 100 + 52 + 30, 30 * 31 // 2, ((0.0, 30, 0.0),))


# ---------------------------------------------------------------- the decider
def cached_index(name: str, prompt: list[int], blocks: int) -> PrefixIndex:
    index, h = PrefixIndex(), None
    stored = []
    for i in range(blocks):
        h = hash_block_tokens(h, prompt[4 * i:4 * i + 4])
        stored.append(hash_to_bytes(h))
    index.update(name, stored, [])
    return index


def test_decider_uses_the_uncached_part_on_the_decode_and_the_prefill_queue():
    prompt = list(range(100, 140))  # 40 tokens, 10 blocks of 4
    d, p = inst("d", InstanceRole.DECODE), inst("p", InstanceRole.PREFILL)
    cfg = RouterConfig(local_prefill_max_tokens=16, prefill_busy_tokens=500)
    queue = {"p": InstanceWork(pending_prefill_tokens=0)}
    decider = PDDecider(cfg, PrefixCache(PrefixIndex()), lambda n: queue.get(n, InstanceWork()))
    assert not decider.decide(prompt, d, [p]).on_decode  # 40 uncached > 16
    assert decider.decide(prompt[:16], d, [p]).on_decode
    # 6 of 10 blocks cached on d: 16 uncached
    decider.cache = PrefixCache(cached_index("d", prompt, 6))
    decision = decider.decide(prompt, d, [p])
    assert decision.on_decode and decision.reason.startswith("16 uncached prompt tokens")
    decider.cache = PrefixCache(PrefixIndex())
    queue["p"] = InstanceWork(pending_prefill_tokens=500)  # prefill busy
    decision = decider.decide(prompt, d, [p])
    assert decision.on_decode and "prefill busy" in decision.reason
    queue["d"] = InstanceWork(pending_prefill_tokens=1)  # ...unless d is prefilling too
    assert not decider.decide(prompt, d, [p]).on_decode
    assert decider.decide(prompt, d, []).on_decode  # no prefill instance


# ---------------------------------------------------------------- SLO_AWARE
def slo_router(work: dict, **cfg) -> SloRouter:
    config = RouterConfig(load_balance_policy="SLO_AWARE", **cfg)
    get = lambda n: work.get(n, InstanceWork())  # noqa: E731
    return SloRouter(config, SloPredictor(config, get), PDDecider(config, PrefixCache(
        PrefixIndex()), get), LeastLoadPolicy(lambda n: 0))


def req(n_prompt: int, **kw) -> GenerateRequest:
    return GenerateRequest("r", list(range(n_prompt)),
                           SamplingParams(max_tokens=kw.pop("max_tokens", 10)), **kw)


def test_slo_aware_short_prompts_on_the_decode_long_ones_on_the_prefill():
    p, d = inst("p", InstanceRole.PREFILL), inst("d", InstanceRole.DECODE)
    r = slo_router({}, local_prefill_max_tokens=256, ttft_slo_ms=1000, tpot_slo_ms=50)
    assert r.route(req(100), [p], [d]).path is Path.DECODE
    route = r.route(req(900), [p], [d])
    assert route.path is Path.PD and route.reason.startswith("SLO_AWARE long prompt")


def test_slo_aware_short_prompt_goes_to_an_idle_prefill_that_answers_first():
    """A short prompt takes the candidate meeting both targets with the lowest TTFT: an
    idle prefill (the decode's streams keep their pace), else the decode."""
    p, d = inst("p", InstanceRole.PREFILL), inst("d", InstanceRole.DECODE)
    work = {"d": InstanceWork(decoding_seqs=20, decoding_ctx_tokens=0)}
    r = slo_router(work, local_prefill_max_tokens=256, ttft_slo_ms=1000, tpot_slo_ms=50,
                   pd_overhead_ms=5)
    # decode path: 2 + 10 + 21 = 33 ms; PD on the idle prefill: 1 + 10 + 5 = 16 ms
    route = r.route(req(100), [p], [d])
    assert route.path is Path.PD and "prefill idle" in route.reason
    work["p"] = prefill_queue(2000)  # busy: 200+ ms -> the decode
    assert r.route(req(100), [p], [d]).path is Path.DECODE


def test_slo_aware_short_prompt_skips_a_decode_holding_prompts():
    """A prompt the decode computes itself that has waited a third of the decode's hold
    limit (its profile's prompt_hold_max_ms) for its first token: the decode's guard holds
    prompts; a short one goes to a prefill meeting the targets instead, and to the decode
    again when none does or once the hold ends; a decode without a guard holds nothing."""
    p = inst("p", InstanceRole.PREFILL)
    d = inst("d", InstanceRole.DECODE, {**PROFILE, "prompt_hold_max_ms": 750.0})
    now = [100.0]
    work = {"d": InstanceWork(pending_prefill_tokens=100,
                              pending_prompts=((99.7, 100, 0.0),)),  # sent 300 ms ago
            "p": prefill_queue(500)}  # busier than the decode: 50+ ms
    config = RouterConfig(load_balance_policy="SLO_AWARE", local_prefill_max_tokens=256,
                          ttft_slo_ms=1000, tpot_slo_ms=50)
    get = lambda n: work.get(n, InstanceWork())  # noqa: E731
    predictor = SloPredictor(config, get, clock=lambda: now[0])
    r = SloRouter(config, predictor, PDDecider(config, PrefixCache(PrefixIndex()), get),
                  LeastLoadPolicy(lambda n: 0))
    route = r.route(req(100), [p], [d])
    assert route.path is Path.PD and "decode holding prompts" in route.reason
    now[0] = 99.9  # the prompt has waited 200 ms only: not holding
    assert r.route(req(100), [p], [d]).path is Path.DECODE
    now[0] = 100.0
    work["p"] = prefill_queue(20000)  # the prefill misses the TTFT: the decode still
    assert r.route(req(100), [p], [d]).path is Path.DECODE
    work["p"] = prefill_queue(500)
    d = inst("d", InstanceRole.DECODE, PROFILE)  # registered again, without a guard
    assert r.route(req(100), [p], [d]).path is Path.DECODE


def test_slo_aware_prefers_the_pd_pair_with_the_lowest_ttft():
    p1, p2 = inst("p1", InstanceRole.PREFILL), inst("p2", InstanceRole.PREFILL)
    d = inst("d", InstanceRole.DECODE)
    r = slo_router({"p1": prefill_queue(3000)},
                   local_prefill_max_tokens=0)
    assert r.route(req(900), [p1, p2], [d]).instance_names == ("p2", "d")


def test_slo_aware_sends_a_long_prompt_to_an_idle_decode_when_the_prefill_misses_the_ttft():
    p, d = inst("p", InstanceRole.PREFILL), inst("d", InstanceRole.DECODE)
    # 9000 prompt tokens queued on p: ~910 ms before this one; the decode is idle and
    # meets both targets (91 ms, no stream to stall): its core takes the prompt
    work = {"p": prefill_queue(9000)}
    r = slo_router(work, local_prefill_max_tokens=0, ttft_slo_ms=500, tpot_slo_ms=50)
    route = r.route(req(900, max_tokens=64), [p], [d])
    assert route.path is Path.DECODE and "long prompt, prefill behind" in route.reason
    assert route.predicted[0] == pytest.approx(1 + 0.1 * 900)
    # When neither meets its targets: the one that misses least. Its prompt would slow the
    # decode to 3 + 0.1 * 900 / 32 = 5.8 ms a token (81% over 3.2); PD's TTFT is
    # 1020 ms (13% over 900)
    route = r.route(req(900, max_tokens=64, ttft_slo_ms=900, tpot_slo_ms=3.2), [p], [d])
    assert route.path is Path.PD and "no candidate meets" in route.reason
    # ... but a long prompt stays off the decode even where it would miss less there
    # (TPOT 66% over 3.5 against PD's TTFT 104% over 500): its stall would spiral
    route = r.route(req(900, max_tokens=64, tpot_slo_ms=3.5), [p], [d])
    assert route.path is Path.PD and "no candidate meets" in route.reason
    # a short one neither, while it would take the decode past its TPOT target (every
    # stream there would miss, not only this request) ...
    r.config = RouterConfig(load_balance_policy="SLO_AWARE", local_prefill_max_tokens=900,
                            ttft_slo_ms=500, tpot_slo_ms=3.5)
    assert r.route(req(900, max_tokens=64), [p], [d]).path is Path.PD
    # ... but when only TTFT misses there, it goes where it misses least: the decode
    # (TTFT ~0.1 s against PD's 1 s, both over 50 ms)
    route = r.route(req(900, max_tokens=64, ttft_slo_ms=50, tpot_slo_ms=10), [p], [d])
    assert route.path is Path.DECODE and "no candidate meets" in route.reason
    # the request's own targets win over the service's: a lax TTFT keeps PD
    assert r.route(req(900, max_tokens=64, ttft_slo_ms=5000), [p], [d]).path is Path.PD


def test_slo_aware_without_profiles_falls_back_to_the_thresholds():
    p, d = inst("p", InstanceRole.PREFILL, None), inst("d", InstanceRole.DECODE)
    r = slo_router({}, local_prefill_max_tokens=256)
    assert r.route(req(100), [p], [d]).path is Path.DECODE
    route = r.route(req(900), [p], [d])
    assert route.path is Path.PD and route.reason.endswith("(no profile)")


def test_always_never_prefills_on_the_decode_unless_no_prefill_is_there():
    p, d = inst("p", InstanceRole.PREFILL), inst("d", InstanceRole.DECODE)
    r = slo_router({}, disagg_decision="ALWAYS")
    assert r.route(req(8), [p], [d]).path is Path.PD
    config = RouterConfig(disagg_decision="ALWAYS")
    router = build_router(config, lambda role: {InstanceRole.DECODE: [d]}.get(role, []),
                          lambda n: 0, no_work, PrefixIndex())
    assert router.unavailable_reason() == "a decode instance is registered but no prefill " \
                                          "instance is"


@pytest.mark.parametrize("policy, decision, conditional", [
    ("LEAST_LOAD", None, False), ("LEAST_LOAD", "CONDITIONAL", True),
    ("SLO_AWARE", None, True), ("SLO_AWARE", "ALWAYS", False), ("CACHE_AWARE", "always", False)])
def test_the_decision_defaults_to_conditional_with_slo_aware_only(policy, decision, conditional):
    config = RouterConfig(load_balance_policy=policy, disagg_decision=decision)
    assert config.conditional is conditional
    d = inst("d", InstanceRole.DECODE)
    router = build_router(config, lambda role: {InstanceRole.DECODE: [d]}.get(role, []),
                          lambda n: 0, no_work, PrefixIndex())
    assert (router.unavailable_reason() is None) is conditional
    with pytest.raises(ValueError, match="disagg_decision"):
        RouterConfig(disagg_decision="SOMETIMES")


def test_conditional_router_with_mix_instances_only_routes_to_mix():
    m = inst("m", InstanceRole.MIX)
    router = build_router(RouterConfig(disagg_decision="CONDITIONAL"),
                          lambda role: {InstanceRole.MIX: [m]}.get(role, []), lambda n: 0,
                          no_work, PrefixIndex())
    assert router.route(req(4)).path is Path.MIX


# ---------------------------------------------------------------- the backend, DECODE path
D1 = inst("d", InstanceRole.DECODE, addr="10.0.0.2:1")
D2 = inst("d2", InstanceRole.DECODE, addr="10.0.0.3:1")
P1 = inst("p", InstanceRole.PREFILL, addr="10.0.0.1:1")


def cond_backend(decodes=(D1,)) -> tuple[ServiceBackend, FakeEngines]:
    engines = FakeEngines()
    subs = SubRequests()
    roles = {InstanceRole.PREFILL: [P1], InstanceRole.DECODE: list(decodes)}
    config = RouterConfig(load_balance_policy="LEAST_LOAD", disagg_decision="CONDITIONAL",
                          local_prefill_max_tokens=4)
    router = build_router(config, lambda role: roles.get(role, []), subs.inflight, subs.work,
                          PrefixIndex())
    return ServiceBackend(None, "tiny", 2048, router, engines, "127.0.0.1:0", subs=subs), engines


async def started(b, engines, prompt, n=1):
    before = len(engines.sent)
    stream = b.generate(GenerateRequest("cmpl-1", prompt, SamplingParams(max_tokens=8, n=n), stream=True))
    first = asyncio.ensure_future(anext(stream))
    for _ in range(100):
        if len(engines.sent) == before + n or first.done():
            break
        await asyncio.sleep(0)
    return stream, first


async def close(stream, first) -> None:
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await stream.aclose()


async def test_both_paths_are_counted_logged_and_relayed(caplog):
    b, engines = cond_backend()
    caplog.set_level(logging.INFO, logger="xllm_service.backend")
    stream, first = await started(b, engines, [5, 6, 7])
    (rid,) = engines.sent
    sub = b.subs.get(rid)
    assert sub.route.path is Path.DECODE and sub.route.instance_names == ("d",)
    assert sub.spec.prefill_name == "" and sub.spec.decode_name == ""
    assert b.metrics.pd_decisions == {"decode": 1}
    assert f"request {rid}: 3 prompt tokens, path decode on d (3 uncached prompt tokens " \
           f"on d <= 4)" in caplog.text
    await feed(b, gen(rid, [1]))  # a decode serving it whole: no prefill token to wait for
    assert await take(first) == [1]
    await feed(b, gen(rid, [2], finished=True))
    assert (await asyncio.wait_for(anext(stream), 1)).finished
    await stream.aclose()
    stream, first = await started(b, engines, [5, 6, 7, 8, 9])
    assert b.subs.get(engines.sent[-1]).route.path is Path.PD
    assert b.metrics.pd_decisions == {"decode": 1, "pd": 1}
    text = b.metrics_text()
    assert 'xllm_service_pd_decisions_total{path="decode"} 1.0' in text
    assert 'xllm_service_pd_decisions_total{path="pd"} 1.0' in text
    await close(stream, first)


async def test_n_is_split_on_the_decode_path():
    b, engines = cond_backend()
    stream, first = await started(b, engines, [5, 6], n=2)
    assert len(engines.sent) == 2
    assert all(b.subs.get(r).route.path is Path.DECODE for r in engines.sent)
    await close(stream, first)


async def test_a_request_prefilled_on_a_decode_migrates_to_another_decode():
    b, engines = cond_backend(decodes=(D1, D2))
    stream, first = await started(b, engines, [5, 6, 7])
    (rid,) = engines.sent
    dead = b.subs.get(rid).route.target
    await feed(b, gen(rid, [1]))
    assert await take(first) == [1]
    b.on_evict(dead)
    await asyncio.gather(*b._tasks)
    (addr, item), = engines.migrated
    other = D2 if dead is D1 else D1
    assert addr == other.meta.rpc_address and list(item.generated_token_ids) == [1]
    assert item.request.routing.decode_name == "" and not item.HasField("kv")
    new_id = item.request.service_req_id
    assert b.subs.get(new_id).route.path is Path.DECODE
    assert b.metrics.migrations == {"ok": 1}
    await feed(b, gen(new_id, [2, 3], finished=True))
    last = await asyncio.wait_for(anext(stream), 1)
    assert last.finished and last.outputs[0].token_ids == [2, 3]
    reply = await b.on_generations(pb.DisaggStreamGenerations(gens=[gen(rid, [9])]))
    assert [s.ok for s in reply.all_status] == [False]


def test_measured_latencies_correct_the_predictions_per_instance():
    p, d = inst("p", InstanceRole.PREFILL), inst("d", InstanceRole.DECODE)
    pred = SloPredictor(RouterConfig(pd_overhead_ms=0), no_work, clock=lambda: 0.0)
    first = pred.predict(Route(p, d), 100, 100, 10)
    assert first.route.predicted == (first.ttft_ms, first.tpot_ms) == (pytest.approx(11), 3)
    pred.observe(first.route, 500.0, None)  # the pair's first hand-over: links set up
    assert pred.scale("p", "ttft") == 1.0
    pred.observe(first.route, 55.0, 6.0)  # a machine 5x / 2x slower than the profile
    again = pred.predict(Route(p, d), 100, 100, 10)
    assert (again.ttft_ms, again.tpot_ms) == (pytest.approx(55), pytest.approx(6))
    # the TTFT scale is the prefill's, the TPOT scale the decode's
    local = pred.predict(Route(d, on_decode=True), 100, 100, 10)
    assert local.ttft_ms == pytest.approx(1 + 10 + 0)  # prefill-only step: d unscaled
    assert local.tpot_ms == pytest.approx(2 * (3 + 0.1 * 100 / 5))
    pred.observe(again.route, 11.0, None)  # back to the profile: the average moves 20%
    assert pred.scale("p", "ttft") == pytest.approx(5 + 0.2 * (1 - 5))
    assert pred.scale("d", "tpot") == pytest.approx(2)


def test_a_ttft_after_a_wait_in_a_prefill_queue_corrects_nothing():
    """The wait in a prefill's queue is set by its deadline order and later arrivals (a
    late prompt waits for all that can still make it), not by the instance's speed."""
    p, d = inst("p", InstanceRole.PREFILL), inst("d", InstanceRole.DECODE)
    work = {"p": prefill_queue(1000)}
    pred = SloPredictor(RouterConfig(pd_overhead_ms=0), lambda n: work.get(n, InstanceWork()))
    queued = pred.predict(Route(p, d), 100, 100, 10)
    assert not queued.route.corrects_ttft
    pred.observe(queued.route, 50_000.0, 6.0)
    assert pred.scale("p", "ttft") == 1.0 and pred.scale("d", "tpot") == pytest.approx(2)
    work.clear()
    assert pred.predict(Route(p, d), 100, 100, 10).route.corrects_ttft


def test_a_ttft_after_prompts_queued_on_the_decode_corrects_nothing():
    """A prompt sent to a decode computing a long one waits for it: a scale taught by that
    wait would predict every later short prompt there late, none would go there again,
    and nothing would correct it back (seen in a benchmark run: 213 of 214 short prompts
    went to the prefill)."""
    d = inst("d", InstanceRole.DECODE)
    work = {"d": InstanceWork(pending_prefill_tokens=1500, pending_prefill_pairs=0)}
    pred = SloPredictor(RouterConfig(), lambda n: work.get(n, InstanceWork()))
    behind = pred.predict(Route(d, on_decode=True), 100, 100, 10)
    assert not behind.route.corrects_ttft
    pred.observe(behind.route, 50_000.0, None)
    assert pred.scale("d", "ttft") == 1.0
    work.clear()
    alone = pred.predict(Route(d, on_decode=True), 100, 100, 10)
    assert alone.route.corrects_ttft
    pred.observe(alone.route, 2 * alone.ttft_ms, None)
    assert pred.scale("d", "ttft") == pytest.approx(2)


def test_the_pd_overhead_is_added_after_the_correction_and_left_out_of_it():
    p, d = inst("p", InstanceRole.PREFILL), inst("d", InstanceRole.DECODE)
    pred = SloPredictor(RouterConfig(pd_overhead_ms=20), no_work)
    first = pred.predict(Route(p, d), 100, 100, 10)
    assert first.ttft_ms == pytest.approx(11 + 20)
    pred.observe(first.route, 500.0, None)  # (the pair's first hand-over corrects nothing)
    pred.observe(first.route, 20 + 22.0, None)  # the prefill ran 2x slower; same overhead
    assert pred.scale("p", "ttft") == pytest.approx(2)
    assert pred.predict(Route(p, d), 100, 100, 10).ttft_ms == pytest.approx(2 * 11 + 20)


async def measured(*outputs: list[int]) -> list[tuple]:
    """(path, TTFT, TPOT) the backend reports of a request whose engine sends `outputs`
    (the last one finishes it), each relayed to the client before the next."""
    b, engines = cond_backend()
    seen = []
    b.router.observe = lambda route, ttft, tpot: seen.append((route.path, ttft, tpot))
    stream, first = await started(b, engines, [5, 6, 7])
    (rid,) = engines.sent
    await feed(b, gen(rid, outputs[0]))
    await take(first)
    for i, tokens in enumerate(outputs[1:], 2):
        await feed(b, gen(rid, tokens, finished=i == len(outputs)))
        await asyncio.wait_for(anext(stream), 1)
    return seen


async def test_the_backend_reports_what_a_request_measured():
    # (the pace is timed from the second output on)
    (path, ttft, tpot), = await measured([1], [2], list(range(3, 3 + MIN_PACED_TOKENS)))
    assert path is Path.DECODE and ttft >= 0 and tpot >= 0


async def test_a_short_stream_corrects_no_tpot():
    """A few tokens come in one or two reports: their spacing is no pace."""
    (_, ttft, tpot), = await measured([1], [2, 3, 4])
    assert ttft >= 0 and tpot is None


def test_a_scale_fades_back_to_one_while_nothing_measures_it():
    """A flood the prediction did not count teaches a high scale; with no stream sent
    there any more, only time can take it back."""
    p, d = inst("p", InstanceRole.PREFILL), inst("d", InstanceRole.DECODE)
    now = [0.0]
    pred = SloPredictor(RouterConfig(pd_overhead_ms=0), no_work, clock=lambda: now[0])
    first = pred.predict(Route(p, d), 100, 100, 10)
    pred.observe(first.route, None, 9 * first.tpot_ms)
    assert pred.scale("d", "tpot") == pytest.approx(9)
    now[0] = SCALE_HALF_LIFE_S
    assert pred.scale("d", "tpot") == pytest.approx(5)
    scaled = pred.predict(Route(p, d), 100, 100, 10)
    assert scaled.tpot_ms == pytest.approx(5 * first.tpot_ms)
    # measured as predicted then: the raw profile held (the scale the prediction used)
    pred.observe(scaled.route, None, scaled.tpot_ms)
    assert pred.scale("d", "tpot") == pytest.approx(5 + 0.2 * (5 - 5))
    now[0] = 10 * SCALE_HALF_LIFE_S
    assert pred.scale("d", "tpot") == pytest.approx(1, abs=0.01)


def test_a_measure_under_the_prediction_floors_the_scale():
    """An instance is not faster than the profile it measured of itself: a stream that
    ran quicker than predicted met fewer neighbours than the prediction counted."""
    p, d = inst("p", InstanceRole.PREFILL), inst("d", InstanceRole.DECODE)
    pred = SloPredictor(RouterConfig(pd_overhead_ms=0), no_work)
    first = pred.predict(Route(p, d), 100, 100, 10)
    for _ in range(30):
        pred.observe(first.route, None, 0.0)
    assert pred.scale("d", "tpot") == pytest.approx(SCALE_MIN)


def test_a_decode_whose_tpot_guard_binds_takes_a_long_prompt_only_within_its_hold_limit():
    """The guard keeps the decode's streams at its target G and gives a prompt the time
    they save under it (1 - step / G); a prompt it would hold past its hold limit goes
    anyway, at the unguarded pace, and stalls the streams as predicted without it."""
    p = inst("p", InstanceRole.PREFILL)
    guarded = {**PROFILE, "prompt_tpot_target_ms": 8.0, "prompt_hold_max_ms": 1000.0}
    d = inst("d", InstanceRole.DECODE, guarded, running=4)
    work = {"p": prefill_queue(9000)}  # the PD pair: TTFT ~910 ms + the overhead
    r = slo_router(work, local_prefill_max_tokens=0, ttft_slo_ms=800, tpot_slo_ms=9)
    # 5 streams: a step 7 ms; the prompt beside them unguarded: 2.8 ms more (9.8 > 8):
    # guarded, 1 - 7/8 of the time, its 90 ms of compute take 720 ms, the streams keep 8
    route = r.route(req(900, max_tokens=64), [p], [d])
    assert route.path is Path.DECODE and "prefill behind" in route.reason
    assert route.predicted == (pytest.approx(90 / (1 - 7 / 8)), pytest.approx(8.0))
    # held 500 ms at most: it goes then, unguarded (TPOT 9.8 > 9): the PD pair misses less
    d = inst("d", InstanceRole.DECODE, {**guarded, "prompt_hold_max_ms": 500.0}, running=4)
    route = r.route(req(900, max_tokens=64), [p], [d])
    assert route.path is Path.PD and "no candidate meets" in route.reason
    # without a guard: 9.8 ms a token > 9: the PD pair too
    d = inst("d", InstanceRole.DECODE, PROFILE, running=4)
    assert r.route(req(900, max_tokens=64), [p], [d]).path is Path.PD
