"""The Responses API's stored responses in etcd, where every service replica finds them
(a client's next turn may reach another replica than its first).

One key per response (`responses/<id>`), written on a lease of its own that expires it
after `ttl_s`; after a write the oldest keys (by write revision) beyond `max_responses`
are deleted. A record over `max_bytes` is not written (xllm_py/api/response_store.py).
etcd failures: a write that fails is logged and the response says `store: false`; a read
that fails is a 503 (the record may exist: a 404 would be a lie).
"""
from __future__ import annotations

import json
import logging
from typing import Any

from xllm_py.api.errors import ServiceUnavailableError
from xllm_py.api.response_store import ResponseStoreLimits, encode_record
from xllm_py.cluster.etcd_client import EtcdClient, EtcdError

logger = logging.getLogger(__name__)

PREFIX = "responses/"


class EtcdResponseStore:
    def __init__(self, etcd: EtcdClient, limits: ResponseStoreLimits | None = None) -> None:
        self.etcd = etcd
        self.limits = limits or ResponseStoreLimits()

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        data = encode_record(record, self.limits)
        if data is None:
            return False
        try:
            lease = await self.etcd.grant_lease(self.limits.ttl_s)
            await self.etcd.put(PREFIX + response_id, data, lease_id=lease)
            await self._trim()
        except EtcdError as e:
            logger.warning("storing a response in etcd failed: %s", e)
            return False
        return True

    async def _trim(self) -> None:
        kvs, _ = await self.etcd.get_prefix(PREFIX, keys_only=True)
        excess = len(kvs) - self.limits.max_responses
        if excess <= 0:
            return
        for kv in sorted(kvs, key=lambda kv: kv.mod_revision)[:excess]:
            await self._drop(kv.key, kv.lease)

    async def _drop(self, key: str, lease: int) -> None:
        """Revoking the record's own lease deletes it and frees the lease at once."""
        if lease:
            await self.etcd.revoke_lease(lease)
        else:
            await self.etcd.delete(key)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        try:
            kv = await self.etcd.get(PREFIX + response_id)
        except EtcdError as e:
            raise ServiceUnavailableError(f"the response store is unavailable ({e})") from None
        return json.loads(kv.value) if kv is not None else None

    async def delete(self, response_id: str) -> bool:
        try:
            kv = await self.etcd.get(PREFIX + response_id)
            if kv is None:
                return False
            await self._drop(kv.key, kv.lease)
            return True
        except EtcdError as e:
            raise ServiceUnavailableError(f"the response store is unavailable ({e})") from None
