"""KV slices of whole blocks: what moves between instances of different TP or PP.

A block of ``kv[2, L, num_blocks, block_size, heads, head_dim]`` holds every layer and
head of the pool. A slice ``Heads`` is ``(src_head, dst_head, num_heads)``, optionally
followed by ``(src_layer, dst_layer, num_layers)``: heads ``[start, start+num_heads)`` of
pool layers ``[layer, layer+num_layers)`` on each side (no layer part, or num_layers 0:
every layer, the two pools holding the same). Of ``n`` blocks that is the strided
``kv[:, layers, ids, :, heads, :]``; ``gather_heads`` packs it contiguously for the wire
(``[2, num_layers, n, block_size, num_heads, head_dim]``), ``scatter_heads`` writes such a
buffer into the other side's heads and layers. A pipeline stage's pool holds its layers
only, so a stage moves the overlap of its layers with the peer rank's at each side's
offset. Which (layers, heads) a decode rank reads from which prefill rank:
``model/kv_layout.transfer_plan``.
"""
from __future__ import annotations

from collections.abc import Sequence

from typing import TYPE_CHECKING

import numpy as np

from xllm_py.kv_transfer.kv_storage import KVCacheStorage

if TYPE_CHECKING:  # torch only where slices are moved: a simulated engine imports no torch
    import torch

# (src_head_start, dst_head_start, num_heads[, src_layer_start, dst_layer_start, num_layers])
Heads = tuple[int, ...]
Span = tuple[int, int]  # (start, count)


def has_layers(heads: Heads | None) -> bool:
    """Whether the slice names a layer range (else it is every layer of both pools)."""
    return heads is not None and len(heads) == 6 and heads[5] > 0


def layer_span(heads: Heads, side: int) -> Span | None:
    """(start, count) of the pool layers the slice covers on ``side`` (0 the source, 1 the
    destination); None: every layer."""
    return (int(heads[3 + side]), int(heads[5])) if has_layers(heads) else None


def slice_layers(storage: KVCacheStorage, heads: Heads, side: int) -> Span:
    """``layer_span``, with every layer spelled out as ``(0, num_layers)``."""
    return layer_span(heads, side) or (0, storage.num_layers)


def slice_block_bytes(storage: KVCacheStorage, count: int, num_layers: int = 0) -> int:
    """Bytes of ``count`` heads of ``num_layers`` layers (0: all) of one block, K and V."""
    per_layer_head = storage.block_bytes // storage.num_kv_heads // storage.num_layers
    return per_layer_head * count * (num_layers or storage.num_layers)


def check_heads(storage: KVCacheStorage, start: int, count: int) -> None:
    if count <= 0 or start < 0 or start + count > storage.num_kv_heads:
        raise ValueError(f"head slice [{start}, {start + count}) outside this pool's "
                         f"{storage.num_kv_heads} KV heads")


def check_slice(storage: KVCacheStorage, heads: object, side: int) -> Heads:
    """``heads`` (a wire value: list or tuple) as a slice valid on ``storage`` at ``side``;
    ValueError naming what is wrong."""
    if (not isinstance(heads, (list, tuple)) or len(heads) not in (3, 6)
            or not all(isinstance(v, (int, np.integer)) for v in heads)):
        raise ValueError(f"bad KV slice {heads!r}")
    out = tuple(int(v) for v in heads)
    check_heads(storage, out[side], out[2])
    if len(out) == 6 and out[5] < 0:
        raise ValueError(f"bad KV slice {heads!r}: negative layer count")
    start, count = slice_layers(storage, out, side)
    if start < 0 or start + count > storage.num_layers:
        raise ValueError(f"layer slice [{start}, {start + count}) outside this pool's "
                         f"{storage.num_layers} layers")
    return out


def slice_bytes(storage: KVCacheStorage, heads: Heads | None) -> int:
    """Bytes a block of ``heads`` is on the wire (None: a whole block of ``storage``)."""
    if heads is None:
        return storage.block_bytes
    return slice_block_bytes(storage, heads[2], heads[5] if has_layers(heads) else 0)


def gather_heads(storage: KVCacheStorage, ids: Sequence[int] | np.ndarray, start: int,
                 count: int, layers: Span | None = None) -> torch.Tensor:
    """Heads ``[start, start+count)`` (of pool layers ``layers`` (start, count), None:
    all) of blocks ``ids``: a contiguous CPU tensor ``[2, L, n, block_size, count,
    head_dim]``."""
    import torch

    check_heads(storage, start, count)
    idx = torch.from_numpy(storage.check_block_ids(ids)).to(storage.device)
    kv = storage.kv if layers is None else storage.kv.narrow(1, *layers)
    out = kv.narrow(4, start, count).index_select(2, idx)
    return out.cpu() if out.is_cuda else out


def scatter_heads(storage: KVCacheStorage, ids: Sequence[int] | np.ndarray, start: int,
                  count: int, buf: torch.Tensor, layers: Span | None = None) -> None:
    """Write ``buf`` (from ``gather_heads``, or its raw bytes) into heads
    ``[start, start+count)`` of pool layers ``layers`` (None: all) of blocks ``ids``."""
    import torch

    check_heads(storage, start, count)
    idx = torch.from_numpy(storage.check_block_ids(ids, unique=True)).to(storage.device)
    kv = storage.kv if layers is None else storage.kv.narrow(1, *layers)
    shape = (2, int(kv.shape[1]), int(idx.numel()), storage.block_size, count,
             storage.head_dim)
    expected = int(np.prod(shape)) * storage.kv.element_size()
    if buf.numel() * buf.element_size() != expected:
        raise ValueError(f"head slice buffer has {buf.numel() * buf.element_size()} bytes, "
                         f"expected {expected}")
    src = buf.contiguous().view(torch.uint8).view(storage.dtype).view(shape).to(storage.device)
    kv.narrow(4, start, count).index_copy_(2, idx, src)


def gather_slice(storage: KVCacheStorage, ids: Sequence[int] | np.ndarray,
                 heads: Heads) -> torch.Tensor:
    """The source side of ``heads`` (its heads and layers) of blocks ``ids``."""
    return gather_heads(storage, ids, heads[0], heads[2],
                        layer_span(heads, 0))


def scatter_slice(storage: KVCacheStorage, ids: Sequence[int] | np.ndarray, heads: Heads,
                  buf: torch.Tensor) -> None:
    """``buf`` (from ``gather_slice``) into the destination side of ``heads``."""
    scatter_heads(storage, ids, heads[1], heads[2], buf,
                  layer_span(heads, 1))
