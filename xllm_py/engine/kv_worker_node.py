"""The engine's KV worker (TP=1: it lives in the engine process, behind a real gRPC
WorkerService): transfer backend listener + WorkerService server. Stop closes both."""
from __future__ import annotations

import dataclasses
import logging

import grpc

from xllm_py.config import TransferConfig
from xllm_py.kv_transfer.factory import create_backend
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from xllm_py.kv_transfer.worker_service import KVWorker, WorkerServicer, create_worker_server
from xllm_py.proto import xllm_pb2 as pb

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class KVWorkerNode:
    worker: KVWorker
    server: object
    transfer_addr: str
    rpc_addr: str

    async def stop(self) -> None:
        await self.server.stop(1.0)
        await self.worker.backend.close()


async def start_kv_worker(storage: KVCacheStorage, transfer: TransferConfig, host: str,
                          port: int, cluster_id: int, meta: pb.InstanceMetaInfo,
                          credentials: grpc.ServerCredentials | None = None) -> KVWorkerNode:
    """`credentials`: the WorkerService serves mutual TLS only."""
    backend = create_backend(transfer.backend, storage, transfer)
    transfer_addr = backend.start()
    worker = KVWorker(storage, backend, cluster_id, model=meta.model)
    server, bound = await create_worker_server(WorkerServicer(worker, transfer.timeout_s),
                                               host, port, credentials)
    logger.info("KV worker %x: %s transfer at %s, WorkerService at %s:%d", cluster_id,
                transfer.backend, transfer_addr, host, bound)
    return KVWorkerNode(worker, server, transfer_addr, f"{host}:{bound}")
