"""OfflinePolicy: the offline (batch) requests of a ContinuousScheduler, their queues and
the room they get. The scheduler owns one, given its KV manager and its queues.

Offline (batch) requests run only in the room online requests leave:
  waiting (own queue, FCFS) -> RUNNING when a seat, the token budget, KV and the
  offline gate (offline_gate.py: time beside online streams) allow
  -> SUSPENDED (out of the batch, KV kept) when online work needs its seat or the gate
  closes; back to RUNNING when the room returns (before any waiting offline request)
  -> PREEMPTED (KV freed, recomputed exactly from prompt + outputs later) when online
  work needs its KV: the suspended go first, then the running, latest first.
With no online request here the gate does not limit: offline work runs at full batch.
The scheduler's step asks the policy whose KV or seat goes, and hands it the requests
to suspend, resume or preempt; the policy keeps its queues and counts.

Pure Python: no torch, no grpc.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from xllm_py.config import SchedulerConfig
from xllm_py.engine.kv_cache_manager import KVCacheManager
from xllm_py.engine.offline_gate import OfflineGate
from xllm_py.engine.scheduler_rules import reset_for_recompute
from xllm_py.request import Request, RequestStatus

if TYPE_CHECKING:
    from xllm_py.engine.scheduler_types import StepState

S = RequestStatus
# A decode asks for offline work only below this KV use (xLLM's check_able_to_pull).
PULL_KV_USAGE = 0.9


class OfflinePolicy:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, running: list[Request],
                 online_waiting: collections.deque[Request]) -> None:
        """`running`: the scheduler's batch (online and offline, admission order);
        `online_waiting`: its online queue (read only: seats it will take)."""
        self.config = config
        self.kv = kv
        self.running = running
        self.online_waiting = online_waiting
        self.waiting: collections.deque[Request] = collections.deque()
        self.suspended: collections.deque[Request] = collections.deque()  # KV kept
        self.gate = OfflineGate(config.max_num_batched_tokens)
        self.num_preemptions = 0  # offline requests whose KV went to other work
        self.num_suspensions = 0  # offline requests taken out of the batch

    # -- queries -------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Offline requests waiting to start (preempted ones included)."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return sum(1 for r in self.running if r.offline)

    @property
    def num_preempted(self) -> int:
        """Offline requests out of the batch for online work: suspended (KV kept) or
        preempted (waiting to be recomputed)."""
        waiting = list(self.waiting)  # (one C call: read from other threads too)
        return len(self.suspended) + sum(1 for r in waiting if r.status == S.PREEMPTED)

    def has_room(self) -> bool:
        """Whether more offline work would fit now: a free seat, KV use under
        PULL_KV_USAGE, and no online stream here or their last step within the gate's
        bound (0.9 x their TPOT target, 1.25 x their steps alone: a PD decode's pull
        condition, as xLLM's check_able_to_pull)."""
        seats_taken = (len(self.running) + len(self.online_waiting) + len(self.waiting)
                       + len(self.suspended))
        if seats_taken >= self.config.max_num_seqs or self.kv.usage >= PULL_KV_USAGE:
            return False
        if not any(not r.offline for r in self.running):
            return True  # no online stream: the gate's last interval is history
        return self.gate.has_room(self.target_s())

    def target_s(self) -> float | None:
        """The TPOT target offline work keeps online steps within (s): the smallest of the
        running online requests' own, else the engine's prompt_tpot_target_ms; None."""
        targets = [r.tpot_slo_ms for r in self.running if not r.offline and r.tpot_slo_ms > 0]
        target_ms = min(targets) if targets else self.config.prompt_tpot_target_ms
        return target_ms / 1000.0 if target_ms > 0 else None

    # -- whose seat or KV goes -----------------------------------------------------------
    def victim(self, request: Request) -> Request:
        """Whose KV goes when `request` (running) needs more: offline work first (the
        suspended, then the running, latest first); online work only for an online one."""
        victim = self.latest()
        if victim is not None or request.offline:
            return victim if victim is not None else request
        return self.running[-1]

    def latest(self) -> Request | None:
        """The offline request whose KV goes first: the latest suspended, else running."""
        if self.suspended:
            return self.suspended[-1]
        return next((r for r in reversed(self.running) if r.offline), None)

    def unscheduled(self, st: StepState) -> Request | None:
        """The latest running offline request without a seq in this step."""
        return next((r for r in reversed(self.running) if r.offline and not st.has(r.request_id)),
                    None)

    # -- moves ---------------------------------------------------------------------
    def suspend(self, request: Request) -> None:
        """Take a running offline request out of the batch, its KV kept."""
        self.running.remove(request)
        request.transition(S.SUSPENDED)
        self.suspended.append(request)
        self.num_suspensions += 1

    def resume(self) -> Request:
        """The first suspended request back into the batch (its KV allocated)."""
        request = self.suspended.popleft()
        request.transition(S.RUNNING)
        self.running.append(request)
        return request

    def preempt(self, request: Request) -> None:
        """Free a running or suspended offline request's KV; it waits first in line."""
        (self.suspended if request.status == S.SUSPENDED else self.running).remove(request)
        reset_for_recompute(request, self.kv)
        self.waiting.appendleft(request)
        self.num_preemptions += 1
