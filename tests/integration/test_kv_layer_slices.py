"""KV between pipeline stages, through each rank's real WorkerService (gRPC) and the tcp
and ucx backends (ucx: private pools, the iov path; the mapped and tag paths:
tests/unit/kv_transfer/test_ucx_head_slices.py): for prefill x decode layouts of TP and PP (uneven stages, replicated heads),
PULL and PUSH, each decode rank ends with exactly the layers and KV heads it holds, taken
from the prefill ranks that hold them at each pool's layer offset
(``parallel/instance_peers.rank_moves`` of ``model/kv_layout.transfer_plan``, moves
addressed to workers in process order), nothing else written; the bytes moved add up to
the prompt's KV once per decode copy. A layer range outside a pool is refused."""
from __future__ import annotations

import grpc
import pytest
import torch

from tests.integration.test_kv_head_slices import BLOCK, BLOCKS, DIM, DST_BLOCKS, SRC_BLOCKS, _Rank
from xllm_py.kv_transfer.head_slices import slice_block_bytes
from xllm_py.model.kv_layout import KVLayout, kv_layout, transfer_plan, worker_rank
from xllm_py.parallel.instance_peers import rank_moves
from xllm_py.proto import xllm_pb2

pytestmark = pytest.mark.integration

LAYERS = 4


async def _instance(layout: KVLayout, backend: str) -> list[_Rank]:
    """The instance's workers in process order (``worker_rank``)."""
    by_worker: dict[int, _Rank] = {}
    for i, r in enumerate(layout.ranks):
        by_worker[worker_rank(layout, i)] = _Rank(r.heads, backend, r.layers)
    ranks = [by_worker[w] for w in range(len(layout.ranks))]
    for r in ranks:
        await r.serve()
    return ranks


def _slice_fields(heads) -> dict:
    if heads is None:
        return {}
    fields = dict(src_head_start=heads[0], dst_head_start=heads[1], num_heads=heads[2])
    if len(heads) == 6:
        fields.update(src_layer_start=heads[3], dst_layer_start=heads[4], num_layers=heads[5])
    return fields


LAYOUTS = [  # (heads, prefill (tp, pp, partition), decode (tp, pp, partition))
    (2, (1, 2, None), (1, 1, None)), (2, (1, 2, None), (2, 1, None)),
    (2, (1, 3, (2, 1, 1)), (1, 2, (1, 3))), (2, (1, 1, None), (1, 2, (3, 1))),
    (1, (1, 2, None), (2, 1, None)),  # one KV head, replicated on the decode's two ranks
    (2, (1, 2, None), (1, 2, None)),  # equal stages: whole blocks
]


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
@pytest.mark.parametrize("mode", ["PULL", "PUSH"])
@pytest.mark.parametrize("heads,src,dst", LAYOUTS)
async def test_each_decode_rank_gets_exactly_its_layers_and_heads(heads, src, dst, mode, backend):
    full = torch.randn(2, LAYERS, BLOCKS, BLOCK, heads, DIM,
                       generator=torch.Generator().manual_seed(7))
    src_layout, dst_layout = kv_layout(LAYERS, heads, *src), kv_layout(LAYERS, heads, *dst)
    prefill, decode = await _instance(src_layout, backend), await _instance(dst_layout, backend)
    try:
        for r in prefill:
            r.storage.kv.copy_(full[:, r.layers[0]:r.layers[1], :, :, r.heads[0]:r.heads[1]])
        for m in rank_moves(transfer_plan(src_layout, dst_layout)):
            s, d = prefill[m.src_rank], decode[m.dst_rank]
            fields = dict(src_blocks=SRC_BLOCKS, dst_blocks=DST_BLOCKS, req_id="r",
                          **_slice_fields(m.heads))
            if mode == "PULL":
                st = await d.stub.PullKVCache(xllm_pb2.PullKVCacheRequest(addr=s.addr, **fields),
                                              timeout=10)
            else:
                st = await s.stub.PushKVCache(xllm_pb2.PushKVCacheRequest(addr=d.addr, **fields),
                                              timeout=10)
            assert st.ok
        others = [b for b in range(BLOCKS) if b not in DST_BLOCKS]
        for r in decode:
            (l0, l1), (h0, h1) = r.layers, r.heads
            want = full[:, l0:l1, SRC_BLOCKS, :, h0:h1, :]
            assert torch.equal(r.storage.kv[:, :, DST_BLOCKS], want), (r.layers, r.heads)
            assert not r.storage.kv[:, :, others].any()  # nothing else written
            own = len(SRC_BLOCKS) * r.storage.block_bytes
            if mode == "PULL":
                assert r.received("pull") == own
        moved = (sum(r.received("push") for r in prefill) if mode == "PUSH"
                 else sum(r.received("pull") for r in decode))
        assert moved == sum(len(SRC_BLOCKS) * r.storage.block_bytes for r in decode)
        copies = 2 if heads < dst[0] else 1  # a replicated head: each decode rank its copy
        assert moved == copies * len(SRC_BLOCKS) * slice_block_bytes(decode[0].storage, heads,
                                                                     LAYERS)
    finally:
        for r in prefill + decode:
            await r.close()


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
async def test_a_layer_range_outside_a_pool_is_refused(backend):
    prefill = await _instance(kv_layout(LAYERS, 2, 1, 2), backend)  # 2 layers a stage
    decode = await _instance(kv_layout(LAYERS, 2, 1, 1), backend)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await decode[0].stub.PullKVCache(xllm_pb2.PullKVCacheRequest(
                addr=prefill[0].addr, src_blocks=[1], dst_blocks=[1], src_head_start=0,
                dst_head_start=0, num_heads=2, src_layer_start=1, dst_layer_start=0,
                num_layers=2), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "layer slice [1, 3) outside" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:  # a layer range needs heads
            await decode[0].stub.PullKVCache(xllm_pb2.PullKVCacheRequest(
                addr=prefill[0].addr, src_blocks=[1], dst_blocks=[1], src_layer_start=2,
                num_layers=2), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "needs num_heads" in e.value.details()
        assert not decode[0].storage.kv.any()
    finally:
        for r in prefill + decode:
            await r.close()
