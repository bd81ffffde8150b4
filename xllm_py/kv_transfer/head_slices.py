"""KV head slices of whole blocks: what moves between instances of different TP.

A block of ``kv[2, L, num_blocks, block_size, heads, head_dim]`` holds every head of the
pool; a head slice ``(start, count)`` of ``n`` blocks is the strided
``kv[:, :, ids, :, start:start+count, :]`` (``block_size`` runs of ``count * head_dim``
elements per (kv, layer, block)). ``gather_heads`` packs it contiguously for the wire
(``[2, L, n, block_size, count, head_dim]``), ``scatter_heads`` writes such a buffer into
a head range of other blocks. Which heads a decode rank reads from which prefill rank:
``model/kv_layout.transfer_plan``.
"""
from __future__ import annotations

from collections.abc import Sequence

from typing import TYPE_CHECKING

import numpy as np

from xllm_py.kv_transfer.kv_storage import KVCacheStorage

if TYPE_CHECKING:  # torch only where slices are moved: a simulated engine imports no torch
    import torch

Heads = tuple[int, int, int]  # (src_head_start, dst_head_start, num_heads)


def slice_block_bytes(storage: KVCacheStorage, count: int) -> int:
    """Bytes of ``count`` heads of one block (all layers, K and V)."""
    return storage.block_bytes // storage.num_kv_heads * count


def check_heads(storage: KVCacheStorage, start: int, count: int) -> None:
    if count <= 0 or start < 0 or start + count > storage.num_kv_heads:
        raise ValueError(f"head slice [{start}, {start + count}) outside this pool's "
                         f"{storage.num_kv_heads} KV heads")


def gather_heads(storage: KVCacheStorage, ids: Sequence[int] | np.ndarray, start: int,
                 count: int) -> torch.Tensor:
    """Heads ``[start, start+count)`` of blocks ``ids``: a contiguous CPU tensor
    ``[2, L, n, block_size, count, head_dim]``."""
    import torch

    check_heads(storage, start, count)
    idx = torch.from_numpy(storage.check_block_ids(ids)).to(storage.device)
    out = storage.kv.narrow(4, start, count).index_select(2, idx)
    return out.cpu() if out.is_cuda else out


def scatter_heads(storage: KVCacheStorage, ids: Sequence[int] | np.ndarray, start: int,
                  count: int, buf: torch.Tensor) -> None:
    """Write ``buf`` (from ``gather_heads``, or its raw bytes) into heads
    ``[start, start+count)`` of blocks ``ids``."""
    import torch

    check_heads(storage, start, count)
    idx = torch.from_numpy(storage.check_block_ids(ids, unique=True)).to(storage.device)
    shape = (2, storage.num_layers, int(idx.numel()), storage.block_size, count,
             storage.head_dim)
    expected = int(np.prod(shape)) * storage.kv.element_size()
    if buf.numel() * buf.element_size() != expected:
        raise ValueError(f"head slice buffer has {buf.numel() * buf.element_size()} bytes, "
                         f"expected {expected}")
    src = buf.contiguous().view(torch.uint8).view(storage.dtype).view(shape).to(storage.device)
    storage.kv.narrow(4, start, count).index_copy_(2, idx, src)
