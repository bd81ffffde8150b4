"""InProcessWorker: this engine's own KV worker called directly, not through gRPC.

With TP 1 the KV worker lives in the engine process (parallel/kv_workers.py); the PD code's
KV moves and links (PullKVCache, PushKVCache, LinkCluster on our own worker) then go
straight to its transfer backend: no gRPC call to ourselves. The WorkerService stays
for other callers (a TP rank 0 calling its ranks > 0, tools).

Same outcomes as the gRPC path (rpc/pd_peers.GrpcWorkerClient over WorkerServicer): a move
larger than the pool or with bad ids, and any transfer failure, raise
StatusError(BAD_GATEWAY, "KV <op> failed: ..."); an incompatible peer at link time
raises FAILED_PRECONDITION, any other link failure UNAVAILABLE.
"""
from __future__ import annotations

import logging

from xllm_py.kv_transfer.base import TransferError
from xllm_py.kv_transfer.head_slices import Heads
from xllm_py.kv_transfer.kv_worker import IncompatiblePeerError, KVWorker, PeerMeta
from xllm_py.pd_messages import KVMove, PeerLink
from xllm_py.status import Status, StatusError

logger = logging.getLogger(__name__)


class InProcessWorker:
    def __init__(self, worker: KVWorker, rpc_timeout_s: float, transfer_timeout_s: float) -> None:
        self.worker = worker
        self.rpc_timeout_s = rpc_timeout_s
        self.transfer_timeout_s = transfer_timeout_s

    async def pull_kv(self, move: KVMove, heads: Heads | None = None) -> None:
        await self._transfer("pull", move, heads)

    async def push_kv(self, move: KVMove, heads: Heads | None = None) -> None:
        await self._transfer("push", move, heads)

    async def _transfer(self, op: str, move: KVMove, heads: Heads | None) -> None:
        w = self.worker
        fn = w.pull_kv_blocks if op == "pull" else w.push_kv_blocks
        try:
            n = max(len(move.src_blocks), len(move.dst_blocks))
            if n > w.storage.meta.num_blocks:
                raise ValueError(f"{n} blocks in one move; the pool has "
                                 f"{w.storage.meta.num_blocks}")
            await fn(move.addr, move.src_blocks, move.dst_blocks, move.request_id,
                     self.transfer_timeout_s, move.transfer_key, heads)
        except (ValueError, TransferError) as exc:
            raise StatusError(Status.BAD_GATEWAY, f"KV {op} failed: {exc}") from None

    async def close(self) -> None:
        """Nothing to close: the worker is the engine's (its KVWorkerNode stops it)."""

    async def link_cluster(self, link: PeerLink) -> None:
        m = link.meta
        peer = None if m is None else PeerMeta.of(m)
        keys = list(m.transfer_keys) if m is not None else []
        try:
            await self.worker.link_cluster(link.cluster_ids, link.addrs, peer,
                                           min(self.rpc_timeout_s, self.transfer_timeout_s),
                                           keys)
        except IncompatiblePeerError as exc:
            raise StatusError(Status.FAILED_PRECONDITION, str(exc)) from None
        except (ValueError, TransferError) as exc:
            raise StatusError(Status.UNAVAILABLE, f"worker link failed: {exc}") from None
