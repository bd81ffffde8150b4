"""PDSchedulerConfig: the PD scheduler's own knobs (kept here until config.py grows a
section for them; the rest comes from EngineConfig: role, rpc_timeout_s, transfer)."""
from __future__ import annotations

import dataclasses
import random

from xllm_py.status import Status, StatusError


@dataclasses.dataclass(frozen=True)
class PDSchedulerConfig:
    # Prefill: AddNewRequests tries per decode while it answers "no KV space", with
    # doubling backoff (8 tries: ~4.5 s) before another decode is tried.
    attempts_per_decode: int = 8
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    # Prefill: decodes tried per request (the service's choice, then the master's list).
    max_decodes_per_request: int = 3
    # Prefill: requests finding a decode at the same time.
    max_dispatching: int = 64
    # Prefill: a queued request is placed on a decode (its blocks set aside there) only
    # while the prompts placed and not handed over yet hold fewer tokens (0: no limit):
    # under a long queue, decode KV is not held by prompts waiting here.
    max_placed_prompt_tokens: int = 4096
    # Prefill: which queued request is placed next (prefill_order.py: fcfs, deadline).
    prefill_order: str = "deadline"
    # Prefill: how often it links the decodes it has not linked yet (prelink_once).
    prelink_interval_s: float = 2.0
    # Decode: a request whose FirstGeneration never comes is freed after this.
    orphan_timeout_s: float = 60.0
    reap_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.attempts_per_decode < 1 or self.max_decodes_per_request < 1:
            raise ValueError("attempts_per_decode and max_decodes_per_request must be >= 1")
        if self.max_dispatching < 1:
            raise ValueError("max_dispatching must be >= 1")
        from xllm_py.cluster.prefill_order import ORDERS
        if self.prefill_order not in ORDERS:
            raise ValueError(f"prefill_order must be one of {', '.join(ORDERS)}, "
                             f"got {self.prefill_order!r}")
        if self.max_placed_prompt_tokens < 0:
            raise ValueError("max_placed_prompt_tokens must be >= 0")


def maybe_inject_fault(fault_rate: float, op: str) -> None:
    """TransferConfig.fault_rate (XLLM_KV_TRANSFER_FAULT_RATE): fail this KV `op`."""
    if fault_rate and random.random() < fault_rate:
        raise StatusError(Status.BAD_GATEWAY,
                          f"KV {op} failed: injected fault (XLLM_KV_TRANSFER_FAULT_RATE)")
