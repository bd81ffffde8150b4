"""Router and load-balance policies over a hand-built instance table."""
from __future__ import annotations

import pytest

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole
from xllm_service.instance_table import InstanceInfo, InstanceState, LoadInfo
from xllm_service.router import (LeastLoadPolicy, NoInstanceError, RoundRobinPolicy, Router,
                                 make_policy)


def info(name: str, role: InstanceRole, waiting: int = 0, kv: float = 0.0) -> InstanceInfo:
    return InstanceInfo(InstanceMeta(name=name, type=role), InstanceState.ACTIVE, 0.0,
                        load=LoadInfo(waiting=waiting, kv_usage=kv))


def table(*infos: InstanceInfo):
    return lambda role: [i for i in infos if i.role == role]


def test_round_robin_cycles_in_name_order():
    rr = RoundRobinPolicy()
    cands = [info("b", InstanceRole.MIX), info("a", InstanceRole.MIX), info("c", InstanceRole.MIX)]
    assert [rr.select(cands).name for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_load_counts_inflight_then_heartbeat_load():
    inflight = {"a": 3, "b": 0, "c": 0}
    ll = LeastLoadPolicy(lambda n: inflight[n])
    cands = [info("a", InstanceRole.MIX), info("b", InstanceRole.MIX, waiting=2),
             info("c", InstanceRole.MIX, kv=0.9)]
    assert ll.select(cands).name == "b"  # b: 0 + 2 waiting < a: 3 in flight < c: 4 * 0.9
    inflight["b"] = 5
    assert ll.select(cands).name == "a"  # a: 3 < c: 3.6 < b: 7


def test_pd_pair_preferred_then_mix():
    r = Router(table(info("p", InstanceRole.PREFILL), info("d", InstanceRole.DECODE),
                     info("m", InstanceRole.MIX)), RoundRobinPolicy())
    route = r.route()
    assert route.is_pd and (route.target.name, route.decode.name) == ("p", "d")
    assert route.instance_names == ("p", "d")
    assert r.route(exclude=["p"]).target.name == "m"


@pytest.mark.parametrize("roles,message", [
    ((), "no engine instance is registered"),
    ((InstanceRole.PREFILL,), "no decode instance"),
    ((InstanceRole.DECODE,), "no prefill instance"),
])
def test_no_instance_messages(roles, message):
    r = Router(table(*(info(f"i{k}", role) for k, role in enumerate(roles))), RoundRobinPolicy())
    with pytest.raises(NoInstanceError, match=message):
        r.route()
    assert message in r.unavailable_reason()


def test_readiness_probe_does_not_advance_round_robin():
    r = Router(table(info("a", InstanceRole.MIX), info("b", InstanceRole.MIX)), RoundRobinPolicy())
    assert r.route().target.name == "a"
    for _ in range(3):
        assert r.unavailable_reason() is None
    assert r.route().target.name == "b"


def test_make_policy_rejects_unknown():
    assert make_policy("rr", lambda n: 0).name == "RR"
    assert make_policy("LEAST_LOAD", lambda n: 0).name == "LEAST_LOAD"
    with pytest.raises(ValueError, match="unknown load balance policy"):
        make_policy("random", lambda n: 0)
