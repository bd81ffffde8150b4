"""The KV worker of each rank: transfer backend listener + WorkerService server.

``start_kv_worker`` starts one: TP 1 and rank 0 in the engine process (engine/cluster_node.py),
ranks > 0 each in its own process, as every xLLM worker has one. Its listener serves only
peers that show ``transfer_key``, a random secret made at start and published in the
instance's registration (kv_transfer/base.py). Stopping the node closes both.

Ranks > 0: rank 0 writes the settings (``KVWorkerSpec``) into the group's store and
broadcasts START_KV_WORKER -> each rank > 0 starts, on an event-loop thread of its own,
the same KV worker as rank 0 over its own KV pool (its own cluster id) and answers under
its key with its addresses or the error -> rank 0 collects every answer (bounded) -> the
workers live as long as their process.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import pickle
import random
import secrets
import threading

import grpc

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import TransferConfig
from xllm_py.kv_transfer.factory import create_backend
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from xllm_py.kv_transfer.kv_worker import KVWorker
from xllm_py.rpc.worker_service import WorkerServicer, create_worker_server

logger = logging.getLogger(__name__)

SPEC_KEY = "kv_worker/spec"
START_TIMEOUT_S = 60.0


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


def _answer_key(rank: int) -> str:
    return f"kv_worker/rank/{rank}"


@dataclasses.dataclass(frozen=True)
class KVWorkerSpec:
    transfer: TransferConfig
    host: str  # bind host of the transfer listener and the WorkerService
    worker_port: int  # 0: a free port; else rank r binds worker_port + r
    cluster_ids: list[int]  # one per rank
    meta: InstanceMeta  # what the worker says of its KV (model, block size, dtype, ...)

    def for_rank(self, rank: int) -> tuple[TransferConfig, int]:
        """The rank's transfer config and WorkerService port (fixed ports offset by rank)."""
        transfer = self.transfer
        if transfer.listen_port:
            transfer = dataclasses.replace(transfer, listen_port=transfer.listen_port + rank)
        return transfer, self.worker_port + rank if self.worker_port else 0


@dataclasses.dataclass(frozen=True)
class RankKVWorker:
    """Where a rank's KV worker can be reached."""

    rank: int
    cluster_id: int
    transfer_addr: str
    rpc_addr: str
    transfer_key: str = dataclasses.field(default="", repr=False)  # peers show it to link


class RankKVWorkerHost:
    """A rank > 0's KV worker on its own event-loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tp-kv-worker",
                                        daemon=True)
        self._thread.start()
        self.node = None

    def start(self, spec: KVWorkerSpec, rank: int, storage: KVCacheStorage,
              tls=None) -> RankKVWorker:
        """``tls``: the engine's TLSConfig (the WorkerService then serves mutual TLS only)."""
        from xllm_py.tls import server_credentials

        transfer, port = spec.for_rank(rank)
        meta = spec.meta
        creds = server_credentials(tls) if tls is not None else None
        self.node = asyncio.run_coroutine_threadsafe(
            start_kv_worker(storage, transfer, spec.host, port, spec.cluster_ids[rank], meta,
                            creds), self.loop).result(START_TIMEOUT_S)
        return RankKVWorker(rank, spec.cluster_ids[rank], self.node.transfer_addr,
                            self.node.rpc_addr, self.node.transfer_key)


def serve_start_request(store, rank: int, storage: KVCacheStorage | None,
                        host: RankKVWorkerHost | None, tls=None) -> RankKVWorkerHost | None:
    """Rank > 0, on START_KV_WORKER: start the worker, answer in the store (never raises:
    rank 0 reports the error)."""
    try:
        if storage is None:
            raise RuntimeError("no KV pool yet")
        if host is not None:
            raise RuntimeError("the KV worker is already running")
        spec: KVWorkerSpec = pickle.loads(store.get(SPEC_KEY))
        host = RankKVWorkerHost()
        w = host.start(spec, rank, storage, tls)
        answer = {"cluster_id": w.cluster_id, "transfer_addr": w.transfer_addr,
                  "rpc_addr": w.rpc_addr, "transfer_key": w.transfer_key}
    except Exception as exc:  # noqa: BLE001 - sent to rank 0, which fails the start-up
        logger.exception("rank %d: KV worker did not start", rank)
        answer = {"error": f"{type(exc).__name__}: {exc}"}
    store.set(_answer_key(rank), json.dumps(answer))
    return host


def collect_answers(store, world_size: int, timeout_s: float = START_TIMEOUT_S
                    ) -> list[RankKVWorker]:
    """Rank 0: every rank > 0's answer; ``RuntimeError`` naming the rank that failed."""
    keys = [_answer_key(r) for r in range(1, world_size)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    out = []
    for rank, key in enumerate(keys, start=1):
        answer = json.loads(store.get(key))
        if "error" in answer:
            raise RuntimeError(f"the KV worker of tensor-parallel rank {rank} did not start: "
                               f"{answer['error']}")
        out.append(RankKVWorker(rank, int(answer["cluster_id"]), answer["transfer_addr"],
                                answer["rpc_addr"], answer.get("transfer_key", "")))
    return out


async def start_rank_kv_workers(executor, config, rank0_cluster_id: int, meta) -> list[RankKVWorker]:
    """Rank 0's engine (cluster node): start ranks 1..N-1's KV workers, each with a fresh
    cluster id, on the engine's transfer settings and ``--worker-port`` (+ rank)."""
    ids = [rank0_cluster_id] + [random.getrandbits(63) for _ in range(1, executor.group.world_size)]
    spec = KVWorkerSpec(transfer=config.transfer, host=config.host,
                        worker_port=config.worker_port, cluster_ids=ids,
                        meta=meta)
    return await asyncio.to_thread(executor.start_kv_workers, spec)
