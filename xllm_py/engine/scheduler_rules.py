"""Request-level rules that ContinuousScheduler and its policies (OfflinePolicy,
RemoteKVAdmission) share: whether a request may enter, how sampled tokens are appended
until one ends it, how a request is reset for recompute, and the seq a step computes.

Pure Python: no torch, no grpc.
"""
from __future__ import annotations

import logging

from xllm_py.engine.kv_cache_manager import KVCacheManager
from xllm_py.engine.scheduler_types import ScheduledSeq
from xllm_py.request import Request, RequestStatus

logger = logging.getLogger(__name__)

S = RequestStatus


def check_new(request: Request, live: dict[str, Request], max_model_len: int) -> None:
    """ValueError unless `request` is fresh, its id not `live`, and its prompt leaves
    room for one generated token."""
    if request.request_id in live:
        raise ValueError(f"request id {request.request_id} is already live")
    if request.status != S.WAITING or request.block_ids:
        raise ValueError(f"request {request.request_id} is not a fresh request")
    if request.num_tokens >= max_model_len:
        raise ValueError(
            f"prompt has {request.num_tokens} tokens; the limit is "
            f"{max_model_len - 1} (max_model_len {max_model_len} "
            "leaves room for one generated token)"
        )


def append_until_stop(request: Request, token_ids: list[int],
                      max_model_len: int) -> tuple[list[int], RequestStatus | None]:
    """Append tokens one by one until one ends the request: (those appended, status)."""
    for n, token_id in enumerate(token_ids, 1):
        request.append_output_token(token_id)
        if (status := request.stop_status(token_id, max_model_len)) is not None:
            return token_ids[:n], status
    return token_ids, None


def reset_for_recompute(request: Request, kv: KVCacheManager) -> None:
    """Free a request's KV to recompute it later (exact: prompt and outputs so far are
    computed again); the caller takes it out of its queue and puts it back in front."""
    kv.free(request)
    request.transition(S.PREEMPTED)
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    logger.info("preempted %s", request.anon_repr())


def scores_prompt(request: Request) -> bool:
    """Wants prompt logprobs and has no output yet (they go out with the first output).
    Such a request takes no prefix-cache hit: exact, and a hit saves compute only."""
    return request.sampling_params.prompt_logprobs is not None and not request.output_token_ids


def make_seq(request: Request, num_new: int, drafts: list[int] = ()) -> ScheduledSeq:
    """The seq computing a request's next `num_new` tokens (the last of them `drafts`,
    speculative guesses)."""
    start = request.num_computed_tokens
    end = start + num_new - len(drafts)  # rows < num_prompt - 1 score a prompt token
    num_prompt_rows = max(0, min(end, request.num_prompt_tokens - 1) - start)
    return ScheduledSeq(
        request_id=request.request_id,
        token_ids=request.all_token_ids[start:end] + list(drafts),
        start_pos=start,
        block_table=list(request.block_ids),
        group_tables=([list(t) for t in request.group_block_ids]
                      if request.group_block_ids else None),
        sample=end == request.num_tokens and request.sampling_params.max_tokens != 0,
        num_prompt_logprob_rows=num_prompt_rows if scores_prompt(request) else 0,
        spec_token_ids=list(drafts))
