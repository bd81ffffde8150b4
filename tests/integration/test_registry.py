"""Registry against a real etcd: agent registration, key repair, crash detection,
restart within the TTL, lease-lost-but-alive, and XllmRpcService over real gRPC.

Measured bounds are asserted (TTL 2 s: etcd's minimum lease TTL) and printed (-s).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from xllm_py.cluster.etcd_client import MASTER_KEY, EtcdClient, instance_key
from xllm_py.cluster.etcd_server import EmbeddedEtcd
from xllm_py.engine.instance_agent import InstanceAgent, LoadReport
from xllm_py.cluster.instance_meta import InstanceMeta, new_incarnation_id, now_ms
from xllm_py.config import InstanceRole
from xllm_service.config import RegistryConfig
from xllm_py.engine.cache_events import CacheEvents
from xllm_py.utils.procs import free_port
from xllm_py.proto import xllm_pb2, xllm_pb2_grpc
from xllm_py.rpc import cluster as wire
from xllm_service.instance_table import InstanceState
from xllm_service.prefix_index import PrefixIndex
from xllm_service.registry import Registry
from xllm_service.rpc_service import ProxyRegistrations, XllmRpcServicer, create_server

from tests.integration.cluster_harness import wait_until
from tests.unit.service.test_cache_routing import EventPool

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TTL_S = 2.0
HB_S = 0.25




async def wait_key(client: EtcdClient, key: str, present: bool, timeout_s: float) -> float:
    t0 = time.monotonic()
    while (await client.get(key) is not None) != present:
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{key} present={not present} after {timeout_s}s")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def make_meta(name: str, role: InstanceRole = InstanceRole.DECODE, http_address: str = "") -> InstanceMeta:
    return InstanceMeta(name=name, type=role, rpc_address="127.0.0.1:1", model="tiny", block_size=16,
                        http_address=http_address)


def agent(endpoint: str, ns: str, name: str, role=InstanceRole.DECODE, **kw) -> InstanceAgent:
    return InstanceAgent(endpoint, make_meta(name, role, kw.pop("http_address", "")), ttl_s=TTL_S,
                         namespace=ns, heartbeat_interval_s=HB_S, **kw)


async def test_agent_registers_under_documented_key_with_namespace(etcd_endpoint, etcd_namespace):
    a = agent(etcd_endpoint, etcd_namespace, "127.0.0.1:9001", InstanceRole.PREFILL)
    raw = EtcdClient(etcd_endpoint)  # no namespace: sees the full key
    await a.start()
    try:
        kv = await raw.get(f"{etcd_namespace}XLLM:PREFILL:127.0.0.1:9001")
        assert kv is not None and kv.lease != 0
        data = json.loads(kv.value)
        assert data["name"] == "127.0.0.1:9001" and data["type"] == "PREFILL"
        assert data["incarnation_id"] == a.incarnation_id and len(a.incarnation_id) == 32
        assert data["schema_version"] == 1 and data["model"] == "tiny"
        assert await raw.get("XLLM:PREFILL:127.0.0.1:9001") is None  # nothing outside the namespace
        assert InstanceMeta.from_json(kv.value) == a.meta
    finally:
        await a.stop()
    assert await raw.get(f"{etcd_namespace}XLLM:PREFILL:127.0.0.1:9001") is None  # clean stop deletes
    await raw.close()


async def test_key_deleted_by_hand_comes_back(etcd_endpoint, etcd_namespace, etcd_client):
    a = agent(etcd_endpoint, etcd_namespace, "d:1")
    await a.start()
    try:
        await etcd_client.delete(a.key)
        took = await wait_key(etcd_client, a.key, present=True, timeout_s=TTL_S)
        print(f"\nkey deleted by hand back after {took:.2f}s")
        assert took <= HB_S + 0.5
        kv = await etcd_client.get(a.key)
        assert InstanceMeta.from_json(kv.value).incarnation_id == a.incarnation_id
    finally:
        await a.stop()


async def test_registry_sees_agent_crash_then_evicts(etcd_endpoint, etcd_namespace, etcd_client):
    registry = Registry(etcd_client, RegistryConfig(evict_grace_s=1.0, health_interval_s=0.1))
    evicted: list[tuple[str, str, float]] = []
    registry.on_evict(lambda info, reason: evicted.append((info.name, reason, time.monotonic())))
    await registry.start()
    a = agent(etcd_endpoint, etcd_namespace, "d:1")
    b = agent(etcd_endpoint, etcd_namespace, "p:1", InstanceRole.PREFILL)
    await a.start()
    await b.start()
    try:
        await wait_until(lambda: len(registry.all()) == 2, 2.0)
        assert [i.name for i in registry.schedulable(InstanceRole.DECODE)] == ["d:1"]
        await a.stop(deregister=False)  # crash: no more keepalive, key left to expire
        t0 = time.monotonic()
        gone = await wait_until(lambda: registry.get("d:1").state is not InstanceState.ACTIVE, TTL_S + 1.5)
        assert registry.get("d:1").state is InstanceState.SUSPECT  # no /health answers
        assert registry.schedulable(InstanceRole.DECODE) == []
        assert await etcd_client.get(a.key) is None
        await wait_until(lambda: evicted, 3.0)
        evict_s = evicted[0][2] - t0
        print(f"\ncrash -> SUSPECT {gone:.2f}s, -> evicted {evict_s:.2f}s (TTL {TTL_S}s, grace 1.0s)")
        assert gone <= TTL_S + 1.0
        assert evict_s <= TTL_S + 1.0 + 1.0 + 0.3
        assert evicted[0][:2] == ("d:1", "evicted") and registry.get("d:1") is None
        assert registry.get("p:1").state is InstanceState.ACTIVE
        assert registry.counts() == {"ACTIVE": 1, "LEASE_LOST": 0, "SUSPECT": 0, "DRAINING": 0}
    finally:
        await b.stop()
        await registry.stop()


async def test_restart_same_name_new_incarnation_within_ttl(etcd_endpoint, etcd_namespace, etcd_client):
    registry = Registry(etcd_client, RegistryConfig(evict_grace_s=1.0, health_interval_s=0.1))
    reasons: list[tuple[str, str]] = []
    registry.on_evict(lambda info, reason: reasons.append((info.incarnation_id, reason)))
    await registry.start()
    first = agent(etcd_endpoint, etcd_namespace, "d:1")
    await first.start()
    second = None
    try:
        await wait_until(lambda: registry.get("d:1") is not None, 2.0)
        await first.stop(deregister=False)  # crash, key still there on the old lease
        second = agent(etcd_endpoint, etcd_namespace, "d:1")
        await second.start()  # restart inside the TTL
        await wait_until(lambda: registry.get("d:1").incarnation_id == second.incarnation_id, 2.0)
        assert reasons == [(first.incarnation_id, "replaced")]
        # The old lease expiring must not take the new registration with it.
        await asyncio.sleep(TTL_S + 1.0)
        info = registry.get("d:1")
        assert info.state is InstanceState.ACTIVE and info.incarnation_id == second.incarnation_id
        assert await etcd_client.get(second.key) is not None
    finally:
        if second is not None:
            await second.stop()
        await registry.stop()


async def _health_server(status: int):
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok".encode())
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_lease_lost_but_healthy_stays_schedulable_then_suspect(etcd_endpoint, etcd_namespace, etcd_client):
    registry = Registry(etcd_client, RegistryConfig(evict_grace_s=0.5, health_interval_s=0.1))
    await registry.start()
    server, http_addr = await _health_server(200)
    a = agent(etcd_endpoint, etcd_namespace, "d:1", http_address=http_addr)
    await a.start()
    try:
        await wait_until(lambda: registry.get("d:1") is not None, 2.0)
        await a.stop(deregister=False)
        await wait_until(lambda: registry.get("d:1").state is InstanceState.LEASE_LOST, TTL_S + 1.5)
        assert [i.name for i in registry.schedulable(InstanceRole.DECODE)] == ["d:1"]
        await asyncio.sleep(1.0)  # alive: never evicted
        assert registry.get("d:1").state is InstanceState.LEASE_LOST
        server.close()
        await server.wait_closed()
        await wait_until(lambda: registry.get("d:1") is None or registry.get("d:1").state is InstanceState.SUSPECT, 1.0)
        await wait_until(lambda: registry.get("d:1") is None, 1.5)
    finally:
        server.close()
        await registry.stop()


async def test_agent_killed_9_in_subprocess(etcd_endpoint, etcd_namespace, etcd_client):
    """A real crash: the agent runs in its own process and gets SIGKILL."""
    code = textwrap.dedent(f"""
        import asyncio, sys
        from xllm_py.engine.instance_agent import InstanceAgent
        from xllm_py.cluster.instance_meta import InstanceMeta
        async def main():
            a = InstanceAgent({etcd_endpoint!r}, InstanceMeta(name="k:1", type="DECODE"), ttl_s={TTL_S},
                              namespace={etcd_namespace!r}, heartbeat_interval_s={HB_S})
            await a.start()
            print("up", flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
    """)
    registry = Registry(etcd_client, RegistryConfig(evict_grace_s=1.0, health_interval_s=0.1))
    await registry.start()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=os.getcwd())
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        assert line.strip() == b"up"
        await wait_until(lambda: registry.get("k:1") is not None, 2.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        t0 = time.monotonic()
        key_gone = await wait_key(etcd_client, instance_key("DECODE", "k:1"), present=False, timeout_s=TTL_S + 1.5)
        await wait_until(lambda: registry.get("k:1") is None, 3.0)
        evicted = time.monotonic() - t0
        print(f"\nkill -9 -> key gone {key_gone:.2f}s, evicted {evicted:.2f}s")
        assert key_gone <= TTL_S + 1.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        await registry.stop()


async def test_agent_reregisters_after_etcd_loses_its_data():
    etcd = EmbeddedEtcd()
    etcd.start()
    client = EtcdClient(etcd.endpoint, timeout_s=1.0)
    a = InstanceAgent(etcd.endpoint, make_meta("d:1"), ttl_s=TTL_S, heartbeat_interval_s=HB_S, etcd_timeout_s=1.0)
    registry = Registry(client, RegistryConfig(evict_grace_s=5.0, health_interval_s=0.1))
    try:
        await a.start()
        await registry.start()
        await wait_until(lambda: registry.get("d:1") is not None, 2.0)
        etcd.stop()   # data dir removed: a fresh, empty etcd on the same port
        etcd.start()
        t0 = time.monotonic()
        await wait_key(client, a.key, present=True, timeout_s=5.0)
        back = time.monotonic() - t0
        await wait_until(lambda: registry.num_resyncs >= 2, 5.0)  # the watch broke and resynced
        await wait_until(lambda: registry.get("d:1") is not None and registry.get("d:1").key_present, 5.0)
        print(f"\netcd wiped -> key back after {back:.2f}s, registry resyncs {registry.num_resyncs}")
        assert registry.get("d:1").state is InstanceState.ACTIVE
        assert registry.num_resyncs >= 2
    finally:
        await a.stop()
        await registry.stop()
        await client.close()
        etcd.stop()


# ---------------------------------------------------------------- XllmRpcService over gRPC


@pytest.fixture
async def rpc(etcd_client):
    registry = Registry(etcd_client, RegistryConfig(evict_grace_s=1.0, health_interval_s=0.1))
    await registry.start()
    proxy = ProxyRegistrations(etcd_client, registry, ttl_s=TTL_S)
    server, port = await create_server(XllmRpcServicer(registry, proxy), "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = xllm_pb2_grpc.XllmRpcServiceStub(channel)
    try:
        yield registry, stub, port
    finally:
        await channel.close()
        await server.stop(0)
        await proxy.stop()
        await registry.stop()


async def test_rpc_heartbeat_updates_table_and_refuses_stale_incarnation(rpc, etcd_endpoint, etcd_namespace):
    registry, stub, _ = rpc
    a = agent(etcd_endpoint, etcd_namespace, "d:1")
    await a.start()
    try:
        await wait_until(lambda: registry.get("d:1") is not None, 2.0)
        req = xllm_pb2.HeartbeatRequest(
            name="d:1", incarnation_id=a.incarnation_id,
            load_metrics=xllm_pb2.LoadMetrics(waiting_requests_num=4, gpu_cache_usage_perc=0.5, running_requests_num=6),
            latency_metrics=xllm_pb2.LatencyMetrics(recent_max_ttft=90, recent_max_tbt=12),
        )
        reply = await stub.Heartbeat(req, timeout=1.0)
        assert reply.ok, reply.message
        load = registry.get("d:1").load
        assert (load.waiting, load.running, load.kv_usage, load.recent_max_ttft_ms, load.recent_max_tbt_ms) == (4, 6, 0.5, 90, 12)
        assert load.last_heartbeat_s is not None

        stale = xllm_pb2.HeartbeatRequest(name="d:1", incarnation_id="old",
                                          load_metrics=xllm_pb2.LoadMetrics(waiting_requests_num=99))
        reply = await stub.Heartbeat(stale, timeout=1.0)
        assert not reply.ok and "stale incarnation" in reply.message
        assert registry.get("d:1").load.waiting == 4

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Heartbeat(xllm_pb2.HeartbeatRequest(name="d:1"), timeout=1.0)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await a.stop()


async def test_rpc_static_lists_only_schedulable_of_role(rpc, etcd_endpoint, etcd_namespace):
    registry, stub, _ = rpc
    agents = [agent(etcd_endpoint, etcd_namespace, n, r) for n, r in
              [("d1:1", InstanceRole.DECODE), ("d2:1", InstanceRole.DECODE), ("p1:1", InstanceRole.PREFILL),
               ("m1:1", InstanceRole.MIX)]]
    for x in agents:
        await x.start()
    try:
        await wait_until(lambda: len(registry.all()) == 4, 2.0)
        await agents[1].stop()  # clean stop: key deleted at once -> SUSPECT
        await wait_until(lambda: registry.get("d2:1").state is not InstanceState.ACTIVE, 1.0)
        decode = await stub.GetStaticDecodeList(xllm_pb2.InstanceID(name="p1:1"), timeout=1.0)
        prefill = await stub.GetStaticPrefillList(xllm_pb2.InstanceID(), timeout=1.0)
        assert list(decode.names) == ["d1:1"]
        assert list(prefill.names) == ["p1:1"]
    finally:
        for x in (agents[0], agents[2], agents[3]):
            await x.stop()


async def test_rpc_get_instance_info(rpc, etcd_endpoint, etcd_namespace):
    registry, stub, _ = rpc
    a = agent(etcd_endpoint, etcd_namespace, "p:1", InstanceRole.PREFILL)
    await a.start()
    try:
        await wait_until(lambda: registry.get("p:1") is not None, 2.0)
        info = await stub.GetInstanceInfo(xllm_pb2.InstanceID(name="p:1"), timeout=1.0)
        assert wire.instance_meta_from_proto(info) == a.meta
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetInstanceInfo(xllm_pb2.InstanceID(name="nope:1"), timeout=1.0)
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
        assert "nope:1" in err.value.details()
    finally:
        await a.stop()


async def test_rpc_generations_default_refuses_every_request(rpc):
    _, stub, _ = rpc
    msg = xllm_pb2.DisaggStreamGenerations(gens=[xllm_pb2.DisaggStreamGeneration(req_id="a"),
                                                 xllm_pb2.DisaggStreamGeneration(req_id="b")])
    reply = await stub.Generations(msg, timeout=1.0)
    assert [(s.ok, s.message) for s in reply.all_status] == [(False, "unknown request")] * 2


async def test_rpc_register_instance_kept_alive_while_heartbeats_arrive(rpc, etcd_client):
    registry, stub, _ = rpc
    meta = make_meta("r:1", InstanceRole.DECODE)
    meta.incarnation_id = new_incarnation_id()
    meta.register_ts_ms = now_ms()
    reply = await stub.RegisterInstance(wire.instance_meta_to_proto(meta), timeout=2.0)
    assert reply.status_code == 200
    key = instance_key("DECODE", "r:1")
    assert (await etcd_client.get(key)) is not None
    assert registry.get("r:1").state is InstanceState.ACTIVE
    hb = xllm_pb2.HeartbeatRequest(name="r:1", incarnation_id=meta.incarnation_id)
    t_end = time.monotonic() + TTL_S + 1.0
    while time.monotonic() < t_end:  # longer than a TTL: the service keeps the key
        assert (await stub.Heartbeat(hb, timeout=1.0)).ok
        await asyncio.sleep(0.3)
    assert (await etcd_client.get(key)) is not None
    # heartbeats stop: the key expires
    gone = await wait_key(etcd_client, key, present=False, timeout_s=2 * TTL_S + 2.0)
    print(f"\nproxy registration: key gone {gone:.2f}s after the last heartbeat")
    await wait_until(lambda: registry.get("r:1") is None or not registry.get("r:1").schedulable, 1.0)
    bad = xllm_pb2.InstanceMetaInfo(type=xllm_pb2.DECODE)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RegisterInstance(bad, timeout=1.0)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_agent_heartbeats_reach_master_found_in_etcd(rpc, etcd_endpoint, etcd_namespace, etcd_client):
    registry, _, port = rpc
    await etcd_client.put(MASTER_KEY, f"127.0.0.1:{port}")
    a = agent(etcd_endpoint, etcd_namespace, "d:1",
              load_fn=lambda: LoadReport(waiting=2, running=3, kv_usage=0.75, recent_max_ttft_ms=50))
    await a.start()
    try:
        await wait_until(lambda: registry.get("d:1") is not None and registry.get("d:1").load.num_heartbeats >= 2, 3.0)
        load = registry.get("d:1").load
        assert (load.waiting, load.running, load.kv_usage, load.recent_max_ttft_ms) == (2, 3, 0.75, 50)
        assert a.master_addr == f"127.0.0.1:{port}"
    finally:
        await a.stop()


async def test_cache_index_recovers_lost_heartbeats_and_a_new_master(
        rpc, etcd_endpoint, etcd_namespace, etcd_client):
    """The master's prefix index of an engine is exact after heartbeats carrying cache
    events were lost (a full snapshot follows a failure) and on a master that never saw
    the earlier events (its first heartbeat is a full snapshot)."""
    registry, _, port = rpc
    index = PrefixIndex()
    registry.on_cache_event(index.update)
    pool, events = EventPool(), CacheEvents()
    held = lambda idx: {h for h in range(10) if idx.matched_blocks("d:1", [h])}  # noqa: E731
    await etcd_client.put(MASTER_KEY, f"127.0.0.1:{port}")
    fulls: list[bool] = []  # each heartbeat's cache_event: full snapshot or delta

    def cache_fn(full: bool):
        fulls.append(full)
        return events.drain(full)

    a = agent(etcd_endpoint, etcd_namespace, "d:1", cache_fn=cache_fn)
    await a.start()
    server_b = None
    try:
        pool.events = ([1, 2, 3], [])
        events.collect(pool)
        await wait_until(lambda: held(index) == {1, 2, 3}, 3.0)
        # The master is unreachable for a while: the events drained meanwhile are lost.
        await etcd_client.put(MASTER_KEY, f"127.0.0.1:{free_port()}")
        await wait_until(lambda: a.last_heartbeat_error != "", 5.0)
        ok_before = a.num_heartbeats_ok
        pool.events = ([4], [2])
        events.collect(pool)
        sent = len(fulls)
        await wait_until(lambda: len(fulls) > sent, 3.0)  # drained into a failing heartbeat
        assert a.num_heartbeats_ok == ok_before
        await etcd_client.put(MASTER_KEY, f"127.0.0.1:{port}")
        await wait_until(lambda: held(index) == {1, 3, 4}, 5.0)
        assert fulls[0] and not all(fulls)  # the first is full, then deltas
        # A new master (another service) learns the whole cache from the first heartbeat.
        registry_b = Registry(etcd_client, RegistryConfig(evict_grace_s=1.0, health_interval_s=0.1))
        await registry_b.start()
        index_b = PrefixIndex()
        registry_b.on_cache_event(index_b.update)
        server_b, port_b = await create_server(
            XllmRpcServicer(registry_b, ProxyRegistrations(etcd_client, registry_b, ttl_s=TTL_S)),
            "127.0.0.1", 0)
        await etcd_client.put(MASTER_KEY, f"127.0.0.1:{port_b}")
        await wait_until(lambda: held(index_b) == {1, 3, 4}, 6.0)
        pool.events = ([5], [1])  # then deltas again
        events.collect(pool)
        await wait_until(lambda: held(index_b) == {3, 4, 5}, 3.0)
    finally:
        await a.stop()
        if server_b is not None:
            await server_b.stop(0)
            await registry_b.stop()
