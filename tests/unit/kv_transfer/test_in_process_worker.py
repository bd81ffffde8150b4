"""TP 1: the PD code moves KV through its own worker's backend, with no gRPC call to
itself (kv_transfer/in_process.py as rank 0's worker of parallel/instance_peers.InstancePeers)."""
from __future__ import annotations

import pytest
import torch

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.kv_transfer import create_backend
from xllm_py.kv_transfer.in_process import InProcessWorker
from xllm_py.kv_transfer.kv_worker import KVWorker
from xllm_py.parallel.instance_peers import InstancePeers
from xllm_py.pd_messages import KVMove, PeerLink
from xllm_py.rpc.pd_peers import PDServiceClient
from xllm_py.status import Status, StatusError
from tests.unit.kv_transfer.test_kv_worker_service import storage


@pytest.fixture
async def pair():
    src_store, dst_store = storage(seed=3), storage()
    src_b, dst_b = create_backend("fake", src_store), create_backend("fake", dst_store)
    src_b.start()
    dst_b.start()
    worker = KVWorker(dst_store, dst_b, cluster_id=11, model="tiny")
    # No WorkerService and no address: a gRPC call would fail.
    meta = InstanceMeta(name="decode:1", worker_rpc_addrs=["127.0.0.1:1"])
    peers = InstancePeers(meta, PDServiceClient(1.0), [InProcessWorker(worker, 1.0, 5.0)])
    yield peers, worker, src_store, src_b, dst_store
    await peers.close()
    await src_b.close()
    await dst_b.close()


async def test_pull_goes_straight_to_the_backend(pair) -> None:
    peers, worker, src_store, src_b, dst_store = pair
    await peers.pull_kv(KVMove("r1", 1, src_b.address, [4, 9, 10], [0, 1, 31]))
    assert torch.equal(dst_store.kv[:, :, [0, 1, 31]], src_store.kv[:, :, [4, 9, 10]])
    assert 'xllm_kv_transfer_seconds_count{op="pull",rank="0"} 1' in worker.metrics.render()


async def test_push_goes_straight_to_the_backend(pair) -> None:
    peers, _, src_store, src_b, dst_store = pair
    await peers.push_kv(KVMove("r2", 1, src_b.address, [3, 4], [20, 5]))
    assert torch.equal(src_store.kv[:, :, [20, 5]], dst_store.kv[:, :, [3, 4]])


@pytest.mark.parametrize("src,dst,msg", [
    ([1, 2], [3], "differ in length"),
    ([1], [32], "out of range"),
    ([40], [1], "out of range"),
    (list(range(33)), list(range(33)), "the pool has 32"),
])
async def test_a_bad_move_is_bad_gateway_and_touches_nothing(pair, src, dst, msg) -> None:
    peers, _, _, src_b, dst_store = pair
    before = dst_store.kv.clone()
    with pytest.raises(StatusError) as err:
        await peers.pull_kv(KVMove("r3", 1, src_b.address, src, dst))
    assert err.value.status is Status.BAD_GATEWAY
    assert err.value.message.startswith("KV pull failed") and msg in err.value.message
    assert torch.equal(dst_store.kv, before)


async def test_link_refuses_an_incompatible_peer(pair) -> None:
    peers, worker, _, src_b, _ = pair
    bad = InstanceMeta(name="prefill:1", model="tiny", block_size=8)
    with pytest.raises(StatusError) as err:
        await peers.link_cluster(PeerLink("prefill:1", [1], [src_b.address], bad))
    assert err.value.status is Status.FAILED_PRECONDITION and "block_size" in err.value.message
    good = InstanceMeta(name="prefill:1", model="tiny", block_size=4, num_layers=2)
    await peers.link_cluster(PeerLink("prefill:1", [1], [src_b.address], good))
    assert worker.linked == {1: src_b.address}
