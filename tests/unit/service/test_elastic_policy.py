"""ElasticPolicy (xllm_service/elastic_policy.py) on a fake clock: initial assignment,
hysteresis, dwell, cold start, the one-of-each floor, and what it never moves."""
from __future__ import annotations

import dataclasses
import math

from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.config import InstanceRole
from xllm_service.config import ElasticConfig
from xllm_service.elastic_policy import Demand, ElasticPolicy, InstanceView, predict

P, D, M = InstanceRole.PREFILL, InstanceRole.DECODE, InstanceRole.MIX
PROFILE = LatencyProfile(prefill_base_ms=5.0, prefill_ms_per_token=0.1, decode_base_ms=10.0,
                         decode_ms_per_seq=0.5, decode_ms_per_ctx_token=0.001)
TARGETS = (500.0, 50.0)
CONFIG = ElasticConfig(hold_s=5.0, min_dwell_s=30.0, warmup_s=5.0, min_samples=20, margin=0.05)
# long prompts, short answers: 2 prefills saturate (rho 0.84), 3 do not
PREFILL_HEAVY = Demand(rate=8.0, prompt_tokens=2048, output_tokens=16, samples=80)
# short prompts, long answers: 1 decode cannot keep up, 2 can
DECODE_HEAVY = Demand(rate=2.0, prompt_tokens=64, output_tokens=512, samples=40)


def view(name: str, role: InstanceRole, **kw) -> InstanceView:
    kw.setdefault("profile", PROFILE)
    kw.setdefault("elastic", True)
    return InstanceView(name, role, **kw)


def fleet(*roles: InstanceRole, **kw) -> list[InstanceView]:
    return [view(f"i{k}", r, **kw) for k, r in enumerate(roles)]


def run(policy: ElasticPolicy, views, demand, t0: float, t1: float, step: float = 1.0):
    """Rounds from t0 to t1; the flips of the first round that made any, and when."""
    t = t0
    while t <= t1:  # (prompts on prefills only: the service's ALWAYS disaggregation)
        flips = policy.decide(t, views, demand, TARGETS, decodes_prefill=False)
        if flips:
            return t, flips
        t += step
    return None, []


def test_prediction_follows_the_bottleneck():
    two = predict(2, 2, [PROFILE], PREFILL_HEAVY, 0, 0, TARGETS, decodes_prefill=False)
    three = predict(3, 1, [PROFILE], PREFILL_HEAVY, 0, 0, TARGETS, decodes_prefill=False)
    assert two.ttft_ms > TARGETS[0] > three.ttft_ms
    assert three.attainment > two.attainment
    # decodes with TPOT headroom compute prompts too (conditional disaggregation)
    shared = predict(2, 2, [PROFILE], PREFILL_HEAVY, 0, 0, TARGETS)
    assert shared.ttft_ms < TARGETS[0] and shared.attainment == 1.0
    # prompts queued now wait their turn
    queued = predict(3, 1, [PROFILE], PREFILL_HEAVY, 12, 0, TARGETS, decodes_prefill=False)
    assert queued.ttft_ms > three.ttft_ms + 800
    one_p = predict(1, 3, [PROFILE], DECODE_HEAVY, 0, 0, TARGETS)
    three_p = predict(3, 1, [PROFILE], DECODE_HEAVY, 0, 0, TARGETS)
    assert one_p.tpot_ms < three_p.tpot_ms and one_p.attainment > three_p.attainment
    assert predict(0, 4, [PROFILE], DECODE_HEAVY, 0, 0, TARGETS).attainment == 0.0


def test_unassigned_instances_are_split_at_once_and_unprofiled_ones_never():
    views = fleet(M, M, M, M) + [view("bare", M, profile=None)]
    flips = ElasticPolicy(CONFIG).decide(0.0, views, Demand(), TARGETS)
    assert sorted((f.name, f.new) for f in flips) == [("i0", P), ("i1", P), ("i2", D), ("i3", D)]
    assert all(f.current is None and f.split == (2, 2) for f in flips)


def test_a_sustained_gain_flips_after_hold_and_a_short_burst_does_not():
    views = fleet(P, P, D, D)
    policy = ElasticPolicy(CONFIG, started_s=0.0)
    when, flips = run(policy, views, PREFILL_HEAVY, 10.0, 30.0)
    assert when == 15.0  # first seen at 10, held for hold_s
    assert [(f.name, f.direction) for f in flips] == [("i2", "decode_to_prefill")]
    assert flips[0].predicted.attainment > flips[0].current.attainment * (1 + CONFIG.margin)
    policy = ElasticPolicy(CONFIG, started_s=0.0)
    assert run(policy, views, PREFILL_HEAVY, 10.0, 13.0)[1] == []  # a 4 s burst
    assert run(policy, views, Demand(), 14.0, 14.0)[1] == []        # it ended: reset
    assert run(policy, views, PREFILL_HEAVY, 15.0, 18.0)[1] == []   # seen anew


def test_decode_heavy_load_flips_a_prefill_to_decode():
    views = fleet(P, P, P, D)
    _, flips = run(ElasticPolicy(CONFIG), views, DECODE_HEAVY, 10.0, 30.0)
    assert [f.direction for f in flips] == ["prefill_to_decode"]  # 2P2D meets the targets
    assert flips[0].split == (2, 2) and flips[0].predicted.attainment == 1.0


def test_cold_start_and_few_samples_do_not_flip():
    views = fleet(P, P, D, D)
    assert run(ElasticPolicy(CONFIG, started_s=8.0), views, PREFILL_HEAVY, 8.0, 12.0)[1] == []
    few = dataclasses.replace(PREFILL_HEAVY, samples=CONFIG.min_samples - 1)
    assert run(ElasticPolicy(CONFIG), views, few, 10.0, 40.0)[1] == []
    young = fleet(P, P, D, D, age_s=1.0)
    assert run(ElasticPolicy(CONFIG), young, PREFILL_HEAVY, 10.0, 40.0)[1] == []


def test_dwell_pins_fixed_and_pending_instances_are_not_moved():
    views = [view("i0", P), view("i1", P), view("i2", D, last_flip_s=20.0), view("i3", D)]
    _, flips = run(ElasticPolicy(CONFIG), views, PREFILL_HEAVY, 10.0, 30.0)
    assert [f.name for f in flips] == ["i3"]
    for blocked in (dict(pinned=True), dict(elastic=False), dict(pending=True),
                    dict(profile=None)):
        views = [view("i0", P), view("i1", P), view("i2", D, **blocked),
                 view("i3", D, **blocked)]
        assert run(ElasticPolicy(CONFIG), views, PREFILL_HEAVY, 10.0, 60.0)[1] == []


def test_never_below_one_prefill_and_one_decode():
    views = fleet(P, D)
    assert run(ElasticPolicy(CONFIG), views, PREFILL_HEAVY, 10.0, 60.0)[1] == []
    assert run(ElasticPolicy(CONFIG), views, DECODE_HEAVY, 10.0, 60.0)[1] == []
    # a fixed decode counts as the decode: the elastic one may turn prefill
    views = [view("e", D), view("p", P, elastic=False), view("d", D, elastic=False)]
    _, flips = run(ElasticPolicy(CONFIG), views, PREFILL_HEAVY, 10.0, 60.0)
    assert [(f.name, f.new) for f in flips] == [("e", P)]


def converge(policy: ElasticPolicy, views: list[InstanceView], demands, t0: float,
             t1: float) -> tuple[list[InstanceView], list[tuple[float, int]]]:
    """Rounds each second from t0 to t1 (the demand of round k: demands[k % len]), every
    flip acknowledged at once; the views at the end and (time, flips) of each round
    that flipped."""
    moves, t, k = [], t0, 0
    while t <= t1:
        flips = policy.decide(t, views, demands[k % len(demands)], TARGETS,
                              decodes_prefill=False)
        new = {f.name: f.new for f in flips}
        views = [dataclasses.replace(v, role=new[v.name], last_flip_s=t) if v.name in new
                 else v for v in views]
        if flips:
            moves.append((t, len(flips)))
        t, k = t + 1.0, k + 1
    return views, moves


def split_of(views) -> tuple[int, int]:
    return sum(v.role is P for v in views), sum(v.role is D for v in views)


def test_the_split_follows_the_demand_in_bounded_steps_and_then_holds():
    config = dataclasses.replace(CONFIG, max_step=2, min_dwell_s=10.0)
    prefill_heavy = Demand(rate=30.0, prompt_tokens=2048, output_tokens=16, samples=300)
    decode_heavy = Demand(rate=14.0, prompt_tokens=64, output_tokens=512, samples=140)
    ends = {}
    for name, demand in (("prefill", prefill_heavy), ("decode", decode_heavy)):
        policy = ElasticPolicy(config)
        views, moves = converge(policy, fleet(*[P] * 6, *[D] * 6), [demand], 10.0, 120.0)
        prefills, decodes = split_of(views)
        ends[name] = prefills
        # the split it reached keeps the load, and it is the nearest such split
        now = predict(prefills, decodes, [PROFILE], demand, 0, 0, TARGETS, False)
        assert now.load <= 1.0
        between = range(6, prefills) if prefills > 6 else range(prefills + 1, 7)
        assert all(predict(p, 12 - p, [PROFILE], demand, 0, 0, TARGETS, False).load > 1.0
                   for p in between)
        # held once (hold_s over the load), then up to max_step a round, each round
        load = predict(6, 6, [PROFILE], demand, 0, 0, TARGETS, False).load
        assert load > 1.0 and moves[0][0] == 10.0 + math.ceil(config.hold_s / load)
        assert all(n <= config.max_step for _, n in moves)
        assert [t for t, _ in moves] == [moves[0][0] + i for i in range(len(moves))]
        # a stable load, its rate jittering by 8%: no flip at all
        jitter = [dataclasses.replace(demand, rate=demand.rate * f) for f in (0.92, 1.08)]
        assert converge(policy, views, jitter, 121.0, 400.0)[1] == []
    assert ends["prefill"] >= 9 > 3 >= ends["decode"]


def test_a_split_that_keeps_the_load_is_not_moved_for_a_better_one():
    # 4P4D keeps a light prefill-heavy load; 6P2D would be less loaded still
    light = Demand(rate=10.0, prompt_tokens=2048, output_tokens=16, samples=100)
    assert predict(4, 4, [PROFILE], light, 0, 0, TARGETS, False).load <= 1.0
    assert (predict(6, 2, [PROFILE], light, 0, 0, TARGETS, False).load
            < predict(4, 4, [PROFILE], light, 0, 0, TARGETS, False).load)
    views = fleet(P, P, P, P, D, D, D, D)
    assert run(ElasticPolicy(CONFIG), views, light, 10.0, 100.0)[1] == []


def test_an_impossible_load_moves_toward_the_least_loaded_split():
    # more prefill work than the whole fleet serves: as many prefills as it may have
    flood = Demand(rate=200.0, prompt_tokens=2048, output_tokens=16, samples=2000)
    views, _ = converge(ElasticPolicy(CONFIG), fleet(P, P, D, D), [flood], 10.0, 60.0)
    assert split_of(views) == (3, 1)


def test_a_rising_load_is_sized_from_the_recent_part_of_the_window():
    # the window still holds the prefill-heavy load; its last part is decode-heavy
    mixed = dataclasses.replace(PREFILL_HEAVY, recent=dataclasses.replace(DECODE_HEAVY, rate=5.0))
    alone = predict(3, 1, [PROFILE], PREFILL_HEAVY, 0, 0, TARGETS, False)
    both = predict(3, 1, [PROFILE], mixed, 0, 0, TARGETS, False)
    assert alone.load <= 1.0 < both.load
    # the spread of prompt lengths costs attention on top of the mean's
    profile = dataclasses.replace(PROFILE, prefill_ms_per_kpair=0.5)
    spread = dataclasses.replace(PREFILL_HEAVY, prompt_sq_tokens=2 * 2048 ** 2)
    assert (predict(3, 1, [profile], spread, 0, 0, TARGETS, False).load
            > predict(3, 1, [profile], PREFILL_HEAVY, 0, 0, TARGETS, False).load)


def test_measured_times_correct_the_profiles():
    # a decode measured twice as slow as its profile holds half the streams: the same
    # demand needs more decodes
    demand = Demand(rate=7.0, prompt_tokens=64, output_tokens=512, samples=70)
    fast, _ = converge(ElasticPolicy(CONFIG), fleet(*[P] * 4, *[D] * 4), [demand], 10.0, 60.0)
    slow, _ = converge(ElasticPolicy(CONFIG), fleet(*[P] * 4, *[D] * 4, tpot_scale=2.0),
                       [demand], 10.0, 60.0)
    assert split_of(fast)[1] < split_of(slow)[1]
    # a correction is bounded: one slow request does not resize the fleet
    assert view("x", D, tpot_scale=1000.0).corrected.decode_base_ms == 3 * PROFILE.decode_base_ms


def test_each_side_keeps_a_reserve_share_of_the_fleet():
    # a prefill flood on 8 instances: as many prefills as the reserve of 2 decodes allows
    flood = Demand(rate=200.0, prompt_tokens=2048, output_tokens=16, samples=2000)
    views, _ = converge(ElasticPolicy(CONFIG), fleet(*[P] * 4, *[D] * 4), [flood], 10.0, 60.0)
    assert split_of(views) == (6, 2)
    # fixed decodes that leave no room for the reserve: the elastic ones may still move
    views = [view("e", D), view("p", P, elastic=False)] + [
        view(f"d{i}", D, elastic=False) for i in range(6)]
    _, flips = run(ElasticPolicy(CONFIG), views, flood, 10.0, 60.0)
    assert [(f.name, f.new) for f in flips] == [("e", P)]


def test_decodes_serve_only_the_prompts_the_router_gives_them():
    """The decodes' spare time counts as prompt servers for the short prompts' share of
    the work (those within the router's local_prefill_max_tokens), no more."""
    long_only = dataclasses.replace(PREFILL_HEAVY, local_share=0.0)
    alone = predict(2, 2, [PROFILE], PREFILL_HEAVY, 0, 0, TARGETS, decodes_prefill=False)
    assert predict(2, 2, [PROFILE], long_only, 0, 0, TARGETS) == alone
    shared = predict(2, 2, [PROFILE], PREFILL_HEAVY, 0, 0, TARGETS)
    some = predict(2, 2, [PROFILE], dataclasses.replace(PREFILL_HEAVY, local_share=0.2), 0, 0,
                   TARGETS)
    # 2 prefills and 0.5 decode servers: a fifth of the work on the decodes
    assert shared.load < some.load < alone.load
    assert math.isclose(some.load, alone.load * 2 / 2.5)
