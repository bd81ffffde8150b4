"""An etcd outage is not an instance's death: a PD pair behind the service keeps serving
while etcd is down (decode metas from the prefill's cache, instances kept by the
service's registry), and everything is back in etcd once it returns."""
from __future__ import annotations

import asyncio
import time

import pytest

from tests.integration.cluster_harness import Harness, client, wait_drained
from xllm_py.cluster.etcd_client import EtcdClient
from xllm_py.cluster.etcd_server import EmbeddedEtcd

pytestmark = pytest.mark.integration


def _greedy(svc, prompt: str) -> list[int]:
    out = client(svc).completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    return out.choices[0].model_extra["token_ids"]


async def test_pd_serves_through_an_etcd_outage(tmp_path):
    etcd = EmbeddedEtcd()
    etcd.start()
    h = Harness(etcd.endpoint, "outage/", tmp_path)
    try:
        svc = h.service()
        prefill = h.engine("PREFILL", "prefill", extra=["--block-size", "8"])
        decode = h.engine("DECODE", "decode", extra=["--block-size", "8"])
        for p in (prefill, decode):
            p.wait_ready(180)
        svc.wait_ready(60, path="/readiness")
        prompts = [f"outage check {i}: alpha beta gamma" for i in range(3)]
        before = [_greedy(svc, p) for p in prompts]

        etcd.kill()  # a crash: the data stays, the endpoint is gone
        down = time.monotonic()
        await asyncio.sleep(h.ttl_s + 1.0)  # past the leases' TTL and the meta cache's
        during = [_greedy(svc, p) for p in prompts]
        assert during == before
        print(f"\nserved {len(prompts)} PD requests {time.monotonic() - down:.1f}s into the outage")
        await wait_drained([prefill.http_url, decode.http_url])

        etcd.start()
        deadline = time.monotonic() + 15
        async with EtcdClient(etcd.endpoint, namespace=h.namespace) as ec:
            while True:  # both instances put their keys back
                kvs, _ = await ec.get_prefix("XLLM:")
                roles = sorted(kv.key.split(":")[1] for kv in kvs if kv.key.count(":") >= 2
                               and not kv.key.startswith("XLLM:SERVICE"))
                if roles == ["DECODE", "PREFILL"]:
                    break
                assert time.monotonic() < deadline, f"instances not back in etcd: {roles}"
                await asyncio.sleep(0.2)
        assert [_greedy(svc, p) for p in prompts] == before
    finally:
        h.stop()
        etcd.stop()
