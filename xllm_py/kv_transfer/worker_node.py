"""The engine's KV worker (TP=1: it lives in the engine process, behind a real gRPC
WorkerService): transfer backend listener + WorkerService server. Stop closes both.

The listener serves only peers that show `transfer_key`, a random secret made here at
start and published in the instance's registration (kv_transfer/base.py)."""
from __future__ import annotations

import dataclasses
import logging
import secrets

import grpc

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import TransferConfig
from xllm_py.kv_transfer.factory import create_backend
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from xllm_py.kv_transfer.worker_service import KVWorker, WorkerServicer, create_worker_server

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class KVWorkerNode:
    worker: KVWorker
    server: object
    transfer_addr: str
    rpc_addr: str
    transfer_key: str = dataclasses.field(default="", repr=False)

    async def stop(self) -> None:
        await self.server.stop(1.0)
        await self.worker.backend.close()


async def start_kv_worker(storage: KVCacheStorage, transfer: TransferConfig, host: str,
                          port: int, cluster_id: int, meta: InstanceMeta,
                          credentials: grpc.ServerCredentials | None = None) -> KVWorkerNode:
    """`credentials`: the WorkerService serves mutual TLS only."""
    transfer_key = secrets.token_hex(16)
    backend = create_backend(transfer.backend, storage, transfer, access_key=transfer_key)
    transfer_addr = backend.start()
    worker = KVWorker(storage, backend, cluster_id, model=meta.model)
    server, bound = await create_worker_server(WorkerServicer(worker, transfer.timeout_s),
                                               host, port, credentials)
    logger.info("KV worker %x: %s transfer at %s, WorkerService at %s:%d", cluster_id,
                transfer.backend, transfer_addr, host, bound)
    return KVWorkerNode(worker, server, transfer_addr, f"{host}:{bound}", transfer_key)
