"""The one layer tensor parallelism adds: a row-parallel linear (input columns split over
the ranks, partial products summed by an all-reduce). Column-parallel layers need no
wrapper: a rank's q/k/v and gate/up are plain linears over its own output rows."""
from __future__ import annotations

import torch
from torch import nn

from xllm_py.parallel.group import TPGroup


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r @ W_r.T) (+ b on rank 0 only)``: ``linear`` holds this rank's
    columns of ``W``; the bias, when the model has one, only on rank 0 so it is added once.
    ``linear`` stays a child module so ``pack_linears`` packs it like any other."""

    def __init__(self, linear: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if not y.is_contiguous():
            y = y.contiguous()
        return self.group.all_reduce(y)

    def extra_repr(self) -> str:
        return f"rank={self.group.rank}, world_size={self.group.world_size}"
