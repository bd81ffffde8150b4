"""UCX mapped-pool path: a peer's KV pool, allocated by UCX as shared memory, mapped into the
puller (``ucp_rkey_ptr``); pulls and pushes are memcpys (ucx/shared_memory.py)."""
from __future__ import annotations

import contextlib
import gc
import importlib.util

import numpy as np
import pytest
import torch

from xllm_py.config import EngineConfig, InstanceRole, TransferConfig
from xllm_py.kv_transfer import TransferError, create_backend
from xllm_py.kv_transfer._peer_main import fill_pattern, peer_process
from xllm_py.kv_transfer.factory import mappable_host_allocator, pool_allocator
from xllm_py.kv_transfer.kv_storage import KVCacheStorage, huge_page_allocator
from tests.unit.ucx_utils import SHAPE, linked, storage

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx not installed")

def test_copy_chunks_copies_exactly_the_chunks() -> None:
    from xllm_py.kv_transfer.ucx.shared_memory import copy_chunks
    from xllm_py.model import cpu_kernels

    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    for kernels in (True, False):
        dst = np.zeros(1 << 20, dtype=np.uint8)
        want = dst.copy()
        # odd offsets and lengths around the 1 KB streaming threshold and the 32-byte alignment
        lens = [1, 31, 33, 1023, 1024, 1025, 4096 + 7, 20000, 65536 + 13]
        so, do, rows_s, rows_d = 3, 5, [], []
        for n in lens:
            rows_s.append((src.ctypes.data + so, n))
            rows_d.append((dst.ctypes.data + do, n))
            want[do:do + n] = src[so:so + n]
            so, do = so + n + 17, do + n + 29
        s_arr, d_arr = (np.array(r, dtype=np.uint64) for r in (rows_s, rows_d))
        ctx = contextlib.nullcontext() if kernels else cpu_kernels.disabled()
        with ctx:
            copy_chunks(d_arr, s_arr)
        assert np.array_equal(dst, want), f"kernels={kernels}"


def test_copy_chunks_refuses_unequal_lengths() -> None:
    from xllm_py.model import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    a = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="lengths differ"):
        cpu_kernels.copy_chunks(np.array([[a.ctypes.data, 8]], dtype=np.uint64),
                                np.array([[a.ctypes.data + 32, 9]], dtype=np.uint64))


def test_shared_allocation_is_zeroed_exported_and_freed_with_its_last_view() -> None:
    from xllm_py.kv_transfer.ucx import shared_memory

    t = mappable_host_allocator()(3 << 20)
    assert t.dtype == torch.uint8 and t.numel() == 3 << 20 and int(t.count_nonzero()) == 0
    mem = shared_memory.lookup(t.data_ptr())
    assert mem is not None and t.data_ptr() % 4096 == shared_memory.POOL_OFFSET
    exp = mem.export()
    assert exp["nbytes"] == 3 << 20 and exp["base"] + exp["offset"] == t.data_ptr() and len(exp["rkey"]) > 0
    fin = mem._finalizer
    view = t[100:200]
    del mem, t
    gc.collect()
    assert fin.alive  # a view still holds the memory
    view.fill_(1)
    del view
    gc.collect()
    assert not fin.alive


def test_remote_pool_is_released_only_after_its_last_copy() -> None:
    from xllm_py.kv_transfer.ucx.shared_memory import RemotePool

    later, destroyed = [], []

    class Probe(RemotePool):
        def _destroy(self) -> None:
            destroyed.append(True)

    pool = Probe(0, 0, 0, later.append)
    assert pool.acquire() and pool.acquire()
    pool.close()
    assert not pool.acquire()  # no new copies once closed
    pool.release()
    assert later == [] and destroyed == []
    pool.release()  # the last copy: the release goes to the IovWorker thread
    assert len(later) == 1 and destroyed == []
    later[0]()
    assert destroyed == [True]
    idle = Probe(0, 0, 0, later.append)
    idle.close()  # nothing in flight: released at once
    assert destroyed == [True, True]


@pytest.mark.integration
async def test_pulls_and_pushes_are_memcpys_of_exactly_the_blocks() -> None:
    a, b = storage(1024, seed=1, mappable=True), storage(900, seed=2, mappable=True)
    async with linked(a, b) as (ba, bb):
        assert bb._peers[ba.address].mapped is not None
        served = ba.stats()["served"]
        rng = np.random.default_rng(3)
        for n in (1, 7, 800):  # 800 blocks = 1.2 MB: the copy thread; the others inline
            src, dst = rng.permutation(1024)[:n], rng.permutation(900)[:n]
            before = b.kv.clone()
            r = await bb.pull(ba.address, src, dst, timeout=10)
            assert r.num_bytes == n * b.block_bytes and r.path == "mapped"
            assert torch.equal(b.kv[:, :, dst], a.kv[:, :, src])
            rest = np.setdiff1d(np.arange(900), dst)
            assert torch.equal(b.kv[:, :, rest], before[:, :, rest])
        src, dst = rng.permutation(900)[:50], rng.permutation(1024)[:50]
        before = a.kv.clone()
        await bb.push(ba.address, src, dst, timeout=10)
        assert torch.equal(a.kv[:, :, dst], b.kv[:, :, src])
        rest = np.setdiff1d(np.arange(1024), dst)
        assert torch.equal(a.kv[:, :, rest], before[:, :, rest])
        assert bb.stats()["mapped"] == 4 and bb.stats()["pulls"] == 3 and bb.stats()["pushes"] == 1
        assert ba.stats()["served"] == served  # the owner took no part


@pytest.mark.integration
async def test_out_of_range_or_duplicate_blocks_are_refused_and_nothing_moves() -> None:
    a, b = storage(64, seed=4, mappable=True), storage(64, seed=5, mappable=True)
    async with linked(a, b) as (ba, bb):
        a0, b0 = a.kv.clone(), b.kv.clone()
        for src in ([63, 64], [-1], [10, 1 << 40]):
            with pytest.raises(TransferError, match="out of range") as e:
                await bb.pull(ba.address, src, list(range(len(src))), timeout=10)
            assert e.value.invalid_argument
        with pytest.raises(TransferError, match="duplicate"):
            await bb.push(ba.address, [1, 2, 3], [5, 9, 5], timeout=10)
        with pytest.raises(TransferError, match="out of range"):
            await bb.push(ba.address, [1], [64], timeout=10)
        assert torch.equal(a.kv, a0) and torch.equal(b.kv, b0)
        assert ba.address in bb._peers  # a refusal keeps the link
        await bb.pull(ba.address, [63], [0], timeout=10)
        assert torch.equal(b.kv[:, :, 0], a.kv[:, :, 63])


@pytest.mark.integration
async def test_private_pools_and_map_off_take_the_iov_path(monkeypatch) -> None:
    a, b = storage(64, seed=6, mappable=False), storage(64, mappable=True)
    async with linked(a, b) as (ba, bb):
        assert bb._peers[ba.address].mapped is None and bb._peers[ba.address].iov_key is not None
        assert (await bb.pull(ba.address, [5, 3], [1, 2], timeout=10)).path == "iov"
        assert torch.equal(b.kv[:, :, [1, 2]], a.kv[:, :, [5, 3]]) and bb.stats()["mapped"] == 0
    monkeypatch.setenv("XLLM_UCX_MAP", "0")
    assert mappable_host_allocator() is None
    a, b = storage(64, seed=7, mappable=False), storage(64, mappable=False)
    async with linked(a, b) as (ba, bb):
        assert bb._peers[ba.address].mapped is None


@pytest.mark.integration
async def test_unlink_unmaps_and_a_relink_maps_again() -> None:
    a, b = storage(64, seed=8, mappable=True), storage(64, mappable=True)
    async with linked(a, b) as (ba, bb):
        first = bb._peers[ba.address].mapped.pool
        await bb.unlink(ba.address)
        assert not first.acquire()  # closed
        await bb.pull(ba.address, [9], [9], timeout=10)  # relinks on demand
        assert bb._peers[ba.address].mapped is not None
        assert torch.equal(b.kv[:, :, 9], a.kv[:, :, 9])


@pytest.mark.integration
async def test_mapped_pull_from_another_process_moves_every_byte() -> None:
    shape = dict(SHAPE, num_blocks=512)
    with peer_process("--backend", "ucx", "--seed", "11", "--dtype", "float32",
                      **shape) as (_, info):
        want = KVCacheStorage(**shape)
        fill_pattern(want, 11)
        b = storage(512, mappable=True)
        bb = create_backend("ucx", b, TransferConfig())
        bb.start()
        try:
            src = np.random.default_rng(12).permutation(512)  # every block, out of order
            dst = np.arange(512)
            await bb.pull(info["transfer_addr"], src, dst, timeout=20)
            assert bb._peers[info["transfer_addr"]].mapped is not None and bb.stats()["mapped"] == 1
            assert torch.equal(b.kv, want.kv[:, :, src])
        finally:
            await bb.close()


def test_engines_allocate_mappable_pools_only_where_they_transfer() -> None:
    ucx = TransferConfig(backend="ucx")
    assert pool_allocator(EngineConfig(role=InstanceRole.PREFILL, transfer=ucx)) is not None
    assert pool_allocator(EngineConfig(role=InstanceRole.DECODE, transfer=ucx)) is not None
    assert pool_allocator(EngineConfig(role=InstanceRole.MIX, transfer=ucx)) is huge_page_allocator
    assert pool_allocator(EngineConfig(role=InstanceRole.PREFILL,
                                       transfer=TransferConfig(backend="tcp"))) is huge_page_allocator
    assert pool_allocator(EngineConfig(role=InstanceRole.MIX, device="cuda")) is None
