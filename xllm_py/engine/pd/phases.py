"""The PD phases of a request, one machine per side (pure Python). Every change goes
through `transition()`, checked against the side's `_ALLOWED` table (as in
xllm_py/request.py); a PD scheduler keeps one record per request until it reaches a
final phase.

Prefill side (PrefillRequest):

    QUEUED --> DISPATCHING --> PREFILLING --> HANDING_OVER --> FINISHED
      |          |     |          |                |
      |          |     +--------> FAILED <---------+
      |          |     (PREFILLING -> FAILED: the engine failed the request's step)
      +----------+----------------+--> CANCELLED

  QUEUED        in the online or offline queue
  DISPATCHING   finding a decode: link, AddNewRequests (retries, other decodes)
  PREFILLING    placed on a decode; the engine computes the prompt and samples a token
  HANDING_OVER  first token out: PUSH (if so configured), then FirstGeneration
  FINISHED      decode took it over, or it ended on prefill (decode told to drop)
  FAILED        reported to the service with its status
  CANCELLED     the service cancelled it; decode (if placed) is told to drop its blocks

Decode side (DecodeRequest), from AddNewRequests (or a migration with KV) on:

    ALLOCATED --> PULLING --> DECODING
      | | |         |  |
      | | |         |  +--> GONE --> DROPPED | FAILED
      | | |         +--> FAILED
      | | +--> DROPPED (FirstGeneration says failed)
      | +--> FAILED (no FirstGeneration within orphan_timeout_s)
      +--> CANCELLED --> DROPPED (FirstGeneration came, or cancel_grace_s passed)

  ALLOCATED   blocks set aside, waiting for FirstGeneration (a PUSH may write into them)
  CANCELLED   cancelled while ALLOCATED: the blocks stay until no push can touch them
  PULLING     FirstGeneration came; the worker pulls the KV (PUSH: already here)
  GONE        cancelled, or its FirstGeneration caller gave up, during the pull: freed
              once the pull ends
  DECODING    the engine runs it (and aborts it on cancel)
  DROPPED     freed without output; FAILED: freed, the service told why
"""
from __future__ import annotations

import dataclasses
import enum
import time

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.rpc.convert import EngineRequestSpec


class PrefillPhase(enum.Enum):
    QUEUED = "queued"
    DISPATCHING = "dispatching"
    PREFILLING = "prefilling"
    HANDING_OVER = "handing_over"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def is_final(self) -> bool:
        return not _PREFILL_ALLOWED[self]


P = PrefillPhase
_PREFILL_ALLOWED: dict[PrefillPhase, set[PrefillPhase]] = {
    P.QUEUED: {P.DISPATCHING, P.CANCELLED},
    P.DISPATCHING: {P.PREFILLING, P.FAILED, P.CANCELLED},
    P.PREFILLING: {P.HANDING_OVER, P.FAILED, P.CANCELLED},
    P.HANDING_OVER: {P.FINISHED, P.FAILED},
    P.FINISHED: set(),
    P.FAILED: set(),
    P.CANCELLED: set(),
}


class DecodePhase(enum.Enum):
    ALLOCATED = "allocated"
    CANCELLED = "cancelled"
    PULLING = "pulling"
    GONE = "gone"
    DECODING = "decoding"
    DROPPED = "dropped"
    FAILED = "failed"

    def is_final(self) -> bool:
        return not _DECODE_ALLOWED[self]


D = DecodePhase
_DECODE_ALLOWED: dict[DecodePhase, set[DecodePhase]] = {
    D.ALLOCATED: {D.PULLING, D.CANCELLED, D.DROPPED, D.FAILED},
    D.CANCELLED: {D.DROPPED},
    D.PULLING: {D.DECODING, D.GONE, D.FAILED},
    D.GONE: {D.DROPPED, D.FAILED},
    D.DECODING: set(),
    D.DROPPED: set(),
    D.FAILED: set(),
}

_ALLOWED = {PrefillPhase: _PREFILL_ALLOWED, DecodePhase: _DECODE_ALLOWED}


def is_transition_allowed(old: enum.Enum, new: enum.Enum) -> bool:
    return type(old) is type(new) and new in _ALLOWED[type(old)][old]


class _Phased:
    phase: enum.Enum
    request_id: str

    def transition(self, new: enum.Enum) -> None:
        """Move to `new`; ValueError (and no change) if the table does not allow it."""
        if not is_transition_allowed(self.phase, new):
            raise ValueError(f"request {self.request_id}: illegal PD phase change "
                             f"{self.phase.name} -> {new.name}")
        self.phase = new


@dataclasses.dataclass
class PrefillRequest(_Phased):
    spec: EngineRequestSpec
    phase: PrefillPhase = PrefillPhase.QUEUED
    decode: InstanceMeta | None = None  # from PREFILLING on
    decode_blocks: list[int] = dataclasses.field(default_factory=list)  # decode needs filled
    num_cached_on_decode: int = 0
    # the queue's order (prefill_order.py), on time.monotonic()'s clock
    deadline_s: float = float("inf")  # arrival + TTFT target; inf: no target
    cost_s: float = 0.0  # predicted prefill
    submitted_s: float | None = None  # given to the engine

    @property
    def request_id(self) -> str:
        return self.spec.request_id


@dataclasses.dataclass
class DecodeRequest(_Phased):
    spec: EngineRequestSpec
    prefill_name: str
    new_block_ids: list[int]  # the blocks prefill's KV goes into
    num_cached_tokens: int
    phase: DecodePhase = DecodePhase.ALLOCATED
    created: float = dataclasses.field(default_factory=time.monotonic)
    cancelled_at: float | None = None  # when it became CANCELLED

    @property
    def request_id(self) -> str:
        return self.spec.request_id
