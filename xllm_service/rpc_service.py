"""XllmRpcService on the service: registration, instance info, heartbeats, generations.

Each handler is thin: proto -> domain, call the registry (or the injected router
callable), domain -> proto; bad input ends with a gRPC status and a message.

RegisterInstance (xLLM declared it but never implemented it): for instances that cannot
reach etcd themselves. The service writes `XLLM:<ROLE>:<name>` on a lease it keeps alive
on the instance's behalf *while heartbeats arrive*: once no accepted heartbeat has come
for one TTL, the service stops refreshing and the key expires with its lease, so a dead
instance leaves the cluster exactly as if it had registered itself. The registration is
also applied to the table at once, so the instance's first heartbeat is accepted without
waiting for the etcd watch to echo the key.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from xllm_py.cluster.etcd_client import EtcdClient, EtcdError, instance_key
from xllm_py.cluster.leased_key import LeasedKey
from xllm_py.cluster.instance_meta import InstanceMeta, InstanceMetaError, new_incarnation_id, now_ms
from xllm_py.config import InstanceRole
from xllm_py.proto import xllm_pb2, xllm_pb2_grpc
from xllm_py.rpc import cluster as cluster_wire
from xllm_py.rpc import service as wire
from xllm_py.utils.aio import cancel_and_wait
from xllm_py.utils.grpc_server import SERVER_OPTIONS, start_grpc_server
from xllm_service.instance_table import LoadInfo
from xllm_service.registry import Registry

logger = logging.getLogger(__name__)

# Outputs one Generations message may carry (an engine sends one per request it ran in a
# step: at most its max_num_seqs).
MAX_GENERATIONS = 4096

OnGenerations = Callable[[xllm_pb2.DisaggStreamGenerations], Awaitable[xllm_pb2.StatusSet]]


async def unknown_generations(msg: xllm_pb2.DisaggStreamGenerations) -> xllm_pb2.StatusSet:
    """Default before a router is attached: no request is known, every engine should cancel."""
    return wire.unknown_generations_reply(wire.num_generations(msg))


MAX_NAME_CHARS = 256


def registration_problem(meta: InstanceMeta) -> str:
    """Why an instance cannot be registered as it says it is, or "" (checked before
    anything is written to etcd)."""
    if len(meta.name) > MAX_NAME_CHARS or len(meta.incarnation_id) > MAX_NAME_CHARS:
        return f"name and incarnation_id have at most {MAX_NAME_CHARS} characters"
    host, _, port = meta.rpc_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"rpc_address must be host:port, got {meta.rpc_address[:80]!r}"
    numbers = {"dp_size": meta.dp_size, "block_size": meta.block_size,
               "num_blocks": meta.num_blocks, "num_layers": meta.num_layers,
               "num_kv_heads": meta.num_kv_heads, "head_dim": meta.head_dim,
               "tp_size": meta.tp_size, "kv_split_size": meta.kv_split_size}
    bad = [name for name, value in numbers.items() if value < 0]
    if bad:
        return f"{bad[0]} must be >= 0"
    if len(meta.cluster_ids) != len(meta.addrs):
        return "cluster_ids and addrs differ in length"
    return ""


def load_from_heartbeat(hb: wire.Heartbeat) -> LoadInfo:
    return LoadInfo(waiting=hb.waiting, running=hb.running, kv_usage=hb.kv_usage,
                    recent_max_ttft_ms=hb.recent_max_ttft_ms,
                    recent_max_tbt_ms=hb.recent_max_tbt_ms)


class ProxyRegistrations:
    """Instance keys the service keeps alive for instances registered over RPC."""

    def __init__(self, etcd: EtcdClient, registry: Registry, ttl_s: float = 3.0) -> None:
        self.etcd = etcd
        self.registry = registry
        self.ttl_s = ttl_s
        self._keys: dict[str, tuple[LeasedKey, str]] = {}  # name -> (key, incarnation)
        self._registered_s: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def names(self) -> list[str]:
        return sorted(self._keys)

    async def register(self, meta: InstanceMeta) -> None:
        old = self._keys.pop(meta.name, None)
        if old is not None:
            await old[0].stop(delete=old[0].key != instance_key(meta.type, meta.name))
        leased = LeasedKey(self.etcd, instance_key(meta.type, meta.name), meta.to_json(), self.ttl_s)
        await leased.ensure()  # raises EtcdError: the caller turns it into UNAVAILABLE
        self._keys[meta.name] = (leased, meta.incarnation_id)
        self._registered_s[meta.name] = time.monotonic()
        self.registry.register(meta)
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="proxy-registrations")

    async def refresh_once(self) -> None:
        now = time.monotonic()
        for name, (leased, incarnation) in list(self._keys.items()):
            info = self.registry.get(name)
            last = info.load.last_heartbeat_s if info and info.incarnation_id == incarnation else None
            last = max(last or 0.0, self._registered_s.get(name, 0.0))
            if now - last > self.ttl_s:
                logger.warning("no heartbeat from %s for %.1fs: letting its key expire", name, now - last)
                del self._keys[name]
                self._registered_s.pop(name, None)
                await leased.stop(delete=False)
                continue
            try:
                await leased.ensure()
            except EtcdError as e:
                logger.warning("keeping %s alive on behalf of %s failed: %s", leased.key, name, e)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.1, self.ttl_s / 3))
            try:
                await self.refresh_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("proxy registration round failed")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        for leased, _ in self._keys.values():
            await leased.stop(delete=False)
        self._keys.clear()


class XllmRpcServicer(xllm_pb2_grpc.XllmRpcServiceServicer):
    def __init__(
        self,
        registry: Registry,
        proxy: ProxyRegistrations | None = None,
        on_generations: OnGenerations | None = None,
    ) -> None:
        self.registry = registry
        self.proxy = proxy
        self.on_generations = on_generations or unknown_generations

    async def RegisterInstance(
        self, request: xllm_pb2.InstanceMetaInfo, context: grpc.aio.ServicerContext
    ) -> xllm_pb2.StatusCode:
        try:
            meta = cluster_wire.instance_meta_from_proto(request)
            problem = registration_problem(meta)
            if problem:
                raise ValueError(problem)
        except (InstanceMetaError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad InstanceMetaInfo: {e}")
        if self.proxy is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this service does not register instances over RPC")
        if not meta.incarnation_id:
            meta.incarnation_id = new_incarnation_id()
        if not meta.register_ts_ms:
            meta.register_ts_ms = now_ms()
        try:
            await self.proxy.register(meta)
        except EtcdError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"registering {meta.name} in etcd failed: {e}")
        return wire.registered_reply(meta.incarnation_id)

    async def GetInstanceInfo(
        self, request: xllm_pb2.InstanceID, context: grpc.aio.ServicerContext
    ) -> xllm_pb2.InstanceMetaInfo:
        name = cluster_wire.instance_id_from_proto(request)
        info = self.registry.get(name)
        if info is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown instance {name!r}")
        return cluster_wire.instance_meta_to_proto(info.meta)

    async def Heartbeat(self, request: xllm_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext) -> xllm_pb2.Status:
        hb = wire.heartbeat_from_proto(request)
        problem = wire.heartbeat_problem(hb)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        result = self.registry.heartbeat(
            hb.name,
            hb.incarnation_id,
            load_from_heartbeat(hb),
            stored_cache=hb.stored_cache,
            removed_cache=hb.removed_cache,
            full_cache=hb.full_cache,
        )
        return wire.heartbeat_reply(result.ok, result.message)

    async def GetStaticDecodeList(
        self, request: xllm_pb2.InstanceID, context: grpc.aio.ServicerContext
    ) -> xllm_pb2.InstanceIDs:
        return wire.instance_ids([i.name for i in self.registry.schedulable(InstanceRole.DECODE)])

    async def GetStaticPrefillList(
        self, request: xllm_pb2.InstanceID, context: grpc.aio.ServicerContext
    ) -> xllm_pb2.InstanceIDs:
        return wire.instance_ids([i.name for i in self.registry.schedulable(InstanceRole.PREFILL)])

    async def Generations(
        self, request: xllm_pb2.DisaggStreamGenerations, context: grpc.aio.ServicerContext
    ) -> xllm_pb2.StatusSet:
        if len(request.gens) > MAX_GENERATIONS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(request.gens)} generations in one call; at most {MAX_GENERATIONS}")
        result = await self.on_generations(request)
        if not wire.reply_fits(request, result):
            logger.error("generations handler answered a wrong number of statuses for %d generations",
                         wire.num_generations(request))
            await context.abort(grpc.StatusCode.INTERNAL, "generations handler returned a wrong number of statuses")
        return result

    async def GenerationsStream(
        self, request_iterator: AsyncIterator[xllm_pb2.DisaggStreamGenerations], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[xllm_pb2.StatusSet]:
        """Generations over one long-lived stream: one StatusSet per message, in order."""
        async for request in request_iterator:
            if len(request.gens) > MAX_GENERATIONS:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{len(request.gens)} generations in one message; at most {MAX_GENERATIONS}")
            result = await self.on_generations(request)
            if not wire.reply_fits(request, result):
                await context.abort(grpc.StatusCode.INTERNAL, "generations handler returned a wrong number of statuses")
            yield result


async def create_server(
    servicer: xllm_pb2_grpc.XllmRpcServiceServicer, host: str = "127.0.0.1", port: int = 0
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server for `servicer`; returns (server, bound port)."""
    return await start_grpc_server(xllm_pb2_grpc.add_XllmRpcServiceServicer_to_server, servicer,
                                   host, port, "XllmRpcService")


def bind_server(host: str, port: int,
                credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.aio.Server, int]:
    """A server bound to host:port (0: any free port), not serving yet: the service knows
    its own address before it builds the components that advertise it. With
    `credentials` (xllm_py.tls.server_credentials) it serves mutual TLS only."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    bound = (server.add_insecure_port(f"{host}:{port}") if credentials is None
             else server.add_secure_port(f"{host}:{port}", credentials))
    if bound == 0:
        raise OSError(f"could not bind XllmRpcService on {host}:{port}")
    return server, bound


async def start_serving(server: grpc.aio.Server,
                        servicer: xllm_pb2_grpc.XllmRpcServiceServicer) -> None:
    """Serve `servicer` on a server from `bind_server`."""
    xllm_pb2_grpc.add_XllmRpcServiceServicer_to_server(servicer, server)
    await server.start()
