"""RoleAssigner (xllm_service/elastic.py) over an in-memory etcd: only the master writes,
a new master continues from the stored epochs and pins, an unacknowledged assignment is
not decided again, the demand window and the metrics."""
from __future__ import annotations

import asyncio
import dataclasses

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.cluster.role_assignment import RoleAssignment, role_key
from xllm_py.config import InstanceRole
from xllm_service.config import ElasticConfig
from xllm_service.elastic import RECENT_SAMPLES, DemandWindow, ElasticMetrics, RoleAssigner
from xllm_service.elastic_policy import ElasticPolicy, predict
from xllm_service.instance_table import InstanceInfo, InstanceState

P, D, M = InstanceRole.PREFILL, InstanceRole.DECODE, InstanceRole.MIX
PROFILE = LatencyProfile(prefill_base_ms=5.0, prefill_ms_per_token=0.1, decode_base_ms=10.0,
                         decode_ms_per_seq=0.5, decode_ms_per_ctx_token=0.001)


@dataclasses.dataclass
class KV:
    key: str
    value: bytes


class MemoryEtcd:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.puts = 0

    async def get_prefix(self, prefix: str):
        return [KV(k, v) for k, v in sorted(self.data.items()) if k.startswith(prefix)], 0

    async def put(self, key: str, value: str) -> int:
        self.data[key] = value.encode()
        self.puts += 1
        return 0


def info(name: str, duty: str = "", epoch: int = 0, profile=PROFILE) -> InstanceInfo:
    meta = InstanceMeta(name=name, type=M, elastic=True, duty=duty, duty_epoch=epoch,
                        latency_profile=profile.to_dict() if profile else {})
    return InstanceInfo(meta, InstanceState.ACTIVE, 0.0, registered_s=-100.0)


def assigner(etcd, instances, master=lambda: True, clock=lambda: 0.0):
    return RoleAssigner(etcd, lambda: instances, master, DemandWindow(clock=clock),
                        lambda: (500.0, 50.0), ElasticPolicy(ElasticConfig()),
                        ElasticMetrics(), clock=clock)


def test_only_the_master_writes_and_assigns_the_unassigned():
    etcd = MemoryEtcd()
    fleet = [info("a"), info("b"), info("bare", profile=None)]
    follower = assigner(etcd, fleet, master=lambda: False)
    assert asyncio.run(follower.round()) == [] and etcd.puts == 0
    flips = asyncio.run(assigner(etcd, fleet).round())
    assert sorted(f.name for f in flips) == ["a", "b"]
    assert {k: RoleAssignment.from_json(v).role for k, v in etcd.data.items()} == {
        role_key("a"): P, role_key("b"): D}


def test_a_new_master_continues_from_stored_epochs_and_pins():
    etcd = MemoryEtcd()
    etcd.data[role_key("a")] = RoleAssignment(P, 7).to_json().encode()
    etcd.data[role_key("b")] = RoleAssignment(D, 3, pinned=True).to_json().encode()
    fleet = [info("a", "PREFILL", 7), info("b", "DECODE", 3), info("c")]
    a = assigner(etcd, fleet, clock=lambda: 50.0)
    flips = asyncio.run(a.round())
    assert [(f.name, f.new) for f in flips] == [("c", D)]  # 1P left as it was
    assert a.assignments["a"].epoch == 7 and a.assignments["b"].pinned
    assert a.last_flip_s["a"] == 50.0  # flips it did not see count as just made
    views = {v.name: v for v in a.views(51.0)}
    assert views["b"].pinned and views["c"].pending and views["c"].role is D
    assert asyncio.run(a.round()) == []  # c not acknowledged yet: nothing more


def test_the_next_epoch_is_above_what_the_instance_acknowledged():
    etcd = MemoryEtcd()  # (an assignment lost from etcd: the acknowledged epoch counts)
    a = assigner(etcd, [info("a", "PREFILL", 9), info("b")])
    asyncio.run(a.round())
    assert RoleAssignment.from_json(etcd.data[role_key("b")]).epoch == 1
    assert a._epoch("a") == 9


def test_demand_window_and_role_seconds():
    now = [0.0]
    window = DemandWindow(window_s=10.0, clock=lambda: now[0])
    for i in range(20):
        now[0] = i * 0.5
        window.add(100 + i, 16)
    d = window.snapshot()
    assert d.samples == 20 and d.rate == 2.0 and d.prompt_tokens == 109.5
    assert d.prompt_sq_tokens == sum((100 + i) ** 2 for i in range(20)) / 20
    # a load that rises: the last half window alone shows it (fewer than RECENT_SAMPLES)
    for i in range(16):
        now[0] = 10.0 + i / 8
        window.add(64, 512)
    d = window.snapshot()
    assert d.recent.samples < RECENT_SAMPLES
    assert d.recent.rate > 1.3 * d.rate > 0 and d.recent.output_tokens > d.output_tokens + 50
    now[0] = 30.0
    assert window.snapshot().samples == 0
    etcd, clock = MemoryEtcd(), [0.0]
    a = assigner(etcd, [info("a", "PREFILL", 1), info("b", "DECODE", 1)],
                 clock=lambda: clock[0])
    etcd.data[role_key("a")] = RoleAssignment(P, 1).to_json().encode()
    etcd.data[role_key("b")] = RoleAssignment(D, 1).to_json().encode()
    asyncio.run(a.round())
    clock[0] = 2.0
    asyncio.run(a.round())
    assert a.metrics.role_seconds == {"PREFILL": 2.0, "DECODE": 2.0}
    text = "".join(str(m) for m in a.metrics.collect())
    assert "xllm_service_role_flips" in text


def test_enough_recent_requests_are_the_demand_alone():
    """At a rate that gives RECENT_SAMPLES requests in under half the window, a turn of
    the load is the demand after RECENT_MIN_S, on both sides: the window's older requests
    neither hold the side the load left nor dilute the side it went to."""
    now = [0.0]
    window = DemandWindow(window_s=10.0, clock=lambda: now[0])
    for i in range(800):  # 8 s of long prompts with short answers, 100 a second
        now[0] = i / 100
        window.add(1024, 4)
    for i in range(120):  # then short prompts with long answers
        now[0] = 8.0 + i / 100
        window.add(64, 128)
    d = window.snapshot()
    assert d.recent is None and (d.prompt_tokens, d.output_tokens) == (64, 128)
    assert 95 <= d.rate <= 105 and d.samples >= RECENT_SAMPLES
    # 10 a second: the trailing span that holds RECENT_SAMPLES requests (3 s)
    window = DemandWindow(window_s=10.0, clock=lambda: now[0])
    for i in range(80):
        now[0] = 20.0 + i / 10
        window.add(256, 16)
    d = window.snapshot()
    assert d.recent is None and d.samples == RECENT_SAMPLES and 9 <= d.rate <= 11
    # 5 a second: fewer than RECENT_SAMPLES in half the window, the pair as before
    window = DemandWindow(window_s=10.0, clock=lambda: now[0])
    for i in range(50):
        now[0] = 40.0 + i / 5
        window.add(256, 16)
    d = window.snapshot()
    assert d.recent is not None and d.samples == 50 and d.recent.samples < RECENT_SAMPLES


def test_a_lull_in_the_recent_half_adds_no_demand():
    now = [0.0]
    window = DemandWindow(window_s=10.0, clock=lambda: now[0])
    for i in range(40):
        now[0] = i * 0.1
        window.add(64, 128)
    now[0] = 9.0    # nothing in the last 5 s, the whole window still holds them all
    d = dataclasses.replace(window.snapshot(), rate=20.0)
    assert d.samples == 40
    slow = dataclasses.replace(PROFILE, prefill_ms_per_token=0.8)
    without_recent = dataclasses.replace(d, recent=None)
    assert (predict(2, 2, [slow], d, 0, 0, (500.0, 50.0)).load
            == predict(2, 2, [slow], without_recent, 0, 0, (500.0, 50.0)).load)


def test_views_carry_the_routers_measured_correction():
    a = RoleAssigner(MemoryEtcd(), lambda: [info("a", "DECODE", 1)], lambda: True,
                     DemandWindow(), lambda: (500.0, 50.0), ElasticPolicy(ElasticConfig()),
                     ElasticMetrics(),
                     measured_scale=lambda name, what: 2.0 if what == "tpot" else 1.5)
    [v] = a.views(0.0)
    assert (v.ttft_scale, v.tpot_scale) == (1.5, 2.0)
    assert v.corrected.decode_base_ms == 2 * PROFILE.decode_base_ms


def test_the_window_measures_the_short_prompts_share():
    """Of the prompt tokens, the share in prompts within the router's local limit."""
    now = [0.0]
    window = DemandWindow(window_s=10.0, clock=lambda: now[0], local_prompt_max_tokens=256)
    for i in range(20):
        now[0] = i / 10
        window.add(1024 if i % 2 else 256, 16)
    assert window.snapshot().local_share == 256 / (256 + 1024)
    assert DemandWindow(window_s=10.0).snapshot().local_share == 1.0  # (no requests)
