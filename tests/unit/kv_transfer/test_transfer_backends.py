"""Conformance: fake, tcp and ucx backends through the same ABC, in one process.

Two storages, random non-contiguous out-of-order block lists, every byte checked; pull and
push; out-of-range ids refused on both sides; a dead peer fails quickly with TransferError.
Plus fault injection of the fake backend and a CUDA test behind the ``gpu`` marker.
"""
from __future__ import annotations

import asyncio
import importlib.util
import threading
import time

import numpy as np
import pytest
import torch

from xllm_py.config import TransferConfig
from xllm_py.kv_transfer import KVTransferBackend, TransferError, create_backend
from xllm_py.kv_transfer.fake import FakeFaults
from xllm_py.kv_transfer.kv_storage import KVCacheStorage

HAS_UCXX = importlib.util.find_spec("ucxx") is not None
_needs_ucxx = pytest.mark.skipif(not HAS_UCXX, reason="ucxx not installed")
_ucx = [_needs_ucxx, pytest.mark.integration]  # the real transports listen on loopback ports
# "ucx-direct" / "ucx-gather" force the UCX data path (auto picks gather for these small slices).
BACKENDS = ["fake", pytest.param("tcp", marks=pytest.mark.integration), pytest.param("ucx", marks=_ucx),
            pytest.param("ucx-direct", marks=_ucx), pytest.param("ucx-gather", marks=_ucx)]
NUM_BLOCKS = 64


def make_storage(seed: int | None = None, dtype: str = "float32", device: str = "cpu") -> KVCacheStorage:
    s = KVCacheStorage(num_layers=2, num_blocks=NUM_BLOCKS, block_size=4, num_kv_heads=2, head_dim=8,
                       dtype=dtype, device=device)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        s.kv.copy_(torch.randn(s.kv.shape, generator=g).to(s.kv))
    return s


@pytest.fixture(params=BACKENDS)
def pair(request):
    a, b = make_storage(seed=1), make_storage(seed=2)
    cfg = TransferConfig(timeout_s=5.0)
    name, _, mode = request.param.partition("-")
    kw = {"mode": mode} if mode else {}
    ba, bb = create_backend(name, a, cfg, **kw), create_backend(name, b, cfg, **kw)
    ba.start()
    bb.start()
    yield a, ba, b, bb
    ba.close_sync()
    bb.close_sync()


def _ids_with_run(rng: np.random.Generator, n: int, run_start: int) -> np.ndarray:
    """n unique ids: a contiguous run of n // 2 ids, then scattered ids in random order."""
    run = np.arange(run_start, run_start + n // 2)
    rest = rng.permutation(np.setdiff1d(np.arange(NUM_BLOCKS), run))[: n - run.size]
    return np.concatenate([run, rest])


def random_lists(rng: np.random.Generator, n: int) -> tuple[list[int], list[int]]:
    """Paired src/dst lists mixing contiguous runs with non-contiguous, out-of-order ids."""
    return _ids_with_run(rng, n, 10).tolist(), _ids_with_run(rng, n, 40 - n // 2).tolist()


def assert_blocks_equal(dst_store: KVCacheStorage, dst: list[int], src_store: KVCacheStorage, src: list[int]) -> None:
    got = dst_store.kv[:, :, dst].view(torch.uint8)
    want = src_store.kv[:, :, src].view(torch.uint8)
    assert torch.equal(got, want)


async def test_pull_and_push_every_byte(pair) -> None:
    a, ba, b, bb = pair
    rng = np.random.default_rng(0)
    for n in (1, 7, 30):
        src, dst = random_lists(rng, n)
        before = b.kv.clone()
        r = await bb.pull(ba.address, src, dst, timeout=5)
        assert r.num_blocks == len(src) and r.num_bytes == len(src) * b.block_bytes
        assert_blocks_equal(b, dst, a, src)
        untouched = sorted(set(range(NUM_BLOCKS)) - set(dst))
        assert torch.equal(b.kv[:, :, untouched], before[:, :, untouched])
    src, dst = random_lists(rng, 20)
    a_before = a.kv.clone()
    await bb.push(ba.address, src, dst, timeout=5)
    assert_blocks_equal(a, dst, b, src)
    untouched = sorted(set(range(NUM_BLOCKS)) - set(dst))
    assert torch.equal(a.kv[:, :, untouched], a_before[:, :, untouched])


async def test_concurrent_pulls(pair) -> None:
    a, ba, b, bb = pair
    jobs = [(list(range(i * 8, i * 8 + 8))[::-1], list(range(i * 8, i * 8 + 8))) for i in range(6)]
    await asyncio.gather(*(bb.pull(ba.address, s, d, timeout=5) for s, d in jobs))
    for s, d in jobs:
        assert_blocks_equal(b, d, a, s)


async def test_empty_transfer_is_a_no_op(pair) -> None:
    a, ba, b, bb = pair
    r = await bb.pull(ba.address, [], [], timeout=5)
    assert r.num_blocks == 0 and r.num_bytes == 0


def _link_of(backend, peer_addr: str):
    """The backend's connection object for a peer (None when there is none)."""
    links = {"ucx": "_peers", "tcp": "_conns"}.get(backend.name)
    if links is None:
        return peer_addr if peer_addr in backend._linked else None  # fake: a set of linked addresses
    return getattr(backend, links).get(peer_addr)


async def test_out_of_range_refused_on_both_sides(pair) -> None:
    a, ba, b, bb = pair
    before_a, before_b = a.kv.clone(), b.kv.clone()
    await bb.link(ba.address)
    link = _link_of(bb, ba.address)
    assert link is not None
    with pytest.raises(ValueError, match="out of range"):  # our own dst ids: checked before sending
        await bb.pull(ba.address, [1, 2], [3, NUM_BLOCKS])
    with pytest.raises(TransferError, match="out of range") as ei:  # the peer's src ids: refused by the peer
        await bb.pull(ba.address, [1, NUM_BLOCKS + 5], [3, 4], timeout=5)
    assert ei.value.invalid_argument
    with pytest.raises(TransferError, match="out of range"):  # push into the peer's bad dst ids
        await bb.push(ba.address, [1, 2], [-1, 4], timeout=5)
    with pytest.raises(ValueError, match="differ"):
        await bb.pull(ba.address, [1, 2], [3])
    assert torch.equal(a.kv, before_a) and torch.equal(b.kv, before_b)
    # a refusal is an answer: the same link is kept, and still works
    assert _link_of(bb, ba.address) is link
    await bb.pull(ba.address, [5], [6], timeout=5)
    assert_blocks_equal(b, [6], a, [5])


async def test_dead_peer_fails_quickly(pair) -> None:
    a, ba, b, bb = pair
    dead = "127.0.0.1:1" if bb.name != "fake" else "fake:999999"
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        await bb.pull(dead, [1], [1], timeout=2)
    assert time.monotonic() - t0 < 3
    # a peer that closed after linking
    await bb.link(ba.address)
    await ba.close()
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        await bb.pull(ba.address, [1], [1], timeout=2)
    assert time.monotonic() - t0 < 3


def test_submit_from_a_plain_thread(pair) -> None:
    a, ba, b, bb = pair
    out: list = []
    t = threading.Thread(target=lambda: out.append(bb.submit_pull(ba.address, [9, 8], [1, 2], timeout=5).result(10)))
    t.start()
    t.join(15)
    assert out and out[0].num_blocks == 2
    assert_blocks_equal(b, [1, 2], a, [9, 8])


# ---------------------------------------------------------------------- fake: fault injection

async def test_fake_fail_next_and_probability() -> None:
    a, b = make_storage(seed=1), make_storage()
    ba = create_backend("fake", a)
    bb = create_backend("fake", b, faults=FakeFaults(fail_next=2))
    ba.start()
    bb.start()
    try:
        for _ in range(2):
            with pytest.raises(TransferError, match="injected"):
                await bb.pull(ba.address, [1], [1])
        assert torch.count_nonzero(b.kv) == 0  # a failed transfer wrote nothing
        await bb.pull(ba.address, [1], [1])
        assert_blocks_equal(b, [1], a, [1])
        assert bb.stats()["failures"] == 2 and bb.stats()["pulls"] == 1
        bb.faults = FakeFaults(fail_prob=0.5, seed=3)
        outcomes = []
        for _ in range(40):
            try:
                await bb.pull(ba.address, [2], [2])
                outcomes.append(True)
            except TransferError:
                outcomes.append(False)
        assert 5 < outcomes.count(False) < 35
        bb.faults = FakeFaults(delay_s=1.0)
        with pytest.raises(TransferError, match="timed out"):
            await bb.pull(ba.address, [3], [3], timeout=0.1)
    finally:
        await ba.close()
        await bb.close()


def test_fake_faults_validation() -> None:
    with pytest.raises(ValueError):
        FakeFaults(fail_prob=1.5)


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown KV transfer backend"):
        create_backend("rdma", make_storage())


# ---------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_UCXX, reason="needs CUDA and ucxx")
@pytest.mark.integration
async def test_ucx_cuda_pull_every_byte() -> None:
    a, b = make_storage(seed=1, device="cuda"), make_storage(device="cuda")
    ba: KVTransferBackend = create_backend("ucx", a)
    bb: KVTransferBackend = create_backend("ucx", b)
    ba.start()
    bb.start()
    try:
        src, dst = [5, 6, 7, 20, 3], [0, 1, 2, 40, 63]
        await bb.pull(ba.address, src, dst, timeout=10)
        torch.cuda.synchronize()
        assert_blocks_equal(b, dst, a, src)
        await bb.push(ba.address, [0, 1], [30, 31], timeout=10)
        torch.cuda.synchronize()
        assert_blocks_equal(a, [30, 31], b, [0, 1])
    finally:
        await ba.close()
        await bb.close()


@pytest.mark.integration
def test_a_peer_process_that_cannot_start_is_reported_and_reaped() -> None:
    from xllm_py.kv_transfer._peer_main import peer_process

    with pytest.raises(RuntimeError, match="peer process failed to start"):
        with peer_process("--backend", "no-such-backend", num_blocks=2):
            pass
