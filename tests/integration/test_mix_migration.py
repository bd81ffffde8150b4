"""A MIX engine killed mid-stream: its single-sequence requests migrate to the other MIX
engine (MultiGenerations, KV recomputed there) and end exactly as an uninterrupted run;
an elastic MIX (a MIX in a cluster) takes a MultiGenerations that carries KV as a decode does."""
from __future__ import annotations

import json

import grpc
import pytest

from tests.integration.cluster_harness import (Harness, kill_mid_stream_and_check_migration,
                                               start_mix_cluster, wait_drained)
from xllm_py.cluster.etcd_client import EtcdClient
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration


async def test_mix_killed_mid_stream_migrates_to_the_other_mix(etcd_server, tmp_path):
    """SIGKILL the MIX engine that serves more greedy streams: each pauses, then continues
    on the survivor, and ends with exactly the tokens (and text) of an uninterrupted run."""
    h = Harness(etcd_server.endpoint, "mix-migrate/", tmp_path)
    try:
        svc, engines = start_mix_cluster(h, 2)
        survivor = await kill_mid_stream_and_check_migration(
            svc, engines, [f"a mix story {i} begins" for i in range(4)], max_tokens=1500,
            pause_bound_s=h.ttl_s + 2.0 + 6.0)  # lease TTL + eviction grace + recompute
        await wait_drained([survivor.http_url])
        await _assert_kv_item_recomputed(etcd_server.endpoint, h.namespace, survivor)
    finally:
        h.stop()


async def _assert_kv_item_recomputed(endpoint: str, namespace: str, engine) -> None:
    """A MIX engine in a cluster is elastic and serves MultiGenerations as a decode does:
    an item whose kv names no blocks to pull is taken and recomputed here."""
    name = engine.http_url.removeprefix("http://")
    async with EtcdClient(endpoint, namespace=namespace) as etcd:
        kv = await etcd.get(f"XLLM:MIX:{name}")
    assert kv is not None, f"{name} not registered"
    req = pb.DisaggRequest(req_id="kv-1", service_req_id="kv-1", max_tokens=8, n=1,
                           source_xservice_addr="127.0.0.1:1")
    req.prompt_tokens.extend([5, 6, 7])
    item = pb.MultiGenerationsRequest(request=req, generated_token_ids=[1],
                                      kv=pb.DisaggGenerationsRequest(req_id="kv-1"))
    async with grpc.aio.insecure_channel(json.loads(kv.value)["rpc_address"]) as ch:
        reply = await pb_grpc.DisaggPDServiceStub(ch).MultiGenerations(
            pb.MultiGenerationsRequests(reqs=[item]), timeout=10)
    assert reply.ok, reply.message
