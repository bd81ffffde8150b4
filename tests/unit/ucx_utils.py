"""Factories for the UCX transfer tests: small KV pools and linked backend pairs."""
from __future__ import annotations

import contextlib

import torch

from xllm_py.config import TransferConfig
from xllm_py.kv_transfer import create_backend
from xllm_py.kv_transfer.factory import mappable_host_allocator
from xllm_py.kv_transfer.kv_storage import KVCacheStorage

SHAPE = dict(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)  # 1536-byte float32 blocks


def storage(num_blocks: int = 64, seed: int | None = None, mappable: bool = False) -> KVCacheStorage:
    """A pool of ``num_blocks`` (random content from ``seed``, else zeros); ``mappable``: in
    UCX shared memory, as PD engines allocate theirs (peers map it)."""
    s = KVCacheStorage(num_blocks=num_blocks, **SHAPE,
                       allocator=mappable_host_allocator() if mappable else None)
    if seed is not None:
        s.kv.copy_(torch.randn(s.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return s


@contextlib.asynccontextmanager
async def linked(a: KVCacheStorage, b: KVCacheStorage, mode: str = "auto"):
    """UCX backends on ``a`` (owner) and ``b`` (requester), b linked to a; closed on exit;
    ``mode``: the data path (auto, or one forced)."""
    ba = create_backend("ucx", a, TransferConfig(), mode=mode)
    bb = create_backend("ucx", b, TransferConfig(), mode=mode)
    ba.start()
    bb.start()
    try:
        await bb.link(ba.address)
        yield ba, bb
    finally:
        await ba.close()
        await bb.close()
