"""A TP 2 PREFILL instance registers one KV worker per rank in etcd (cluster ids, transfer
addresses, WorkerService addresses, tp_size 2, dp_size 1), as xLLM does, and each rank's
layers and KV heads; each rank's
WorkerService answers for its own pool: its cluster id, its KV heads, the same blocks."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.integration.cluster_harness import Harness
from xllm_py.cluster.etcd_client import instance_key
from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.proto import xllm_pb2, xllm_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
async def test_every_rank_registers_its_kv_worker(etcd_endpoint, etcd_namespace, etcd_client,
                                                  tmp_path, backend):
    harness = Harness(etcd_endpoint, etcd_namespace, tmp_path)
    try:
        prefill = harness.engine("PREFILL", "prefill-tp2", extra=[
            "--tensor-parallel-size", "2", "--kv-transfer-backend", backend,
            "--num-blocks", "40"])
        await asyncio.to_thread(prefill.wait_ready, 240)
        name = prefill.http_url.removeprefix("http://")
        kv = None
        for _ in range(100):  # registration follows readiness by a moment
            kv = await etcd_client.get(instance_key("PREFILL", name))
            if kv is not None:
                break
            await asyncio.sleep(0.1)
        assert kv is not None, prefill.log_tail()
        meta = InstanceMeta.from_json(kv.value)
        assert (meta.tp_size, meta.dp_size) == (2, 1)
        assert len(set(meta.cluster_ids)) == 2
        assert len(meta.addrs) == len(meta.ports) == len(meta.worker_rpc_addrs) == 2
        assert len(set(meta.addrs)) == len(set(meta.worker_rpc_addrs)) == 2
        assert meta.num_kv_heads == 2  # the model's; each rank holds one
        # each rank's layers x KV heads (tiny: 4 layers), from which a PD pair's plan is made
        assert (meta.pp_size, meta.rank_kv) == (1, [[0, 4, 0, 1], [0, 4, 1, 2]])
        for rank, addr in enumerate(meta.worker_rpc_addrs):
            async with grpc.aio.insecure_channel(addr) as channel:
                info = await xllm_pb2_grpc.WorkerServiceStub(channel).GetCacheInfo(
                    xllm_pb2.Empty(), timeout=10)
            assert info.cluster_id == meta.cluster_ids[rank]
            assert info.addr.rsplit(":", 1)[1] == meta.addrs[rank].rsplit(":", 1)[1]
            assert (info.num_kv_heads, info.num_blocks) == (1, 40)
    finally:
        harness.stop()
