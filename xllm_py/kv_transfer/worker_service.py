"""KVWorker (domain) and WorkerServicer (thin gRPC layer) of one worker process.

RPCs (xLLM WorkerService):
- PullKVCache(cluster_id, addr, src_blocks, dst_blocks, req_id): this worker pulls the
  peer's ``src_blocks`` (peer at ``addr``) into its own ``dst_blocks``; with ``num_heads``
  only that KV head slice (peers of different TP, kv_transfer/head_slices.py).
- PushKVCache: this worker sends its ``src_blocks`` into the peer's ``dst_blocks``.
- LinkCluster(cluster_ids, addrs, meta): refuse an incompatible peer (FAILED_PRECONDITION,
  the message names every difference), then connect to each address showing the peer's
  transfer key (meta.transfer_keys; base.py: an owner refuses a hello without its key).
- UnlinkCluster, GetCacheInfo.
- GetTransferMetrics: this worker's transfer counters (rank 0 of a TP instance renders
  every rank's on its /metrics, parallel/rank_metrics.py).

Status mapping: bad arguments (length mismatch, out-of-range ids on either side) ->
INVALID_ARGUMENT; timeout -> DEADLINE_EXCEEDED; refused for want of the peer's transfer
key -> PERMISSION_DENIED; any other transfer failure -> UNAVAILABLE.
Success -> Status(ok=True, code=200). Each transfer logs one INFO line (req id, blocks,
bytes, ms) and updates ``KVTransferMetrics``.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import grpc

from xllm_py.kv_transfer.base import KVTransferBackend, TransferError, TransferResult
from xllm_py.kv_transfer.head_slices import Heads
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from xllm_py.kv_transfer.metrics import KVTransferMetrics
from xllm_py.kv_compat import kv_compat_differences
from xllm_py.proto import xllm_pb2, xllm_pb2_grpc
from xllm_py.rpc import worker as wire
from xllm_py.utils.grpc_server import start_grpc_server

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


async def _abort_for(context: grpc.aio.ServicerContext, e: Exception) -> None:
    if isinstance(e, IncompatiblePeerError):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    if isinstance(e, ValueError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, TransferError):
        if e.invalid_argument:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if e.timeout:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        if e.denied:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    raise e


class WorkerServicer(xllm_pb2_grpc.WorkerServiceServicer):
    """Thin: proto -> KVWorker call -> Status / gRPC status code."""

    def __init__(self, worker: KVWorker, timeout_s: float | None = None) -> None:
        self.worker = worker
        self.timeout_s = timeout_s

    def _timeout(self, context: grpc.aio.ServicerContext) -> float | None:
        remaining = context.time_remaining()
        if remaining is None:
            return self.timeout_s
        return min(remaining, self.timeout_s) if self.timeout_s else remaining

    def _check_move(self, request) -> None:
        """A move larger than the whole pool is refused before anything is touched (the
        block ids themselves are checked by the backend: ours here, the peer's there)."""
        num_blocks = self.worker.storage.meta.num_blocks
        n = max(len(request.src_blocks), len(request.dst_blocks))
        if n > num_blocks:
            raise ValueError(f"{n} blocks in one move; the pool has {num_blocks}")

    async def PullKVCache(self, request: xllm_pb2.PullKVCacheRequest,
                          context: grpc.aio.ServicerContext) -> xllm_pb2.Status:
        t = wire.transfer_from_proto(request)
        try:
            self._check_move(t)
            await self.worker.pull_kv_blocks(t.addr, t.src_blocks, t.dst_blocks,
                                             t.req_id, self._timeout(context),
                                             t.transfer_key, t.heads)
        except (ValueError, TransferError) as e:
            await _abort_for(context, e)
        return wire.ok_to_proto()

    async def PushKVCache(self, request: xllm_pb2.PushKVCacheRequest,
                          context: grpc.aio.ServicerContext) -> xllm_pb2.Status:
        t = wire.transfer_from_proto(request)
        try:
            self._check_move(t)
            await self.worker.push_kv_blocks(t.addr, t.src_blocks, t.dst_blocks,
                                             t.req_id, self._timeout(context),
                                             t.transfer_key, t.heads)
        except (ValueError, TransferError) as e:
            await _abort_for(context, e)
        return wire.ok_to_proto()

    async def LinkCluster(self, request: xllm_pb2.ClusterLink,
                          context: grpc.aio.ServicerContext) -> xllm_pb2.Status:
        link = wire.link_from_proto(request)
        try:
            await self.worker.link_cluster(link.cluster_ids, link.addrs, link.peer_meta,
                                           self._timeout(context), link.keys)
        except (ValueError, TransferError) as e:
            await _abort_for(context, e)
        return wire.ok_to_proto()

    async def UnlinkCluster(self, request: xllm_pb2.ClusterLink,
                            context: grpc.aio.ServicerContext) -> xllm_pb2.Status:
        link = wire.link_from_proto(request)
        await self.worker.unlink_cluster(link.cluster_ids, link.addrs)
        return wire.ok_to_proto()

    async def GetCacheInfo(self, request: xllm_pb2.Empty,
                           context: grpc.aio.ServicerContext) -> xllm_pb2.CacheInfo:
        return wire.cache_info_to_proto(self.worker.cache_info())

    async def GetTransferMetrics(self, request: xllm_pb2.Empty,
                                 context: grpc.aio.ServicerContext) -> xllm_pb2.TransferMetrics:
        return wire.transfer_metrics_to_proto(self.worker.metrics.snapshot())


async def create_worker_server(servicer: WorkerServicer, host: str = "127.0.0.1", port: int = 0,
                               credentials: grpc.ServerCredentials | None = None,
                               ) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server with the WorkerService (mutual TLS with `credentials`);
    returns (server, bound port)."""
    return await start_grpc_server(xllm_pb2_grpc.add_WorkerServiceServicer_to_server, servicer,
                                   host, port, "the worker service", credentials=credentials)
