"""MasterElection: which xllm_service process is the master.

Stages:
  1. announce - `XLLM:SERVICE:<addr>` = addr on this service's own lease (LeasedKey);
  2. campaign - create `XLLM:SERVICE:MASTER` = addr if absent (one transaction, on a
                fresh lease). Won: master. Lost: follower, remember the winner;
  3. hold     - the master refreshes its lease every ttl/3; if the lease is gone or etcd
                has not answered for a whole TTL it steps down (it can no longer prove it
                holds the key), then campaigns again;
  4. follow   - followers watch the master key; a DELETE (lease expired with the dead
                master, or a resignation) triggers an immediate campaign. A re-read every
                ttl/3 backs the watch up. Takeover after a master crash: about one TTL.
  5. stop     - resign (delete the master key if ours, revoke leases) or, with
                `resign=False`, just stop (a crash: keys expire with their leases).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable

from xllm_py.cluster.etcd_client import MASTER_KEY, EtcdClient, EtcdError, service_key
from xllm_py.cluster.leased_key import LeasedKey
from xllm_py.utils.aio import cancel_and_wait, wait_for

logger = logging.getLogger(__name__)

# callback(is_master, master_addr)
MasterChangeCallback = Callable[[bool, "str | None"], "None | Awaitable[None]"]


class MasterElection:
    def __init__(self, etcd: EtcdClient, my_addr: str, ttl_s: float = 3.0) -> None:
        self.etcd = etcd
        self.my_addr = my_addr
        self.ttl_s = ttl_s
        self.interval_s = max(0.1, ttl_s / 3)
        self._service_key = LeasedKey(etcd, service_key(my_addr), my_addr, ttl_s, interval_s=self.interval_s)
        self._lease_id: int | None = None
        self._last_refresh_ok = 0.0
        self._is_master = False
        self._master_addr: str | None = None
        self._callbacks: list[MasterChangeCallback] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.became_master_at: float | None = None  # monotonic, for measurements

    @property
    def is_master(self) -> bool:
        return self._is_master

    @property
    def master_addr(self) -> str | None:
        return self._master_addr

    def on_change(self, callback: MasterChangeCallback) -> None:
        self._callbacks.append(callback)

    async def start(self) -> None:
        self._service_key.start_background()
        self._tasks = [
            asyncio.create_task(self._campaign_loop(), name="election-campaign"),
            asyncio.create_task(self._watch_loop(), name="election-watch"),
        ]

    async def wait_decided(self, timeout_s: float = 5.0) -> None:
        """Wait until a master is known (us or another)."""
        deadline = time.monotonic() + timeout_s
        while self._master_addr is None:
            if time.monotonic() > deadline:
                raise TimeoutError("no master elected in time")
            await asyncio.sleep(0.02)

    async def stop(self, resign: bool = True) -> None:
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            await cancel_and_wait(t)
        if resign:
            try:
                if self._is_master:
                    await self.etcd.delete_if_value(MASTER_KEY, self.my_addr)
                if self._lease_id is not None:
                    await self.etcd.revoke_lease(self._lease_id)
            except EtcdError as e:
                logger.warning("resigning as master failed (the key expires with its lease): %s", e)
        self._lease_id = None
        await self._service_key.stop(delete=resign)
        if self._is_master:
            logger.info("%s stops being the master (shutting down)", self.my_addr)
        self._set(False, None if self._is_master else self._master_addr, stopping=True)

    # ------------------------------------------------------------------ internals

    def _set(self, is_master: bool, master_addr: str | None, stopping: bool = False) -> None:
        if is_master == self._is_master and master_addr == self._master_addr:
            return
        was = self._is_master
        self._is_master, self._master_addr = is_master, master_addr
        if is_master and not was:
            self.became_master_at = time.monotonic()
            logger.info("%s is now the master", self.my_addr)
        elif was and not is_master and not stopping:
            logger.warning("%s is no longer the master (master: %s)", self.my_addr, master_addr)
        for cb in self._callbacks:
            try:
                result = cb(is_master, master_addr)
                if inspect.isawaitable(result):
                    asyncio.ensure_future(result)
            except Exception:
                logger.exception("master change callback failed")

    async def _campaign(self) -> None:
        lease_id = await self.etcd.grant_lease(self.ttl_s)
        try:
            created, current = await self.etcd.put_if_absent(MASTER_KEY, self.my_addr, lease_id)
        except EtcdError:
            # The member may have written the key before it failed to answer: revoking
            # the lease takes such a key with it, so the next round can win at once
            # instead of finding a key nobody holds until its lease runs out.
            try:
                await self.etcd.revoke_lease(lease_id)
            except EtcdError:
                pass  # then the key goes when the lease expires
            raise
        if created:
            self._lease_id = lease_id
            self._last_refresh_ok = time.monotonic()
            self._set(True, self.my_addr)
            return
        await self.etcd.revoke_lease(lease_id)
        self._set(False, current.decode() if current else None)

    async def _hold(self) -> None:
        assert self._lease_id is not None
        try:
            ttl = await self.etcd.refresh_lease(self._lease_id)
        except EtcdError as e:
            if time.monotonic() - self._last_refresh_ok > self.ttl_s:
                logger.warning("master lease unrefreshed for a whole TTL (%s): stepping down", e)
                self._lease_id = None
                self._set(False, None)
            raise
        if ttl <= 0:
            logger.warning("master lease expired: stepping down")
            self._lease_id = None
            self._set(False, None)
            return
        self._last_refresh_ok = time.monotonic()
        kv = await self.etcd.get(MASTER_KEY)
        if kv is None:  # deleted by hand: take it back on our lease
            created, current = await self.etcd.put_if_absent(MASTER_KEY, self.my_addr, self._lease_id)
            if not created:
                self._set(False, current.decode() if current else None)
        elif kv.value.decode() != self.my_addr:
            self._set(False, kv.value.decode())

    async def _campaign_loop(self) -> None:
        while True:
            try:
                if self._is_master and self._lease_id is not None:
                    await self._hold()
                else:
                    await self._campaign()
            except EtcdError as e:
                logger.warning("election: etcd call failed (will retry): %s", e)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("election round failed (will retry)")
            try:
                await wait_for(self._wake.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def _watch_loop(self) -> None:
        while True:
            try:
                async for ev in self.etcd.watch_prefix(MASTER_KEY):
                    if ev.key == MASTER_KEY:
                        self._wake.set()
            except EtcdError as e:
                logger.debug("election watch interrupted: %s", e)
                await asyncio.sleep(self.interval_s)
