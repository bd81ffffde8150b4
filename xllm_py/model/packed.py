"""Linear layers with weights pre-packed for oneDNN (CPU inference).

``nn.Linear`` on CPU calls MKL ``sgemm`` every step with the weight in its plain
``[out, in]`` layout. oneDNN can reorder the weight once, at load time, into the blocked
layout its kernels read, and then runs the small-batch matmuls of decoding markedly
faster, and with better use of a second core (``benchmarks/bench_engine.py``; figures in
docs/DESIGN.md). ``pack_linears`` swaps every ``nn.Linear`` of a loaded model for a
``PackedLinear``. Up to ~96 rows (decode batches) the native panel kernel
(``cpu_kernels.linear_panels``: 16-column panels, a 6 x 16 register tile, weights read
once per call) beats oneDNN; past that (prefill) oneDNN wins. When the kernels are
available both layouts are kept: twice the linear-weight memory, the price of the fastest
path at every batch size (``--pack-weights false`` keeps the plain weights only).

Packing is used where it is known to be exact to float32 rounding and supported: CPU,
float32 weights, a torch built with oneDNN. Elsewhere ``pack_linears`` leaves the model
as it is and says so.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from xllm_py.model import cpu_kernels

logger = logging.getLogger(__name__)

# Rows per matmul that the blocked layout is tuned for; any row count works (measured:
# a hint of 32 is as fast as the exact size from 7 to 500 rows, a hint of 1 is not).
DEFAULT_BATCH_HINT = 32


def packing_supported(model: nn.Module) -> tuple[bool, str]:
    """Whether ``pack_linears`` would pack this model, and why not when it would not."""
    if not torch.backends.mkldnn.is_available():
        return False, "torch was built without oneDNN"
    params = list(model.parameters())
    if not params:
        return False, "the model has no parameters"
    if any(p.device.type != "cpu" for p in params):
        return False, "the model is not on the CPU"
    if any(isinstance(m, nn.Linear) and m.weight.dtype != torch.float32 for m in model.modules()):
        return False, "only float32 weights are packed"
    return True, ""


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int = DEFAULT_BATCH_HINT) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        # An opaque mkldnn tensor: kept as a plain attribute (not a parameter/buffer, which
        # state_dict and .to() would try to treat as a dense tensor).
        self._packed = packed
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(),
                                                                  requires_grad=False)
        # panels for decode-size batches (None: every call goes to oneDNN)
        self._panels = (cpu_kernels.pack_panels(linear.weight.detach())
                        if cpu_kernels.available() else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._panels is not None:  # None from the kernel: too many rows, other dtype...
            y = cpu_kernels.linear_panels(x, self._panels, self.out_features, self.bias)
            if y is not None:
                return y
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, packed=onednn"


def pack_linears(model: nn.Module, batch_hint: int = DEFAULT_BATCH_HINT) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a ``PackedLinear``; returns how many.

    Returns 0 (and logs why) when packing is not supported for this model.
    """
    ok, why = packing_supported(model)
    if not ok:
        logger.info("linear weights not packed: %s", why)
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child, batch_hint))
                count += 1
    logger.info("packed %d linear layers for oneDNN (batch hint %d)", count, batch_hint)
    return count
