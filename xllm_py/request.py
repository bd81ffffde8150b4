"""Request and its state machine, the one request status of an engine (pure Python).

Lifecycles (every status change goes through a `transition` checked against `_ALLOWED`:
`Request.transition` for the engine's sequences, the same table for the PD records of
engine/pd/phases.py, which name these statuses by their PD phase):

    MIX:      WAITING -> RUNNING (<-> PREEMPTED) -> FINISHED_*
    prefill:  WAITING (PD: queued) -> DISPATCHING (PD: finding a decode) -> RUNNING
              (<-> PREEMPTED) -> SENDING_KV -> FINISHED_LENGTH_CAPPED
              (SENDING_KV holds the blocks until the KV transfer is confirmed; the engine's
              sequence starts at WAITING when the record is RUNNING)
    decode:   WAITING -> WAITING_FOR_REMOTE_KVS -> RECEIVING_KVS -> RUNNING (<-> PREEMPTED)
              -> FINISHED_*; the record only (the engine's sequence waits throughout):
              WAITING_FOR_REMOTE_KVS -> REMOTE_KVS_CANCELLED -> FINISHED_ABORTED (cancelled
              before the KV came: its blocks kept until no push can write into them),
              RECEIVING_KVS -> RECEIVING_KVS_CANCELLED -> FINISHED_ABORTED | FINISHED_ERROR
              (cancelled during its transfer: freed once the transfer ended)
    offline:  as above, and RUNNING <-> SUSPENDED (out of the batch for online work, its
              KV kept); SUSPENDED -> PREEMPTED when online work needs that KV (freed,
              recomputed later from prompt + outputs)

Any live state may end in FINISHED_ABORTED or FINISHED_ERROR, except where a KV transfer
may still touch the blocks: RECEIVING_KVS ends through RUNNING, FINISHED_ERROR or
RECEIVING_KVS_CANCELLED, REMOTE_KVS_CANCELLED only in FINISHED_ABORTED.
"""
from __future__ import annotations

import enum
import time

from xllm_py.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 1
    # Decode side: blocks allocated, prompt KV not yet arrived from the prefill instance.
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    # Blocks taken away; waits to be recomputed from prompt + outputs so far.
    PREEMPTED = 4
    # Prefill side: compute done, blocks held until the transfer to decode is confirmed.
    SENDING_KV = 5
    FINISHED_STOPPED = 6
    FINISHED_LENGTH_CAPPED = 7
    FINISHED_ABORTED = 8
    FINISHED_ERROR = 9
    # Offline only: out of the batch while online work needs the room, its KV kept.
    SUSPENDED = 10
    # PD prefill: placing the request on a decode (link, AddNewRequests), before the engine.
    DISPATCHING = 11
    # PD decode: FirstGeneration came; the KV is being moved into the blocks set aside.
    RECEIVING_KVS = 12
    # PD decode: cancelled before its KV came; blocks kept while a push may write them.
    REMOTE_KVS_CANCELLED = 13
    # PD decode: cancelled during its KV transfer; blocks freed once the transfer ended.
    RECEIVING_KVS_CANCELLED = 14

    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)

_FAILED = {RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}

_ALLOWED: dict[RequestStatus, set[RequestStatus]] = {
    RequestStatus.WAITING: {
        RequestStatus.RUNNING,
        RequestStatus.WAITING_FOR_REMOTE_KVS,
        RequestStatus.DISPATCHING,
        *_FAILED,
    },
    RequestStatus.DISPATCHING: {RequestStatus.RUNNING, *_FAILED},
    RequestStatus.WAITING_FOR_REMOTE_KVS: {
        RequestStatus.RUNNING,
        RequestStatus.RECEIVING_KVS,
        RequestStatus.REMOTE_KVS_CANCELLED,
        *_FAILED,
    },
    RequestStatus.RECEIVING_KVS: {
        RequestStatus.RUNNING,
        RequestStatus.RECEIVING_KVS_CANCELLED,
        RequestStatus.FINISHED_ERROR,
    },
    RequestStatus.REMOTE_KVS_CANCELLED: {RequestStatus.FINISHED_ABORTED},
    RequestStatus.RECEIVING_KVS_CANCELLED: {*_FAILED},
    RequestStatus.RUNNING: {
        RequestStatus.PREEMPTED,
        RequestStatus.SUSPENDED,
        RequestStatus.SENDING_KV,
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        *_FAILED,
    },
    # A preempted request has outputs, so a stop string found late may still end it.
    RequestStatus.PREEMPTED: {
        RequestStatus.RUNNING,
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        *_FAILED,
    },
    RequestStatus.SENDING_KV: {RequestStatus.FINISHED_LENGTH_CAPPED, *_FAILED},
    # (as PREEMPTED: its outputs so far may end it on a stop string found late)
    RequestStatus.SUSPENDED: {
        RequestStatus.RUNNING,
        RequestStatus.PREEMPTED,
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        *_FAILED,
    },
    RequestStatus.FINISHED_STOPPED: set(),
    RequestStatus.FINISHED_LENGTH_CAPPED: set(),
    RequestStatus.FINISHED_ABORTED: set(),
    RequestStatus.FINISHED_ERROR: set(),
}

FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def prompt_token_error(token_ids: list[int], vocab_size: int | None) -> str | None:
    """Why a prompt given as token ids cannot run (an id outside the vocabulary), or None.
    Checked where requests enter (HTTP, engine intake): one bad id fails a whole step."""
    if not token_ids or not vocab_size:
        return None
    lo, hi = min(token_ids), max(token_ids)
    if lo >= 0 and hi < vocab_size:
        return None
    return (f"prompt token id {lo if lo < 0 else hi} is out of range: the vocabulary has "
            f"{vocab_size} tokens")


def finish_reason(status: RequestStatus) -> str | None:
    """"stop" | "length" | "abort" | "error" for a finished status, else None."""
    return FINISH_REASONS.get(status)


def is_transition_allowed(old: RequestStatus, new: RequestStatus) -> bool:
    return new in _ALLOWED[old]


class Request:
    """One sequence being generated. Token contents never appear in logs (`anon_repr`)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        remote_decode: bool = False,
        offline: bool = False,
        tpot_slo_ms: float = 0.0,
    ) -> None:
        if not request_id:
            raise ValueError("request_id must be a non-empty string")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        # Lower value is served first (FCFS within one priority).
        self.priority = priority
        # Prefill side of a PD pair: sample one token, then hold the KV for the decode peer.
        self.remote_decode = remote_decode
        # Offline (batch) work: scheduled only into the room online requests leave.
        self.offline = offline
        # The client's TPOT target (ms, 0: none); offline work beside it keeps steps within it.
        self.tpot_slo_ms = tpot_slo_ms
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        # Tokens whose KV is in the cache (prefix hits included).
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission (usage report).
        self.num_cached_tokens = 0
        # Owned by KVCacheManager: the block table and the hash chain of full blocks.
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        # Hybrid models (kv_groups.py): the tables of KV groups 1.. (group 0's is
        # block_ids), as long as it; a sliding group's blocks before its window are 0.
        self.group_block_ids: list[list[int]] = []
        # Stop token id or stop string that ended the request; None for EOS / length.
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.error_message: str = ""
        # Owned by the engine: this request's sampler settings, built once (SamplingRow).
        self.sampling_row: object | None = None
        # Owned by the engine: the structured-output matcher (structured/compiler.py).
        self.grammar: object | None = None
        # KV tiers (engine/kv_tiering.py): while True the scheduler does not admit it (its
        # prefix is being looked up below the pool); then the prefix found (StagedPrefix:
        # first_block, num_blocks, data), taken at admission.
        self.tier_pending = False
        self.tier_prefix: object | None = None

    # -- token views -------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs; do not mutate (use `append_output_token`)."""
        return self._all_token_ids

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def stop_status(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """The finished status `token_id`, just appended, ends this request with (EOS and
        stop token ids once min_tokens are out, max_tokens, the context limit); None."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in params.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    # -- state ---------------------------------------------------------------------
    def is_finished(self) -> bool:
        return self.status.is_finished()

    @property
    def finish_reason(self) -> str | None:
        return finish_reason(self.status)

    def transition(self, new_status: RequestStatus) -> None:
        """Move to `new_status`; raise ValueError on an edge not in `_ALLOWED`."""
        if new_status not in _ALLOWED[self.status]:
            raise ValueError(
                f"request {self.request_id}: transition {self.status.name} -> "
                f"{new_status.name} is not allowed"
            )
        self.status = new_status

    def anon_repr(self) -> str:
        return (
            f"Request(id={self.request_id}, status={self.status.name}, "
            f"num_prompt_tokens={self.num_prompt_tokens}, "
            f"num_output_tokens={self.num_output_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, "
            f"num_cached_tokens={self.num_cached_tokens}, num_blocks={len(self.block_ids)}, "
            f"priority={self.priority}, remote_decode={self.remote_decode}, offline={self.offline})"
        )

    __repr__ = anon_repr
