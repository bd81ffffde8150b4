"""ContinuousScheduler: continuous batching with chunked prefill and preemption.

One engine step:
    schedule() -> SchedulerOutput (which tokens of which requests to compute, with
    block tables) -> model runner -> update_from_output(out, sampled) -> RequestUpdate
    per request that produced a token or finished.

Request stages (see xllm_py/request.py for the state machine):
    add_request -> waiting queue -> admitted when its KV fits (prefix hits skip compute)
    -> running: decode tokens first, then prefill chunks, under a per-step token budget
    (beside decoding streams: at most max_prefill_tokens_while_decoding, and only what
    keeps every stream's mean TPOT within prompt_tpot_target_ms: tpot_guard.py)
    -> preempted (blocks freed, recomputed later from prompt + outputs) or finished
    (blocks freed at once); max_tokens 0 ends right after the prefill; a request whose
    prefix the KV tiers are looking up waits (engine/kv_tiering.py). Prompt logprobs:
    computed from scratch (cached blocks have KV, no logits; scheduler_rules.scores_prompt).
    The scheduler owns two policies, each given what it needs: `remote`
    (RemoteKVAdmission, scheduler_pd.py: a decode's prompts whose KV comes from a peer,
    a prefill's KV held until sent) and `offline` (OfflinePolicy, scheduler_offline.py:
    offline requests in the room online work leaves; suspended or preempted for it).
    Speculation (spec_decode/, a Speculator passed in): a decode of the last token plus the
    guesses; update_from_output appends the accepted tokens and the Speculator rolls back.

Pure Python: no torch, no grpc.
"""
from __future__ import annotations

import collections
import logging
import math
import time
from typing import Callable

from xllm_py.config import CacheConfig, SchedulerConfig
from xllm_py.engine.block_pool import BlockPool
from xllm_py.engine.hybrid_kv import HybridKVCacheManager
from xllm_py.engine.kv_cache_manager import KVCacheManager
from xllm_py.engine.scheduler_offline import OfflinePolicy
from xllm_py.engine.scheduler_pd import RemoteKVAdmission
from xllm_py.engine.scheduler_rules import (append_until_stop, check_new, make_seq,
                                            reset_for_recompute, scores_prompt)
from xllm_py.engine.scheduler_types import (  # noqa: F401 - re-exported
    RemoteAllocation, RequestUpdate, ScheduledSeq, SchedulerOutput, StepState)
from xllm_py.engine.spec_decode.speculator import Speculator
from xllm_py.engine.tpot_guard import Stream, TpotGuard
from xllm_py.request import Request, RequestStatus

logger = logging.getLogger(__name__)

S = RequestStatus


class ContinuousScheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int | None = None,
        kv_cache_manager: KVCacheManager | None = None,
        clock: Callable[[], float] = time.monotonic,
        group_windows: tuple[int, ...] = (0,),
        speculator: Speculator | None = None,
    ) -> None:
        """`group_windows`: the KV groups' windows (model/kv_groups.py; one group of full
        attention unless the model mixes sliding-window layers in). `speculator`: None, no
        speculative decoding."""
        if kv_cache_manager is None:
            num_blocks = num_blocks if num_blocks is not None else cache_config.num_blocks
            if num_blocks is None:
                raise ValueError("num_blocks is required (or pass a kv_cache_manager)")
            pool = BlockPool(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                             num_groups=len(group_windows))
            kv_cache_manager = (KVCacheManager(pool) if len(group_windows) == 1
                                else HybridKVCacheManager(pool, group_windows))
        self.config = scheduler_config
        self.kv = kv_cache_manager
        self.speculator = speculator
        self.block_size = kv_cache_manager.block_size
        # A lone request must always fit in the cache, or preemption could loop forever;
        # without chunked prefill, its whole recompute must fit in one step's budget.
        self.max_model_len = min(
            scheduler_config.max_model_len,
            kv_cache_manager.max_tokens_for_one(scheduler_config.max_num_batched_tokens)
        )
        if not scheduler_config.enable_chunked_prefill:
            self.max_model_len = min(self.max_model_len, scheduler_config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}  # every live request
        self.waiting: collections.deque[Request] = collections.deque()  # online
        self.running: list[Request] = []  # admission order
        self.offline = OfflinePolicy(scheduler_config, kv_cache_manager, self.running, self.waiting)
        self.remote = RemoteKVAdmission(kv_cache_manager, self.requests, self.running,
                                        self.offline, self.max_model_len, self.finish_request)
        self._finished_ids: list[str] = []
        self.clock = clock
        self.tpot_guard = (TpotGuard(scheduler_config.prompt_tpot_target_ms,
                                     max_hold_ms=scheduler_config.prompt_hold_max_ms)
                           if scheduler_config.prompt_tpot_target_ms > 0 else None)

    # -- queries -------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.offline.waiting)

    def has_unfinished_requests(self) -> bool:
        """Any live request, including those waiting for or holding KV for a peer."""
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        """Whether schedule() may have work (a request waiting for its KV tiers' lookup: not)."""
        return bool(self.running or self.offline.waiting or self.offline.suspended
                    or any(not r.tier_pending for r in self.waiting))

    def waiting_fills_a_step(self) -> bool:
        """Whether the waiting requests alone fill a step (its sequence or token budget)."""
        if len(self.waiting) >= self.config.max_num_seqs:
            return True
        budget = self.config.max_num_batched_tokens
        for request in (*self.waiting, *self.offline.waiting):
            budget -= request.num_tokens
            if budget <= 0:
                return True
        return False

    def kv_usage(self) -> float:
        return self.kv.usage

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # -- admission and termination -----------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request (FCFS; a lower `priority` value goes ahead; offline ones in
        their own queue)."""
        check_new(request, self.requests, self.max_model_len)
        self.requests[request.request_id] = request
        if self.tpot_guard is not None:
            self.tpot_guard.queued(request.request_id, self.clock())
        queue = self.offline.waiting if request.offline else self.waiting
        index = len(queue)
        while index > 0 and queue[index - 1].priority > request.priority and (
            queue[index - 1].status == S.WAITING
        ):
            index -= 1
        queue.insert(index, request)

    def abort_request(
        self, request_id: str, status: RequestStatus = S.FINISHED_ABORTED
    ) -> bool:
        """End a live request in any state and free its blocks. False if unknown."""
        return self.finish_request(request_id, status)

    def finish_request(
        self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> bool:
        """End a request from outside the step (stop string, abort, error). False if unknown."""
        if not status.is_finished():
            raise ValueError(f"finish status must be a FINISHED_* status, got {status.name}")
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.transition(status)
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self._remove(request)
        return True

    # -- the step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Online first: its running requests (decodes, then prompt chunks), then its
        waiting ones; offline requests only in what is left (seats, token budget, KV, and
        beside online streams the offline gate's time), their running ones first, then the suspended, then the
        waiting. Decode sequences come first in the output."""
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        target_s = self.offline.target_s()
        self.offline.gate.begin_step(self.clock(), target_s)
        budget = self.config.max_num_batched_tokens
        st = StepState(out, budget, budget)
        online = [r for r in self.running if not r.offline]
        decodes = [r for r in online if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in online if r.num_tokens - r.num_computed_tokens > 1]
        # Prompt tokens once a decode rides the step: the cap, and the TPOT guard's limit.
        cap = (self.config.max_prefill_tokens_while_decoding
               if self.config.enable_chunked_prefill else 0)
        st.ride_limit = min(cap or math.inf, self._guard_limit(decodes, prefills))
        # 1. Running online requests: decode steps first, then unfinished prefill chunks.
        guesses = self.speculator.propose(decodes, self.max_model_len) if self.speculator else {}
        for request in decodes:
            self._run(request, st, is_decode=True, drafts=guesses.get(request.request_id, []))
        for request in prefills:
            self._run(request, st, is_decode=False)
        # 2. Admit waiting online requests while KV, budget and seats allow (none if an
        #    online request was just preempted: the freed space belongs to it).
        self._admit_waiting(self.waiting, st, math.inf)
        # 3. Offline work in what is left.
        self._schedule_offline(st, self.offline.gate.limit(bool(decodes), target_s))
        out.seqs = list(st.decodes.values()) + list(st.prompts.values())
        out.num_batched_tokens = sum(len(s.token_ids) for s in out.seqs)
        out.num_decode_seqs = len(st.decodes)
        self.offline.gate.carried(st.online_decodes, st.offline_tokens)
        if self.tpot_guard is not None:
            self.tpot_guard.size_step(out.num_decode_seqs,
                                      out.num_batched_tokens - out.num_decode_seqs)
        return out

    def _run(self, request: Request, st: "StepState", is_decode: bool,
             offline_limit: float = math.inf, drafts: list[int] = ()) -> bool:
        """Schedule a running request's next tokens (preempting for KV space: offline
        requests first), a decode's `drafts` (speculative guesses) while the budget and KV
        allow; False when it got none."""
        if request.status != S.RUNNING:  # preempted earlier in this step
            return False
        if st.budget == 0 or st.num_seqs >= self.config.max_num_seqs:
            return False
        if is_decode:
            st.prompt_budget = min(st.prompt_budget, st.ride_limit)
        limit = min(st.budget if is_decode else min(st.budget, st.prompt_budget), offline_limit)
        num_new = self._num_new_tokens(request, request.num_computed_tokens, int(limit))
        if num_new == 0:
            return False
        drafts = drafts[:int(limit) - num_new]
        num_new += len(drafts)
        # Most decode steps fit in the last block: no allocation to ask for.
        fits = request.num_computed_tokens + num_new <= len(request.block_ids) * self.block_size
        while not fits and self.kv.allocate_slots(request, num_new) is None:
            if drafts:  # guesses never preempt anyone
                num_new, drafts = num_new - len(drafts), []
                fits = request.num_computed_tokens + num_new <= len(request.block_ids) * self.block_size
                continue
            victim = self.offline.victim(request)
            self._preempt(victim, st)
            if victim is request:
                return False
        self._add_seq(request, num_new, st, is_decode, drafts)
        return True

    def _add_seq(self, request: Request, num_new: int, st: "StepState", is_decode: bool,
                 drafts: list[int] = ()) -> None:
        seq = make_seq(request, num_new, drafts)
        (st.decodes if is_decode else st.prompts)[request.request_id] = seq
        st.budget -= num_new
        if not is_decode:
            st.prompt_budget -= num_new
        if request.offline:
            st.offline_tokens += num_new
        elif is_decode:
            st.online_decodes += 1

    def _admit_waiting(self, queue: collections.deque, st: "StepState",
                       offline_limit: float) -> None:
        """Admit the head of `queue` while KV, budget, seats (and for offline work its
        limit) allow. An online request takes seats and KV from offline work."""
        while queue and not st.online_preempted and st.budget > 0:
            if (request := next((r for r in queue if not r.tier_pending), None)) is None:
                return  # (each waits for its KV tiers' lookup)
            if st.num_seqs >= self.config.max_num_seqs:
                return
            if len(self.running) >= self.config.max_num_seqs:
                victim = None if request.offline else self.offline.unscheduled(st)
                if victim is None:
                    return
                self.offline.suspend(victim)
                continue
            computed_blocks, num_cached = (  # cached blocks have no logits: recompute
                ([], 0) if scores_prompt(request) else self.kv.get_computed_blocks(request))
            loaded = self.kv.tier_hit(request, num_cached)  # (with the KV tiers' blocks)
            room = min(st.budget, st.prompt_budget, offline_limit - st.offline_tokens)
            num_new = self._num_new_tokens(request, loaded, max(0, int(room)))
            if num_new == 0:
                return
            if self.kv.allocate_slots(request, loaded - num_cached + num_new, computed_blocks,
                                      first_pos=loaded) is None:
                victim = None if request.offline else self.offline.latest()
                if victim is None:
                    return  # FCFS: the head waits for space
                self._preempt(victim, st)
                continue
            queue.remove(request)
            st.out.loads.extend(self.kv.tier_loads(request, num_cached, loaded))
            if request.status == S.WAITING:
                request.num_cached_tokens = loaded
            request.num_computed_tokens = loaded
            request.transition(S.RUNNING)
            self.running.append(request)
            self._add_seq(request, num_new, st, is_decode=False)

    def _guard_limit(self, decodes: list[Request], prefills: list[Request]) -> float:
        """Prompt tokens the TPOT guard lets this step carry beside `decodes` (inf: no
        limit, or no guard); starts the guard's step."""
        guard = self.tpot_guard
        if guard is None:
            return math.inf
        now = self.clock()
        guard.begin_step(now)
        if not decodes or not (prefills or self.waiting):
            return math.inf
        waiting = [r.request_id for r in prefills] + (
            [self.waiting[0].request_id] if self.waiting else [])
        streams = [Stream(r.request_id, None if r.sampling_params.max_tokens is None
                          else r.sampling_params.max_tokens - r.num_output_tokens)
                   for r in decodes]
        allowed = guard.prompt_tokens_allowed(now, streams, guard.oldest_wait_s(now, waiting))
        return math.inf if allowed is None else allowed

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, int],
        accepted: dict[str, list[int]] | None = None
    ) -> list[RequestUpdate]:
        """Advance computed tokens, append sampled tokens (and after them the `accepted`
        guesses of a speculating seq, one by one) and apply token-level stops."""
        updates: list[RequestUpdate] = []
        if self.tpot_guard is not None:
            self.tpot_guard.end_step(self.clock(), (s.request_id for s in scheduler_output.seqs
                                                    if s.request_id in sampled))
        for seq in scheduler_output.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != S.RUNNING:
                continue  # finished or preempted since schedule()
            num_before = len(updates)
            self._advance(request, seq, sampled, accepted, updates)
            if request.remote_decode:  # (the update outlives the request)
                for upd in updates[num_before:]:
                    upd.remote_decode = True
        return updates

    def _advance(self, request: Request, seq, sampled: dict[str, int],
                 accepted: dict[str, list[int]] | None, updates: list[RequestUpdate]) -> None:
        """One scheduled seq's outcome: its computed tokens, its sampled token and stops."""
        request.num_computed_tokens = seq.start_pos + len(seq.token_ids) - len(seq.spec_token_ids)
        self.kv.cache_full_blocks(request)
        cached = request.num_cached_tokens
        if not seq.sample:
            if (request.sampling_params.max_tokens == 0
                    and request.num_computed_tokens >= request.num_tokens):
                self._end(request, S.FINISHED_LENGTH_CAPPED)  # prompt scored: done
                updates.append(RequestUpdate(request.request_id, [], True, "length",
                                             num_cached_tokens=cached))
            return
        token_id = sampled.get(seq.request_id)
        if token_id is None:
            logger.warning("no sampled token for request %s; failing it", seq.request_id)
            request.error_message = "no token was sampled"
            self._end(request, S.FINISHED_ERROR)
            updates.append(RequestUpdate(request.request_id, [], True, "error",
                                         num_cached_tokens=cached))
            return
        # (the verify's tokens after the first: as many as the guesses the model kept)
        verified = (accepted or {}).get(seq.request_id, ())
        tokens, status = append_until_stop(request, [token_id, *verified], self.max_model_len)
        predicted = None
        if seq.spec_token_ids:
            self.speculator.settle(request, len(seq.spec_token_ids), len(verified), len(tokens),
                                   self.kv)
            predicted = self.speculator.prediction_usage(request)
        if status is not None:
            self._end(request, status)
            updates.append(RequestUpdate(request.request_id, tokens, True,
                                         request.finish_reason, request.stop_reason,
                                         num_cached_tokens=cached, predicted=predicted))
        elif request.remote_decode:
            # Prefill of a PD pair: its part ends here; KV stays until sent (of a
            # sliding-window layer's, only what the decode's first token reads).
            request.transition(S.SENDING_KV)
            self.kv.trim(request, request.num_computed_tokens)
            self.running.remove(request)
            updates.append(RequestUpdate(request.request_id, [token_id], True, "length",
                                         kv_held=True, num_cached_tokens=cached))
        else:
            updates.append(RequestUpdate(request.request_id, tokens,
                                         num_cached_tokens=cached, predicted=predicted))

    # -- internals ---------------------------------------------------------------------------
    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens - num_computed
        if num_new > budget:
            return budget if self.config.enable_chunked_prefill else 0
        return num_new

    def _preempt(self, request: Request, st: StepState | None) -> None:
        """Free a running or suspended request's KV for recompute (exact: prompt and
        outputs so far are computed again); the budget of its seq goes back to `st`."""
        if request.offline:
            self.offline.preempt(request)
        else:
            self.running.remove(request)
            reset_for_recompute(request, self.kv)
            self.waiting.appendleft(request)
        if st is None:
            return
        st.out.preempted_ids.append(request.request_id)
        st.online_preempted |= not request.offline
        seq = st.decodes.pop(request.request_id, None)
        if seq is not None and not request.offline:
            st.online_decodes -= 1
        seq = seq or st.prompts.pop(request.request_id, None)
        if seq is not None:
            st.budget += len(seq.token_ids)
            if request.offline:
                st.offline_tokens -= len(seq.token_ids)

    def _schedule_offline(self, st: StepState, limit: float) -> None:
        """Offline requests in the room online work left: running ones within `limit`
        tokens (those past it suspended, their KV kept), then the suspended ones (while
        their next token fits without preempting anything), then the waiting ones."""
        offline = self.offline
        for request in [r for r in self.running if r.offline]:
            if request.status != S.RUNNING or st.has(request.request_id):
                continue
            if st.offline_tokens >= limit:
                offline.suspend(request)
                continue
            is_decode = request.num_tokens - request.num_computed_tokens == 1
            self._run(request, st, is_decode, limit - st.offline_tokens)
        while (offline.suspended and st.offline_tokens < limit and st.budget > 0
               and st.num_seqs < self.config.max_num_seqs
               and len(self.running) < self.config.max_num_seqs):
            request = offline.suspended[0]
            left = request.num_tokens - request.num_computed_tokens
            num_new = self._num_new_tokens(request, request.num_computed_tokens,
                                           int(min(st.budget, limit - st.offline_tokens)))
            if num_new == 0 or self.kv.allocate_slots(request, num_new) is None:
                break
            offline.resume()
            self._add_seq(request, num_new, st, is_decode=left == 1)
        if st.offline_tokens < limit:
            self._admit_waiting(offline.waiting, st, limit)

    def _end(self, request: Request, status: RequestStatus) -> None:
        request.transition(status)
        self._remove(request)

    def _remove(self, request: Request) -> None:
        """Drop a finished request from every queue and free its blocks."""
        for queue in (self.running, self.waiting, self.offline.waiting, self.offline.suspended):
            if request in queue:
                queue.remove(request)
        self.kv.free(request)
        del self.requests[request.request_id]
        if self.speculator is not None:
            self.speculator.finished(request)
        if self.tpot_guard is not None:
            self.tpot_guard.forget(request.request_id)
        self._finished_ids.append(request.request_id)

