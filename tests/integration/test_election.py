"""MasterElection against a real etcd: one master, takeover after a crash, resignation."""
from __future__ import annotations

import asyncio
import time

import pytest

from xllm_py.cluster.etcd_client import MASTER_KEY, EtcdClient, service_key
from xllm_service.election import MasterElection

from tests.integration.cluster_harness import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TTL_S = 2.0




@pytest.fixture
async def pair(etcd_endpoint, etcd_namespace):
    clients = [EtcdClient(etcd_endpoint, namespace=etcd_namespace) for _ in range(2)]
    elections = [MasterElection(c, f"127.0.0.1:{7000 + i}", ttl_s=TTL_S) for i, c in enumerate(clients)]
    changes: list[list[tuple[bool, str | None]]] = [[], []]
    for i, e in enumerate(elections):
        e.on_change(lambda is_master, addr, i=i: changes[i].append((is_master, addr)))
    try:
        yield elections, changes
    finally:
        for e in elections:
            await e.stop()
        for c in clients:
            await c.close()


async def test_exactly_one_master_and_both_agree(pair, etcd_client):
    (a, b), changes = pair
    await asyncio.gather(a.start(), b.start())
    await a.wait_decided()
    await b.wait_decided()
    await asyncio.sleep(3 * a.interval_s)  # a few rounds: still exactly one
    assert [a.is_master, b.is_master].count(True) == 1
    master = a if a.is_master else b
    assert a.master_addr == b.master_addr == master.my_addr
    kv = await etcd_client.get(MASTER_KEY)
    assert kv is not None and kv.value.decode() == master.my_addr and kv.lease != 0
    for e in (a, b):
        assert (await etcd_client.get(service_key(e.my_addr))) is not None
    winner = 0 if a.is_master else 1
    assert changes[winner][0] == (True, master.my_addr)


async def test_follower_takes_over_after_master_crash(pair, etcd_client):
    (a, b), changes = pair
    await a.start()
    await wait_until(lambda: a.is_master, 3.0)
    await b.start()
    await b.wait_decided()
    assert not b.is_master and b.master_addr == a.my_addr
    await a.stop(resign=False)  # crash: the master key stays until its lease expires
    t0 = time.monotonic()
    await wait_until(lambda: b.is_master, TTL_S + 2.0)
    took = b.became_master_at - t0
    print(f"\nmaster crash -> takeover in {took:.2f}s (TTL {TTL_S}s)")
    assert took <= TTL_S + 1.0
    kv = await etcd_client.get(MASTER_KEY)
    assert kv.value.decode() == b.my_addr
    assert changes[1][-1] == (True, b.my_addr)
    # The crashed service's own key expires too.
    while (await etcd_client.get(service_key(a.my_addr))) is not None:
        assert time.monotonic() - t0 < TTL_S + 1.5, "crashed service key did not expire"
        await asyncio.sleep(0.05)


async def test_resign_hands_over_at_once(pair, etcd_client):
    (a, b), _ = pair
    await a.start()
    await wait_until(lambda: a.is_master, 3.0)
    await b.start()
    await b.wait_decided()
    await a.stop(resign=True)
    took = await wait_until(lambda: b.is_master, TTL_S)
    print(f"\nresign -> takeover in {took:.2f}s")
    assert took < 1.0
    assert (await etcd_client.get(service_key(a.my_addr))) is None


async def test_master_key_deleted_by_hand_is_taken_back(pair, etcd_client):
    (a, _b), _ = pair
    await a.start()
    await wait_until(lambda: a.is_master, 3.0)
    await etcd_client.delete(MASTER_KEY)
    t0 = time.monotonic()
    while (kv := await etcd_client.get(MASTER_KEY)) is None:
        assert time.monotonic() - t0 < TTL_S, "master key not restored"
        await asyncio.sleep(0.05)
    assert kv.value.decode() == a.my_addr and a.is_master
