"""KVWorker: one worker's KV pool and transfer backend, what xLLM's WorkerService does
(its gRPC servicer: rpc/worker_service.py; the PD code calls it in this process through
in_process.py).

- pull_kv_blocks(addr, src_blocks, dst_blocks): pull the peer's ``src_blocks`` (peer at
  ``addr``) into our own ``dst_blocks``; with ``heads`` only that KV head slice (peers of
  different TP, head_slices.py). push_kv_blocks: send ours into the peer's.
- link_cluster(cluster_ids, addrs, peer_meta, keys): refuse an incompatible peer
  (IncompatiblePeerError, naming every difference), then connect to each address showing
  the peer's transfer key (base.py: an owner refuses a hello without its key).
- unlink_cluster, cache_info; ``metrics``: this worker's transfer counters.

Each transfer logs one INFO line (req id, blocks, bytes, ms) and updates
``KVTransferMetrics``. ``PeerMeta`` is the part of a peer's InstanceMeta that decides
whether the two pools can exchange blocks.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from xllm_py.kv_transfer.base import KVTransferBackend, TransferError, TransferResult
from xllm_py.kv_transfer.head_slices import Heads
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from xllm_py.kv_transfer.metrics import KVTransferMetrics
from xllm_py.kv_compat import kv_compat_differences
from xllm_py.pd_messages import KVMove, PeerLink

logger = logging.getLogger(__name__)


class IncompatiblePeerError(ValueError):
    """A peer's KV cache cannot exchange blocks with ours; the message names each difference."""


@dataclasses.dataclass(frozen=True)
class PeerMeta:
    """The compatibility-relevant part of a peer's InstanceMetaInfo (0 / "" = not stated)."""

    model: str = ""
    block_size: int = 0
    kv_dtype: str = ""
    kv_layout: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0

    @classmethod
    def of(cls, meta: Any) -> "PeerMeta":
        """The fields of anything that has them by these names: an InstanceMeta, or the
        proto InstanceMetaInfo (rpc/worker.py)."""
        return cls(**{f.name: getattr(meta, f.name) for f in dataclasses.fields(cls)})


def compatibility_errors(ours: PeerMeta, theirs: PeerMeta) -> list[str]:
    """Differences between two pools; fields the peer leaves unset are not compared (lenient parse)."""
    return [f"{field}: ours {a!r}, peer {b!r}" for field, a, b in kv_compat_differences(ours, theirs)]


@dataclasses.dataclass(frozen=True)
class CacheInfoData:
    cluster_id: int
    addr: str
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    kv_layout: str
    block_bytes: int


class KVWorker:
    """One worker's KV cache plus its transfer backend (xLLM: link_cluster, pull_kv_blocks)."""

    def __init__(self, storage: KVCacheStorage, backend: KVTransferBackend, cluster_id: int,
                 model: str = "", metrics: KVTransferMetrics | None = None) -> None:
        self.storage = storage
        self.backend = backend
        self.cluster_id = cluster_id
        self.model = model
        self.metrics = metrics or KVTransferMetrics()
        self.linked: dict[int, str] = {}

    @property
    def address(self) -> str:
        return self.backend.address

    def local_meta(self) -> PeerMeta:
        m = self.storage.meta
        return PeerMeta(model=self.model, block_size=m.block_size, kv_dtype=m.dtype, kv_layout=m.layout,
                        num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)

    def cache_info(self) -> CacheInfoData:
        m = self.storage.meta
        return CacheInfoData(cluster_id=self.cluster_id, addr=self.backend.address, num_blocks=m.num_blocks,
                             block_size=m.block_size, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                             head_dim=m.head_dim, kv_dtype=m.dtype, kv_layout=m.layout, block_bytes=m.block_bytes)

    async def link_cluster(self, cluster_ids: Sequence[int], addrs: Sequence[str],
                           peer_meta: PeerMeta | None = None, timeout: float | None = None,
                           keys: Sequence[str] = ()) -> None:
        """`keys`: each peer worker's transfer key (with addrs; none: linked unkeyed)."""
        if len(cluster_ids) != len(addrs):
            raise ValueError(f"cluster_ids ({len(cluster_ids)}) and addrs ({len(addrs)}) differ in length")
        if peer_meta is not None:
            errors = compatibility_errors(self.local_meta(), peer_meta)
            if errors:
                msg = "incompatible peer KV cache: " + "; ".join(errors)
                logger.warning("link_cluster %s refused: %s", list(addrs), msg)
                raise IncompatiblePeerError(msg)
        keys = list(keys) + [""] * (len(addrs) - len(keys))
        for cid, addr, key in zip(cluster_ids, addrs, keys):
            await self.backend.link(addr, timeout, key=key)
            self.linked[int(cid)] = addr
        logger.info("linked cluster ids %s at %s", list(cluster_ids), list(addrs))

    async def unlink_cluster(self, cluster_ids: Sequence[int], addrs: Sequence[str]) -> None:
        targets = set(addrs) | {self.linked[c] for c in cluster_ids if c in self.linked}
        for c in cluster_ids:
            self.linked.pop(int(c), None)
        for addr in targets:
            await self.backend.unlink(addr)

    async def pull_kv_blocks(self, addr: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                             req_id: str = "", timeout: float | None = None,
                             key: str = "", heads: Heads | None = None) -> TransferResult:
        """`key`: the peer's transfer key, when not known from link_cluster; ``heads``
        (src_start, dst_start, count): only those KV heads (peers of different TP)."""
        self.backend.set_peer_key(addr, key)
        return await self._transfer("pull", addr, src_blocks, dst_blocks, req_id, timeout, heads)

    async def push_kv_blocks(self, addr: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                             req_id: str = "", timeout: float | None = None,
                             key: str = "", heads: Heads | None = None) -> TransferResult:
        """`key`: the peer's transfer key (a push needs no link first)."""
        self.backend.set_peer_key(addr, key)
        return await self._transfer("push", addr, src_blocks, dst_blocks, req_id, timeout, heads)

    async def _transfer(self, op: str, addr: str, src: Sequence[int], dst: Sequence[int],
                        req_id: str, timeout: float | None,
                        heads: Heads | None = None) -> TransferResult:
        t0 = time.perf_counter()
        fn = self.backend.pull if op == "pull" else self.backend.push
        try:
            result = (await fn(addr, src, dst, timeout) if heads is None
                      else await fn(addr, src, dst, timeout, heads=heads))
        except ValueError as e:
            self.metrics.observe_failure(op, "invalid_argument")
            logger.warning("kv %s req=%s peer=%s refused: %s", op, req_id, addr, e)
            raise
        except TransferError as e:
            reason = ("invalid_argument" if e.invalid_argument else "timeout" if e.timeout
                      else "denied" if e.denied else "error")
            self.metrics.observe_failure(op, reason)
            logger.warning("kv %s req=%s peer=%s blocks=%d failed after %.1f ms: %s",
                           op, req_id, addr, len(src), (time.perf_counter() - t0) * 1e3, e)
            raise
        self.metrics.observe_success(op, result.num_bytes, result.num_blocks, result.seconds)
        logger.info("kv %s req=%s peer=%s blocks=%d runs=%d bytes=%d ms=%.2f (%.2f GB/s)%s",
                    op, req_id, addr, result.num_blocks, result.num_runs, result.num_bytes,
                    result.seconds * 1e3, result.gbps, f" path={result.path}" if result.path else "")
        return result


class KVWorkerClient(Protocol):
    """How the PD code reaches one of its instance's KV workers: in this process
    (in_process.InProcessWorker) or over its WorkerService (rpc/pd_peers.GrpcWorkerClient).
    Same outcomes either way: a failed move raises StatusError(BAD_GATEWAY, "KV <op>
    failed: ..."), an incompatible peer at link time FAILED_PRECONDITION, any other link
    failure UNAVAILABLE."""

    async def pull_kv(self, move: KVMove, heads: Heads | None = None) -> None:
        """PullKVCache: the peer's ``move.src_blocks`` into ours (``heads``: that slice)."""

    async def push_kv(self, move: KVMove, heads: Heads | None = None) -> None:
        """PushKVCache: our ``move.src_blocks`` into the peer's."""

    async def link_cluster(self, link: PeerLink) -> None:
        """LinkCluster: link the peer's workers (refusing an incompatible one)."""

    async def close(self) -> None: ...
