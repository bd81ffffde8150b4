"""The prefill queue's deadline order (xllm_py/cluster/prefill_order.py)."""
from __future__ import annotations

import math

import pytest

from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.cluster.prefill_order import PrefillCostModel, Queued, pick

INF = math.inf


def test_all_on_time_is_earliest_deadline_first():
    q = [Queued(10.0, 1.0), Queued(5.0, 1.0), Queued(7.0, 1.0)]
    assert pick(q, now_s=0.0, ahead_s=0.0) == 1


def test_a_late_request_yields_to_one_that_can_still_make_it():
    # the oldest cannot finish by its deadline any more (0 + 2 + 3 > 4): the next goes first
    q = [Queued(4.0, 3.0), Queued(6.0, 3.0)]
    assert pick(q, now_s=0.0, ahead_s=2.0) == 1
    # nothing ahead: both fit, the earliest deadline goes
    assert pick(q, now_s=0.0, ahead_s=0.0) == 0


def test_nobody_on_time_or_no_targets_is_arrival_order():
    assert pick([Queued(1.0, 5.0), Queued(2.0, 5.0)], now_s=0.0, ahead_s=0.0) == 0
    assert pick([Queued(INF, 1.0), Queued(INF, 0.1)], now_s=0.0, ahead_s=0.0) == 0
    # a request with a target it can meet goes before those without one
    assert pick([Queued(INF, 1.0), Queued(3.0, 1.0)], now_s=0.0, ahead_s=0.0) == 1


def test_cost_model_predicts_from_the_profile_and_learns_the_machine():
    profile = LatencyProfile(prefill_base_ms=0.0, prefill_ms_per_token=1.0, decode_base_ms=5.0,
                             decode_ms_per_seq=0.5, decode_ms_per_ctx_token=0.0,
                             prefill_ms_per_kpair=0.0)
    model = PrefillCostModel(profile)
    assert model.predict_s(1000) == pytest.approx(1.0)
    for _ in range(50):  # the machine runs at half the profile's speed
        model.observe(1000, 2.0)
    assert model.predict_s(500) == pytest.approx(1.0, rel=0.01)
    model.observe(1000, 0.0)  # nonsense is ignored
    assert model.predict_s(500) == pytest.approx(1.0, rel=0.01)


def test_a_short_prompt_goes_ahead_of_a_long_one_with_time_to_spare():
    long_, short = Queued(10.0, 3.0), Queued(12.0, 0.1)
    assert pick([long_, short], now_s=0.0, ahead_s=0.0) == 1
    # ... not when the long one would then miss: it is due just after its own prefill
    assert pick([Queued(3.05, 3.0), short], now_s=0.0, ahead_s=0.0) == 0


def test_the_longest_request_yields_when_not_all_can_make_it():
    # each fits alone; in deadline order the 3 s one leaves no room for the next two:
    # dropping it keeps two on time (earliest deadline first would keep one)
    q = [Queued(3.5, 3.0), Queued(3.6, 1.0), Queued(3.7, 1.0)]
    assert pick(q, now_s=0.0, ahead_s=0.0) == 1


def test_finish_time_counts_the_prompt_under_way_and_skips_late_ones():
    from xllm_py.cluster.prefill_order import finish_s
    late, due = Queued(0.05, 0.5), Queued(0.9, 0.2)
    # `due` is under way (it can still make it), then the new one; `late` goes last
    assert finish_s([late, due, Queued(1.0, 0.02)], 2, now_s=0.0) == pytest.approx(0.22)
    # without a target the new one waits for all
    assert finish_s([late, due, Queued(INF, 0.02)], 2, now_s=0.0) == pytest.approx(0.72)
    # alone: its own prefill
    assert finish_s([Queued(INF, 0.3)], 0, now_s=5.0) == pytest.approx(5.3)
    # a long queue is bounded: the picks past max_picks are summed
    many = [Queued(INF, 0.01)] * 100 + [Queued(INF, 1.0)]
    assert finish_s(many, 100, now_s=0.0, max_picks=10) == pytest.approx(2.0)
