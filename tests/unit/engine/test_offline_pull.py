"""OfflinePuller (a decode's side of the PD pull) against a real scheduler and fake peers:
it pulls only with room, says its free seats and KV tokens, picks prefills round robin,
counts pulls sent / answered / failed, and waits for what it was handed."""
from __future__ import annotations

import asyncio

from tests.unit.pd_fakes import FakePeers
from tests.unit.sched_utils import create_requests, create_scheduler
from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole
from xllm_py.engine.pd import offline_pull
from xllm_py.engine.pd.metrics import PDMetrics
from xllm_py.engine.pd.offline_pull import OfflinePuller
from xllm_py.engine.remote_kv import offline_room
from xllm_py.status import Status, StatusError


def _puller(sched, peers, arrivals=lambda: 0):
    async def prefills():
        return ["prefill:1", "prefill:2"]

    async def resolve(name):
        return InstanceMeta(name=name, type=InstanceRole.PREFILL, rpc_address="127.0.0.1:1")

    metrics = PDMetrics(lambda: 0)
    async def room():  # (the engine answers the connector's OfflineRoom this way)
        return offline_room(sched)

    return OfflinePuller(room, "decode:1", peers, prefills, resolve, metrics,
                         arrivals), metrics


def _count(metrics, name: str) -> float:
    return metrics.registry.get_sample_value(f"xllm_pd_{name}_total") or 0.0


async def test_pulls_with_its_free_seats_and_kv_round_robin():
    sched = create_scheduler(max_num_seqs=8)  # 64 usable blocks of 4 tokens
    for r in create_requests(3, 6):
        sched.add_request(r)
    sched.schedule()
    peers = FakePeers()
    puller, metrics = _puller(sched, peers)
    assert await puller.pull_once() == 0
    assert await puller.pull_once() == 0
    (first, pull), (second, _) = peers.pulls
    assert (first, second) == ("prefill:1", "prefill:2")
    assert pull.source_instance_name == "decode:1"
    assert pull.preferred_req_len == 5  # 8 seats, 3 taken
    assert pull.max_total_len == sched.kv.block_pool.num_free_blocks * 4
    assert (_count(metrics, "pulls_sent"), _count(metrics, "pulls_answered")) == (2, 2)


async def test_no_pull_without_room():
    sched = create_scheduler(max_num_seqs=2)
    for r in create_requests(2, 6):
        sched.add_request(r)
    peers = FakePeers()
    puller, metrics = _puller(sched, peers)
    assert await puller.pull_once() is None
    assert peers.pulls == [] and _count(metrics, "pulls_sent") == 0


async def test_a_failed_pull_is_counted_not_raised():
    peers = FakePeers()
    peers.pull_error = StatusError(Status.UNAVAILABLE, "prefill gone")
    puller, metrics = _puller(create_scheduler(), peers)
    assert await puller.pull_once() == 0
    assert (_count(metrics, "pulls_failed"), _count(metrics, "pulls_answered")) == (1, 0)


async def test_waits_until_the_handed_requests_arrived(monkeypatch):
    monkeypatch.setattr(offline_pull, "PULL_INTERVAL_S", 0.01)
    arrived = [0]
    peers = FakePeers()
    peers.pull_answer = 2
    puller, _ = _puller(create_scheduler(), peers, lambda: arrived[0])
    task = asyncio.create_task(puller.pull_once())
    await asyncio.sleep(0.05)
    assert not task.done()  # handed 2, none placed here yet
    arrived[0] = 2
    assert await asyncio.wait_for(task, 1) == 2
