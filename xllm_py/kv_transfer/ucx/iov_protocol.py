"""Pull / push of host-memory KV blocks as single iov tag messages on an ``IovWorker``.

Wire (all on the shared-memory endpoints of the two IovWorkers; tags are
``kind << 60 | req_id``):

pull, requester R / owner O:
  R posts: receive DATA (iov straight into its cache slices), receive STATUS; then sends REQ.
  O validates the source ids; refused -> STATUS(error) only (R cancels its DATA receive,
  nothing was matched, nothing written); accepted -> DATA (iov from its cache) and STATUS("").
  One message each way plus the status: no staging buffer, no gather, no scatter.
push, R sends its blocks into O's:
  R posts STATUS and DONE receives, sends REQ; O validates the destination ids, posts its
  DATA receive, replies STATUS; R sends DATA; O replies DONE once every byte is in place.

REQ = header ``<QQdQB`` (req id, requester token, timeout, number of runs, op) + runs as
int64 [n, 3]. The token names the requester's endpoint on the owner (set up at link time).
Both sides build their own iov lists from their own pool: wire order is run-major, then
K/V, then layer; slice ``kv[k, l, start:start + n]`` is contiguous in memory.
"""
from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from xllm_py.kv_transfer.base import Run, TransferError
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from xllm_py.kv_transfer.ucx import ucp_ffi as ffi
from xllm_py.kv_transfer.ucx.iov_worker import KIND_DATA, KIND_DONE, KIND_REQ, KIND_STATUS, TaskGen, tag

OP_PULL, OP_PUSH = 1, 2
_HDR = struct.Struct("<QQdQB")
_STATUS_MAX = 4096


def iov_chunks(storage: KVCacheStorage, runs: np.ndarray, side: int) -> np.ndarray:
    """uint64 [len(runs) * 2 * L, 2] (address, length) of the slices of ``runs`` (column ``side``)."""
    L, B, sb = storage.num_layers, storage.num_blocks, storage.slice_bytes
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    kl = np.arange(2 * L, dtype=np.int64)  # k * L + l, in wire order (k major)
    offs = ((kl[None, :] * B + r[:, side:side + 1]) * sb).reshape(-1)
    lens = np.repeat(r[:, 2] * sb, 2 * L)
    out = np.empty((offs.size, 2), dtype=np.uint64)
    out[:, 0] = storage.kv.data_ptr() + offs
    out[:, 1] = lens
    return out


def encode_request(op: int, req_id: int, token: int, timeout: float, runs: list[Run]) -> bytes:
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    return _HDR.pack(req_id, token, timeout, r.shape[0], op) + r.tobytes()


def decode_request(data: bytes) -> tuple[int, int, int, float, np.ndarray]:
    """(op, req_id, token, timeout, runs int64 [n, 3])."""
    req_id, token, timeout, n, op = _HDR.unpack_from(data)
    runs = np.frombuffer(data, dtype=np.int64, count=3 * n, offset=_HDR.size).reshape(n, 3)
    return op, req_id, token, timeout, runs


def check_src_runs(runs: np.ndarray, num_blocks: int) -> str | None:
    """The source side of a pull, vectorised: every run inside ``[0, num_blocks)``; None when valid.

    (Same rule as ``KVTransferBackend._check_remote_runs(.., "src")``, without expanding the
    runs to ids and back: that cost ~0.1 ms of the owner's time per request under load.)
    """
    if runs.size == 0:
        return None
    start, n = runs[:, 0], runs[:, 2]
    if int(n.min()) <= 0:
        return "peer refused: run lengths must be positive"
    if (int(start.min()) < 0 or int(start.max()) >= num_blocks or int(n.max()) > num_blocks
            or int((start + n).max()) > num_blocks):  # (the first three: no int64 overflow below)
        bad = sorted({int(b) for s0, k in zip(start.tolist(), n.tolist())
                      for b in (s0, s0 + k - 1) if not 0 <= b < num_blocks})
        return f"peer refused: block ids out of range [0, {num_blocks}): {bad[:8]}"
    return None


def _status_text(op: ffi.Op, buf) -> str:
    return buf.raw[:op.info.length].decode(errors="replace")


def _t(track: list[ffi.Op], op: ffi.Op) -> ffi.Op:
    track.append(op)
    return op


def _request(track: list[ffi.Op], worker: int, ep: int, op: int, req_id: int, token: int,
             timeout: float, runs: list[Run]) -> TaskGen:
    """Posts the STATUS receive, sends the request and waits for both; a refusal raises."""
    status, sbuf = ffi.tag_recv_bytes(worker, _STATUS_MAX, tag(KIND_STATUS, req_id))
    _t(track, status)
    req = _t(track, ffi.tag_send_bytes(ep, encode_request(op, req_id, token, timeout, runs),
                                       tag(KIND_REQ, req_id)))
    yield [req, status]
    err = _status_text(status, sbuf)
    if err:
        raise TransferError(err, invalid_argument=True)


def pull_task(track: list[ffi.Op], worker: int, ep: int, storage: KVCacheStorage, req_id: int, token: int,
              timeout: float, runs: list[Run]) -> TaskGen:
    """Requester side. A refusal leaves the DATA receive unmatched: the worker cancels it."""
    data = _t(track, ffi.tag_recv_iov(worker, iov_chunks(storage, np.asarray(runs), side=1),
                                      tag(KIND_DATA, req_id)))
    yield from _request(track, worker, ep, OP_PULL, req_id, token, timeout, runs)
    yield [data]


def push_task(track: list[ffi.Op], worker: int, ep: int, storage: KVCacheStorage, req_id: int, token: int,
              timeout: float, runs: list[Run]) -> TaskGen:
    done, dbuf = ffi.tag_recv_bytes(worker, _STATUS_MAX, tag(KIND_DONE, req_id))
    _t(track, done)
    yield from _request(track, worker, ep, OP_PUSH, req_id, token, timeout, runs)
    yield [_t(track, ffi.tag_send_iov(ep, iov_chunks(storage, np.asarray(runs), side=0), tag(KIND_DATA, req_id))),
           done]
    err = _status_text(done, dbuf)
    if err:
        raise TransferError(f"peer failed to write the pushed blocks: {err}")


def serve_task(track: list[ffi.Op], worker: int, ep: int, storage: KVCacheStorage, op: int, req_id: int,
               runs: np.ndarray, check: Callable[[list[Run], str], object],
               on_served: Callable[[], None]) -> TaskGen:
    """Owner side of a request; ``check(runs, side)`` returns an error string or the validated ids."""
    if op == OP_PULL:
        checked = check_src_runs(runs, storage.num_blocks)
    elif op == OP_PUSH:
        checked = check([tuple(r) for r in runs.tolist()], "dst")
    else:
        checked = f"unknown op {op}"
    if isinstance(checked, str):
        yield [_t(track, ffi.tag_send_bytes(ep, checked.encode()[:_STATUS_MAX], tag(KIND_STATUS, req_id)))]
        return
    if op == OP_PULL:
        yield [_t(track, ffi.tag_send_iov(ep, iov_chunks(storage, runs, side=0), tag(KIND_DATA, req_id))),
               _t(track, ffi.tag_send_bytes(ep, b"", tag(KIND_STATUS, req_id)))]
    else:
        data = _t(track, ffi.tag_recv_iov(worker, iov_chunks(storage, runs, side=1), tag(KIND_DATA, req_id)))
        yield [_t(track, ffi.tag_send_bytes(ep, b"", tag(KIND_STATUS, req_id)))]
        try:
            yield [data]
        except ffi.UcpError as e:
            yield [_t(track, ffi.tag_send_bytes(ep, str(e).encode(), tag(KIND_DONE, req_id)))]
            raise
        yield [_t(track, ffi.tag_send_bytes(ep, b"", tag(KIND_DONE, req_id)))]
    on_served()
