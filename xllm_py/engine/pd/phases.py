"""The PD records of a request, one per side, whose phases are statuses of the one
request status (xllm_py/request.py: RequestStatus and its `_ALLOWED` table); every
change goes through `transition()`, checked against that table. A PD scheduler keeps a
record until the request leaves its side. `PrefillPhase` and `DecodePhase` only name
the statuses as each side says them.

Prefill side (PrefillRequest):

    QUEUED --> DISPATCHING --> PREFILLING --> HANDING_OVER --> FINISHED
      |          |     |          |                |
      |          |     +--------> FAILED <---------+
      |          |     (PREFILLING -> FAILED: the engine failed the request's step)
      +----------+----------------+--> CANCELLED

  QUEUED        WAITING: in the online or offline queue
  DISPATCHING   DISPATCHING: finding a decode: link, AddNewRequests (retries, other decodes)
  PREFILLING    RUNNING: placed on a decode; the engine computes the prompt, samples a token
  HANDING_OVER  SENDING_KV: first token out: PUSH (if so configured), then FirstGeneration
  FINISHED      FINISHED_LENGTH_CAPPED: decode took it over, or it ended on prefill
  FAILED        FINISHED_ERROR: reported to the service with its status
  CANCELLED     FINISHED_ABORTED: the service cancelled it; decode (if placed) drops it

Decode side (DecodeRequest), from AddNewRequests (or a migration with KV) on:

    ALLOCATED --> PULLING --> DECODING
      | | |         |  |
      | | |         |  +--> GONE --> DROPPED | FAILED
      | | |         +--> FAILED
      | | +--> DROPPED (FirstGeneration says failed)
      | +--> FAILED (no FirstGeneration within orphan_timeout_s)
      +--> CANCELLED --> DROPPED (FirstGeneration came, or cancel_grace_s passed)

  ALLOCATED   WAITING_FOR_REMOTE_KVS: blocks set aside, waiting for FirstGeneration (a
              PUSH may write into them)
  CANCELLED   REMOTE_KVS_CANCELLED: cancelled while ALLOCATED; the blocks stay until no
              push can touch them
  PULLING     RECEIVING_KVS: FirstGeneration came; the worker pulls the KV (PUSH: here)
  GONE        RECEIVING_KVS_CANCELLED: cancelled, or its FirstGeneration caller gave up,
              during the pull: freed once the pull ends
  DECODING    RUNNING: the engine runs it (and aborts it on cancel); the record ends
  DROPPED     FINISHED_ABORTED: freed without output; FAILED: FINISHED_ERROR, the service
              told why
"""
from __future__ import annotations

import dataclasses
import time

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.engine.pd.kv_stream import KVStream
from xllm_py.request import RequestStatus, is_transition_allowed
from xllm_py.rpc.convert import EngineRequestSpec

S = RequestStatus


class PrefillPhase:
    """The prefill side's names of the statuses its records take."""
    QUEUED = S.WAITING
    DISPATCHING = S.DISPATCHING
    PREFILLING = S.RUNNING
    HANDING_OVER = S.SENDING_KV
    FINISHED = S.FINISHED_LENGTH_CAPPED
    FAILED = S.FINISHED_ERROR
    CANCELLED = S.FINISHED_ABORTED
    ALL = (QUEUED, DISPATCHING, PREFILLING, HANDING_OVER, FINISHED, FAILED, CANCELLED)


class DecodePhase:
    """The decode side's names of the statuses its records take."""
    ALLOCATED = S.WAITING_FOR_REMOTE_KVS
    CANCELLED = S.REMOTE_KVS_CANCELLED
    PULLING = S.RECEIVING_KVS
    GONE = S.RECEIVING_KVS_CANCELLED
    DECODING = S.RUNNING
    DROPPED = S.FINISHED_ABORTED
    FAILED = S.FINISHED_ERROR
    ALL = (ALLOCATED, CANCELLED, PULLING, GONE, DECODING, DROPPED, FAILED)
    # where the record ends: the engine runs the request, or it is over
    LEAVES = (DECODING, DROPPED, FAILED)


class _Phased:
    phase: RequestStatus
    request_id: str

    def transition(self, new: RequestStatus) -> None:
        """Move to `new`; ValueError (and no change) if the table does not allow it."""
        if not is_transition_allowed(self.phase, new):
            raise ValueError(f"request {self.request_id}: transition {self.phase.name} -> "
                             f"{new.name} is not allowed")
        self.phase = new


@dataclasses.dataclass
class PrefillRequest(_Phased):
    spec: EngineRequestSpec
    phase: RequestStatus = PrefillPhase.QUEUED
    decode: InstanceMeta | None = None  # from PREFILLING on
    decode_blocks: list[int] = dataclasses.field(default_factory=list)  # decode needs filled
    num_cached_on_decode: int = 0
    # the queue's order (prefill_order.py), on time.monotonic()'s clock
    deadline_s: float = float("inf")  # arrival + TTFT target; inf: no target
    cost_s: float = 0.0  # predicted prefill
    submitted_s: float | None = None  # given to the engine
    stream: KVStream | None = None  # PUSH, a long prompt: its KV moving while it computes

    @property
    def request_id(self) -> str:
        return self.spec.request_id


@dataclasses.dataclass
class DecodeRequest(_Phased):
    spec: EngineRequestSpec
    prefill_name: str
    new_block_ids: list[int]  # the blocks prefill's KV goes into
    num_cached_tokens: int
    phase: RequestStatus = DecodePhase.ALLOCATED
    created: float = dataclasses.field(default_factory=time.monotonic)
    cancelled_at: float | None = None  # when it became CANCELLED

    @property
    def request_id(self) -> str:
        return self.spec.request_id
