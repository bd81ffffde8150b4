"""RemoteKVAdmission: the PD side of a ContinuousScheduler, requests whose KV moves
between engines. The scheduler owns one (`scheduler.remote`), given its KV manager, its
live requests and batch, its offline policy and how it ends a request.

Decode side: allocate_for_remote (blocks for a prompt whose KV comes from a peer; an
online request may take them from offline work), finish_remote_kvs (the KV arrived: the
request joins the batch), fail_remote_kvs. Prefill side: finish_sending (the decode has
the KV: the held blocks are freed).

Pure Python: no torch, no grpc.
"""
from __future__ import annotations

import logging
from typing import Callable

from xllm_py.engine.kv_cache_manager import KVCacheManager
from xllm_py.engine.scheduler_offline import OfflinePolicy
from xllm_py.engine.scheduler_rules import append_until_stop, check_new
from xllm_py.engine.scheduler_types import RemoteAllocation, RequestUpdate
from xllm_py.request import Request, RequestStatus

logger = logging.getLogger(__name__)

S = RequestStatus


class RemoteKVAdmission:
    def __init__(self, kv: KVCacheManager, requests: dict[str, Request],
                 running: list[Request], offline: OfflinePolicy, max_model_len: int,
                 finish: Callable[[str, RequestStatus], bool]) -> None:
        """`requests`, `running`: the scheduler's live requests and batch; `finish(id,
        status)`: the scheduler's end of a request (its blocks freed, its queues left)."""
        self.kv = kv
        self.requests = requests
        self.running = running
        self.offline = offline
        self.max_model_len = max_model_len
        self.finish = finish

    @property
    def num_waiting_for_remote_kvs(self) -> int:
        return sum(1 for r in self.requests.values() if r.status == S.WAITING_FOR_REMOTE_KVS)

    @property
    def num_sending_kv(self) -> int:
        return sum(1 for r in self.requests.values() if r.status == S.SENDING_KV)

    # -- decode side -----------------------------------------------------------------------
    def allocate_for_remote(self, request: Request) -> RemoteAllocation | None:
        """Allocate blocks for a prompt whose KV comes from a peer; None if no KV space.

        Covers the prompt plus one slot for the first token; prefix hits are shared. An
        online request that does not fit takes the KV of offline requests (preempted for
        recompute). The request waits (WAITING_FOR_REMOTE_KVS) and is not scheduled until
        finish_remote_kvs.
        """
        check_new(request, self.requests, self.max_model_len)
        computed_blocks, num_cached = self.kv.get_computed_blocks(request)
        num_new = request.num_prompt_tokens + 1 - num_cached
        first_pos = request.num_prompt_tokens  # (the first token: the window it reads)
        while self.kv.allocate_slots(request, num_new, computed_blocks, first_pos) is None:
            victim = None if request.offline else self.offline.latest()
            if victim is None:
                return None
            self.offline.preempt(victim)
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_new = request.num_prompt_tokens + 1 - num_cached
        # (usage's cached tokens are the prefill's: what this hit spares is moving them)
        request.transition(S.WAITING_FOR_REMOTE_KVS)
        self.requests[request.request_id] = request
        return RemoteAllocation(
            request_id=request.request_id,
            block_ids=list(request.block_ids),
            new_block_ids=self.kv.handover_block_ids(self.kv.tables(request), num_cached,
                                                     request.num_prompt_tokens),
            num_cached_tokens=num_cached,
        )

    def finish_remote_kvs(
        self, request_id: str, first_token_ids: list[int]
    ) -> RequestUpdate | None:
        """The prompt KV has arrived: the request joins decode batches.

        Returns None normally; a finished RequestUpdate (no new tokens) when the given
        tokens already end the request (max_tokens, EOS, stop token, length).
        """
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"unknown request id {request_id}")
        if request.status != S.WAITING_FOR_REMOTE_KVS:
            raise ValueError(
                f"request {request_id} is {request.status.name}, not WAITING_FOR_REMOTE_KVS"
            )
        if not first_token_ids:
            raise ValueError("first_token_ids must not be empty")
        request.transition(S.RUNNING)
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_full_blocks(request)
        _, status = append_until_stop(request, list(first_token_ids), self.max_model_len)
        if status is not None:
            self.finish(request_id, status)
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
        return self.finish(request_id, S.FINISHED_ERROR)

    # -- prefill side ----------------------------------------------------------------------
    def finish_sending(self, request_id: str) -> bool:
        """The decode peer has the KV: free the held blocks. False if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status != S.SENDING_KV:
            raise ValueError(f"request {request_id} is {request.status.name}, not SENDING_KV")
        return self.finish(request_id, S.FINISHED_LENGTH_CAPPED)
