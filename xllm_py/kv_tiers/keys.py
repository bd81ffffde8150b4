"""TierKeyspace: the name a KV block has in every tier.

A block's key is its prefix chain hash (engine/block_pool.py: it covers every token
before the block) and its KV group (hybrid models cache each group's block under its own
key), inside a namespace hashed from everything that makes two pools' bytes incompatible:
the model and its checkpoint, KV dtype, block size, the pool's layout and its shape, and
the TP head slice a rank holds. Two engines of different models or layouts sharing one
store therefore never read each other's blocks: their keys differ.
"""
from __future__ import annotations

import dataclasses
import hashlib


@dataclasses.dataclass(frozen=True)
class TierKeyspace:
    model: str  # the model's name and a fingerprint of its checkpoint
    kv_dtype: str
    block_size: int
    layout: str
    num_slots: int  # cache tensors in the pool (layers, or a hybrid model's group size)
    num_kv_heads: int  # held by this rank
    head_dim: int
    head_slice: tuple[int, int] = (0, 0)  # (first KV head, count) of this rank; (0, 0): all
    group_windows: tuple[int, ...] = (0,)
    block_bytes: int = 0

    @property
    def namespace(self) -> str:
        raw = repr(dataclasses.astuple(self)).encode()
        return hashlib.sha256(raw).hexdigest()[:16]

    def key(self, block_hash: int, group: int = 0) -> str:
        return f"xkv-{self.namespace}-{group}-{block_hash:016x}"
