"""MetaCache: instance metas by name, read through from etcd and kept for a short while.

A prefill resolves its decode peer's meta for every request; reading etcd each time put an
etcd round trip on the request path and failed every PD request while etcd was down
(an etcd outage is not an instance's death). Fresh entries (< `ttl_s`) are served from
memory; a failed read serves the last known meta, however old, and says so in the log.
"""
from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

from xllm_py.cluster.etcd_client import EtcdError
from xllm_py.cluster.instance_meta import InstanceMeta

logger = logging.getLogger(__name__)

Fetch = Callable[[str], Awaitable[InstanceMeta | None]]


class MetaCache:
    def __init__(self, fetch: Fetch, ttl_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, tuple[float, InstanceMeta]] = {}

    def invalidate(self, name: str) -> None:
        """Read `name` from etcd next time (a call to the meta's address failed: the
        instance may have restarted elsewhere, under the same name)."""
        self._entries.pop(name, None)

    async def get(self, name: str) -> InstanceMeta | None:
        entry = self._entries.get(name)
        now = self._clock()
        if entry is not None and now - entry[0] < self.ttl_s:
            return entry[1]
        try:
            meta = await self._fetch(name)
        except EtcdError as exc:
            if entry is None:
                raise
            logger.warning("etcd read of instance %s failed (%s); using its meta from %.0fs ago",
                           name, exc, now - entry[0])
            return entry[1]
        if meta is None:
            self._entries.pop(name, None)
        else:
            self._entries[name] = (now, meta)
        return meta
