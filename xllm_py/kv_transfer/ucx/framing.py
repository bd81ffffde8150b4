"""Wire framing of the ucxx control connection: fixed-size JSON messages and request tags.

A request's tag is 63 random bits with the low ``IDX_BITS`` clear: the tag path sends a
request's i-th data message on ``tag | i``, so one request may have up to ``MAX_MSGS``.
"""
from __future__ import annotations

import json
import secrets
from typing import Any

import torch

IDX_BITS = 24
MAX_MSGS = 1 << IDX_BITS
CTRL_SIZE = 4096  # control messages are one fixed-size message (JSON padded with spaces)


def new_req() -> int:
    """A fresh request tag (its low IDX_BITS number the request's data messages)."""
    return secrets.randbits(63 - IDX_BITS) << IDX_BITS


async def send_ctrl(ep: Any, obj: dict, tag: int | None = None) -> None:
    """One message when the JSON fits in CTRL_SIZE, else a {"more": n} message then the payload.

    A fixed size lets the receiver post its buffer without a size message first (ucxx's
    send_obj/recv_obj take two messages, i.e. an extra wake-up per hop). Callers sending
    on a shared tag must serialise (the two-message form must not interleave).
    """
    data = json.dumps(obj).encode()
    if len(data) <= CTRL_SIZE:
        await ep.send(bytearray(data.ljust(CTRL_SIZE)), tag=tag)
        return
    await ep.send(bytearray(json.dumps({"more": len(data)}).encode().ljust(CTRL_SIZE)), tag=tag)
    await ep.send(bytearray(data), tag=tag)


async def recv_ctrl(ep: Any, tag: int | None = None) -> dict:
    buf = bytearray(CTRL_SIZE)
    await ep.recv(buf, tag=tag)
    obj = json.loads(buf)
    if "more" in obj:
        buf = bytearray(int(obj["more"]))
        await ep.recv(buf, tag=tag)
        obj = json.loads(buf)
    return obj


def ucx_buffer(t: torch.Tensor) -> Any:
    """Buffer object UCXX accepts: numpy view for host memory, the tensor (CUDA array interface) on GPU."""
    return t if t.is_cuda else t.numpy()
