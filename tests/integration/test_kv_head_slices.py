"""KV head slices between instances of different TP, through each rank's real
WorkerService (gRPC) and the tcp and ucx transfer backends (ucx: private pools, the iov
path; the mapped and tag paths: tests/unit/kv_transfer/test_ucx_head_slices.py): for P TP 2 -> D TP 1, P TP 1 -> D TP 2,
P TP 2 -> D TP 2 (and replicated heads, P TP 4 -> D TP 2), PULL and PUSH, every decode
rank ends with exactly the KV heads it owns, read from the prefill ranks that hold them
(``model/kv_layout.transfer_plan``, contiguous block runs merged), nothing else written, and the
bytes each decode rank received (transfer metrics) equal its own heads' bytes."""
from __future__ import annotations

import grpc
import pytest
import torch

from xllm_py.config import TransferConfig
from xllm_py.kv_transfer import create_backend
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from xllm_py.kv_transfer.kv_worker import KVWorker
from xllm_py.model.kv_layout import kv_layout, transfer_plan
from xllm_py.rpc.worker_service import WorkerServicer, create_worker_server
from xllm_py.model.sharding import kv_head_range
from xllm_py.proto import xllm_pb2, xllm_pb2_grpc

pytestmark = pytest.mark.integration

LAYERS, BLOCKS, BLOCK, DIM = 2, 24, 4, 8
SRC_BLOCKS = [3, 4, 5, 9, 17]  # runs (3..5), (9), (17)
DST_BLOCKS = [10, 11, 12, 2, 20]


class _Rank:
    """One rank: its pool (its heads and layers only), transfer backend, KVWorker and
    WorkerService."""

    def __init__(self, heads: tuple[int, int], backend: str,
                 layers: tuple[int, int] = (0, LAYERS)) -> None:
        self.heads, self.layers = heads, layers
        self.storage = KVCacheStorage(layers[1] - layers[0], BLOCKS, BLOCK, heads[1] - heads[0],
                                      DIM)
        self.backend = create_backend(backend, self.storage, TransferConfig(backend=backend))
        self.addr = self.backend.start()
        self.worker = KVWorker(self.storage, self.backend, cluster_id=id(self) & 0xFFFF)

    async def serve(self) -> None:
        self.server, port = await create_worker_server(WorkerServicer(self.worker, 10.0))
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = xllm_pb2_grpc.WorkerServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()
        await self.server.stop(0)
        await self.backend.close()

    def received(self, op: str) -> int:
        return self.worker.metrics.bytes_total.get(op, 0)


async def _instance(num_kv_heads: int, tp: int, backend: str) -> list[_Rank]:
    ranks = [_Rank(kv_head_range(num_kv_heads, tp, r), backend) for r in range(tp)]
    for r in ranks:
        await r.serve()
    return ranks


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
@pytest.mark.parametrize("mode", ["PULL", "PUSH"])
@pytest.mark.parametrize("heads,src_tp,dst_tp", [(4, 2, 1), (4, 1, 2), (4, 2, 2), (2, 4, 2)])
async def test_each_decode_rank_gets_exactly_its_heads(heads, src_tp, dst_tp, mode, backend):
    full = torch.randn(2, LAYERS, BLOCKS, BLOCK, heads, DIM,
                       generator=torch.Generator().manual_seed(5))
    prefill, decode = await _instance(heads, src_tp, backend), await _instance(heads, dst_tp, backend)
    try:
        for r in prefill:
            r.storage.kv.copy_(full[..., r.heads[0]:r.heads[1], :])
        plan = transfer_plan(kv_layout(LAYERS, heads, src_tp), kv_layout(LAYERS, heads, dst_tp))
        for d, rank in enumerate(decode):
            for piece in plan.to_rank(d):  # whole layers: one piece per (prefill rank, heads)
                src = prefill[piece.src_rank]
                fields = dict(src_blocks=SRC_BLOCKS, dst_blocks=DST_BLOCKS, req_id="r",
                              src_head_start=piece.src_head, dst_head_start=piece.dst_head,
                              num_heads=piece.num_heads)
                if mode == "PULL":  # the decode rank's worker reads from the prefill rank
                    st = await rank.stub.PullKVCache(xllm_pb2.PullKVCacheRequest(
                        addr=src.addr, **fields), timeout=10)
                else:  # the prefill rank's worker writes into the decode rank
                    st = await src.stub.PushKVCache(xllm_pb2.PushKVCacheRequest(
                        addr=rank.addr, **fields), timeout=10)
                assert st.ok
        own_bytes = len(SRC_BLOCKS) * decode[0].storage.block_bytes
        for rank in decode:
            h0, h1 = rank.heads
            want = full[:, :, SRC_BLOCKS, :, h0:h1, :]
            assert torch.equal(rank.storage.kv[:, :, DST_BLOCKS], want)
            others = [b for b in range(BLOCKS) if b not in DST_BLOCKS]
            assert not rank.storage.kv[:, :, others].any()  # nothing else written
            assert rank.storage.block_bytes * len(SRC_BLOCKS) == own_bytes
            if mode == "PULL":
                assert rank.received("pull") == own_bytes
        if mode == "PUSH":  # what the prefill ranks sent adds up to every decode rank's heads
            assert sum(r.received("push") for r in prefill) == own_bytes * dst_tp
        print(f"\n{backend} {mode} P TP {src_tp} -> D TP {dst_tp} ({heads} KV heads): each decode rank "
              f"received {own_bytes} bytes ({len(SRC_BLOCKS)} blocks x {h1 - h0} head(s)); "
              f"prefill ranks sent {[r.received('push') for r in prefill] if mode == 'PUSH' else '-'}")
    finally:
        for r in prefill + decode:
            await r.close()


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
async def test_out_of_range_head_slice_is_refused(backend):
    prefill, decode = await _instance(4, 2, backend), await _instance(4, 1, backend)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await decode[0].stub.PullKVCache(xllm_pb2.PullKVCacheRequest(
                addr=prefill[0].addr, src_blocks=[1], dst_blocks=[1], src_head_start=1,
                dst_head_start=0, num_heads=2), timeout=10)  # the prefill rank has 2 heads
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "head slice [1, 3) outside" in e.value.details()
        assert not decode[0].storage.kv.any()
    finally:
        for r in prefill + decode:
            await r.close()
