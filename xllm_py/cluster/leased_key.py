"""LeasedKey: one etcd key kept alive on its own lease, put back when it disappears."""
from __future__ import annotations

import asyncio
import logging

from xllm_py.cluster.etcd_client import EtcdClient, EtcdError
from xllm_py.utils.aio import cancel_and_wait, wait_for

logger = logging.getLogger(__name__)


class LeasedKey:
    """Keeps `key = value` alive on its own lease; puts it back when it disappears.

    Each tick (every `interval_s`): refresh the lease; if the lease is gone (expired,
    etcd restarted without its data) grant a new one and put the key; if the key is gone
    or changed (deleted by hand) put it back. `stop()` deletes the key and revokes the
    lease. `stop(delete=False)` only stops refreshing (the key expires with the lease).
    """

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        value: str | bytes,
        ttl_s: float,
        interval_s: float | None = None,
    ) -> None:
        self.client = client
        self.key = key
        self._value = value.encode() if isinstance(value, str) else value
        self.ttl_s = ttl_s
        self.interval_s = interval_s if interval_s is not None else max(0.1, ttl_s / 3)
        self.lease_id: int | None = None
        self.num_reputs = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @property
    def value(self) -> bytes:
        return self._value

    def set_value(self, value: str | bytes) -> None:
        """Change the value; written on the next tick (call `await ensure()` to write now)."""
        self._value = value.encode() if isinstance(value, str) else value
        self._wake.set()

    async def start(self) -> None:
        """Write the key once (raises EtcdError if etcd is unreachable), then keep it alive."""
        await self.ensure()
        self._task = asyncio.create_task(self._loop(), name=f"leased-key {self.key}")

    def start_background(self) -> None:
        """Keep the key alive without a first synchronous write (etcd may be down now)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"leased-key {self.key}")

    async def ensure(self) -> None:
        """One tick: make sure the lease is alive and the key holds our value on it."""
        if self.lease_id is not None:
            ttl = await self.client.refresh_lease(self.lease_id)
            if ttl <= 0:
                logger.warning("lease %x of %s expired; registering again", self.lease_id, self.key)
                self.lease_id = None
        if self.lease_id is None:
            self.lease_id = await self.client.grant_lease(self.ttl_s)
            await self.client.put(self.key, self._value, self.lease_id)
            self.num_reputs += 1
            return
        current = await self.client.get(self.key)
        if current is None or current.value != self._value or current.lease != self.lease_id:
            if current is None:
                logger.warning("key %s disappeared; putting it back", self.key)
            await self.client.put(self.key, self._value, self.lease_id)
            self.num_reputs += 1

    async def _loop(self) -> None:
        while True:
            try:
                await wait_for(self._wake.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.ensure()
            except EtcdError as e:
                logger.warning("keeping %s alive failed (will retry): %s", self.key, e)
            except Exception:
                logger.exception("keeping %s alive failed unexpectedly (will retry)", self.key)

    async def stop(self, delete: bool = True) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if not delete:
            return
        lease_id, self.lease_id = self.lease_id, None
        try:
            await self.client.delete(self.key)
            if lease_id is not None:
                await self.client.revoke_lease(lease_id)
        except EtcdError as e:
            logger.warning("removing %s on stop failed (it expires with its lease): %s", self.key, e)

