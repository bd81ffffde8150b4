"""Two real processes: a peer worker (subprocess) and this test's worker, over gRPC + UCX.

The peer owns a storage filled with a known pattern and serves the WorkerService and the
transfer listener. The test drives its own worker through PullKVCache / PushKVCache over
real gRPC, checks every byte, checks that an incompatible LinkCluster is refused with a
message naming the difference, and that killing the peer makes a pull fail, not hang.
"""
from __future__ import annotations

import importlib.util
import time

import grpc
import pytest
import torch

from xllm_py.config import TransferConfig
from xllm_py.kv_transfer import create_backend
from xllm_py.kv_transfer._peer_main import fill_pattern, peer_process
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from xllm_py.kv_transfer.kv_worker import KVWorker
from xllm_py.rpc.worker_service import WorkerServicer, create_worker_server
from xllm_py.proto import xllm_pb2, xllm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HAS_UCXX = importlib.util.find_spec("ucxx") is not None
SHAPE = dict(num_layers=2, num_blocks=64, block_size=4, num_kv_heads=2, head_dim=8)
SEED = 7


NEEDS_UCXX = pytest.mark.skipif(not HAS_UCXX, reason="ucxx missing")


# ucx: the peer's pool is shared memory this process maps (a pull is a memcpy);
# ucx-private: a plain pool, the iov message path through the peer
@pytest.fixture(params=["tcp", pytest.param("ucx", marks=NEEDS_UCXX),
                        pytest.param("ucx-private", marks=NEEDS_UCXX)])
async def two_workers(request):
    backend_name, _, private = request.param.partition("-")
    flags = ("--backend", backend_name, *(("--private-pool",) if private else ()))
    with peer_process(*flags, "--seed", str(SEED), "--model", "tiny", **SHAPE) as (proc, info):
        info["mapped"] = backend_name == "ucx" and not private
        store = KVCacheStorage(**SHAPE)
        backend = create_backend(backend_name, store, TransferConfig(timeout_s=10))
        backend.start()
        worker = KVWorker(store, backend, cluster_id=2, model="tiny")
        server, port = await create_worker_server(WorkerServicer(worker), "127.0.0.1", 0)
        ours = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        theirs = grpc.aio.insecure_channel(f"127.0.0.1:{info['grpc_port']}")
        try:
            yield (xllm_pb2_grpc.WorkerServiceStub(ours), xllm_pb2_grpc.WorkerServiceStub(theirs),
                   store, info, proc)
        finally:
            await ours.close()
            await theirs.close()
            await server.stop(0)
            await backend.close()


def expected_peer_storage() -> KVCacheStorage:
    s = KVCacheStorage(**SHAPE)
    fill_pattern(s, SEED)
    return s


async def test_pull_and_push_across_processes(two_workers) -> None:
    ours, theirs, store, info, _ = two_workers
    peer = expected_peer_storage()
    cache = await theirs.GetCacheInfo(xllm_pb2.Empty(), timeout=5)
    assert cache.addr == info["transfer_addr"] and cache.num_blocks == 64

    src = [3, 4, 5, 6, 50, 12, 13, 0, 63, 33]
    dst = [10, 11, 12, 13, 1, 40, 41, 63, 0, 20]
    st = await ours.PullKVCache(xllm_pb2.PullKVCacheRequest(
        cluster_id=info["cluster_id"], addr=info["transfer_addr"], src_blocks=src, dst_blocks=dst, req_id="req-1"),
        timeout=15)
    assert st.ok
    assert torch.equal(store.kv[:, :, dst].view(torch.uint8), peer.kv[:, :, src].view(torch.uint8))
    untouched = sorted(set(range(64)) - set(dst))
    assert torch.count_nonzero(store.kv[:, :, untouched]) == 0

    # push our (now known) blocks into the peer's blocks 30..33, then pull them back elsewhere
    st = await ours.PushKVCache(xllm_pb2.PushKVCacheRequest(
        addr=info["transfer_addr"], src_blocks=[10, 11, 1, 40], dst_blocks=[30, 31, 32, 33], req_id="req-2"), timeout=15)
    assert st.ok
    st = await ours.PullKVCache(xllm_pb2.PullKVCacheRequest(
        addr=info["transfer_addr"], src_blocks=[30, 31, 32, 33], dst_blocks=[50, 51, 52, 53], req_id="req-3"), timeout=15)
    assert st.ok
    assert torch.equal(store.kv[:, :, [50, 51, 52, 53]], peer.kv[:, :, [3, 4, 50, 12]])

    # out-of-range on the peer side: refused, nothing written
    before = store.kv.clone()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await ours.PullKVCache(xllm_pb2.PullKVCacheRequest(
            addr=info["transfer_addr"], src_blocks=[64], dst_blocks=[5]), timeout=15)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in ei.value.details()
    assert torch.equal(store.kv, before)


async def test_incompatible_link_refused(two_workers) -> None:
    ours, theirs, store, info, _ = two_workers
    our_info = await ours.GetCacheInfo(xllm_pb2.Empty(), timeout=5)
    meta = xllm_pb2.InstanceMetaInfo(model="other-model", block_size=4, kv_dtype="bfloat16",
                                     kv_layout=our_info.kv_layout, num_layers=2, num_kv_heads=2, head_dim=8)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await theirs.LinkCluster(xllm_pb2.ClusterLink(cluster_ids=[2], addrs=[our_info.addr], meta=meta), timeout=5)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "model: ours 'tiny', peer 'other-model'" in ei.value.details()
    assert "kv_dtype: ours 'float32', peer 'bfloat16'" in ei.value.details()
    # a compatible link works, both ways
    meta.model, meta.kv_dtype = "tiny", "float32"
    assert (await theirs.LinkCluster(xllm_pb2.ClusterLink(cluster_ids=[2], addrs=[our_info.addr], meta=meta), timeout=10)).ok


async def test_killed_peer_fails_not_hangs(two_workers) -> None:
    ours, theirs, store, info, proc = two_workers
    assert (await ours.LinkCluster(xllm_pb2.ClusterLink(cluster_ids=[1], addrs=[info["transfer_addr"]]), timeout=10)).ok
    assert (await ours.PullKVCache(xllm_pb2.PullKVCacheRequest(
        addr=info["transfer_addr"], src_blocks=[1], dst_blocks=[1]), timeout=15)).ok
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    try:
        await ours.PullKVCache(xllm_pb2.PullKVCacheRequest(
            addr=info["transfer_addr"], src_blocks=[2], dst_blocks=[2]), timeout=30)
    except grpc.aio.AioRpcError as e:
        elapsed = time.monotonic() - t0
        assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert elapsed < 12, f"took {elapsed:.1f}s"  # bounded by the worker's transfer timeout (10 s), not the RPC's 30 s
        assert torch.count_nonzero(store.kv[:, :, 2]) == 0
    else:
        # A mapped pool (same host) is a memcpy from the shared memory the peer left: until
        # this process notices the lost connection, a pull still copies the blocks the
        # peer held, intact. Any other path needs the peer and must fail.
        assert info["mapped"], "a pull through a killed peer succeeded"
        assert torch.equal(store.kv[:, :, 2], expected_peer_storage().kv[:, :, 2])
