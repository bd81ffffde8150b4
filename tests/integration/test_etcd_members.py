"""A member of the etcd cluster dies: a three-member etcd (real etcd processes), two
services with `--elastic-pd on` and three MIX engines (tiny model), every process given
the three members with the leader first. Under a load through the service, the leader is
SIGKILLed: the processes move to the other members, every request gives the greedy tokens
of an engine's own MIX path, none fails, the instances stay registered on live leases,
both services still see them ACTIVE, and the elastic assignments are as they were."""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.integration.cluster_harness import (Harness, aclient, labelled, metric,
                                               wait_drained, wait_until)
from tests.integration.test_elastic_pd import (COMMON, PROFILE, greedy, name_of, prompt, state,
                                               wait_settled)
from xllm_py.cluster.etcd_client import EtcdClient, instance_key
from xllm_py.cluster.etcd_server import EmbeddedEtcdCluster
from xllm_py.config import InstanceRole

pytestmark = pytest.mark.integration


async def test_leader_killed_under_load_nothing_lost_registry_converges(tmp_path):
    with EmbeddedEtcdCluster(3) as etcd:  # stopped however the test ends
        await _leader_killed_under_load(etcd, tmp_path)


async def _leader_killed_under_load(etcd: EmbeddedEtcdCluster, tmp_path) -> None:
    leader = etcd.leader()
    # the leader first: every process starts on the member that is killed
    endpoints = ",".join([leader.endpoint]
                         + [m.endpoint for m in etcd.members if m is not leader])
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    h = Harness(endpoints, "members/", tmp_path)
    try:
        services = [h.service(f"service-{i}", extra=["--elastic-pd", "on"],
                              settings={"elastic_min_dwell_s": 600}) for i in range(2)]
        engines = [h.engine("MIX", f"mix-{i}", extra=COMMON,
                            settings={"latency_profile": str(profile)}) for i in range(3)]
        for e in engines:
            e.wait_ready(240)
        for s in services:
            s.wait_ready(60)
        names = [name_of(e) for e in engines]
        async with EtcdClient(endpoints, namespace=h.namespace) as client:
            await wait_settled(client, names)
            before = await state(client)
            load = ([(prompt(i, 300), 4) for i in range(6)]
                    + [(prompt(100 + i, 12), 48) for i in range(6)])
            direct = aclient(engines[0])
            reference = [await greedy(direct, p, n) for p, n in load]

            leases = {n: (await client.get(instance_key(InstanceRole.MIX, n))).lease for n in names}
            svc = aclient(services[0])
            first = [asyncio.create_task(greedy(svc, p, n)) for p, n in load[::2]]
            await wait_until(lambda: sum(metric(e.http_url, "xllm_requests_running")
                                         for e in engines) > 0, 60)
            leader.kill()
            killed = asyncio.get_running_loop().time()
            # more load while the cluster elects: routed and placed with etcd moving on
            second = [asyncio.create_task(greedy(svc, p, n)) for p, n in load[1::2]]
            results = await asyncio.gather(*first, *second, return_exceptions=True)
            assert [r for r in results if isinstance(r, BaseException)] == []
            ordered = [None] * len(load)
            ordered[::2], ordered[1::2] = results[:len(first)], results[len(first):]
            assert ordered == reference

            new_leader = etcd.leader()
            assert new_leader is not leader
            # every process that was on the killed member moved on
            for proc in [*services, *engines]:
                assert "unreachable; moving to" in proc.log_path.read_text(errors="replace"), proc.name
            # registered on live leases: two TTLs after the kill each key is still there on
            # the lease it had before (kept alive through the other members: leases are
            # cluster-wide; a lost lease would have been replaced by a new one). The wait is
            # fixed on purpose: what is checked is that nothing changed for two TTLs.
            loop = asyncio.get_running_loop()
            await wait_until(lambda: loop.time() > killed + 2 * h.ttl_s, 3 * h.ttl_s + 5,
                             step_s=0.2)
            for n in names:
                kv = await client.get(instance_key(InstanceRole.MIX, n))
                assert kv is not None and kv.lease == leases[n] != 0, n
            for s in services:
                await wait_until(lambda s=s: labelled(s.http_url, "xllm_service_instances",
                                                      'state="ACTIVE"') == 3, 30)
            after = await state(client)
            assert {n: after[n][0] for n in names} == {n: before[n][0] for n in names}
            await wait_settled(client, names)
            again = await asyncio.gather(*(greedy(svc, p, n) for p, n in load[::3]))
            assert again == reference[::3]
        assert await wait_drained([e.http_url for e in engines], 30) >= 0
        for e in engines:
            assert "Traceback" not in e.log_path.read_text(errors="replace")
    finally:
        h.stop()
