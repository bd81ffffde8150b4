"""Which part of the model each tensor-parallel rank holds (Megatron-style), as plain numbers.

Rank ``r`` of ``tp`` ranks holds query heads ``[r*h/tp, (r+1)*h/tp)`` and the KV heads
they read: ``num_kv_heads / tp`` of them when ``tp`` divides ``num_kv_heads``; one KV head,
replicated on ``tp / num_kv_heads`` neighbouring ranks, when ``tp`` exceeds (and is a
multiple of) ``num_kv_heads``. MLP columns ``[r*i/tp, (r+1)*i/tp)``. q/k/v and gate/up are
split by output rows (column parallel), o_proj and down_proj by input columns (row
parallel, summed by an all-reduce). Embedding, norms and q/k norms are replicated; the LM
head lives on rank 0 only (the only rank that samples).

No torch here: the PD side (model/kv_layout.py) uses the same head ranges.
"""
from __future__ import annotations

import dataclasses

from xllm_py.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TPShard:
    rank: int
    tp_size: int
    q_heads: tuple[int, int]  # [start, end) of the model's query heads
    kv_heads: tuple[int, int]  # [start, end) of the model's KV heads
    intermediate: tuple[int, int]  # [start, end) of the MLP's intermediate columns

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]


def tp_error(num_heads: int, num_kv_heads: int, intermediate_size: int, tp: int) -> str | None:
    """Why a model cannot be split over ``tp`` ranks, or None when it can."""
    if tp < 1:
        return f"tensor parallel size must be >= 1, got {tp}"
    if num_heads % tp:
        return f"{num_heads} attention heads cannot be split over {tp} ranks"
    if intermediate_size % tp:
        return f"intermediate size {intermediate_size} cannot be split over {tp} ranks"
    if num_kv_heads % tp and tp % num_kv_heads:
        return (f"{num_kv_heads} KV heads cannot be split over {tp} ranks (nor replicated: "
                f"{tp} is not a multiple of {num_kv_heads})")
    return None


def kv_head_range(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, end) of the KV heads rank ``rank`` of ``tp`` holds (see module doc)."""
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // num_kv_heads)
    return head, head + 1


def shard_for(config: ModelConfig, rank: int, tp: int) -> TPShard:
    """Rank ``rank``'s part; ``ValueError`` when the model cannot be split over ``tp``."""
    error = tp_error(config.num_heads, config.num_kv_heads, config.intermediate_size, tp)
    if error is not None:
        raise ValueError(error)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside [0, {tp})")
    h = config.num_heads // tp
    i = config.intermediate_size // tp
    return TPShard(rank=rank, tp_size=tp, q_heads=(rank * h, (rank + 1) * h),
                   kv_heads=kv_head_range(config.num_kv_heads, tp, rank),
                   intermediate=(rank * i, (rank + 1) * i))


def shard_config(config: ModelConfig, shard: TPShard) -> ModelConfig:
    """The config of the rank's local model: its head and column counts."""
    return dataclasses.replace(config, num_heads=shard.num_heads,
                               num_kv_heads=shard.num_kv_heads,
                               intermediate_size=shard.intermediate_size)
