"""The prefill queue's deadline order (xllm_py/engine/pd/prefill_order.py)."""
from __future__ import annotations

import math

import pytest

from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.engine.pd.prefill_order import PrefillCostModel, Queued, pick

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
