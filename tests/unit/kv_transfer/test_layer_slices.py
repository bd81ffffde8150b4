"""KV slices with a layer range (head_slices.py): a pipeline stage's pool (its layers
only) gathers the overlap with another pool at its offset and the other scatters it at
its own; the wire size counts those layers and heads only; a slice outside a pool is
refused."""
from __future__ import annotations

import pytest
import torch

from xllm_py.kv_transfer.head_slices import (check_slice, gather_slice, scatter_slice,
                                             slice_bytes)
from xllm_py.kv_transfer.kv_storage import KVCacheStorage


def _pool(layers: int, heads: int, seed: int | None = None) -> KVCacheStorage:
    s = KVCacheStorage(layers, 16, 4, heads, 8)
    if seed is not None:
        s.kv.copy_(torch.randn(s.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return s


def test_a_stage_fills_its_layers_of_a_whole_pool_and_nothing_else():
    stage = _pool(3, 2, seed=1)  # holds model layers [1, 4) of 4, both heads
    whole = _pool(4, 2)
    heads = (0, 0, 2, 1, 2, 2)  # stage layers [1, 3) -> layers [2, 4) of the whole pool
    buf = gather_slice(stage, [5, 6, 9], heads)
    assert buf.numel() * buf.element_size() == 3 * slice_bytes(stage, heads)
    assert slice_bytes(stage, heads) == whole.block_bytes // 2  # 2 of 4 layers
    scatter_slice(whole, [0, 1, 2], heads, buf)
    assert torch.equal(whole.kv[:, 2:4, [0, 1, 2]], stage.kv[:, 1:3, [5, 6, 9]])
    assert not whole.kv[:, :2].any() and not whole.kv[:, :, 3:].any()


def test_layers_and_heads_together():
    src = _pool(2, 4, seed=2)
    dst = _pool(4, 1)
    heads = (3, 0, 1, 0, 2, 2)  # head 3 of both src layers -> head 0 of dst layers 2, 3
    scatter_slice(dst, [7], heads, gather_slice(src, [4], heads))
    assert torch.equal(dst.kv[:, 2:, 7], src.kv[:, :, 4, :, 3:4])
    assert not dst.kv[:, :2].any()


@pytest.mark.parametrize("heads,side,match", [
    ((0, 0, 2, 2, 0, 2), 0, r"layer slice \[2, 4\) outside this pool's 3 layers"),
    ((0, 0, 3), 1, r"head slice \[0, 3\) outside"),
    ((0, 0, 2, 0, 0), 0, "bad KV slice"),
    ((0, 0, 2, 0, 0, -1), 0, "negative layer count"),
])
def test_a_slice_outside_the_pool_is_refused(heads, side, match):
    with pytest.raises(ValueError, match=match):
        check_slice(_pool(3, 2), heads, side)
