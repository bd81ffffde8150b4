"""Several services, master failover (the engine frees what the dead master was streaming),
engine restart within the TTL, and no instances."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.integration.cluster_harness import (Harness, aclient, client, long_stream, metric, wait_drained,
                                               wait_until)
from xllm_py.cluster.etcd_client import EtcdClient

pytestmark = pytest.mark.integration


def test_no_instances_gives_503_with_reason(etcd_server, tmp_path):
    h = Harness(etcd_server.endpoint, "empty/", tmp_path)
    try:
        svc = h.service()
        svc.wait_ready(60)  # /health is liveness: 200 without instances
        r = httpx.get(svc.http_url + "/readiness", trust_env=False)
        assert r.status_code == 503 and "no engine instance" in r.text
        with pytest.raises(openai.APIStatusError) as e:
            client(svc).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert e.value.status_code == 503
        assert "no engine instance is registered" in e.value.message
    finally:
        h.stop()


async def _master(etcd_endpoint: str, namespace: str) -> str | None:
    async with EtcdClient(etcd_endpoint, namespace=namespace) as etcd:
        kv = await etcd.get("XLLM:SERVICE:MASTER")
        return kv.value.decode() if kv else None


async def test_master_failover_and_engine_restart(etcd_server, tmp_path):
    ns = "failover/"
    h = Harness(etcd_server.endpoint, ns, tmp_path)
    try:
        services = [h.service(f"service-{i}") for i in range(2)]
        engine = h.engine("MIX", "mix")
        engine.wait_ready(180)
        for s in services:
            s.wait_ready(60, path="/readiness")
        master_addr = await _master(etcd_server.endpoint, ns)
        assert master_addr
        # Which service process is the master? Its rpc port is in its command line.
        master = next(s for s in services if master_addr.rsplit(":", 1)[1] in s.argv)
        other = next(s for s in services if s is not master)
        streams = [asyncio.create_task(long_stream(aclient(master), f"orphan {i}"))
                   for i in range(2)]
        # both streaming through the master
        await wait_until(lambda: metric(engine.http_url, "xllm_requests_running") == 2, 60, 0.1)
        master.kill()
        killed = time.monotonic()
        results = await asyncio.gather(*streams)
        assert all(r.startswith("error") for r, _ in results)
        # The engine's next Generations to the dead master fails: it aborts both requests
        # (left alone they would run ~1500 tokens) and frees their blocks.
        freed_s = await wait_drained([engine.http_url], timeout_s=3.0)
        print(f"\nengine freed the dead master's requests {freed_s:.2f}s after the kill")
        while True:
            now_master = await _master(etcd_server.endpoint, ns)
            if now_master and now_master != master_addr:
                break
            assert time.monotonic() - killed < h.ttl_s + 3, "no takeover"
            await asyncio.sleep(0.1)
        takeover_s = time.monotonic() - killed
        print(f"\nmaster takeover after {takeover_s:.1f}s")
        assert now_master.rsplit(":", 1)[1] in other.argv
        c = client(other)
        for i in range(3):
            r = c.completions.create(model="tiny", prompt=f"still here {i}", max_tokens=4)
            assert r.usage.completion_tokens >= 1
        # Restart the engine under the same name (same port) within the TTL.
        port = engine.http_url.rsplit(":", 1)[1]
        engine.kill()
        engine2 = h.engine("MIX", "mix-restarted", port=int(port))
        engine2.wait_ready(180)
        restarted = time.monotonic()
        deadline = restarted + 10
        while True:
            try:
                r = c.completions.create(model="tiny", prompt="after restart", max_tokens=4)
                break
            except openai.APIStatusError:
                assert time.monotonic() < deadline, "restarted engine not accepted"
                await asyncio.sleep(0.2)
        assert r.usage.completion_tokens >= 1
        async with EtcdClient(etcd_server.endpoint, namespace=ns) as etcd:
            kvs, _ = await etcd.get_prefix("XLLM:MIX:")
        assert len(kvs) == 1  # one name, the new incarnation
    finally:
        h.stop()
