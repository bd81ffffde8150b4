"""Offline requests on a PD pair (service + PREFILL + DECODE on a real etcd): the prefill
holds them until the decode pulls (SendPullSignal), every one completes with the greedy
output it has online, and the pulls show on both engines' /metrics."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tests.integration.cluster_harness import Harness, aclient, metric, wait_drained
from xllm_py.cluster.etcd_client import EtcdClient
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

BODY = {"ignore_eos": True, "return_token_ids": True}
NAMESPACE = "offline-pd/"


@pytest.fixture(scope="module")
def pd(etcd_server, tmp_path_factory):
    h = Harness(etcd_server.endpoint, NAMESPACE, tmp_path_factory.mktemp("logs"))
    try:
        svc = h.service()
        common = ["--block-size", "8", "--num-blocks", "512"]
        prefill = h.engine("PREFILL", "prefill", extra=common)
        decode = h.engine("DECODE", "decode", extra=common)
        for p in (prefill, decode):
            p.wait_ready(180)
        svc.wait_ready(60, path="/readiness")
        yield svc, prefill, decode
    finally:
        h.stop()


async def test_offline_requests_are_pulled_and_keep_greedy_output(pd):
    svc, prefill, decode = pd
    c = aclient(svc)
    prompts = [f"Batch line {i}: summarise the story of the fox" for i in range(12)]

    async def one(prompt: str, offline: bool) -> list[int]:
        r = await c.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                       temperature=0, extra_body={**BODY, "offline": offline})
        return r.choices[0].model_extra["token_ids"]

    offline = await asyncio.gather(*(one(p, True) for p in prompts))
    online = [await one(p, False) for p in prompts]
    assert offline == online and all(len(ids) == 16 for ids in offline)
    assert metric(decode.http_url, "xllm_pd_pulls_answered_total") >= 1
    assert metric(prefill.http_url, "xllm_pd_offline_handed_total") == len(prompts)
    await wait_drained([prefill.http_url, decode.http_url], 10)


async def _rpc_address(etcd_endpoint: str, role: str, proc) -> str:
    name = proc.http_url.removeprefix("http://")
    async with EtcdClient(etcd_endpoint, namespace=NAMESPACE) as etcd:
        kv = await etcd.get(f"XLLM:{role}:{name}")
    assert kv is not None, f"{name} not registered"
    return json.loads(kv.value)["rpc_address"]


async def test_send_pull_signal_is_served_by_the_prefill_only(pd, etcd_server):
    svc, prefill, decode = pd
    async with grpc.aio.insecure_channel(
            await _rpc_address(etcd_server.endpoint, "DECODE", decode)) as ch:
        stub = pb_grpc.DisaggPDServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SendPullSignal(pb.PullSignal(source_instance_name="x",
                                                    preferred_req_len=1), timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    async with grpc.aio.insecure_channel(
            await _rpc_address(etcd_server.endpoint, "PREFILL", prefill)) as ch:
        stub = pb_grpc.DisaggPDServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SendPullSignal(pb.PullSignal(), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        reply = await stub.SendPullSignal(pb.PullSignal(
            source_instance_name="nobody", preferred_req_len=4, max_total_len=1000), timeout=5)
        assert reply.status.ok and reply.num_handed == 0  # nothing offline is queued
