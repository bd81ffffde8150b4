"""OfflineQueue: a prefill's offline requests, handed to a decode only when it pulls.

Stages of an offline request here (its PrefillPhase stays QUEUED until dispatched):
  add -> queued (arrival order) -> granted to a pull (SendPullSignal from a decode with
  room: up to `preferred_req_len` requests whose prompt + max_tokens together fit its
  `max_total_len`; the request is placed on that decode) -> taken by the dispatch loop
  after every online request. A request cancelled meanwhile is skipped.

Pure Python (asyncio-free): the PrefillSide calls it on the event loop.
"""
from __future__ import annotations

import collections

from xllm_py.pd_messages import OfflinePull
from xllm_py.engine.pd.phases import PrefillPhase, PrefillRequest


def request_tokens(rec: PrefillRequest) -> int:
    """KV tokens the request may take on a decode: its prompt and max_tokens."""
    return len(rec.spec.prompt_token_ids) + (rec.spec.params.max_tokens or 0)


class OfflineQueue:
    def __init__(self) -> None:
        self._queued: collections.deque[PrefillRequest] = collections.deque()
        self._granted: collections.deque[PrefillRequest] = collections.deque()

    def __len__(self) -> int:
        """Queued, not granted yet."""
        return len(self._queued)

    def add(self, rec: PrefillRequest) -> None:
        self._queued.append(rec)

    def grant(self, pull: OfflinePull) -> list[PrefillRequest]:
        """The requests this pull takes, in arrival order (placed on its decode)."""
        granted: list[PrefillRequest] = []
        tokens = 0
        while self._queued and len(granted) < pull.preferred_req_len:
            rec = self._queued[0]
            if rec.phase is not PrefillPhase.QUEUED:  # cancelled while queued
                self._queued.popleft()
                continue
            need = request_tokens(rec)
            if tokens + need > pull.max_total_len:
                break
            self._queued.popleft()
            rec.spec.decode_name = pull.source_instance_name
            tokens += need
            granted.append(rec)
        self._granted.extend(granted)
        return granted

    def has_granted(self) -> bool:
        return bool(self._granted)

    def take(self) -> PrefillRequest | None:
        """The next granted request to dispatch (None: none granted)."""
        while self._granted:
            rec = self._granted.popleft()
            if rec.phase is PrefillPhase.QUEUED:
                return rec
        return None
