"""KVConnector: where the engine's step meets KV that lives elsewhere (PD), the scheduler
role of vLLM's KV connector (docs/DESIGN.md section 3). Pure Python: no torch, no gRPC.

The engine owns one connector (MIX: `NoConnector`) and calls it on the engine thread only:

  poll()                  at every turn of the loop, before the step: the connector's
                          events since the last poll, in order (a decode's request whose
                          KV arrived or failed to, one to drop, a prefill's send that ended,
                          a request whose blocks are to be set aside now, a question)
  resolve(event, result)  after the engine applied an event (remote_kv.py): the answer
                          goes back to whoever posted it
  request_finished(...)   a PREFILL's request sampled its first token: the connector
                          hands it over; the engine holds its blocks (SENDING_KV) until a
                          `SendDone` event for it comes back through poll()
  request_failed(id)      a request the connector handles ended with an error in a step

The transfers themselves run outside the step (the PD code on the event loop, the
transfer backend's thread); they only ever reach the engine through poll(). The PD
implementation is engine/pd/connector.py.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from xllm_py.engine.engine_request import EngineRequest
from xllm_py.engine.scheduler_types import RemoteAllocation
from xllm_py.outputs import TokenLogprob

__all__ = ["AdmitRemote", "Drop", "Event", "KVConnector", "NoConnector", "OfflineRoom",
           "RecvDone", "RecvFailed", "RemoteAllocation", "SendDone"]


# ---------------------------------------------------------------- events (engine applies)
@dataclasses.dataclass
class AdmitRemote:
    """Decode: a request whose prompt KV comes from a peer: allocate its blocks now
    (prefix aware); answered with a RemoteAllocation, None (no KV space) or why not."""
    request: EngineRequest


@dataclasses.dataclass
class RecvDone:
    """Decode: the prompt KV arrived: WAITING_FOR_REMOTE_KVS -> RUNNING with the
    prefill's first token(s)."""
    parent_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclasses.dataclass
class RecvFailed:
    """Decode: the KV did not arrive (or the hand-over cannot be decoded): the request
    fails with `code`, its blocks freed."""
    parent_id: str
    message: str
    code: int


@dataclasses.dataclass
class Drop:
    """Decode: free the request without output (cancelled, or the prefill said failed)."""
    parent_id: str


@dataclasses.dataclass
class SendDone:
    """Prefill: the decode has the KV (or failed): free the blocks held in SENDING_KV."""
    request_id: str  # the sequence's id


@dataclasses.dataclass
class OfflineRoom:
    """Decode: (free seats, free KV tokens) for offline work, or None."""


Event = AdmitRemote | RecvDone | RecvFailed | Drop | SendDone | OfflineRoom


class KVConnector:
    """The interface, and the connector of an engine without remote KV (MIX)."""

    #: PREFILL: every request ends here at its first token and is handed over.
    hands_over = False

    def poll(self) -> list[tuple[Event, Any]]:
        """(event, token for resolve) pairs posted since the last poll, in order."""
        return []

    def resolve(self, token: Any, result: Any) -> None:
        """The engine applied the event posted with `token`; `result` goes back."""

    def request_finished(self, update, delta, tables: list[list[int]]) -> None:
        """PREFILL: a request sampled its first token (`update.kv_held`: its blocks are
        held until SendDone); `delta` its CompletionDelta or None, `tables` its block
        tables per KV group."""

    def request_failed(self, request_id: str) -> None:
        """A step ended the request with an error before its hand-over."""


NoConnector = KVConnector
