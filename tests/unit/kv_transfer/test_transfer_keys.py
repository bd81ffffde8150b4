"""Transfer keys: a backend built with `access_key` (every engine's KV worker) serves only
requesters that show it; a pull or push from a peer that did not link with the key is
refused (denied, PERMISSION_DENIED through the WorkerService) and moves no byte."""
from __future__ import annotations

import grpc
import pytest
import torch

from xllm_py.config import TransferConfig
from xllm_py.kv_transfer import TransferError, create_backend
from xllm_py.kv_transfer.kv_worker import KVWorker
from xllm_py.rpc.worker_service import WorkerServicer, create_worker_server
from xllm_py.proto import xllm_pb2, xllm_pb2_grpc
from tests.unit.kv_transfer.test_transfer_backends import BACKENDS, make_storage

KEY = "owner-transfer-key-0123456789abcdef"


@pytest.fixture(params=BACKENDS)
def keyed_pair(request):
    """(owner storage, owner backend with KEY, requester storage, requester backend)."""
    owner, requester = make_storage(seed=1), make_storage(seed=2)
    cfg = TransferConfig(timeout_s=5.0)
    name, _, mode = request.param.partition("-")
    kw = {"mode": mode} if mode else {}
    bo = create_backend(name, owner, cfg, access_key=KEY, **kw)
    br = create_backend(name, requester, cfg, **kw)
    bo.start()
    br.start()
    yield owner, bo, requester, br
    bo.close_sync()
    br.close_sync()


async def test_unlinked_or_wrong_key_is_refused_and_moves_nothing(keyed_pair) -> None:
    owner, bo, requester, br = keyed_pair
    owner_before, requester_before = owner.kv.clone(), requester.kv.clone()
    for key in ("", "wrong-key", KEY[:-1]):
        br.set_peer_key(bo.address, key)  # ("" keeps none)
        with pytest.raises(TransferError) as pulled:
            await br.pull(bo.address, [1, 2, 3], [4, 5, 6], timeout=5)
        assert pulled.value.denied and "transfer key" in str(pulled.value)
        with pytest.raises(TransferError) as pushed:
            await br.push(bo.address, [1, 2, 3], [4, 5, 6], timeout=5)
        assert pushed.value.denied
        with pytest.raises(TransferError):
            await br.link(bo.address, timeout=5, key=key)
    assert torch.equal(owner.kv, owner_before) and torch.equal(requester.kv, requester_before)


async def test_linked_with_the_key_moves_every_byte(keyed_pair) -> None:
    owner, bo, requester, br = keyed_pair
    await br.link(bo.address, timeout=5, key=KEY)
    await br.pull(bo.address, [1, 9, 3], [4, 5, 60], timeout=5)
    assert torch.equal(requester.kv[:, :, [4, 5, 60]], owner.kv[:, :, [1, 9, 3]])
    await br.push(bo.address, [7, 8], [20, 30], timeout=5)
    assert torch.equal(owner.kv[:, :, [20, 30]], requester.kv[:, :, [7, 8]])
    await br.unlink(bo.address)  # the key goes with the link
    with pytest.raises(TransferError) as exc:
        await br.pull(bo.address, [1], [2], timeout=5)
    assert exc.value.denied


async def test_worker_service_answers_permission_denied_without_the_key() -> None:
    owner, requester = make_storage(seed=1), make_storage(seed=2)
    bo = create_backend("fake", owner, access_key=KEY)
    br = create_backend("fake", requester)
    bo.start()
    br.start()
    server, port = await create_worker_server(WorkerServicer(KVWorker(requester, br, 7), 5.0))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = xllm_pb2_grpc.WorkerServiceStub(channel)
            pull = xllm_pb2.PullKVCacheRequest(addr=bo.address, src_blocks=[1], dst_blocks=[2])
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.PullKVCache(pull, timeout=5)
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
            link = xllm_pb2.ClusterLink(cluster_ids=[1], addrs=[bo.address],
                                        meta=xllm_pb2.InstanceMetaInfo(transfer_keys=[KEY]))
            assert (await stub.LinkCluster(link, timeout=5)).ok
            assert (await stub.PullKVCache(pull, timeout=5)).ok
        assert torch.equal(requester.kv[:, :, 2], owner.kv[:, :, 1])
    finally:
        await server.stop(0)
        await bo.close()
        await br.close()
