"""Stored responses of the Responses API (`store`, GET / DELETE /v1/responses/{id},
`previous_response_id`).

A record is one JSON document: the response object as a client sees it and the
conversation it ended (the chat messages of its history, input and output, less its
`instructions`, which a next turn does not inherit), so that a next turn prepends it
without reading anything else. Records are bounded (`ResponseStoreLimits`): at most
`max_responses` (the oldest go first), each at most `max_bytes` (a larger one is not
stored and the response says `store: false`), each expiring `ttl_s` after it was written.

`MemoryResponseStore` serves a standalone engine (one process); the service keeps its
records in etcd (xllm_service/response_store.py), where every replica finds them.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from typing import Any, Callable, Protocol

from xllm_py.api.errors import APIError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ResponseStoreLimits:
    max_responses: int = 1000
    # One record; under etcd's default request limit (1.5 MiB) with room for the key.
    max_bytes: int = 1 << 20
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_responses < 1 or self.max_bytes < 1 or self.ttl_s <= 0:
            raise ValueError("response store limits must be positive")


class ResponseNotFoundError(APIError):
    """404 naming a stored response that is not there (never stored, expired, deleted)."""

    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, response_id: str, param: str | None = None) -> None:
        what = "Previous response" if param == "previous_response_id" else "Response"
        super().__init__(f"{what} with id '{response_id}' not found.", param=param,
                         code="response_not_found")


class ResponseStore(Protocol):
    limits: ResponseStoreLimits

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        """Store `record`; False when it is over max_bytes (then it is not stored)."""
        ...

    async def get(self, response_id: str) -> dict[str, Any] | None:
        """The record, or None when it is not there (never stored, expired, deleted)."""
        ...

    async def delete(self, response_id: str) -> bool:
        """True if it was there."""
        ...


def encode_record(record: dict[str, Any], limits: ResponseStoreLimits) -> bytes | None:
    """The record's bytes, None when over the limit."""
    data = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
    if len(data) > limits.max_bytes:
        logger.warning("a response of %d bytes is over the store's limit of %d; not stored",
                       len(data), limits.max_bytes)
        return None
    return data


class MemoryResponseStore:
    """Records in this process, in write order (the oldest evicted first)."""

    def __init__(self, limits: ResponseStoreLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or ResponseStoreLimits()
        self._clock = clock
        self._records: collections.OrderedDict[str, tuple[float, bytes]] = \
            collections.OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._records)

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        data = encode_record(record, self.limits)
        if data is None:
            return False
        self._expire()
        self._records.pop(response_id, None)
        self._records[response_id] = (self._clock() + self.limits.ttl_s, data)
        while len(self._records) > self.limits.max_responses:
            self._records.popitem(last=False)
        return True

    async def get(self, response_id: str) -> dict[str, Any] | None:
        self._expire()
        entry = self._records.get(response_id)
        return json.loads(entry[1]) if entry is not None else None

    async def delete(self, response_id: str) -> bool:
        self._expire()
        return self._records.pop(response_id, None) is not None

    def _expire(self) -> None:
        now = self._clock()
        while self._records:
            _, (expires, _) = next(iter(self._records.items()))
            if expires > now:  # (write order is expiry order: one ttl for all)
                break
            self._records.popitem(last=False)
