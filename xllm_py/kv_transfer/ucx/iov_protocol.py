"""Pull / push of host-memory KV blocks as single iov tag messages on an ``IovWorker``.

Wire (all on the shared-memory endpoints of the two IovWorkers; tags are
``kind << 60 | req_id``):

pull, requester R / owner O:
  R sends REQ, then posts: receive DATA (iov straight into its cache slices), receive STATUS.
  O validates the source ids; refused -> STATUS(error) only (R cancels its DATA receive,
  nothing was matched, nothing written); accepted -> DATA (iov from its cache) only.
  One message each way: no staging buffer, no gather, no scatter.
push, R sends its blocks into O's:
  R posts STATUS and DONE receives, sends REQ; O validates the destination ids, posts its
  DATA receive, replies STATUS; R sends DATA; O replies DONE once every byte is in place.

REQ = header ``<QQdQB`` (req id, requester token, timeout, number of runs, op) + runs as
int64 [n, 3] (+ with ``OP_HEADS`` set in op: the head slice, int64 [3]; with
``OP_LAYERS`` too: its layer range, int64 [3] more). The token names
the requester's endpoint on the owner (set up at link time). Both sides build their own
iov lists from their own pool: wire order is run-major, then K/V, then layer; slice
``kv[k, l, start:start + n]`` is contiguous in memory; a head slice cuts each of those
into its token slots' rows (slices.py). The owner checks a head slice against its pool.
"""
from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from xllm_py.kv_transfer.base import Run, TransferError
from xllm_py.kv_transfer.head_slices import Heads, layer_span
from xllm_py.kv_transfer.kv_storage import SMALL_LIST, KVCacheMeta, KVCacheStorage
from xllm_py.kv_transfer.ucx import slices
from xllm_py.kv_transfer.ucx import ucp_ffi as ffi
from xllm_py.kv_transfer.ucx.iov_task import KIND_DATA, KIND_DONE, KIND_REQ, KIND_STATUS, AnyOf, TaskGen, tag

OP_PULL, OP_PUSH = 1, 2
OP_HEADS = 0x80  # flag: a head slice follows the runs
OP_LAYERS = 0x40  # flag (with OP_HEADS): the slice has a layer range
_HDR = struct.Struct("<QQdQB")
_STATUS_MAX = 4096


class IovLayout:
    """Where each (kv, layer) slice of a pool starts, computed once: an iov list for a run
    list is then one broadcast add (8-11 vs 25-29 us per call standalone, 2-3x that under load).

    Holds the cache's base address: build it after the pool is allocated, for that pool.
    """

    __slots__ = ("num_blocks", "num_slices", "slice_bytes", "block_bytes", "_base", "block_size",
                 "num_kv_heads", "head_bytes", "row_bytes", "shape")

    def __init__(self, storage: KVCacheStorage) -> None:
        self._init(storage.kv.data_ptr(), storage.meta)

    @classmethod
    def of_pool(cls, address: int, meta: KVCacheMeta) -> IovLayout:
        """The layout of a pool given by where it starts (e.g. a peer's pool mapped here)."""
        layout = cls.__new__(cls)
        layout._init(address, meta)
        return layout

    def _init(self, address: int, meta: KVCacheMeta) -> None:
        L, B, sb = meta.num_layers, meta.num_blocks, meta.block_bytes // (2 * meta.num_layers)
        self.num_blocks, self.num_slices, self.slice_bytes = B, 2 * L, sb
        self.block_bytes = 2 * L * sb
        self.block_size, self.num_kv_heads = meta.block_size, meta.num_kv_heads
        self.shape = (meta.num_kv_heads, L)  # slices.PoolShape
        self.row_bytes = sb // meta.block_size  # one token slot: every head
        self.head_bytes = self.row_bytes // meta.num_kv_heads
        # int64 addresses (user space < 2**63), viewed as uint64 for UCX
        self._base = address + np.arange(2 * L, dtype=np.int64) * (B * sb)  # k * L + l, k major

    def chunks(self, runs: np.ndarray, side: int) -> np.ndarray:
        """uint64 [len(runs) * 2 * L, 2] (address, length) of the slices of ``runs`` (column ``side``)."""
        out = np.empty((runs.shape[0], self.num_slices, 2), dtype=np.int64)
        r = runs * self.slice_bytes  # bytes
        np.add(self._base, r[:, side:side + 1], out=out[:, :, 0])
        out[:, :, 1] = r[:, 2:3]
        return out.reshape(-1, 2).view(np.uint64)


def encode_request(op: int, req_id: int, token: int, timeout: float, runs: np.ndarray | list[Run],
                   heads: Heads | None = None) -> bytes:
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    flags = 0 if not heads else OP_HEADS | (OP_LAYERS if len(heads) == 6 else 0)
    msg = _HDR.pack(req_id, token, timeout, r.shape[0], op | flags) + r.tobytes()
    return msg if heads is None else msg + np.asarray(heads, dtype=np.int64).tobytes()


def decode_request(data: bytes) -> tuple[int, int, int, float, np.ndarray, Heads | None]:
    """(op, req_id, token, timeout, runs int64 [n, 3], heads or None); a message too short
    for what its header announces raises ValueError."""
    req_id, token, timeout, n, op = _HDR.unpack_from(data)
    runs = np.frombuffer(data, dtype=np.int64, count=3 * n, offset=_HDR.size).reshape(n, 3)
    heads = None
    if op & OP_HEADS:
        count = 6 if op & OP_LAYERS else 3
        heads = tuple(np.frombuffer(data, dtype=np.int64, count=count,
                                    offset=_HDR.size + 24 * n).tolist())
        op &= ~(OP_HEADS | OP_LAYERS)
    return op, req_id, token, timeout, runs, heads


def check_src_runs(runs: np.ndarray, num_blocks: int) -> str | None:
    """The source side of a pull: every run inside ``[0, num_blocks)``; None when valid."""
    return check_runs(runs, num_blocks, 0)


def check_runs(runs: np.ndarray, num_blocks: int, side: int) -> str | None:
    """Every run's blocks in column ``side`` (0: source, 1: destination) inside
    ``[0, num_blocks)``; None when valid, else the refusal.

    (Same rule as ``KVTransferBackend._check_remote_runs``, without expanding the runs to
    ids and back: that cost ~0.1 ms of the owner's time per request under load. Few runs:
    a loop over Python ints, 1-2 vs 11-21 us for the numpy reductions standalone.)
    """
    if runs.shape[0] <= SMALL_LIST:
        rows = runs.tolist()
        if all(r[2] > 0 and 0 <= r[side] and r[side] + r[2] <= num_blocks for r in rows):  # (Python ints: no overflow)
            return None
        start, n = [r[side] for r in rows], [r[2] for r in rows]
    else:
        start_a, n_a = runs[:, side], runs[:, 2]
        if (int(n_a.min()) > 0 and int(start_a.min()) >= 0 and int(n_a.max()) <= num_blocks
                and int(start_a.max()) < num_blocks  # (these four: no int64 overflow below)
                and int((start_a + n_a).max()) <= num_blocks):
            return None
        start, n = start_a.tolist(), n_a.tolist()
    if min(n) <= 0:
        return "peer refused: run lengths must be positive"
    bad = sorted({b for s0, k in zip(start, n) for b in (s0, s0 + k - 1) if not 0 <= b < num_blocks})
    return f"peer refused: block ids out of range [0, {num_blocks}): {bad[:8]}"


def _status_text(op: ffi.Op, buf) -> str:
    return buf.raw[:op.info.length].decode(errors="replace")


def _t(track: list[ffi.Op], op: ffi.Op) -> ffi.Op:
    track.append(op)
    return op


def _unanswered(worker: int, *ops: ffi.Op) -> None:
    """The peer refused: it sends nothing more, so cancel these receives here. (Left to the
    worker, a failed task's cancelled receives get drain receives waiting for a late answer.)"""
    for op in ops:
        op.cancel(worker)
        op.poll()


class IovRequest:
    """A pull or push as the requester posts it, prepared on the caller's thread (the iov
    list and the request message), so that the worker thread only posts."""

    __slots__ = ("op", "req_id", "msg", "chunks", "nbytes", "keep")

    def __init__(self, layout: IovLayout, op: int, req_id: int, token: int, timeout: float,
                 runs: np.ndarray, heads: Heads | None = None) -> None:
        self.op, self.req_id = op, req_id
        self.msg = encode_request(op, req_id, token, timeout, runs, heads)
        side = 1 if op == OP_PULL else 0  # our side of each run
        if heads is None:
            self.chunks = layout.chunks(runs, side)
            self.nbytes = int(runs[:, 2].sum()) * layout.block_bytes
        else:
            self.chunks = slices.head_chunks(layout, runs, side, heads[side], heads[2], merge=True,
                                             layers=layer_span(heads, side))
            self.nbytes = int(runs[:, 2].sum()) * slices.heads_bytes_per_block(layout, heads)
        self.keep: object = None  # a buffer the posted receive points into, besides the cache

    @classmethod
    def scratch_pull(cls, layout: IovLayout, req_id: int, token: int, timeout: float,
                     runs: np.ndarray, scratch: np.ndarray, heads: Heads | None = None) -> IovRequest:
        """A pull of the owner's source runs whose data lands in ``scratch`` (uint8, at least
        the pull's size), in the same pieces as into the cache (our destination column is
        ignored): for warming up a link without touching our cache. The owner cannot tell it
        from a pull."""
        req = cls(layout, OP_PULL, req_id, token, timeout, runs, heads)
        if scratch.dtype != np.uint8 or scratch.size < req.nbytes or not scratch.flags.c_contiguous:
            raise ValueError(f"scratch must be contiguous uint8 of at least {req.nbytes} bytes")
        lens = req.chunks[:, 1].astype(np.int64)
        chunks = np.empty_like(req.chunks)
        chunks[:, 0] = (scratch.ctypes.data + np.cumsum(lens) - lens).astype(np.uint64)
        chunks[:, 1] = req.chunks[:, 1]
        req.chunks, req.keep = chunks, scratch
        return req


def _request(track: list[ffi.Op], worker: int, ep: int, req: IovRequest) -> TaskGen:
    """Posts the STATUS receive, sends the request and waits for both; a refusal raises."""
    status, sbuf = ffi.tag_recv_bytes(worker, _STATUS_MAX, tag(KIND_STATUS, req.req_id))
    _t(track, status)
    sent = _t(track, ffi.tag_send_bytes(ep, req.msg, tag(KIND_REQ, req.req_id)))
    yield [sent, status]
    err = _status_text(status, sbuf)
    if err:
        raise TransferError(err, invalid_argument=True)


def pull_task(track: list[ffi.Op], worker: int, ep: int, req: IovRequest) -> TaskGen:
    """Requester side: done when the data is in; a refusal raises.

    The request goes out first and the receives are posted while the owner wakes up and
    validates (they overlap: ~0.1 ms each under load). Should the owner's answer still
    come first, UCX keeps it as an unexpected message until the receive is posted (one
    more copy, same result). A refusal leaves the DATA receive unmatched: the worker cancels it.
    """
    sent = _t(track, ffi.tag_send_bytes(ep, req.msg, tag(KIND_REQ, req.req_id)))
    data = _t(track, ffi.tag_recv_iov(worker, req.chunks, tag(KIND_DATA, req.req_id), keep=req.keep,
                                      expected=req.nbytes))
    status, sbuf = ffi.tag_recv_bytes(worker, _STATUS_MAX, tag(KIND_STATUS, req.req_id))
    _t(track, status)
    yield [sent]
    yield AnyOf((data, status))  # the owner answers with one of them
    if status.done:
        err = _status_text(status, sbuf)
        if err:
            _unanswered(worker, data)
            raise TransferError(err, invalid_argument=True)
        if not data.done:  # an empty STATUS is a confirmation (older owners send one after DATA)
            yield [data]


def push_task(track: list[ffi.Op], worker: int, ep: int, req: IovRequest) -> TaskGen:
    done, dbuf = ffi.tag_recv_bytes(worker, _STATUS_MAX, tag(KIND_DONE, req.req_id))
    _t(track, done)
    try:
        yield from _request(track, worker, ep, req)
    except TransferError as e:
        if e.invalid_argument:
            _unanswered(worker, done)
        raise
    yield [_t(track, ffi.tag_send_iov(ep, req.chunks, tag(KIND_DATA, req.req_id))), done]
    err = _status_text(done, dbuf)
    if err:
        raise TransferError(f"peer failed to write the pushed blocks: {err}")


TASKS = {OP_PULL: pull_task, OP_PUSH: push_task}


def serve_task(track: list[ffi.Op], worker: int, ep: int, layout: IovLayout, op: int, req_id: int,
               runs: np.ndarray, check: Callable[[list[Run], str], object],
               on_served: Callable[[], None], heads: Heads | None = None,
               peer_shape: slices.PoolShape | None = None) -> TaskGen:
    """Owner side of a request; ``check(runs, side)`` returns an error string or the validated
    ids. ``peer_shape``: the requester's pool's (KV heads, layers) (None: not known)."""
    side = 0 if op == OP_PULL else 1  # ours
    checked: object = f"unknown op {op}" if op not in (OP_PULL, OP_PUSH) else (
        slices.refusal(heads, layout.shape, peer_shape, side))
    if checked is not None:
        checked = f"peer refused: {checked}"
    else:
        checked = (check_src_runs(runs, layout.num_blocks) if op == OP_PULL
                   else check([tuple(r) for r in runs.tolist()], "dst"))
    if isinstance(checked, str):
        yield [_t(track, ffi.tag_send_bytes(ep, checked.encode()[:_STATUS_MAX], tag(KIND_STATUS, req_id)))]
        return
    chunks = (layout.chunks(runs, side) if heads is None
              else slices.head_chunks(layout, runs, side, heads[side], heads[2], merge=True,
                                      layers=layer_span(heads, side)))
    if op == OP_PULL:
        yield [_t(track, ffi.tag_send_iov(ep, chunks, tag(KIND_DATA, req_id)))]
    else:
        data = _t(track, ffi.tag_recv_iov(worker, chunks, tag(KIND_DATA, req_id)))
        yield [_t(track, ffi.tag_send_bytes(ep, b"", tag(KIND_STATUS, req_id)))]
        try:
            yield [data]
        except ffi.UcpError as e:
            yield [_t(track, ffi.tag_send_bytes(ep, str(e).encode(), tag(KIND_DONE, req_id)))]
            raise
        yield [_t(track, ffi.tag_send_bytes(ep, b"", tag(KIND_DONE, req_id)))]
    on_served()
