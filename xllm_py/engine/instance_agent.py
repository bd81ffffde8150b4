"""InstanceAgent: an engine's membership in the cluster (runs in the engine's event loop).

Stages:
  1. stamp    - a fresh incarnation_id (uuid) and register_ts_ms for this process start;
  2. register - put `XLLM:<ROLE>:<name>` = JSON InstanceMeta on a lease (LeasedKey): the
                lease is refreshed every `heartbeat_interval_s`; a key that disappears
                (lease expired, etcd restarted, deleted by hand) is put back on a new lease;
  3. heartbeat- every `heartbeat_interval_s`, `Heartbeat` (deadline 1 s) to the master's
                XllmRpcService, found under `XLLM:SERVICE:MASTER` (re-read on failure and
                every few seconds); failures are logged and retried, never fatal. Its
                cache_event (from `cache_fn(full)`) is a full snapshot of the prefix
                cache on the first heartbeat a master gets, after a failed one (its
                events may be lost), and every `cache_resync_s`; a delta otherwise;
  4. stop     - delete the key, revoke the lease (`stop(deregister=False)` just stops,
                leaving the key to expire: what a crash looks like to the cluster).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc

from xllm_py.cluster.etcd_client import MASTER_KEY, EtcdClient, EtcdError, instance_key
from xllm_py.cluster.leased_key import LeasedKey
from xllm_py.cluster.instance_meta import InstanceMeta, new_incarnation_id, now_ms
from xllm_py.proto import xllm_pb2_grpc
from xllm_py.rpc import cluster as wire
from xllm_py.utils.aio import cancel_and_wait
from xllm_py.tls import EtcdTLSConfig, TLSConfig, channel_credentials
from xllm_py.utils.grpc_channels import open_channel

logger = logging.getLogger(__name__)

HEARTBEAT_DEADLINE_S = 1.0
_MASTER_REREAD_S = 3.0


@dataclasses.dataclass
class LoadReport:
    """What `load_fn` returns each heartbeat."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    recent_max_ttft_ms: int = 0
    recent_max_tbt_ms: int = 0
    stored_cache: list[bytes] = dataclasses.field(default_factory=list)
    removed_cache: list[bytes] = dataclasses.field(default_factory=list)


# cache_fn(full) -> (stored, removed) block hashes: the change since the previous call, or
# with full=True every hash held (and no removals).
CacheFn = Callable[[bool], "tuple[list[bytes], list[bytes]]"]

# load_fn may return a LoadReport or the tuple
# (waiting, running, kv_usage, recent_max_ttft_ms, recent_max_tbt_ms, (stored, removed)).
LoadFn = Callable[[], "LoadReport | tuple"]


def _as_report(value: "LoadReport | tuple") -> LoadReport:
    if isinstance(value, LoadReport):
        return value
    waiting, running, kv_usage, ttft, tbt, *rest = value
    stored, removed = (rest[0] if rest and rest[0] else ([], []))
    return LoadReport(int(waiting), int(running), float(kv_usage), int(ttft), int(tbt), list(stored), list(removed))


class InstanceAgent:
    def __init__(
        self,
        etcd_endpoint: str,
        meta: InstanceMeta,
        ttl_s: float = 3.0,
        namespace: str = "",
        heartbeat_interval_s: float = 0.5,
        load_fn: LoadFn | None = None,
        credentials: tuple[str, str] | None = None,
        etcd_timeout_s: float = 2.0,
        cache_fn: CacheFn | None = None,
        cache_resync_s: float = 30.0,
        tls: TLSConfig | None = None,
        etcd_tls: "EtcdTLSConfig | None" = None,
    ) -> None:
        """`tls`: the heartbeat channel to the master over mutual TLS; `etcd_tls`: how to
        reach etcd (its own TLS set-up)."""
        # A new incarnation per process start: the service tells restarts apart by it.
        self.meta = dataclasses.replace(meta, incarnation_id=new_incarnation_id(), register_ts_ms=now_ms())
        self.ttl_s = ttl_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.load_fn = load_fn
        self.cache_fn = cache_fn
        self.cache_resync_s = cache_resync_s
        self._cache_synced: tuple[str, float] | None = None  # (master, when) of the last full one
        self.etcd = EtcdClient(etcd_endpoint, namespace=namespace, credentials=credentials,
                               timeout_s=etcd_timeout_s, tls=etcd_tls)
        self._channel_credentials = channel_credentials(tls) if tls is not None else None
        self.key = instance_key(self.meta.type, self.meta.name)
        self._leased = LeasedKey(self.etcd, self.key, self.meta.to_json(), ttl_s, interval_s=heartbeat_interval_s)
        self._task: asyncio.Task[None] | None = None
        self._master_addr: str | None = None
        self._master_read_s = 0.0
        self._channel: grpc.aio.Channel | None = None
        self._channel_addr: str | None = None
        self.num_heartbeats_ok = 0
        self.last_heartbeat_error: str = ""

    @property
    def incarnation_id(self) -> str:
        return self.meta.incarnation_id

    @property
    def master_addr(self) -> str | None:
        return self._master_addr

    async def start(self) -> None:
        """Register (retrying in the background if etcd is down now) and start heartbeats."""
        try:
            await self._leased.ensure()
            logger.info("registered %s (incarnation %s)", self.key, self.incarnation_id)
        except EtcdError as e:
            logger.warning("registering %s failed, will retry: %s", self.key, e)
        self._leased.start_background()
        self._task = asyncio.create_task(self._heartbeat_loop(), name=f"heartbeat {self.meta.name}")

    async def stop(self, deregister: bool = True) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        await self._leased.stop(delete=deregister)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        await self.etcd.close()

    def update_meta(self, **changes: object) -> None:
        """Change published fields (e.g. num_blocks known after start-up); same incarnation."""
        self.meta = dataclasses.replace(self.meta, **changes)  # type: ignore[arg-type]
        self._leased.set_value(self.meta.to_json())

    async def publish(self) -> None:
        """Write the key now (raises EtcdError when etcd is unreachable)."""
        await self._leased.ensure()

    # ------------------------------------------------------------------ heartbeats

    async def _resolve_master(self, force: bool = False) -> str | None:
        if not force and self._master_addr and time.monotonic() - self._master_read_s < _MASTER_REREAD_S:
            return self._master_addr
        try:
            kv = await self.etcd.get(MASTER_KEY)
        except EtcdError as e:
            logger.warning("reading %s failed: %s", MASTER_KEY, e)
            return self._master_addr
        self._master_read_s = time.monotonic()
        addr = kv.value.decode() if kv else None
        if addr != self._master_addr:
            logger.info("master is now %s", addr)
        self._master_addr = addr
        return addr

    def _stub(self, addr: str) -> xllm_pb2_grpc.XllmRpcServiceStub:
        if self._channel is None or self._channel_addr != addr:
            if self._channel is not None:
                asyncio.ensure_future(self._channel.close())
            self._channel = open_channel(addr, self._channel_credentials)
            self._channel_addr = addr
        return xllm_pb2_grpc.XllmRpcServiceStub(self._channel)

    async def heartbeat_once(self) -> bool:
        """One heartbeat to the current master; True if it was accepted."""
        addr = await self._resolve_master()
        if not addr:
            self.last_heartbeat_error = "no master registered"
            return False
        report = _as_report(self.load_fn()) if self.load_fn else LoadReport()
        full = False
        if self.cache_fn is not None:
            synced = self._cache_synced
            full = (synced is None or synced[0] != addr
                    or time.monotonic() - synced[1] > self.cache_resync_s)
            report.stored_cache, report.removed_cache = self.cache_fn(full)
        req = wire.heartbeat_to_proto(
            self.meta.name, self.incarnation_id, report.waiting, report.running, report.kv_usage,
            report.recent_max_ttft_ms, report.recent_max_tbt_ms, report.stored_cache,
            report.removed_cache, full_cache=full)
        try:
            reply = await self._stub(addr).Heartbeat(req, timeout=HEARTBEAT_DEADLINE_S)
        except grpc.aio.AioRpcError as e:
            self.last_heartbeat_error = f"{e.code().name}: {e.details()}"
            logger.warning("heartbeat to master %s failed: %s", addr, self.last_heartbeat_error)
            self._cache_synced = None
            await self._resolve_master(force=True)
            return False
        ok, why = wire.heartbeat_reply_from_proto(reply)
        if not ok:
            # Usually the master has not seen our key yet (watch lag) or a new master is
            # still syncing; the key keeps us registered, so just try again next time.
            self.last_heartbeat_error = why
            logger.info("heartbeat refused by %s: %s", addr, why)
            self._cache_synced = None
            await self._resolve_master(force=True)
            return False
        if full:
            self._cache_synced = (addr, time.monotonic())
        self.num_heartbeats_ok += 1
        self.last_heartbeat_error = ""
        return True

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self.heartbeat_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("heartbeat failed unexpectedly (will retry)")
                self._cache_synced = None  # its cache events may be lost: resend them all
            await asyncio.sleep(self.heartbeat_interval_s)
