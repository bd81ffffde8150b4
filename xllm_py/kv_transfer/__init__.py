"""KV cache storage and transfer between workers (xLLM: link_cluster / pull_kv_blocks).

Modules: kv_storage (the cache tensor), base (ABC, TransferError,
group_contiguous), fake / tcp / ucx (backends), factory (create_backend), mapping (TP/DP
worker mapping), metrics (Prometheus text counters), kv_worker (KVWorker), in_process.
"""
from xllm_py.kv_transfer.base import (
    KVTransferBackend,
    TransferError,
    TransferResult,
    TransferTimeout,
    group_contiguous,
)
from xllm_py.kv_transfer.factory import create_backend
from xllm_py.kv_transfer.kv_storage import KVCacheMeta, KVCacheStorage

__all__ = [
    "KVCacheMeta", "KVCacheStorage", "KVTransferBackend", "TransferError",
    "TransferResult", "TransferTimeout", "create_backend", "group_contiguous",
]
