"""The PD scheduler's settings (`PDSchedulerConfig`, a section of EngineConfig: the
settings file's pd_* keys) and the KV transfers' injected faults."""
from __future__ import annotations

import random

from xllm_py.config import PDSchedulerConfig  # noqa: F401 - imported from here by engine/pd
from xllm_py.status import Status, StatusError


def maybe_inject_fault(fault_rate: float, op: str) -> None:
    """TransferConfig.fault_rate (the settings file's kv_transfer_fault_rate): fail this
    KV `op`."""
    if fault_rate and random.random() < fault_rate:
        raise StatusError(Status.BAD_GATEWAY,
                          f"KV {op} failed: injected fault (kv_transfer_fault_rate)")
