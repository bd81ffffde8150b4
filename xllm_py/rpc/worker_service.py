"""WorkerServicer: a KVWorker (kv_transfer/kv_worker.py) behind xLLM's WorkerService.

RPCs: PullKVCache, PushKVCache (``num_heads``: one KV head slice, ``num_layers``: of those
layers only), LinkCluster (with the peer's meta and transfer keys), UnlinkCluster,
GetCacheInfo, GetTransferMetrics (this worker's transfer counters: rank 0 of a TP
instance renders every rank's on its /metrics, parallel/rank_metrics.py).

Status mapping: bad arguments (length mismatch, out-of-range ids on either side, a move
larger than the pool) -> INVALID_ARGUMENT; an incompatible peer -> FAILED_PRECONDITION;
timeout -> DEADLINE_EXCEEDED; refused for want of the peer's transfer key ->
PERMISSION_DENIED; any other transfer failure -> UNAVAILABLE. Success -> Status(ok=True,
code=200).
"""
from __future__ import annotations

import grpc

from xllm_py.kv_transfer.base import TransferError
from xllm_py.kv_transfer.kv_worker import IncompatiblePeerError, KVWorker
from xllm_py.proto import xllm_pb2, xllm_pb2_grpc
from xllm_py.rpc import worker as wire
from xllm_py.utils.grpc_server import start_grpc_server

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
        return await self._move(self.worker.pull_kv_blocks, request, context)

    async def PushKVCache(self, request: xllm_pb2.PushKVCacheRequest,
                          context: grpc.aio.ServicerContext) -> xllm_pb2.Status:
        return await self._move(self.worker.push_kv_blocks, request, context)

    async def _move(self, move, request, context: grpc.aio.ServicerContext) -> xllm_pb2.Status:
        """A pull or push (`move`: the worker's) of the blocks `request` names."""
        try:
            t = wire.transfer_from_proto(request)
            self._check_move(t)
            await move(t.addr, t.src_blocks, t.dst_blocks, t.req_id, self._timeout(context),
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
