"""What a scheduler step hands out: the sequences to compute (SchedulerOutput of
ScheduledSeq), what each request did (RequestUpdate), and a decode's allocation for a
prompt computed elsewhere (RemoteAllocation). Pure data, shared by the scheduler, the
model runner and the engine."""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # tokens to compute this step
    start_pos: int  # = num_computed_tokens before the step
    block_table: list[int]  # the full table after allocation
    sample: bool  # this step reaches the last known token: sample one
    num_prompt_logprob_rows: int = 0  # leading tokens whose logits score a prompt token
    # Hybrid models: the tables of KV groups 1.. (Request.group_block_ids); None: one group
    group_tables: list[list[int]] | None = None
    # Speculative guesses after the last known token (the tail of token_ids): the seq
    # samples at that token's row and returns the logits of the guesses' rows too.
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = dataclasses.field(default_factory=list)
    num_batched_tokens: int = 0
    num_decode_seqs: int = 0  # the first seqs: one token of a running stream each
    preempted_ids: list[str] = dataclasses.field(default_factory=list)
    # Requests that finished (any reason) since the previous schedule(): the runner may
    # drop per-request state (seeded generators, penalties) for them.
    finished_ids: list[str] = dataclasses.field(default_factory=list)
    # (block id, bytes) of prefixes from the KV tiers: written into the pool before the
    # step's forward (engine/kv_tiering.py)
    loads: list[tuple[int, object]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RequestUpdate:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # Prefill side of PD: done here, blocks held for the decode peer (finish_sending).
    kv_held: bool = False
    num_cached_tokens: int = 0  # prefix-cache hit at admission (the request may be gone)
    # After a verify step of a request with a prediction: its guessed tokens kept and not
    # kept so far (its usage reports them)
    predicted: tuple[int, int] | None = None
    remote_decode: bool = False  # the request's (it may be gone): its decode is elsewhere


@dataclasses.dataclass
class RemoteAllocation:
    request_id: str
    block_ids: list[int]  # the full block table
    # Blocks the peer must fill: those covering prompt positions [num_cached_tokens,
    # num_prompt_tokens). Blocks shared via the prefix cache are not in it. Hybrid
    # models: per KV group in order, of a sliding group only the window's
    # (KVCacheManager.handover_block_ids).
    new_block_ids: list[int]
    num_cached_tokens: int


@dataclasses.dataclass
class StepState:
    """The scheduler's own: what one schedule() has handed out so far, and what is left of its budgets."""
    out: SchedulerOutput
    budget: int
    prompt_budget: float
    ride_limit: float = math.inf
    decodes: dict[str, ScheduledSeq] = dataclasses.field(default_factory=dict)
    prompts: dict[str, ScheduledSeq] = dataclasses.field(default_factory=dict)
    offline_tokens: int = 0
    online_decodes: int = 0
    online_preempted: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.decodes) + len(self.prompts)

    def has(self, request_id: str) -> bool:
        return request_id in self.decodes or request_id in self.prompts
