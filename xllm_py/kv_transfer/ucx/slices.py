"""KV head slices on the UCX data paths: which bytes of a pool a slice is, and who may ask.

A head slice ``(start, count)`` of the blocks of a run is, per (kv, layer), one strided
piece of the pool: ``n * block_size`` rows (one per token slot) of ``count * head_bytes``
bytes, ``row_bytes`` (= ``num_kv_heads * head_bytes``) apart; the rows of consecutive
blocks follow each other at the same stride. ``head_chunks`` lists them as (address,
length) rows in the iov wire order (run-major, then K/V, then layer, then slot): the
mapped path copies them row for row between the two pools in one native call, the iov
path sends / receives them as one iov message (the side whose pool holds exactly the
slice's heads describes whole slices instead: UCX does not need the two sides cut alike).

Rows as iov entries, not a gather into a staging buffer + one contiguous message + a
scatter: the rows go straight from pool to pool, with no copy on either side
(``bench_kv_transfer.py --heads 4``; figures in docs/benchmarks.md). Rows are copied with
plain stores: they are short, and non-temporal stores (as ``copy_chunks`` uses from 1 KB)
do not pay off for them.

A slice with a layer range (pipeline stages, head_slices.py) takes only those layers'
(kv, layer) pieces, at each side's own layer offset: the rows of both sides still pair up
one for one.

Peers of different TP or pipeline stages (same model: same block size, head_dim, dtype)
link with pools that differ in ``num_kv_heads`` or ``num_layers`` (a ``PoolShape``):
between them only slices that fit both pools are valid, a whole-block transfer is refused
(``refusal``), on the requester and on the owner.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from xllm_py.kv_transfer.head_slices import Heads, has_layers
from xllm_py.kv_transfer.kv_storage import KVCacheMeta

if TYPE_CHECKING:  # (iov_protocol imports this module)
    from xllm_py.kv_transfer.ucx.iov_protocol import IovLayout


PoolShape = tuple[int, int]  # (num_kv_heads, num_layers) of a pool


def link_shape_key(meta: KVCacheMeta) -> tuple:
    """What two pools must share to link: everything but num_blocks, num_kv_heads and
    num_layers (and the block bytes, which follow from them)."""
    return (meta.block_size, meta.head_dim, meta.dtype, meta.layout)


def shape_of(meta: KVCacheMeta) -> PoolShape:
    return meta.num_kv_heads, meta.num_layers


def head_chunks(layout: IovLayout, runs: np.ndarray, side: int, start: int, count: int,
                merge: bool = False, layers: tuple[int, int] | None = None) -> np.ndarray:
    """uint64 [rows, 2] (address, length) of heads ``[start, start + count)`` of pool
    layers ``layers`` ((start, count), None: all) of the blocks of ``runs`` (column
    ``side``), one row per (run, kv, layer, slot). ``merge``: where the slice is every head
    of the pool, whole (kv, layer) slices of each run instead (fewer iov entries, same
    bytes in the same order)."""
    if layers is None and merge and start == 0 and count == layout.num_kv_heads:
        return layout.chunks(runs, side)
    base = layout._base  # first byte of each (kv, layer) slice, k major
    if layers is not None:
        base = base.reshape(2, -1)[:, layers[0]:layers[0] + layers[1]].reshape(-1)
    if merge and start == 0 and count == layout.num_kv_heads:
        out = np.empty((runs.shape[0], base.size, 2), dtype=np.int64)
        r = runs * layout.slice_bytes
        np.add(base, r[:, side:side + 1], out=out[:, :, 0])
        out[:, :, 1] = r[:, 2:3]
        return out.reshape(-1, 2).view(np.uint64)
    rows_per_run = runs[:, 2] * layout.block_size  # rows of one (kv, layer) slice of each run
    # first row of each (run, kv, layer): [len(runs), 2L]
    first = base[None, :] + (runs[:, side:side + 1] * layout.slice_bytes
                             + start * layout.head_bytes)
    reps = np.repeat(rows_per_run, base.size)  # rows of each (run, kv, layer) group
    total = int(reps.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(reps) - reps, reps)
    out = np.empty((total, 2), dtype=np.int64)
    out[:, 0] = np.repeat(first.reshape(-1), reps) + within * layout.row_bytes
    out[:, 1] = count * layout.head_bytes
    return out.view(np.uint64)


def slice_bytes_per_block(layout: IovLayout, count: int, num_layers: int = 0) -> int:
    """Bytes of ``count`` heads of ``num_layers`` layers (0: all) of one block."""
    slices_ = 2 * num_layers if num_layers else layout.num_slices
    return slices_ * layout.block_size * count * layout.head_bytes


def heads_bytes_per_block(layout: IovLayout, heads: Heads | None) -> int:
    """Bytes of one block of ``heads`` (None: a whole block)."""
    if heads is None:
        return layout.block_bytes
    return slice_bytes_per_block(layout, heads[2], heads[5] if has_layers(heads) else 0)


def check_range(num_kv_heads: int, start: int, count: int, whose: str) -> str | None:
    """None when heads ``[start, start + count)`` lie in a pool of ``num_kv_heads``."""
    if count <= 0 or start < 0 or start + count > num_kv_heads:
        return (f"head slice [{start}, {start + count}) outside {whose} "
                f"{num_kv_heads} KV heads")
    return None


def refusal(heads: Heads | None, ours: PoolShape, theirs: PoolShape | None,
            our_col: int) -> str | None:
    """Why a transfer between our pool and a peer's (None: not known) is refused, or None.
    ``our_col``: our column in runs and heads (0: we are the source, 1: the destination).
    Checked by the requester and again by the owner (which prefixes "peer refused: ")."""
    if heads is None:
        if theirs is not None and theirs != ours:
            return (f"whole KV blocks cannot move between pools of {ours[0]} KV heads x "
                    f"{ours[1]} layers and {theirs[0]} x {theirs[1]} (instances of different "
                    "TP or PP exchange slices)")
        return None
    if not all(isinstance(h, (int, np.integer)) for h in heads) or len(heads) not in (3, 6):
        return f"bad head slice {heads!r}"
    err = check_range(ours[0], int(heads[our_col]), int(heads[2]), "this pool's")
    if err is None and theirs is not None:
        err = check_range(theirs[0], int(heads[1 - our_col]), int(heads[2]), "the peer's")
    if err is not None:
        return err
    if not has_layers(heads):
        if theirs is not None and theirs[1] != ours[1]:
            return (f"every layer of a block cannot move between pools of {ours[1]} and "
                    f"{theirs[1]} layers (pipeline stages exchange layer slices)")
        return None
    for shape, col, whose in ((ours, our_col, "this pool's"), (theirs, 1 - our_col, "the peer's")):
        start = int(heads[3 + col])
        if shape is not None and (start < 0 or start + int(heads[5]) > shape[1]):
            return (f"layer slice [{start}, {start + int(heads[5])}) outside {whose} "
                    f"{shape[1]} layers")
    return None


def parse_heads(value: object) -> Heads | None | str:
    """A wire ``heads`` field (JSON list or None) as Heads, or the refusal when malformed."""
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) not in (3, 6)
            or not all(type(v) is int for v in value)):
        return f"bad head slice {value!r}"
    return tuple(value)
