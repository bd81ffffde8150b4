"""xLLM's TP/DP worker mapping for KV transfer (pure functions).

Not used yet: every instance has one worker today, and the PD code (xllm_py/engine/pd/)
moves KV between worker 0 of each side. Kept for tensor parallelism, where
each destination worker pulls from the source worker this module names.

Workers of an instance are numbered ``dp_rank * tp + tp_rank``. A decode (destination)
worker ``dst_worker_rank = dst_dp_rank * dst_tp + tp_rank`` pulls from the prefill
(source) worker ``src_dp_rank * src_tp + (dst_worker_rank % src_tp)`` (xLLM
``pull_kv_blocks``); ``link_cluster`` links, for each destination worker, the worker of
every source DP group that it may pull from.

Different TP sizes (seed 002: n = m, n > m, n < m): each TP rank holds the KV heads of
``model.sharding.kv_head_range`` (split, or replicated when tp exceeds the KV heads).
``kv_head_plan`` gives a destination rank the heads it owns as ``HeadSlice``s, each read
from one source rank that holds them: equal TP, rank to rank, whole blocks; P TP 2 -> D
TP 1, the decode rank reads half its heads from each prefill rank; P TP 1 -> D TP 2,
each decode rank reads its half from the one prefill rank. ``head_mapping_error`` says
why a pair cannot be mapped (refused at link time).
"""
from __future__ import annotations

import dataclasses

from xllm_py.model.sharding import head_mapping_error, kv_head_range


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


@dataclasses.dataclass(frozen=True)
class HeadSlice:
    """KV heads ``[src_start, src_start + count)`` of source rank ``src_rank``'s pool go to
    ``[dst_start, dst_start + count)`` of the destination rank's pool (local head
    indices: each pool holds only its rank's heads)."""

    src_rank: int
    src_start: int
    dst_start: int
    count: int


def kv_head_plan(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[HeadSlice]:
    """What destination rank ``dst_rank`` reads, in head order: every KV head it owns once,
    consecutive heads of one source rank merged into one slice. A head replicated on
    several source ranks is read from ``replicas[dst_rank % len(replicas)]`` (spreads the
    readers). ``ValueError`` when the pair cannot be mapped."""
    error = head_mapping_error(num_kv_heads, src_tp, dst_tp)
    if error is not None:
        raise ValueError(error)
    if not 0 <= dst_rank < dst_tp:
        raise ValueError(f"dst_rank {dst_rank} out of range for tp {dst_tp}")
    src_ranges = [kv_head_range(num_kv_heads, src_tp, r) for r in range(src_tp)]
    d0, d1 = kv_head_range(num_kv_heads, dst_tp, dst_rank)
    plan: list[HeadSlice] = []
    for head in range(d0, d1):
        replicas = [r for r, (a, b) in enumerate(src_ranges) if a <= head < b]
        src = replicas[dst_rank % len(replicas)]
        src_local, dst_local = head - src_ranges[src][0], head - d0
        last = plan[-1] if plan else None
        if (last is not None and last.src_rank == src
                and last.src_start + last.count == src_local):
            plan[-1] = dataclasses.replace(last, count=last.count + 1)
        else:
            plan.append(HeadSlice(src, src_local, dst_local, 1))
    return plan
