"""The offline side of ContinuousScheduler (a mixin: it shares the scheduler's queues).

Offline (batch) requests run only in the room online requests leave:
  waiting_offline (own queue, FCFS) -> RUNNING when a seat, the token budget, KV and the
  offline gate (offline_gate.py: time beside online streams) allow
  -> SUSPENDED (out of the batch, KV kept) when online work needs its seat or the gate
  closes; back to RUNNING when the room returns (before any waiting offline request)
  -> PREEMPTED (KV freed, recomputed exactly from prompt + outputs later) when online
  work needs its KV: the suspended go first, then the running, latest first.
With no online request here the gate does not limit: offline work runs at full batch.

Pure Python: no torch, no grpc.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from xllm_py.request import Request, RequestStatus

if TYPE_CHECKING:
    from xllm_py.engine.scheduler_types import StepState

S = RequestStatus
# A decode asks for offline work only below this KV use (xLLM's check_able_to_pull).
PULL_KV_USAGE = 0.9


class OfflineMixin:
    @property
    def num_offline_waiting(self) -> int:
        """Offline requests waiting to start (preempted ones included)."""
        return len(self.waiting_offline)

    @property
    def num_offline_running(self) -> int:
        return sum(1 for r in self.running if r.offline)

    @property
    def num_offline_preempted(self) -> int:
        """Offline requests out of the batch for online work: suspended (KV kept) or
        preempted (waiting to be recomputed)."""
        waiting = list(self.waiting_offline)  # (one C call: read from other threads too)
        return len(self.suspended) + sum(1 for r in waiting if r.status == S.PREEMPTED)

    def offline_has_room(self) -> bool:
        """Whether more offline work would fit now: a free seat, KV use under
        PULL_KV_USAGE, and no online stream here or their last step within the gate's
        bound (0.9 x their TPOT target, 1.25 x their steps alone: a PD decode's pull
        condition, as xLLM's check_able_to_pull)."""
        if (len(self.running) + self.num_waiting + len(self.suspended)
                >= self.config.max_num_seqs or self.kv.usage >= PULL_KV_USAGE):
            return False
        if not any(not r.offline for r in self.running):
            return True  # no online stream: the gate's last interval is history
        return self.offline_gate.has_room(self._offline_target_s())

    def _schedule_offline(self, st: StepState, limit: float) -> None:
        """Offline requests in the room online work left: running ones within `limit`
        tokens (those past it suspended, their KV kept), then the suspended ones (while
        their next token fits without preempting anything), then the waiting ones."""
        for request in [r for r in self.running if r.offline]:
            if request.status != S.RUNNING or st.has(request.request_id):
                continue
            is_decode = request.num_tokens - request.num_computed_tokens == 1
            if st.offline_tokens >= limit:
                self._suspend(request)
                continue
            self._run(request, st, is_decode, limit - st.offline_tokens)
        while (self.suspended and st.offline_tokens < limit and st.budget > 0
               and st.num_seqs < self.config.max_num_seqs
               and len(self.running) < self.config.max_num_seqs):
            request = self.suspended[0]
            left = request.num_tokens - request.num_computed_tokens
            num_new = self._num_new_tokens(request, request.num_computed_tokens,
                                           int(min(st.budget, limit - st.offline_tokens)))
            if num_new == 0 or self.kv.allocate_slots(request, num_new) is None:
                break
            self.suspended.popleft()
            request.transition(S.RUNNING)
            self.running.append(request)
            self._add_seq(request, num_new, st, is_decode=left == 1)
        if st.offline_tokens < limit:
            self._admit_waiting(self.waiting_offline, st, limit)

    def _offline_target_s(self) -> float | None:
        """The TPOT target offline work keeps online steps within (s): the smallest of the
        running online requests' own, else the engine's prompt_tpot_target_ms; None."""
        targets = [r.tpot_slo_ms for r in self.running if not r.offline and r.tpot_slo_ms > 0]
        target_ms = min(targets) if targets else self.config.prompt_tpot_target_ms
        return target_ms / 1000.0 if target_ms > 0 else None

    def _victim(self, request: Request) -> Request:
        """Whose KV goes when `request` (running) needs more: offline work first (the
        suspended, then the running, latest first); online work only for an online one."""
        victim = self._offline_victim()
        if victim is not None or request.offline:
            return victim if victim is not None else request
        return self.running[-1]

    def _offline_victim(self) -> Request | None:
        if self.suspended:
            return self.suspended[-1]
        return next((r for r in reversed(self.running) if r.offline), None)

    def _unscheduled_offline(self, st: StepState) -> Request | None:
        return next((r for r in reversed(self.running) if r.offline and not st.has(r.request_id)),
                    None)

    def _suspend(self, request: Request) -> None:
        """Take a running offline request out of the batch, its KV kept."""
        self.running.remove(request)
        request.transition(S.SUSPENDED)
        self.suspended.append(request)
        self.num_offline_suspensions += 1

