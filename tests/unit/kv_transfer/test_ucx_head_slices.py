"""UCX KV head slices (instances of different TP, ucx/slices.py) on every data path.

A pool of 4 KV heads and one of 2 (same layers, block size, head_dim, dtype) link; pulls
and pushes of head ranges over the mapped, iov and tag paths put exactly
``gather_heads`` of the source into the destination's head range, and nothing else moves
(other heads, other blocks). Whole blocks between the two are refused, so is a head range
outside either pool, on the requester and, when a peer skips that check, on the owner.
"""
from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest
import torch

from xllm_py.kv_transfer import TransferError
from xllm_py.kv_transfer.factory import mappable_host_allocator
from xllm_py.kv_transfer.head_slices import gather_heads, slice_block_bytes
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from tests.unit.ucx_utils import linked
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx not installed")

SHAPE = dict(num_layers=3, block_size=4, head_dim=8)
# (path, backend mode, pools allocated mappable)
PATHS = [("mapped", "auto", True), ("iov", "iov", False), ("tag", "direct", False)]


def storage(num_kv_heads: int, num_blocks: int, seed: int, mappable: bool = False,
            device: str = "cpu", **shape: int) -> KVCacheStorage:
    s = KVCacheStorage(num_blocks=num_blocks, num_kv_heads=num_kv_heads, **{**SHAPE, **shape},
                       allocator=mappable_host_allocator() if mappable else None, device=device)
    s.kv.copy_(torch.randn(s.kv.shape, generator=torch.Generator().manual_seed(seed)).to(device))
    return s


def _lists(rng: np.random.Generator, n: int, src_blocks: int, dst_blocks: int) -> tuple[list, list]:
    """n source / destination ids: a contiguous run of n // 2, then scattered, shuffled ids."""
    run = n // 2
    src = np.concatenate([np.arange(3, 3 + run), rng.permutation(np.arange(3 + run, src_blocks))[:n - run]])
    dst = np.concatenate([np.arange(7, 7 + run), rng.permutation(np.arange(7 + run, dst_blocks))[:n - run]])
    return src.tolist(), dst.tolist()


def assert_slice_moved(dst_store: KVCacheStorage, before: torch.Tensor, dst: list, dst_start: int,
                       src_store: KVCacheStorage, src: list, src_start: int, count: int) -> None:
    """The destination's heads [dst_start, +count) of blocks ``dst`` are the source's slice;
    every other byte of the destination pool is as ``before``."""
    got = dst_store.kv[:, :, dst, :, dst_start:dst_start + count]
    assert torch.equal(got, gather_heads(src_store, src, src_start, count))
    mask = torch.ones(dst_store.kv.shape, dtype=torch.bool)
    mask[:, :, dst, :, dst_start:dst_start + count] = False
    assert torch.equal(dst_store.kv[mask], before[mask])


# ---------------------------------------------------------------------- pieces (no transfers)

def test_head_chunks_are_the_rows_of_the_slice() -> None:
    from xllm_py.kv_transfer.ucx.iov_protocol import IovLayout
    from xllm_py.kv_transfer.ucx.slices import head_chunks

    s = storage(4, 32, seed=1)
    layout = IovLayout(s)
    runs = np.array([[30, 0, 2], [3, 7, 1], [0, 31, 1]], dtype=np.int64)
    flat = s.kv.view(torch.uint8).reshape(-1)
    base = s.kv.data_ptr()
    for side in (0, 1):
        for start, count in ((0, 4), (1, 2), (3, 1)):
            chunks = head_chunks(layout, runs, side, start, count)
            got = torch.cat([flat[int(a) - base:int(a) - base + int(n)] for a, n in chunks])
            ids = [r[side] + i for r in runs.tolist() for i in range(r[2])]
            # wire order: run-major, then kv, then layer, then slot
            want = torch.cat([s.kv[k, layer, r[side]:r[side] + r[2], :, start:start + count].reshape(-1)
                              for r in runs.tolist() for k in range(2) for layer in range(3)])
            assert torch.equal(got, want.view(torch.uint8))
            assert int(chunks[:, 1].sum()) == len(ids) * slice_block_bytes(s, count)
    merged = head_chunks(layout, runs, 0, 0, 4, merge=True)  # every head: whole (kv, layer) slices
    assert np.array_equal(merged, layout.chunks(runs, 0))


def test_request_carries_heads() -> None:
    from xllm_py.kv_transfer.ucx.iov_protocol import OP_PULL, OP_PUSH, decode_request, encode_request

    msg = encode_request(OP_PUSH, 7, 1 << 59, 2.5, [(1, 2, 3), (9, 8, 1)], heads=(2, 0, 1))
    op, req, tok, timeout, runs, heads = decode_request(msg)
    assert (op, req, tok, timeout, heads) == (OP_PUSH, 7, 1 << 59, 2.5, (2, 0, 1))
    assert runs.tolist() == [[1, 2, 3], [9, 8, 1]]
    assert decode_request(encode_request(OP_PULL, 1, 2, 1.0, [(0, 0, 1)]))[5] is None
    with pytest.raises(ValueError):  # announces heads it does not carry
        decode_request(msg[:-8])


def test_refusal_rules() -> None:
    from xllm_py.kv_transfer.ucx.slices import parse_heads, refusal

    h4, h2 = (4, 3), (2, 3)  # (KV heads, layers)
    assert refusal(None, h4, h4, 0) is None and refusal(None, h4, None, 1) is None
    assert "whole KV blocks cannot move between pools of 4 KV heads x 3 layers and 2 x 3" in \
        refusal(None, h4, h2, 0)
    assert refusal((2, 0, 2), h4, h2, 0) is None and refusal((2, 0, 2), h2, h4, 1) is None
    assert "outside this pool's 4 KV heads" in refusal((3, 0, 2), h4, h2, 0)
    assert "outside the peer's 2 KV heads" in refusal((2, 1, 2), h4, h2, 0)
    assert "outside this pool's" in refusal((0, 0, 0), h4, h2, 0)  # empty slice
    assert "outside this pool's" in refusal((-1, 0, 1), h4, h2, 0)
    # pipeline stages: pools of other layers exchange layer slices only
    assert "whole KV blocks cannot move" in refusal(None, (2, 3), (2, 1), 0)
    assert "every layer of a block cannot move between pools of 3 and 1" in \
        refusal((0, 0, 2), (2, 3), (2, 1), 0)
    assert refusal((0, 0, 2, 2, 0, 1), (2, 3), (2, 1), 0) is None
    assert "layer slice [2, 4) outside this pool's 3 layers" in \
        refusal((0, 0, 2, 2, 0, 2), (2, 3), (2, 4), 0)
    assert "layer slice [3, 5) outside the peer's 4 layers" in \
        refusal((0, 0, 2, 0, 3, 2), (2, 3), (2, 4), 0)
    assert parse_heads(None) is None and parse_heads([1, 0, 2]) == (1, 0, 2)
    assert parse_heads([1, 0, 2, 0, 1, 1]) == (1, 0, 2, 0, 1, 1)
    for bad in ([1, 2], "abc", [1.0, 0, 1], [1, 0, True], {"a": 1}, [1, 0, 2, 0]):
        assert "bad head slice" in parse_heads(bad)


# ---------------------------------------------------------------------- transfers

@pytest.mark.integration
@pytest.mark.parametrize("path,mode,mappable", PATHS)
async def test_head_slices_pull_and_push_exactly_their_bytes(path: str, mode: str, mappable: bool) -> None:
    a, b = storage(4, 1200, seed=1, mappable=mappable), storage(2, 1100, seed=2, mappable=mappable)
    async with linked(a, b, mode) as (ba, bb):
        assert bb._peers[ba.address].path == path
        rng = np.random.default_rng(3)
        # (n blocks, heads): the puller's every head from the middle of the owner's (P TP 1
        # -> D TP 2), one head into the puller's second (P TP 2 -> D TP 1, half from each
        # prefill rank); 1000 blocks of 2 heads = 1.5 MB: the mapped path's copy thread
        for n, heads in ((1, (1, 0, 2)), (9, (3, 1, 1)), (1000, (2, 0, 2)), (250, (0, 1, 1))):
            src, dst = _lists(rng, n, a.num_blocks, b.num_blocks)
            before = b.kv.clone()
            r = await bb.pull(ba.address, src, dst, timeout=10, heads=heads)
            assert r.path == path and r.num_blocks == n and r.num_bytes == n * slice_block_bytes(b, heads[2])
            assert_slice_moved(b, before, dst, heads[1], a, src, heads[0], heads[2])
        for n, heads in ((5, (0, 2, 2)), (200, (1, 0, 1))):
            src, dst = _lists(rng, n, b.num_blocks, a.num_blocks)
            before = a.kv.clone()
            r = await bb.push(ba.address, src, dst, timeout=10, heads=heads)
            assert r.path == path and r.num_bytes == n * slice_block_bytes(a, heads[2])
            assert_slice_moved(a, before, dst, heads[1], b, src, heads[0], heads[2])
        # the other direction of TP: the owner holds fewer heads than the requester
        before = a.kv.clone()
        async with linked(b, a, mode) as (ob, oa):
            await oa.pull(ob.address, [4, 5, 6], [20, 21, 60], timeout=10, heads=(0, 2, 2))
            assert_slice_moved(a, before, [20, 21, 60], 2, b, [4, 5, 6], 0, 2)
        if path != "mapped":  # the owner served them all (the mapped path needs no owner)
            await wait_until(lambda: ba.stats()["served"] >= 6, 5, 0.01)


@pytest.mark.integration
@pytest.mark.parametrize("path,mode,mappable", PATHS)
async def test_whole_blocks_and_bad_head_ranges_are_refused(path: str, mode: str, mappable: bool) -> None:
    a, b = storage(4, 64, seed=4, mappable=mappable), storage(2, 64, seed=5, mappable=mappable)
    async with linked(a, b, mode) as (ba, bb):
        a0, b0 = a.kv.clone(), b.kv.clone()
        for op in (bb.pull, bb.push):
            with pytest.raises(TransferError, match="whole KV blocks cannot move between pools of 2 KV heads x 3 layers and 4 x 3") as e:
                await op(ba.address, [1, 2], [3, 4], timeout=10)
            assert e.value.invalid_argument
        with pytest.raises(TransferError, match=r"head slice \[3, 5\) outside the peer's 4 KV heads"):
            await bb.pull(ba.address, [1], [1], timeout=10, heads=(3, 0, 2))
        with pytest.raises(ValueError, match=r"head slice \[1, 3\) outside this pool's 2 KV heads"):
            await bb.pull(ba.address, [1], [1], timeout=10, heads=(0, 1, 2))
        # a requester that skips its own check: the owner refuses (the mapped path has no
        # owner in a transfer: the same check runs in the path itself), on the backend's loop
        p = bb._peers[ba.address]
        data_path = bb._path(p)
        owner = "peer refused: " if path != "mapped" else "ucx: "
        bad = [("pull", [(1, 1, 1)], (3, 0, 2), r"head slice \[3, 5\) outside this pool's 4 KV heads"),
               ("push", [(1, 1, 2)], (0, 3, 2), r"head slice \[3, 5\) outside this pool's 4 KV heads"),
               ("pull", [(1, 1, 1)], None, "whole KV blocks cannot move"),
               ("push", [(1, 1, 1)], None, "whole KV blocks cannot move")]
        if path == "mapped":  # (there the pools are ours and the peer's, from our side)
            bad[0] = ("pull", [(1, 1, 1)], (3, 0, 2), r"head slice \[3, 5\) outside the peer's 4 KV heads")
            bad[1] = ("push", [(1, 1, 2)], (0, 3, 2), r"head slice \[3, 5\) outside the peer's 4 KV heads")
        for what, runs, heads, message in bad:
            with pytest.raises(TransferError, match=owner + message) as e:
                await asyncio.wrap_future(bb._lt.submit(data_path.transfer(p, what, runs, 10, heads)))
            assert e.value.invalid_argument
        assert torch.equal(a.kv, a0) and torch.equal(b.kv, b0)  # nothing written anywhere
        assert bb._peers[ba.address] is p  # a refusal keeps the link, which still works
        await bb.pull(ba.address, [9], [8], timeout=10, heads=(1, 1, 1))
        assert_slice_moved(b, b0, [8], 1, a, [9], 1, 1)


@pytest.mark.integration
@pytest.mark.parametrize("path,mode,mappable", PATHS)
async def test_layer_slices_between_pipeline_stages_move_exactly_their_layers(
        path: str, mode: str, mappable: bool) -> None:
    """A stage's pool (1 layer, 2 heads) and a whole pool (3 layers, 4 heads): the stage's
    layer and heads land in layer 2 of the whole pool's head range and back; whole blocks
    and every-layer slices between them are refused."""
    a = storage(4, 300, seed=13, mappable=mappable)  # 3 layers
    b = storage(2, 300, seed=14, mappable=mappable, num_layers=1)
    async with linked(a, b, mode) as (ba, bb):
        assert bb._peers[ba.address].path == path and bb._peers[ba.address].shape == (4, 3)
        rng = np.random.default_rng(5)
        for n, heads in ((3, (1, 0, 2, 2, 0, 1)), (250, (0, 1, 1, 0, 0, 1))):
            src, dst = _lists(rng, n, a.num_blocks, b.num_blocks)
            before = b.kv.clone()
            r = await bb.pull(ba.address, src, dst, timeout=10, heads=heads)
            assert r.path == path and r.num_bytes == n * slice_block_bytes(b, heads[2], 1)
            l0 = heads[3]
            assert torch.equal(b.kv[:, :, dst, :, heads[1]:heads[1] + heads[2]],
                               a.kv[:, l0:l0 + 1, src, :, heads[0]:heads[0] + heads[2]])
            mask = torch.ones(b.kv.shape, dtype=torch.bool)
            mask[:, :, dst, :, heads[1]:heads[1] + heads[2]] = False
            assert torch.equal(b.kv[mask], before[mask])
        before = a.kv.clone()  # push: the stage's layer into layer 1 of the whole pool
        r = await bb.push(ba.address, [4, 5], [40, 41], timeout=10, heads=(0, 2, 2, 0, 1, 1))
        assert torch.equal(a.kv[:, 1:2, [40, 41], :, 2:4], b.kv[:, :, [4, 5]])
        mask = torch.ones(a.kv.shape, dtype=torch.bool)
        mask[:, 1, [40, 41], :, 2:4] = False
        assert torch.equal(a.kv[mask], before[mask])
        for heads, message in ((None, "whole KV blocks cannot move"),
                               ((0, 0, 2), "every layer of a block cannot move"),
                               ((0, 0, 2, 3, 0, 1), r"layer slice \[3, 4\) outside the peer's 3")):
            with pytest.raises(TransferError, match=message):
                await bb.pull(ba.address, [1], [1], timeout=10, heads=heads)


@pytest.mark.integration
async def test_a_malformed_iov_request_is_dropped_not_fatal() -> None:
    from xllm_py.kv_transfer.ucx.iov_protocol import OP_PULL, encode_request

    a, b = storage(4, 64, seed=6), storage(2, 64, seed=7)
    async with linked(a, b, "iov") as (ba, bb):
        msg = encode_request(OP_PULL, 1, bb._token, 1.0, [(1, 1, 1)], heads=(0, 0, 2))
        assert ba._iov_path.on_request(0, msg[:-8]) is None  # heads announced, not there
        await bb.pull(ba.address, [2], [3], timeout=10, heads=(2, 0, 2))  # the worker still serves
        assert torch.equal(b.kv[:, :, 3], a.kv[:, :, 2, :, 2:4])


@pytest.mark.integration
async def test_link_accepts_other_kv_heads_only(caplog) -> None:
    """Pools of other KV heads link, and the iov link's warm-up pulls slices (served, no
    failure); another head_dim is refused at link time."""
    a, b = storage(4, 64, seed=8), storage(1, 64, seed=9)
    with caplog.at_level("WARNING"):
        async with linked(a, b, "iov") as (ba, bb):
            assert bb._peers[ba.address].shape == (4, 3)
            await wait_until(lambda: ba.stats()["served"] >= bb.config.warmup_pulls, 5, 0.01)
    assert not [r for r in caplog.records if "warm-up" in r.getMessage()]
    c = storage(4, 64, seed=10, head_dim=16)
    with pytest.raises(TransferError, match="incompatible KV block layout"):
        async with linked(c, b):
            pass


@pytest.mark.gpu
@pytest.mark.integration
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_pools_move_head_slices_on_the_tag_path() -> None:
    a, b = storage(4, 64, seed=11, device="cuda"), storage(2, 64, seed=12, device="cuda")
    async with linked(a, b) as (ba, bb):
        assert bb._peers[ba.address].path == "tag"
        before = b.kv.clone()
        await bb.pull(ba.address, [5, 6, 20], [0, 1, 40], timeout=10, heads=(2, 0, 2))
        torch.cuda.synchronize()
        assert torch.equal(b.kv[:, :, [0, 1, 40]], gather_heads(a, [5, 6, 20], 2, 2).cuda())
        rest = [i for i in range(64) if i not in (0, 1, 40)]
        assert torch.equal(b.kv[:, :, rest], before[:, :, rest])
        a_before = a.kv.clone()
        await bb.push(ba.address, [3], [30], timeout=10, heads=(1, 3, 1))
        torch.cuda.synchronize()
        assert torch.equal(a.kv[:, :, 30, :, 3], b.kv[:, :, 3, :, 1])
        assert torch.equal(a.kv[:, :, 30, :, :3], a_before[:, :, 30, :, :3])
