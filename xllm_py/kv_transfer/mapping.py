"""xLLM's TP/DP worker mapping for KV transfer (pure functions).

Not used yet: every instance has one worker today, and the PD code (xllm_py/engine/pd/)
moves KV between worker 0 of each side. Kept for tensor parallelism, where
each destination worker pulls from the source worker this module names.

Workers of an instance are numbered ``dp_rank * tp + tp_rank``. A decode (destination)
worker ``dst_worker_rank = dst_dp_rank * dst_tp + tp_rank`` pulls from the prefill
(source) worker ``src_dp_rank * src_tp + (dst_worker_rank % src_tp)`` (xLLM
``pull_kv_blocks``); ``link_cluster`` links, for each destination worker, the worker of
every source DP group that it may pull from.

Which heads and layers a decode rank reads from which prefill rank, for instances of
any (TP, PP) layout: ``model/kv_layout.transfer_plan``.
"""
from __future__ import annotations


def worker_rank(dp_rank: int, tp: int, tp_rank: int) -> int:
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp {tp}")
    if dp_rank < 0:
        raise ValueError("dp_rank must be >= 0")
    return dp_rank * tp + tp_rank


def src_worker_for(dst_dp_rank: int, dst_tp: int, tp_rank: int, src_dp_rank: int, src_tp: int,
                   src_dp: int | None = None) -> int:
    """The source worker rank a destination worker pulls from (xLLM pull_kv_blocks)."""
    if src_tp <= 0 or dst_tp <= 0:
        raise ValueError("tp sizes must be positive")
    if src_dp is not None and not 0 <= src_dp_rank < src_dp:
        raise ValueError(f"src_dp_rank {src_dp_rank} out of range for src_dp {src_dp}")
    dst_worker_rank = worker_rank(dst_dp_rank, dst_tp, tp_rank)
    return src_dp_rank * src_tp + (dst_worker_rank % src_tp)


def link_cluster_map(src_dp: int, src_tp: int, dst_dp: int, dst_tp: int) -> dict[int, list[int]]:
    """For every destination worker rank: the source worker ranks it must link (one per source DP group)."""
    for name, v in (("src_dp", src_dp), ("src_tp", src_tp), ("dst_dp", dst_dp), ("dst_tp", dst_tp)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    out: dict[int, list[int]] = {}
    for dst_dp_rank in range(dst_dp):
        for tp_rank in range(dst_tp):
            out[worker_rank(dst_dp_rank, dst_tp, tp_rank)] = [
                src_worker_for(dst_dp_rank, dst_tp, tp_rank, s, src_tp, src_dp) for s in range(src_dp)
            ]
    return out
