"""The service's TTFT / TPOT targets: the request's, else the operator's
(--ttft-slo-ms / --tpot-slo-ms), else derived from the latency profiles of the instances
it routes over (xllm_service/pd_decision.py `SloRouter.stated`,
xllm_py/cluster/slo_defaults.py), and stated on /metrics."""
from __future__ import annotations

import pytest

from tests.unit.service.test_pd_decision import PROFILE, inst, no_work, req, slo_router
from xllm_py.cluster import slo_defaults
from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.config import InstanceRole
from xllm_service.config import RouterConfig
from xllm_service.metrics import ServiceMetrics
from xllm_service.pd_decision import build_router
from xllm_service.prefix_index import PrefixIndex


def test_slo_aware_targets_come_from_the_profiles_unless_stated():
    p = inst("p", InstanceRole.PREFILL, {**PROFILE, "max_model_len": 1024})
    d = inst("d", InstanceRole.DECODE)
    derived = (slo_defaults.ttft_target_ms([LatencyProfile.from_dict(p.meta.latency_profile)]),
               slo_defaults.tpot_target_ms([LatencyProfile.from_dict(PROFILE)]))
    assert derived == (pytest.approx(1.5 * (2 * 1 + 102.4)), pytest.approx(1.25 * 10))  # 1024 tokens in 2 chunks; 8 seqs
    r = slo_router({})  # no target given: the profiles'
    route = r.route(req(100), [p], [d])
    assert r.targets(req(100)) == derived
    assert f"(targets {derived[0]:.0f}/{derived[1]:.0f} ms)" in route.reason
    assert r.targets(req(100, tpot_slo_ms=7)) == (derived[0], 7)  # the request's own wins
    r = slo_router({}, tpot_slo_ms=30)  # the operator's wins over the derived one
    assert r.stated([p], [d]) == (derived[0], 30)
    assert r.stated([inst("p", InstanceRole.PREFILL, None)], [d]) == (0.0, 30)
    # the service states them on /metrics (over the instances registered now)
    config = RouterConfig()  # the defaults: SLO_AWARE, targets from the profiles
    router = build_router(config, lambda role: {InstanceRole.PREFILL: [p],
                                                InstanceRole.DECODE: [d]}.get(role, []),
                          lambda n: 0, no_work, PrefixIndex())
    text = ServiceMetrics(lambda: [], slo_targets=router.stated_targets).render()
    assert f'xllm_service_slo_target_ms{{target="tpot"}} {derived[1]}' in text
    assert 'xllm_service_slo_target_ms{target="ttft"}' in text
    least = build_router(RouterConfig(load_balance_policy="LEAST_LOAD"), lambda role: [],
                         lambda n: 0, no_work, PrefixIndex())
    assert "slo_target" not in ServiceMetrics(lambda: [], slo_targets=least.stated_targets).render()


def test_targets_stay_what_an_incarnation_measured_first():
    """An engine registers its profile again as its steps correct it: the predictions
    follow, the stated targets stay (rounds of one benchmark against one target); an
    instance that restarts (a new incarnation) states them anew."""
    p = inst("p", InstanceRole.PREFILL)
    d = inst("d", InstanceRole.DECODE)
    r = slo_router({})
    first = r.stated([p], [d])
    slower = {**PROFILE, "decode_base_ms": 9.0}
    d_corrected = inst("d", InstanceRole.DECODE, slower)
    assert r.stated([p], [d_corrected]) == first
    assert r.predictor.profile(d_corrected).decode_base_ms == 9.0  # (what routing uses)
    d_restarted = inst("d", InstanceRole.DECODE, slower)
    d_restarted.meta.incarnation_id = "i-d-2"
    assert r.stated([p], [d_restarted]) == (first[0], pytest.approx(first[1] + 1.25 * 7))
    d_none = inst("d", InstanceRole.DECODE, None)  # none registered: none stated
    assert r.stated([p], [d_none]) == (0.0, 0.0)
