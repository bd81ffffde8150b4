"""The mapped path: a same-host peer's KV pool mapped into this process, transfers are memcpys.

Where both pools were allocated by UCX as shared memory (shared_memory.py), our pool's
remote key travels in the link hello (``pool_export``); at link time the requester maps
the peer's whole pool over its iov endpoint to it (``map_peer``, page tables filled at
once). A pull or push then checks the peer's side of every run against its pool here (the
peer takes no part) and runs one native memcpy call (``start``). Where mapping is not
possible (another host or IPC namespace, a private pool, ``UCXConfig.map_peer_pools`` off)
the link takes the iov path. The mapping is released with the iov endpoint (unlink).
A slice (peers of different TP or PP) is the same one call, one row per token slot of
each (run, kv, layer) of its layers (slices.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

import numpy as np

from xllm_py.config import UCXConfig
from xllm_py.kv_transfer.base import Run, TransferError, runs_to_ids
from xllm_py.kv_transfer.head_slices import Heads, layer_span
from xllm_py.kv_transfer.kv_storage import KVCacheMeta, KVCacheStorage, prefault_pages
from xllm_py.kv_transfer.ucx import iov_protocol, shared_memory, slices
from xllm_py.kv_transfer.ucx.iov_worker import IovWorker
from xllm_py.kv_transfer.ucx.peer import Peer

logger = logging.getLogger(__name__)


class MappedPool:
    """A linked peer's pool mapped into this process: transfers with it are memcpys."""

    __slots__ = ("pool", "layout")

    def __init__(self, pool: shared_memory.RemotePool, layout: iov_protocol.IovLayout) -> None:
        self.pool, self.layout = pool, layout


class MappedPath:
    name = "mapped"

    def __init__(self, storage: KVCacheStorage, worker: IovWorker, layout: iov_protocol.IovLayout,
                 config: UCXConfig, stats: dict[str, int]) -> None:
        self.storage = storage
        self.worker = worker
        self.layout = layout  # ours
        self.config = config
        self._stats = stats
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None

    def pool_export(self) -> dict | None:
        """Our pool's remote key when UCX allocated it as mappable memory (see shared_memory.py)."""
        if not self.config.map_peer_pools:
            return None
        mem = shared_memory.lookup(self.storage.kv.data_ptr())
        return None if mem is None else mem.export()

    async def map_peer(self, key: Any, export: dict, meta: KVCacheMeta, peer_addr: str) -> MappedPool | None:
        """Map the peer's pool over our iov endpoint to it; None (the iov path) when that is not
        possible here. The mapping's page tables are filled now, not by the first pulls."""
        if not self.config.map_peer_pools:
            return None
        need = meta.num_blocks * meta.block_bytes
        if int(export.get("nbytes", 0)) != need:
            logger.warning("ucx: %s exports a pool of %s bytes, its layout needs %d: not mapped",
                           peer_addr, export.get("nbytes"), need)
            return None
        try:
            pool = await asyncio.wrap_future(self.worker.map_remote(key, export))
        except Exception as e:  # noqa: BLE001 - e.g. UNREACHABLE: another host or IPC namespace
            logger.info("ucx: cannot map the KV pool of %s (%s); using the iov path", peer_addr, e)
            return None
        t0 = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(None, prefault_pages, pool.address, pool.nbytes)
        layout = iov_protocol.IovLayout.of_pool(pool.address, meta)
        logger.info("ucx: mapped the KV pool of %s (%d MB, prefaulted in %.1f ms): transfers are memcpys",
                    peer_addr, need >> 20, (time.perf_counter() - t0) * 1e3)
        return MappedPool(pool, layout)

    async def transfer(self, p: Peer, what: str, runs: list[Run], timeout: float,
                       heads: Heads | None = None) -> None:
        await asyncio.wrap_future(self.start(p, what, runs, timeout, heads))

    def start(self, p: Peer, what: str, runs: list[Run], timeout: float,
              heads: Heads | None = None) -> concurrent.futures.Future:
        """A pull or push with a mapped peer: the peer's side of every run (and head slice)
        checked against its pool here, then one native memcpy call: on the calling thread up
        to ``UCXConfig.inline_copy_bytes`` (a thread hop costs more than the copy), else on
        our copy thread. A memcpy cannot hang: no deadline (``timeout`` is not used)."""
        m = p.mapped
        arr = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
        theirs = 0 if what == "pull" else 1
        err = slices.refusal(heads, self.layout.shape, m.layout.shape, 1 - theirs)
        if err is not None:
            err = f"ucx: {err}"
        else:
            err = iov_protocol.check_runs(arr, m.layout.num_blocks, theirs)
        if err is None and what == "push" and arr.shape[0] > 1:
            dst = runs_to_ids(runs)[1]
            if np.unique(dst).size != dst.size:
                err = "peer refused: duplicate destination block ids"
        if err is not None:
            f: concurrent.futures.Future = concurrent.futures.Future()
            f.set_exception(TransferError(err, invalid_argument=True))
            return f

        def copy() -> None:
            if not m.pool.acquire():
                raise TransferError("ucx: the link to the peer was closed")
            try:
                if heads is None:
                    ours, other = self.layout.chunks(arr, 1 - theirs), m.layout.chunks(arr, theirs)
                else:  # (row for row on both sides: copy_chunks pairs equal lengths)
                    ours = slices.head_chunks(self.layout, arr, 1 - theirs, heads[1 - theirs],
                                              heads[2], layers=layer_span(heads, 1 - theirs))
                    other = slices.head_chunks(m.layout, arr, theirs, heads[theirs], heads[2],
                                               layers=layer_span(heads, theirs))
                shared_memory.copy_chunks(ours, other) if what == "pull" else shared_memory.copy_chunks(other, ours)
            finally:
                m.pool.release()
            self._stats["mapped"] += 1

        block_bytes = slices.heads_bytes_per_block(self.layout, heads)
        if int(arr[:, 2].sum()) * block_bytes <= self.config.inline_copy_bytes:
            f = concurrent.futures.Future()
            try:
                copy()
                f.set_result(None)
            except Exception as e:  # noqa: BLE001
                f.set_exception(e)
            return f
        if self._copier is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-ucx-copy")
        return self._copier.submit(copy)

    async def close(self) -> None:
        """Copies in flight end first: their pools stay mapped till then."""
        if self._copier is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._copier.shutdown)
            self._copier = None
