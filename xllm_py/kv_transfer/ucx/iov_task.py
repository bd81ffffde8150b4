"""The IovWorker's task model: message tags and what a task yields (iov_worker.py has the rules).

A tag is a kind (request, status, data, done) in the top bits and a request id below.
"""
from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from xllm_py.kv_transfer.ucx import ucp_ffi as ffi

KIND_SHIFT = 60
KIND_MASK = 0xF << KIND_SHIFT
ID_MASK = (1 << KIND_SHIFT) - 1
KIND_REQ, KIND_STATUS, KIND_DATA, KIND_DONE = 1, 2, 3, 4


class AnyOf(tuple):
    """Yielded by a task instead of a list: resume once any of these ops is done (not all)."""

    __slots__ = ()


TaskGen = Generator["list[ffi.Op] | AnyOf", None, Any]
MakeTask = Callable[[list[ffi.Op]], TaskGen]


def tag(kind: int, req_id: int) -> int:
    return (kind << KIND_SHIFT) | (req_id & ID_MASK)


def ready(ops: list[ffi.Op] | AnyOf) -> bool:
    if type(ops) is AnyOf:
        return any(op.done for op in ops)
    return all(op.done for op in ops)


def poll_ready(ops: list[ffi.Op] | AnyOf) -> bool:
    if type(ops) is AnyOf:
        return any([op.poll() for op in ops])  # (a list: poll every one)
    return all(op.poll() for op in ops)


class TaskCancelled(Exception):
    pass
