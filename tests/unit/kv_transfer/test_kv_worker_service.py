"""WorkerService over in-process gRPC (fake backend): replies, status codes, metrics."""
from __future__ import annotations

import grpc
import pytest
import torch

from xllm_py.kv_transfer import create_backend
from xllm_py.kv_transfer.fake import FakeFaults
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from xllm_py.kv_transfer.kv_worker import KVWorker, PeerMeta, compatibility_errors
from xllm_py.proto import xllm_pb2, xllm_pb2_grpc
from xllm_py.rpc.worker_service import WorkerServicer, create_worker_server

pytestmark = pytest.mark.integration  # a gRPC server


def storage(seed: int | None = None) -> KVCacheStorage:
    s = KVCacheStorage(num_layers=2, num_blocks=32, block_size=4, num_kv_heads=2, head_dim=8)
    if seed is not None:
        s.kv.copy_(torch.randn(s.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return s


@pytest.fixture
async def setup():
    src_store, dst_store = storage(seed=3), storage()
    src_b = create_backend("fake", src_store)
    dst_b = create_backend("fake", dst_store, faults=FakeFaults())
    src_b.start()
    dst_b.start()
    worker = KVWorker(dst_store, dst_b, cluster_id=11, model="tiny")
    server, port = await create_worker_server(WorkerServicer(worker), "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = xllm_pb2_grpc.WorkerServiceStub(channel)
    yield stub, worker, src_store, src_b, dst_store, dst_b
    await channel.close()
    await server.stop(0)
    await src_b.close()
    await dst_b.close()


def meta(**kw) -> xllm_pb2.InstanceMetaInfo:
    base = dict(model="tiny", block_size=4, kv_dtype="float32", kv_layout="kv,layer,block,slot,head,dim",
                num_layers=2, num_kv_heads=2, head_dim=8)
    base.update(kw)
    return xllm_pb2.InstanceMetaInfo(**base)


async def test_pull_ok_every_byte_and_metrics(setup) -> None:
    stub, worker, src_store, src_b, dst_store, _ = setup
    st = await stub.PullKVCache(xllm_pb2.PullKVCacheRequest(
        cluster_id=1, addr=src_b.address, src_blocks=[4, 9, 10, 2], dst_blocks=[0, 1, 2, 31], req_id="r1"), timeout=5)
    assert st.ok and st.code == 200
    assert torch.equal(dst_store.kv[:, :, [0, 1, 2, 31]], src_store.kv[:, :, [4, 9, 10, 2]])
    text = worker.metrics.render()
    assert f'xllm_kv_transfer_bytes_total{{op="pull",rank="0"}} {4 * dst_store.block_bytes}' in text
    assert 'xllm_kv_transfer_seconds_count{op="pull",rank="0"} 1' in text


async def test_push_ok(setup) -> None:
    stub, worker, src_store, src_b, dst_store, _ = setup
    dst_store.kv.fill_(1.5)
    st = await stub.PushKVCache(xllm_pb2.PushKVCacheRequest(
        cluster_id=1, addr=src_b.address, src_blocks=[3, 4], dst_blocks=[20, 5], req_id="r2"), timeout=5)
    assert st.ok
    assert torch.equal(src_store.kv[:, :, [20, 5]], dst_store.kv[:, :, [3, 4]])


@pytest.mark.parametrize("src,dst,msg", [
    ([1, 2], [3], "differ in length"),
    ([1], [32], "out of range"),       # our own pool
    ([40], [1], "out of range"),       # the peer's pool
])
async def test_invalid_argument(setup, src, dst, msg) -> None:
    stub, worker, _, src_b, dst_store, _ = setup
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.PullKVCache(xllm_pb2.PullKVCacheRequest(addr=src_b.address, src_blocks=src, dst_blocks=dst), timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert msg in ei.value.details()
    assert torch.count_nonzero(dst_store.kv) == 0
    assert "xllm_kv_transfer_failures_total" in worker.metrics.render()


async def test_transfer_failure_is_unavailable_and_timeout_is_deadline(setup) -> None:
    stub, worker, _, src_b, dst_store, dst_b = setup
    dst_b.inject_failures(1)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.PullKVCache(xllm_pb2.PullKVCacheRequest(addr=src_b.address, src_blocks=[1], dst_blocks=[1]), timeout=5)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "injected" in ei.value.details()
    assert torch.count_nonzero(dst_store.kv) == 0
    dst_b.faults = FakeFaults(delay_s=2.0)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.PullKVCache(xllm_pb2.PullKVCacheRequest(addr=src_b.address, src_blocks=[1], dst_blocks=[1]), timeout=0.5)
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 'reason="error"' in worker.metrics.render()


async def test_link_cluster_and_cache_info(setup) -> None:
    stub, worker, _, src_b, _, _ = setup
    st = await stub.LinkCluster(xllm_pb2.ClusterLink(cluster_ids=[7], addrs=[src_b.address], meta=meta()), timeout=5)
    assert st.ok and worker.linked == {7: src_b.address}
    st = await stub.UnlinkCluster(xllm_pb2.ClusterLink(cluster_ids=[7]), timeout=5)
    assert st.ok and worker.linked == {}
    info = await stub.GetCacheInfo(xllm_pb2.Empty(), timeout=5)
    assert (info.cluster_id, info.num_blocks, info.block_size, info.num_layers, info.num_kv_heads, info.head_dim) == (11, 32, 4, 2, 2, 8)
    assert info.kv_dtype == "float32" and info.kv_layout == "kv,layer,block,slot,head,dim"
    assert info.block_bytes == worker.storage.block_bytes and info.addr == worker.address


async def test_link_cluster_refuses_incompatible_peer(setup) -> None:
    stub, worker, _, src_b, _, _ = setup
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.LinkCluster(xllm_pb2.ClusterLink(
            cluster_ids=[7], addrs=[src_b.address], meta=meta(model="other", block_size=16, kv_dtype="bfloat16")), timeout=5)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    d = ei.value.details()
    assert "model: ours 'tiny', peer 'other'" in d and "block_size: ours 4, peer 16" in d and "kv_dtype" in d
    assert "num_layers" not in d
    assert worker.linked == {}
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.LinkCluster(xllm_pb2.ClusterLink(cluster_ids=[7, 8], addrs=[src_b.address]), timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_link_cluster_unreachable_peer() -> None:
    w = KVWorker(storage(), create_backend("fake", storage()), cluster_id=1)
    w.backend.start()
    try:
        with pytest.raises(Exception, match="no peer"):
            await w.link_cluster([1], ["fake:987654"])
    finally:
        await w.backend.close()


def test_compatibility_errors_lenient() -> None:
    ours = PeerMeta("m", 16, "float16", "kv,layer,block,slot,head,dim", 4, 8, 64)
    assert compatibility_errors(ours, PeerMeta()) == []  # peer states nothing: nothing to compare
    errs = compatibility_errors(ours, PeerMeta(num_layers=5, head_dim=128, kv_layout="layer,kv"))
    assert [e.split(":")[0] for e in errs] == ["kv_layout", "num_layers", "head_dim"]
