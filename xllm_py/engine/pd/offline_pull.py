"""OfflinePuller: a decode with room asks prefills for offline work (xLLM's PD OOC pull,
`check_able_to_pull`: KV use < 0.9 and the last decode step < 0.9 x the TPOT target).

Stages, repeated:
  room? (the connector's OfflineRoom, answered in the engine's step:
  engine/remote_kv.offline_room: a free seat, KV use under 0.9, the online streams' last
  step under 0.9 x their TPOT target; no online stream: room)
  -> a prefill from the master's list, round robin (the list kept PREFILL_LIST_TTL_S)
  -> SendPullSignal(PullSignal{our name, free seats, free KV tokens}), with the RPC
  deadline -> the prefill hands over n offline requests (AddNewRequests to us, as any
  request) -> n > 0: wait until they arrived (or PULL_SETTLE_S), pull again at once;
  n == 0: the next pull waits longer (doubling up to PULL_IDLE_MAX_S); no room: checked
  again after PULL_INTERVAL_S. A failed pull is counted and logged, never raised.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Awaitable, Callable

from xllm_py.engine.pd.links import MetaResolver
from xllm_py.pd_messages import OfflinePull
from xllm_py.engine.pd.metrics import PDMetrics
from xllm_py.engine.pd.peers import PDPeers
from xllm_py.status import StatusError

logger = logging.getLogger(__name__)

PULL_INTERVAL_S = 0.05
PULL_IDLE_MAX_S = 0.25  # an idle decode asks 4 times a second: batch work starts within it
PULL_SETTLE_S = 5.0
PREFILL_LIST_TTL_S = 2.0

# Names of the schedulable prefill instances (from the master).
PrefillLister = Callable[[], Awaitable[list[str]]]
# (free seats, free KV tokens) for offline work, or None (PDConnector.offline_room).
RoomAsker = Callable[[], Awaitable[tuple[int, int] | None]]


class OfflinePuller:
    def __init__(self, room: RoomAsker, name: str, peers: PDPeers,
                 list_prefills: PrefillLister, resolve_meta: MetaResolver,
                 metrics: PDMetrics, arrivals: Callable[[], int]) -> None:
        self.room = room
        self.name = name
        self.peers = peers
        self.list_prefills = list_prefills
        self.resolve_meta = resolve_meta
        self.metrics = metrics
        self.arrivals = arrivals  # offline requests placed here so far (AddNewRequests)
        self._rr = itertools.count()
        self._prefills: tuple[float, list[str]] = (-1e9, [])

    async def loop(self) -> None:
        delay = PULL_INTERVAL_S
        while True:
            await asyncio.sleep(delay)
            try:
                handed = await self.pull_once()
            except Exception:  # never let the loop die
                logger.exception("offline pull failed")
                handed = 0
            if handed is None or handed > 0:
                delay = PULL_INTERVAL_S
            else:
                delay = min(PULL_IDLE_MAX_S, delay * 2)

    async def pull_once(self) -> int | None:
        """One pull if there is room: the requests handed (None: no room or no prefill)."""
        room = await self.room()
        if room is None:
            return None
        seats, free_tokens = room
        before = self.arrivals()
        prefill = await self._next_prefill()
        if prefill is None:
            return None
        self.metrics.pulls_sent.inc()
        try:
            handed = await self.peers.send_pull_signal(
                prefill, OfflinePull(self.name, seats, free_tokens))
        except StatusError as exc:
            self.metrics.pulls_failed.inc()
            logger.info("offline pull from %s failed: %s", prefill.name, exc.message)
            return 0
        self.metrics.pulls_answered.inc()
        if handed:
            logger.info("prefill %s hands %d offline requests over", prefill.name, handed)
            await self._settle(before + handed)
        return handed

    async def _settle(self, target: int) -> None:
        """Until the requests handed have been placed here, or PULL_SETTLE_S."""
        deadline = time.monotonic() + PULL_SETTLE_S
        while time.monotonic() < deadline and self.arrivals() < target:
            await asyncio.sleep(PULL_INTERVAL_S)

    async def _next_prefill(self):
        at, names = self._prefills
        if time.monotonic() - at > PREFILL_LIST_TTL_S:
            try:
                names = await self.list_prefills()
            except Exception as exc:  # the master may be switching over
                logger.info("could not list prefill instances: %s", exc)
                names = []
            self._prefills = (time.monotonic(), names)
        if not names:
            return None
        name = names[next(self._rr) % len(names)]
        return await self.resolve_meta(name)
