"""ContinuousScheduler: continuous batching with chunked prefill and preemption.

One engine step:
    schedule() -> SchedulerOutput (which tokens of which requests to compute, with
    block tables) -> model runner -> update_from_output(out, sampled) -> RequestUpdate
    per request that produced a token or finished.

Request stages (see xllm_py/request.py for the state machine):
    add_request -> waiting queue -> admitted when its KV fits (prefix hits skip compute)
    -> running: decode tokens first, then prefill chunks, under a per-step token budget
    (prompt tokens beside decoding streams: at most max_prefill_tokens_while_decoding, and
    with prompt_tpot_target_ms only what keeps every stream's mean TPOT within it:
    tpot_guard.py)
    -> preempted (blocks freed, recomputed later from prompt + outputs) or finished
    (blocks freed at once); max_tokens 0 ends right after the prefill. Prompt logprobs:
    computed from scratch (cached blocks have KV, no logits; see _scores_prompt). PD hooks:
    allocate_for_remote / finish_remote_kvs / fail_remote_kvs (decode side),
    remote_decode requests and finish_sending (prefill).

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
from xllm_py.engine.kv_cache_manager import KVCacheManager, cdiv
from xllm_py.engine.scheduler_types import (  # noqa: F401 - re-exported
    RemoteAllocation, RequestUpdate, ScheduledSeq, SchedulerOutput)
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
    ) -> None:
        if kv_cache_manager is None:
            num_blocks = num_blocks if num_blocks is not None else cache_config.num_blocks
            if num_blocks is None:
                raise ValueError("num_blocks is required (or pass a kv_cache_manager)")
            pool = BlockPool(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
            kv_cache_manager = KVCacheManager(pool)
        self.config = scheduler_config
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        pool = kv_cache_manager.block_pool
        # A lone request must always fit in the cache, or preemption could loop forever;
        # without chunked prefill, its whole recompute must fit in one step's budget.
        self.max_model_len = min(
            scheduler_config.max_model_len, pool.num_usable_blocks * self.block_size
        )
        if not scheduler_config.enable_chunked_prefill:
            self.max_model_len = min(self.max_model_len, scheduler_config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}  # every live request
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order
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
        return len(self.waiting)

    @property
    def num_waiting_for_remote_kvs(self) -> int:
        return sum(1 for r in self.requests.values() if r.status == S.WAITING_FOR_REMOTE_KVS)

    @property
    def num_sending_kv(self) -> int:
        return sum(1 for r in self.requests.values() if r.status == S.SENDING_KV)

    def has_unfinished_requests(self) -> bool:
        """Any live request, including those waiting for or holding KV for a peer."""
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        """Whether schedule() may have work: waiting or running requests."""
        return bool(self.waiting or self.running)

    def waiting_fills_a_step(self) -> bool:
        """Whether the waiting requests alone fill a step (its sequence or token budget)."""
        if len(self.waiting) >= self.config.max_num_seqs:
            return True
        budget = self.config.max_num_batched_tokens
        for request in self.waiting:
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
        """Queue a new request (FCFS; a lower `priority` value goes ahead)."""
        self._check_new(request)
        self.requests[request.request_id] = request
        if self.tpot_guard is not None:
            self.tpot_guard.queued(request.request_id, self.clock())
        index = len(self.waiting)
        while index > 0 and self.waiting[index - 1].priority > request.priority and (
            self.waiting[index - 1].status == S.WAITING
        ):
            index -= 1
        self.waiting.insert(index, request)

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
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        # Prompt tokens this step: capped once a decode rides it (the stall on the streams).
        prompt_budget = budget
        cap = (self.config.max_prefill_tokens_while_decoding
               if self.config.enable_chunked_prefill else 0)
        scheduled: dict[str, ScheduledSeq] = {}

        # 1. Running requests: decode steps first, then unfinished prefill chunks.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        num_decodes = len(decodes)
        # prompt tokens once a decode rides the step: the cap, and the TPOT guard's limit
        ride_limit = min(cap or math.inf, self._guard_limit(decodes, prefills))
        for i, request in enumerate(decodes + prefills):
            if request.status != S.RUNNING:  # preempted earlier in this loop
                continue
            if budget == 0 or len(scheduled) >= self.config.max_num_seqs:
                break
            is_decode = i < num_decodes
            if is_decode:
                prompt_budget = min(prompt_budget, ride_limit)
            limit = budget if is_decode else min(budget, prompt_budget)
            num_new = self._num_new_tokens(request, request.num_computed_tokens, limit)
            if num_new == 0:
                continue
            # Most decode steps fit in the last block: no allocation to ask for.
            fits = request.num_computed_tokens + num_new <= len(request.block_ids) * self.block_size
            while not fits and self.kv.allocate_slots(request, num_new) is None:
                victim = self.running[-1]
                budget += self._preempt(victim, scheduled, out)
                if victim is request:
                    break
            if request.status != S.RUNNING:
                continue
            scheduled[request.request_id] = self._make_seq(request, num_new)
            budget -= num_new
            if not is_decode:
                prompt_budget -= num_new

        # 2. Admit waiting requests while KV, budget and seats allow (none if we just
        #    preempted: the freed space belongs to the preempted requests).
        while (
            self.waiting
            and not out.preempted_ids
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(scheduled) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            computed_blocks, num_cached = (  # cached blocks have no logits: recompute
                ([], 0) if _scores_prompt(request) else self.kv.get_computed_blocks(request))
            num_new = self._num_new_tokens(request, num_cached, min(budget, prompt_budget))
            if num_new == 0:
                break
            if self.kv.allocate_slots(request, num_new, computed_blocks) is None:
                break  # FCFS: the head waits for space
            self.waiting.popleft()
            if request.status == S.WAITING:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.transition(S.RUNNING)
            self.running.append(request)
            scheduled[request.request_id] = self._make_seq(request, num_new)
            budget -= num_new
            prompt_budget -= num_new

        out.seqs = list(scheduled.values())
        out.num_batched_tokens = sum(len(s.token_ids) for s in out.seqs)
        out.num_decode_seqs = sum(1 for r in decodes if r.request_id in scheduled)
        if self.tpot_guard is not None:
            self.tpot_guard.size_step(out.num_decode_seqs,
                                      out.num_batched_tokens - out.num_decode_seqs)
        return out

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
        self, scheduler_output: SchedulerOutput, sampled: dict[str, int]
    ) -> list[RequestUpdate]:
        """Advance computed tokens, append sampled tokens and apply token-level stops."""
        updates: list[RequestUpdate] = []
        if self.tpot_guard is not None:
            self.tpot_guard.end_step(self.clock(), (s.request_id for s in scheduler_output.seqs
                                                    if s.request_id in sampled))
        for seq in scheduler_output.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != S.RUNNING:
                continue  # finished or preempted since schedule()
            request.num_computed_tokens = seq.start_pos + len(seq.token_ids)
            self.kv.cache_full_blocks(request)
            cached = request.num_cached_tokens
            if not seq.sample:
                if (request.sampling_params.max_tokens == 0
                        and request.num_computed_tokens >= request.num_tokens):
                    self._end(request, S.FINISHED_LENGTH_CAPPED)  # prompt scored: done
                    updates.append(RequestUpdate(request.request_id, [], True, "length",
                                                 num_cached_tokens=cached))
                continue
            token_id = sampled.get(seq.request_id)
            if token_id is None:
                logger.warning("no sampled token for request %s; failing it", seq.request_id)
                request.error_message = "no token was sampled"
                self._end(request, S.FINISHED_ERROR)
                updates.append(RequestUpdate(request.request_id, [], True, "error",
                                             num_cached_tokens=cached))
                continue
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                self._end(request, status)
                updates.append(RequestUpdate(request.request_id, [token_id], True,
                                             request.finish_reason, request.stop_reason,
                                             num_cached_tokens=cached))
            elif request.remote_decode:
                # Prefill of a PD pair: its part ends here; KV stays until sent.
                request.transition(S.SENDING_KV)
                self.running.remove(request)
                updates.append(RequestUpdate(request.request_id, [token_id], True, "length",
                                             kv_held=True, num_cached_tokens=cached))
            else:
                updates.append(RequestUpdate(request.request_id, [token_id],
                                             num_cached_tokens=cached))
        return updates

    # -- PD hooks: decode side -------------------------------------------------------------
    def allocate_for_remote(self, request: Request) -> RemoteAllocation | None:
        """Allocate blocks for a prompt whose KV comes from a peer; None if no KV space.

        Covers the prompt plus one slot for the first token; prefix hits are shared.
        The request waits (WAITING_FOR_REMOTE_KVS) and is not scheduled until
        finish_remote_kvs.
        """
        self._check_new(request)
        computed_blocks, num_cached = self.kv.get_computed_blocks(request)
        num_new = request.num_prompt_tokens + 1 - num_cached
        if self.kv.allocate_slots(request, num_new, computed_blocks) is None:
            return None
        request.num_cached_tokens = num_cached
        request.transition(S.WAITING_FOR_REMOTE_KVS)
        self.requests[request.request_id] = request
        first_new = num_cached // self.block_size
        last = cdiv(request.num_prompt_tokens, self.block_size)
        return RemoteAllocation(
            request_id=request.request_id,
            block_ids=list(request.block_ids),
            new_block_ids=request.block_ids[first_new:last],
            num_cached_tokens=num_cached,
        )

    def finish_remote_kvs(
        self, request_id: str, first_token_ids: list[int]
    ) -> RequestUpdate | None:
        """The prompt KV has arrived: the request joins decode batches.

        Returns None normally; a finished RequestUpdate (no new tokens) when the given
        tokens already end the request (max_tokens, EOS, stop token, length).
        """
        request = self._get(request_id)
        if request.status != S.WAITING_FOR_REMOTE_KVS:
            raise ValueError(
                f"request {request_id} is {request.status.name}, not WAITING_FOR_REMOTE_KVS"
            )
        if not first_token_ids:
            raise ValueError("first_token_ids must not be empty")
        request.transition(S.RUNNING)
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_full_blocks(request)
        status = None
        for token_id in first_token_ids:
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                break
        if status is not None:
            self._end(request, status)
            return RequestUpdate(request_id, [], True, request.finish_reason, request.stop_reason,
                                 num_cached_tokens=request.num_cached_tokens)
        self.running.append(request)
        return None

    def fail_remote_kvs(self, request_id: str, reason: str) -> bool:
        """The KV transfer failed: end the request with FINISHED_ERROR, free its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        logger.warning("KV transfer for request %s failed: %s", request_id, reason)
        request.error_message = reason
        return self.finish_request(request_id, S.FINISHED_ERROR)

    # -- PD hooks: prefill side -----------------------------------------------------------
    def finish_sending(self, request_id: str) -> bool:
        """The decode peer has the KV: free the held blocks. False if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status != S.SENDING_KV:
            raise ValueError(f"request {request_id} is {request.status.name}, not SENDING_KV")
        return self.finish_request(request_id, S.FINISHED_LENGTH_CAPPED)

    # -- internals ---------------------------------------------------------------------------
    def _check_new(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id} is already live")
        if request.status != S.WAITING or request.block_ids:
            raise ValueError(f"request {request.request_id} is not a fresh request")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_tokens} tokens; the limit is "
                f"{self.max_model_len - 1} (max_model_len {self.max_model_len} "
                "leaves room for one generated token)"
            )

    def _get(self, request_id: str) -> Request:
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"unknown request id {request_id}")
        return request

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens - num_computed
        if num_new > budget:
            return budget if self.config.enable_chunked_prefill else 0
        return num_new

    def _make_seq(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        end = start + num_new  # rows at positions < num_prompt - 1 score the next prompt token
        num_prompt_rows = max(0, min(end, request.num_prompt_tokens - 1) - start)
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_pos=start,
            block_table=list(request.block_ids),
            sample=end == request.num_tokens and request.sampling_params.max_tokens != 0,
            num_prompt_logprob_rows=num_prompt_rows if _scores_prompt(request) else 0,
        )

    def _preempt(
        self, request: Request, scheduled: dict[str, ScheduledSeq], out: SchedulerOutput
    ) -> int:
        """Free a running request for recompute; returns the budget it gives back."""
        self.running.remove(request)
        self.kv.free(request)
        request.transition(S.PREEMPTED)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_ids.append(request.request_id)
        logger.info("preempted %s", request.anon_repr())
        seq = scheduled.pop(request.request_id, None)
        return len(seq.token_ids) if seq is not None else 0

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in params.eos_token_ids:
                return S.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return S.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return S.FINISHED_LENGTH_CAPPED
        if request.num_tokens >= self.max_model_len:
            return S.FINISHED_LENGTH_CAPPED
        return None

    def _end(self, request: Request, status: RequestStatus) -> None:
        request.transition(status)
        self._remove(request)

    def _remove(self, request: Request) -> None:
        """Drop a finished request from every queue and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        del self.requests[request.request_id]
        if self.tpot_guard is not None:
            self.tpot_guard.forget(request.request_id)
        self._finished_ids.append(request.request_id)


def _scores_prompt(request: Request) -> bool:
    """Wants prompt logprobs and has no output yet (they go out with the first output).
    Such a request takes no prefix-cache hit: exact, and a hit saves compute only."""
    return request.sampling_params.prompt_logprobs is not None and not request.output_token_ids
