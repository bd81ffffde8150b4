"""Registry: keeps the service's InstanceTable in step with etcd and with the instances.

Stages:
  1. sync   - get_prefix("XLLM:") lists every instance key and the store revision;
  2. watch  - PUT/DELETE events from revision+1 update the table; when the stream breaks
              (etcd restarted, compacted) go back to 1 after a short backoff. While etcd is
              unreachable the table is left as it is: an etcd outage is not an engine death;
  3. probe  - every `health_interval_s`, instances whose key is gone are probed on
              `http://<http_address>/health` (200: LEASE_LOST, still schedulable;
              anything else: SUSPECT); SUSPECT ones past `evict_grace_s` are evicted and
              the evict callbacks run (the router fails their in-flight requests).

Heartbeats (XllmRpcService.Heartbeat) go through `heartbeat()` into the same table.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from xllm_py.cluster.etcd_client import INSTANCE_PREFIX, EtcdClient, EtcdError, EventKind, parse_instance_key
from xllm_py.cluster.instance_meta import InstanceMeta, InstanceMetaError
from xllm_py.config import InstanceRole
from xllm_service.config import RegistryConfig
from xllm_py.utils.aio import cancel_and_wait, wait_for
from xllm_service.instance_table import (
    Change,
    ChangeKind,
    HeartbeatResult,
    InstanceInfo,
    InstanceTable,
    LoadInfo,
)

logger = logging.getLogger(__name__)

EvictCallback = Callable[[InstanceInfo, str], "None | Awaitable[None]"]  # (old info, reason)
ChangeCallback = Callable[[Change], "None | Awaitable[None]"]
CacheEventCallback = Callable[[str, list[bytes], list[bytes], bool], "None | Awaitable[None]"]

class Registry:
    def __init__(
        self,
        etcd: EtcdClient,
        config: RegistryConfig = RegistryConfig(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.etcd = etcd
        self.config = config
        self.table = InstanceTable(evict_grace_s=config.evict_grace_s)
        self._clock = clock
        self._cluster_id = 0
        self._last_revision = 0
        self._seen: dict[str, int] = {}  # instance key -> mod_revision, as the watch saw it
        self._mismatches = 0
        self._evict_callbacks: list[EvictCallback] = []
        self._change_callbacks: list[ChangeCallback] = []
        self._cache_callbacks: list[CacheEventCallback] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._callback_tasks: set[asyncio.Task[None]] = set()
        self._http: httpx.AsyncClient | None = None
        self._synced = asyncio.Event()
        self.num_resyncs = 0

    # ------------------------------------------------------------------ router API

    def schedulable(self, role: InstanceRole | None = None) -> list[InstanceInfo]:
        return self.table.schedulable(role)

    def get(self, name: str) -> InstanceInfo | None:
        return self.table.get(name)

    def all(self) -> list[InstanceInfo]:
        return self.table.all()

    def counts(self) -> dict[str, int]:
        return self.table.counts()

    def on_evict(self, callback: EvictCallback) -> None:
        """`callback(info, reason)`: reason "evicted" (gone past the grace period) or
        "replaced" (a new incarnation took the name). May be sync or async."""
        self._evict_callbacks.append(callback)

    def on_change(self, callback: ChangeCallback) -> None:
        self._change_callbacks.append(callback)

    def on_cache_event(self, callback: CacheEventCallback) -> None:
        """`callback(name, stored_hashes, removed_hashes, full)` for each heartbeat carrying
        them (`full`: stored_hashes is all the instance holds)."""
        self._cache_callbacks.append(callback)

    # ------------------------------------------------------------------ inputs

    def heartbeat(
        self,
        name: str,
        incarnation_id: str,
        load: LoadInfo,
        stored_cache: list[bytes] | None = None,
        removed_cache: list[bytes] | None = None,
        full_cache: bool = False,
    ) -> HeartbeatResult:
        result = self.table.heartbeat(name, incarnation_id, load, self._clock())
        self._dispatch(list(result.changes))
        if result.ok and (stored_cache or removed_cache or full_cache):
            for cb in self._cache_callbacks:
                self._run_callback(cb, name, list(stored_cache or []), list(removed_cache or []),
                                   full_cache)
        return result

    def register(self, meta: InstanceMeta) -> list[Change]:
        """Apply a registration at once (RegisterInstance) before the watch echoes it."""
        changes = self.table.key_put(meta, self._clock())
        self._dispatch(changes)
        return changes

    # ------------------------------------------------------------------ lifecycle

    async def start(self, wait_synced_s: float | None = 5.0) -> None:
        """Start watching; waits (up to `wait_synced_s`) for the first full listing."""
        self._http = httpx.AsyncClient(timeout=self.config.health_timeout_s, trust_env=False)
        self._tasks = [
            asyncio.create_task(self._watch_loop(), name="registry-watch"),
            asyncio.create_task(self._probe_loop(), name="registry-probe"),
        ]
        if wait_synced_s:
            try:
                await wait_for(self._synced.wait(), wait_synced_s)
            except asyncio.TimeoutError:
                logger.warning("registry: no etcd listing within %.1fs; continuing, will retry", wait_synced_s)

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            await cancel_and_wait(t)
        for t in list(self._callback_tasks):
            t.cancel()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # ------------------------------------------------------------------ watch

    def _parse(self, key: str, value: bytes) -> InstanceMeta | None:
        parsed = parse_instance_key(key)
        if parsed is None:
            return None
        role, name = parsed
        try:
            meta = InstanceMeta.from_json(value)
        except InstanceMetaError as e:
            logger.warning("registry: ignoring instance key %s: %s", key, e)
            return None
        if meta.name != name or meta.type != role:
            logger.warning(
                "registry: key %s carries name=%r type=%s; the key wins", key, meta.name, meta.type.value
            )
            meta = dataclasses.replace(meta, name=name, type=role)
        return meta

    async def _sync(self) -> int:
        self._cluster_id, _ = await self.etcd.store_identity()
        kvs, revision = await self.etcd.get_prefix(INSTANCE_PREFIX)
        self._seen = {kv.key: kv.mod_revision for kv in kvs}
        self._mismatches = 0
        metas = [m for kv in kvs if (m := self._parse(kv.key, kv.value)) is not None]
        self._dispatch(self.table.resync(metas, self._clock()))
        self._last_revision = revision
        self.num_resyncs += 1
        self._synced.set()
        logger.info("registry: synced %d instance(s) at revision %d", len(metas), revision)
        return revision

    async def _consume(self, start_revision: int) -> None:
        async for ev in self.etcd.watch_prefix(INSTANCE_PREFIX, start_revision=start_revision):
            self._last_revision = max(self._last_revision, ev.revision)
            if ev.kind is EventKind.PUT:
                self._seen[ev.key] = ev.revision
            else:
                self._seen.pop(ev.key, None)
            self._on_event(ev.kind, ev.key, ev.value)

    async def _store_replaced(self) -> bool:
        """True if the watch no longer matches etcd: another store (wiped, replaced: an
        open watch on it waits for revisions that never come) or keys whose changes the
        watch has not delivered for two checks in a row (an in-flight event takes ms)."""
        try:
            cluster_id, revision = await self.etcd.store_identity()
            kvs, _ = await self.etcd.get_prefix(INSTANCE_PREFIX, keys_only=True)
        except EtcdError:
            return False  # unreachable: the watch stream breaks by itself
        if cluster_id != self._cluster_id or revision < self._last_revision:
            logger.warning(
                "registry: etcd changed under the watch (cluster %x rev %d, had %x rev %d); resyncing",
                cluster_id, revision, self._cluster_id, self._last_revision,
            )
            return True
        if {kv.key: kv.mod_revision for kv in kvs} != self._seen:
            self._mismatches += 1
            if self._mismatches >= 2:
                logger.warning("registry: watch missed changes under %s; resyncing", INSTANCE_PREFIX)
                return True
        else:
            self._mismatches = 0
        return False

    async def _watch_loop(self) -> None:
        attempt = 0
        while True:
            watch: asyncio.Task[None] | None = None
            try:
                revision = await self._sync()
                attempt = 0
                watch = asyncio.create_task(self._consume(revision + 1), name="registry-watch-stream")
                while True:
                    done, _ = await asyncio.wait({watch}, timeout=self.config.identity_check_s)
                    if done:
                        watch.result()  # raises what broke the stream
                        raise EtcdError("watch ended")
                    if await self._store_replaced():
                        break
            except EtcdError as e:
                backoff = self.config.resync_backoff_s
                delay = backoff[min(attempt, len(backoff) - 1)]
                attempt += 1
                logger.warning("registry: etcd watch interrupted (%s); resync in %.1fs", e, delay)
                await asyncio.sleep(delay)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("registry: watch loop failed; resync in 1s")
                await asyncio.sleep(1.0)
            finally:
                await cancel_and_wait(watch)  # its error, if any, was handled above

    def _on_event(self, kind: EventKind, key: str, value: bytes) -> None:
        now = self._clock()
        if kind is EventKind.PUT:
            meta = self._parse(key, value)
            if meta is not None:
                self._dispatch(self.table.key_put(meta, now))
            return
        parsed = parse_instance_key(key)
        if parsed is not None:
            role, name = parsed
            self._dispatch(self.table.key_deleted(name, now, role=role))

    # ------------------------------------------------------------------ probes

    async def _probe(self, info: InstanceInfo) -> bool:
        addr = info.meta.http_address
        if not addr or self._http is None:
            return False
        try:
            resp = await self._http.get(f"http://{addr}/health", timeout=self.config.health_timeout_s)
            return resp.status_code == 200
        except httpx.HTTPError:
            return False

    async def probe_once(self) -> None:
        """Probe every instance whose key is gone, then evict what is due."""
        lost = [i for i in self.table.all() if not i.key_present]
        if lost:
            results = await asyncio.gather(*(self._probe(i) for i in lost))
            now = self._clock()
            for info, ok in zip(lost, results):
                self._dispatch(self.table.health_result(info.name, ok, now, incarnation_id=info.incarnation_id))
        self._dispatch(self.table.tick(self._clock()))

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.probe_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("registry: probe round failed")

    # ------------------------------------------------------------------ callbacks

    def _dispatch(self, changes: list[Change]) -> None:
        for change in changes:
            for cb in self._change_callbacks:
                self._run_callback(cb, change)
            if change.kind in (ChangeKind.EVICTED, ChangeKind.REPLACED):
                reason = "evicted" if change.kind is ChangeKind.EVICTED else "replaced"
                for ecb in self._evict_callbacks:
                    self._run_callback(ecb, change.info, reason)

    def _run_callback(self, cb: Callable[..., object], *args: object) -> None:
        try:
            result = cb(*args)
        except Exception:
            logger.exception("registry callback %r failed", cb)
            return
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._callback_tasks.add(task)
            task.add_done_callback(self._callback_done)

    def _callback_done(self, task: "asyncio.Future[object]") -> None:
        self._callback_tasks.discard(task)  # type: ignore[arg-type]
        if not task.cancelled() and task.exception() is not None:
            logger.error("registry async callback failed: %r", task.exception())
