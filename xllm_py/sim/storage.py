"""SimKVStorage: the simulated engine's KV pool, a small real payload per block.

Each slot holds (token id, position + 1) as two int32: what the simulated forward wrote
for that token. A decode step checks that the slot before each sequence's position holds
that position, so a KV transfer that lost or misplaced a block shows (runner.py). A block
is ``block_size * 8`` bytes (128 B at 16 tokens), whatever the model's real block size.
The interface is the part of ``KVCacheStorage`` that the transfer layer uses; ``meta``
states the model's cache shape (what the instance advertises, so that peers' compatibility
checks run as between real engines), with the payload's ``block_bytes``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from xllm_py.kv_transfer.kv_storage import KV_LAYOUT, KVCacheMeta, KVCacheStorage


class SimKVStorage:
    check_block_ids = KVCacheStorage.check_block_ids  # (uses num_blocks only)

    def __init__(self, num_blocks: int, block_size: int, num_layers: int = 1,
                 num_kv_heads: int = 1, head_dim: int = 2, dtype: str = "float32") -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got "
                             f"{num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv = np.zeros((num_blocks, block_size, 2), dtype=np.int32)
        self.block_bytes = block_size * 2 * 4
        self.is_cuda = False
        self.meta = KVCacheMeta(num_layers=num_layers, num_blocks=num_blocks,
                                block_size=block_size, num_kv_heads=num_kv_heads,
                                head_dim=head_dim, dtype=dtype, layout=KV_LAYOUT,
                                block_bytes=self.block_bytes)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def read_blocks(self, ids: Sequence[int] | np.ndarray) -> bytes:
        return self.kv[self.check_block_ids(ids)].tobytes()

    def write_blocks(self, ids: Sequence[int] | np.ndarray, data: bytes) -> None:
        idx = self.check_block_ids(ids, unique=True)
        if len(data) != idx.size * self.block_bytes:
            raise ValueError(f"payload has {len(data)} bytes, expected "
                             f"{idx.size * self.block_bytes}")
        self.kv[idx] = np.frombuffer(data, dtype=np.int32).reshape(idx.size, self.block_size, 2)

    def write_tokens(self, block_table: Sequence[int], start_pos: int,
                     token_ids: Sequence[int]) -> None:
        """What a forward does to the cache: each token's slot gets (token, position + 1)."""
        pos = np.arange(start_pos, start_pos + len(token_ids))
        blocks = np.asarray(block_table, dtype=np.int64)[pos // self.block_size]
        slots = pos % self.block_size
        self.kv[blocks, slots, 0] = token_ids
        self.kv[blocks, slots, 1] = pos + 1

    def holds_position(self, block_table: Sequence[int], pos: int) -> bool:
        """Whether the slot of position ``pos`` holds what a forward wrote there."""
        block = block_table[pos // self.block_size]
        return int(self.kv[block, pos % self.block_size, 1]) == pos + 1
