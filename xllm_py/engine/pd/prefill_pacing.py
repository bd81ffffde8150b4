"""The online queue's order and pacing of a PrefillSide (a mixin: it shares its records).

Which online request goes next (`_take_online`: deadline order by the request's TTFT
target with a cost model from the latency profile, xllm_py/cluster/prefill_order.py, or
FCFS) and when (`_wait_for_room`: while the prompts placed on decodes and not handed over
hold fewer than `max_placed_prompt_tokens`, and in deadline order once the work placed
ahead is within PLACE_LEAD_S of done).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

from xllm_py.cluster.prefill_order import PrefillCostModel, Queued, pick
from xllm_py.engine.pd.config import PDSchedulerConfig
from xllm_py.engine.pd.phases import PrefillPhase, PrefillRequest

logger = logging.getLogger(__name__)

P = PrefillPhase
# Deadline order: the next request is placed once the work placed ahead is predicted to
# be done within this long (its AddNewRequests, link and admission fit in it).
PLACE_LEAD_S = 0.2


def cost_model(engine, pd_config: PDSchedulerConfig) -> PrefillCostModel | None:
    """The deadline order's predictions: this instance's latency profile, as registered
    at start-up (engine.latency_profile, xllm_py/engine/self_profile.py; none: FCFS)."""
    profile = getattr(engine, "latency_profile", None)
    if pd_config.prefill_order != "deadline" or profile is None:
        return None
    return PrefillCostModel(dataclasses.replace(
        profile, max_num_batched_tokens=engine.step_budget_tokens))


class PacingMixin:
    def placed_prompt_tokens(self) -> int:
        """Prompt tokens of the requests finding a decode or prefilling: decode blocks set
        aside (or about to be) for prompts not handed over yet."""
        return sum(len(r.spec.prompt_token_ids) for r in self._requests.values()
                   if r.phase in (P.DISPATCHING, P.PREFILLING))

    async def _wait_for_room(self) -> None:
        """Until the placed prompts leave room (one prompt always goes: a longer one
        than the limit waits for the others alone); in deadline order, also until the
        work placed ahead is within PLACE_LEAD_S of done: the next request is chosen
        when the engine is about to take it, not a whole prompt earlier: chosen early it
        rarely finds a request that can still make its deadline
        (benchmarks/bench_prefill_order.py)."""
        limit = self.pd_config.max_placed_prompt_tokens
        while True:
            if limit and 0 < self.placed_prompt_tokens() >= limit:
                self._room.clear()
                await self._room.wait()
                continue
            wait_s = self._ahead_s(time.monotonic()) - PLACE_LEAD_S if self._cost else 0.0
            if wait_s <= 0 or not self._online:
                return
            self._room.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._room.wait(), wait_s)

    def _take_online(self) -> PrefillRequest | None:
        """The next online request (the queue's order; module docstring)."""
        self._online = [r for r in self._online if r.phase is P.QUEUED]  # not cancelled
        if not self._online:
            return None
        index = 0
        if self._cost is not None and len(self._online) > 1:
            now = time.monotonic()
            index = pick([Queued(r.deadline_s, r.cost_s) for r in self._online], now,
                         self._ahead_s(now))
        return self._online.pop(index)

    def _ahead_s(self, now: float) -> float:
        """Predicted prefill work placed and not computed yet: the placed prompts' costs
        less what the engine has computed since it took the oldest of them."""
        placed = [r for r in self._requests.values() if r.phase in (P.DISPATCHING, P.PREFILLING)]
        started = [r.submitted_s for r in placed if r.submitted_s is not None]
        busy = now - max(min(started), self._last_first_token_s) if started else 0.0
        return max(0.0, sum(r.cost_s for r in placed) - max(0.0, busy))

