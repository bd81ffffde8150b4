"""PrefillPacer: the order and pacing of a PrefillSide's online queue. The side owns one,
given its records (read only) and the instance's latency profile.

Which online request goes next (`take`: deadline order by the request's TTFT target with
a cost model from the latency profile, xllm_py/cluster/prefill_order.py, or FCFS) and
when (`wait_for_room`: while the prompts placed on decodes and not handed over hold
fewer than `max_placed_prompt_tokens`, and in deadline order once the work placed ahead
is within PLACE_LEAD_S of done). Each prefill's measured time (`first_token`) corrects
the cost model.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.cluster.prefill_order import PrefillCostModel, Queued, pick
from xllm_py.config import PDSchedulerConfig
from xllm_py.engine.pd.phases import PrefillPhase, PrefillRequest

logger = logging.getLogger(__name__)

P = PrefillPhase
# Deadline order: the next request is placed once the work placed ahead is predicted to
# be done within this long (its AddNewRequests, link and admission fit in it).
PLACE_LEAD_S = 0.2
# Prompts shorter than this do not correct the cost model: their time is mostly the
# step's fixed costs, and short prompts share steps.
OBSERVE_MIN_TOKENS = 256


def cost_model(profile: LatencyProfile | None, step_budget_tokens: int,
               pd_config: PDSchedulerConfig) -> PrefillCostModel | None:
    """The deadline order's predictions: this instance's latency profile, as registered
    at start-up (xllm_py/engine/self_profile.py; none: FCFS)."""
    if pd_config.prefill_order != "deadline" or profile is None:
        return None
    return PrefillCostModel(dataclasses.replace(
        profile, max_num_batched_tokens=step_budget_tokens))


class PrefillPacer:
    def __init__(self, pd_config: PDSchedulerConfig, records: dict[str, PrefillRequest],
                 cost: PrefillCostModel | None) -> None:
        """`records`: the side's live requests (read only: which are placed); `cost`:
        cost_model's (None: FCFS)."""
        self.pd_config = pd_config
        self.records = records
        self.cost = cost
        self.online: list[PrefillRequest] = []  # arrival order
        self.room = asyncio.Event()  # set when a placed prompt is handed over or ends
        self._last_first_token_s = 0.0

    def queue(self, rec: PrefillRequest) -> None:
        """An online request joins the queue (its deadline and predicted cost set)."""
        if rec.spec.ttft_slo_ms > 0:
            rec.deadline_s = time.monotonic() + rec.spec.ttft_slo_ms / 1000.0
        if self.cost is not None:
            rec.cost_s = self.cost.predict_s(len(rec.spec.prompt_token_ids))
        self.online.append(rec)

    def placed_prompt_tokens(self) -> int:
        """Prompt tokens of the requests finding a decode or prefilling: decode blocks set
        aside (or about to be) for prompts not handed over yet."""
        return sum(len(r.spec.prompt_token_ids) for r in self.records.values()
                   if r.phase in (P.DISPATCHING, P.PREFILLING))

    async def wait_for_room(self) -> None:
        """Until the placed prompts leave room (one prompt always goes: a longer one
        than the limit waits for the others alone); in deadline order, also until the
        work placed ahead is within PLACE_LEAD_S of done: the next request is chosen
        when the engine is about to take it, not a whole prompt earlier: chosen early it
        rarely finds a request that can still make its deadline
        (benchmarks/bench_prefill_order.py)."""
        limit = self.pd_config.max_placed_prompt_tokens
        while True:
            if limit and 0 < self.placed_prompt_tokens() >= limit:
                self.room.clear()
                await self.room.wait()
                continue
            wait_s = self._ahead_s(time.monotonic()) - PLACE_LEAD_S if self.cost else 0.0
            if wait_s <= 0 or not self.online:
                return
            self.room.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.room.wait(), wait_s)

    def take(self) -> PrefillRequest | None:
        """The next online request (the queue's order; module docstring)."""
        self.online = [r for r in self.online if r.phase is P.QUEUED]  # not cancelled
        if not self.online:
            return None
        index = 0
        if self.cost is not None and len(self.online) > 1:
            now = time.monotonic()
            index = pick([Queued(r.deadline_s, r.cost_s) for r in self.online], now,
                         self._ahead_s(now))
        return self.online.pop(index)

    def first_token(self, rec: PrefillRequest) -> None:
        """`rec` sampled its first token: its prompt's compute time (from when the engine
        took it, submitted or the previous first token if that came later) corrects the
        cost model."""
        now = time.monotonic()
        if self.cost is not None and rec.submitted_s is not None:
            start = max(rec.submitted_s, self._last_first_token_s)
            if len(rec.spec.prompt_token_ids) >= OBSERVE_MIN_TOKENS:
                self.cost.observe(len(rec.spec.prompt_token_ids), now - start)
        self._last_first_token_s = now

    def _ahead_s(self, now: float) -> float:
        """Predicted prefill work placed and not computed yet: the placed prompts' costs
        less what the engine has computed since it took the oldest of them."""
        placed = [r for r in self.records.values() if r.phase in (P.DISPATCHING, P.PREFILLING)]
        started = [r.submitted_s for r in placed if r.submitted_s is not None]
        busy = now - max(min(started), self._last_first_token_s) if started else 0.0
        return max(0.0, sum(r.cost_s for r in placed) - max(0.0, busy))
