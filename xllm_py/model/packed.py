"""Linear layers with weights packed once at load (CPU inference).

``nn.Linear`` on CPU calls MKL ``sgemm`` every step with the weight in its plain
``[out, in]`` layout. ``pack_linears`` swaps every ``nn.Linear`` of a loaded model for a
``PackedLinear``, which re-lays the weight out once for a faster kernel. With the native
kernels available it holds one copy, 16-column panels: up to ``PANEL_MAX_ROWS`` (~96,
decode batches) ``cpu_kernels.linear_panels`` (a 6 x 16 register tile, weights read once
per call), past that (prefill) ``cpu_kernels.linear_large`` (rows split between the
threads, x packed per 6-row tile in L2, the panel walked in 256-row chunks). Both are
at least as fast as oneDNN on the same shapes, so oneDNN's packed copy is not kept: one
copy of each weight instead of two. Without the kernels (no compiler, no AVX2/FMA,
``XLLM_CPU_KERNELS=0``) the weight is held in oneDNN's blocked layout instead, which is
faster than sgemm at decode sizes (1.6-1.9x on tiny-25m's matmuls) and uses every core.
``--pack-weights false`` keeps the plain ``nn.Linear``.

Packing is used where it is known to be exact to float32 rounding and supported: CPU,
float32 weights, a torch built with oneDNN. Elsewhere ``pack_linears`` leaves the model
as it is and says so.

Weight dtype of the panels (``weight_dtype``): a checkpoint stored in bfloat16 loads into
float32 parameters whose values are all bfloat16 numbers; ``"auto"`` (the default) keeps
such a weight as bfloat16 panels, which the kernels widen exactly as they load it and
multiply in float32: the same sums as float32 panels, half the bytes in memory and
streamed per decode step. A weight with any value that bfloat16 cannot hold keeps float32
panels, so ``"auto"`` never changes a result. ``"float32"`` always keeps float32;
``"bfloat16"`` rounds to it (and says how many weights it rounded). bfloat16 panels need
the native kernels; without them the weights stay float32 (oneDNN). Before bfloat16,
``"auto"`` looks for a weight that is exactly int8 times a scale per 32 values (a GGUF
Q8_0 or Q5_0 tensor, dequantized) and keeps it as int8 panels (int8_panels.py): the same
sums again, from a quarter of the bytes; a tied LM head held so also serves the
embedding's lookups, and the float32 table goes. Before that, a weight the loader gave GGUF
Q4_K or Q6_K blocks (a converted GGUF) that hold its values exactly stays in them as
K-quant panels (kquant_panels.py): the same sums once more, from 0.59 or 1.08 bytes a
weight.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from xllm_py.model import cpu_kernels, kquant_panels
from xllm_py.model.int8_panels import (PanelEmbedding, dequantize_panels, int8_blocks,
                                       pack_int8_panels, vnni_tables)

logger = logging.getLogger(__name__)

# Rows per matmul that oneDNN's blocked layout is tuned for; any row count works (a hint of
# 32 serves decode batches and prompt chunks alike; a hint of 1 slows the larger ones).
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
    """``y = x @ W.T + b`` with ``W`` held once, packed: as 16-column panels for the native
    kernels when they are available, else in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int = DEFAULT_BATCH_HINT,
                 weight_dtype: torch.dtype = torch.float32,
                 int8: tuple[torch.Tensor, torch.Tensor] | None = None,
                 kquant: kquant_panels.KQuantPanels | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(),
                                                                  requires_grad=False)
        weight = linear.weight.detach()
        # Exactly one of the two layouts. Panels [ceil(out/16), in, 16]: every row count
        # (linear_panels up to PANEL_MAX_ROWS, linear_large past that).
        # bfloat16 panels: the kernels widen them exactly (module docstring)
        self._scales = None  # int8 panels: their float32 scales [np, K / 32, 16]
        self._kq = None  # GGUF Q4_K / Q6_K panels (kquant_panels.py); _panels: their values
        self._vnni = None  # int8 panels' tables for the head's integer argmax, on first use
        if kquant is not None and cpu_kernels.linear_available():
            self._kq = kquant
            self._panels = kquant.q
        elif int8 is not None and cpu_kernels.linear_available():
            self._panels, self._scales = pack_int8_panels(*int8)
        else:
            self._panels = (cpu_kernels.pack_panels(weight, weight_dtype)
                            if cpu_kernels.linear_available() else None)
        # oneDNN's packed weight, an opaque mkldnn tensor: kept as a plain attribute (not a
        # parameter/buffer, which state_dict and .to() would treat as a dense tensor).
        self._packed = None
        if self._panels is None:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._panels is None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [],
                                                      "")
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype == torch.float32 and not x2.is_contiguous():
            x2 = x2.contiguous()  # a copy costs far less than the matmul's slower path
        if self._kq is not None:
            y = cpu_kernels.linear_panels_kquant(x2, self._kq, self.bias)
        elif self._scales is not None:
            y = cpu_kernels.linear_panels_int8(x2, self._panels, self._scales,
                                               self.out_features, self.bias)
        elif x2.shape[0] <= cpu_kernels.PANEL_MAX_ROWS:
            y = cpu_kernels.linear_panels(x2, self._panels, self.out_features, self.bias)
        else:
            y = cpu_kernels.linear_large(x2, self._panels, self.out_features, self.bias)
        if y is None:  # the kernels declined (disabled, out of memory, other dtype...)
            y = self._linear_from_panels(x2)
        return y.view(*x.shape[:-1], self.out_features)

    def vnni_tables(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """int8 panels' tables for csrc/head_vnni.c (int8_panels.vnni_tables), built on
        first use: only an LM head asked for greedy argmaxes needs them. None: no int8
        panels."""
        if self._scales is None:
            return None
        if self._vnni is None:
            self._vnni = vnni_tables(self._panels, self._scales)
        return self._vnni

    def _linear_from_panels(self, x2: torch.Tensor) -> torch.Tensor:
        """The same product in torch, reading the panels in place: [M, K] @ [np, K, 16] is a
        batched matmul to [np, M, 16], whose panels side by side are the columns of y."""
        m, num = x2.shape[0], self._panels.shape[0]
        if self._kq is not None:
            panels = self._kq.dequantize()
        elif self._scales is not None:
            panels = dequantize_panels(self._panels, self._scales)
        else:
            panels = self._panels
        y = torch.matmul(x2, panels.to(x2.dtype)).transpose(0, 1).reshape(m, num * 16)
        y = y[:, :self.out_features]
        return y + self.bias if self.bias is not None else y.contiguous()

    def extra_repr(self) -> str:
        layout = "onednn" if self._panels is None else f"panels-{self._kq.qtype}" if (
            self._kq is not None) else {
            torch.float32: "panels", torch.bfloat16: "panels-bf16",
            torch.int8: "panels-int8"}[self._panels.dtype]
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, packed={layout}"


WEIGHT_DTYPES = ("auto", "float32", "bfloat16")


def is_bfloat16_valued(weight: torch.Tensor) -> bool:
    """Whether every value of ``weight`` is a bfloat16 number (as in a checkpoint stored in
    bfloat16 and loaded as float32): then bfloat16 panels hold it exactly."""
    return weight.dtype == torch.bfloat16 or torch.equal(
        weight.to(torch.bfloat16).to(weight.dtype), weight)


def pack_linears(model: nn.Module, batch_hint: int = DEFAULT_BATCH_HINT,
                 weight_dtype: str = "auto") -> int:
    """Replace every ``nn.Linear`` in ``model`` by a ``PackedLinear``; returns how many.
    ``weight_dtype``: ``WEIGHT_DTYPES``, the panels' dtype (module docstring).

    Returns 0 (and logs why) when packing is not supported for this model.
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, "
                         f"got {weight_dtype!r}")
    ok, why = packing_supported(model)
    if not ok:
        logger.info("linear weights not packed: %s", why)
        return 0
    panels = cpu_kernels.linear_available()
    count = num_bf16 = num_int8 = num_kq = num_rounded = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                dtype, int8, kq = torch.float32, None, None
                if panels and weight_dtype == "auto":
                    kq = kquant_panels.for_linear(child)
                    int8 = int8_blocks(child.weight) if kq is None else None
                if panels and weight_dtype != "float32" and int8 is None and kq is None:
                    exact = is_bfloat16_valued(child.weight)
                    if exact or weight_dtype == "bfloat16":
                        dtype = torch.bfloat16
                        num_rounded += not exact
                setattr(parent, name, PackedLinear(child, batch_hint, dtype, int8, kq))
                count += 1
                num_bf16 += dtype == torch.bfloat16
                num_int8 += int8 is not None
                num_kq += kq is not None
    if num_rounded:
        logger.warning("weight dtype bfloat16: %d of %d linear weights rounded to bfloat16",
                       num_rounded, count)
    if num_int8:
        _embed_from_int8_head(model)
        head = getattr(model, "lm_head", None)
        if isinstance(head, PackedLinear) and cpu_kernels.vnni_available():
            head.vnni_tables()  # at load, not in the first greedy step (~1 s at 262,144 rows)
    if panels:
        logger.info("packed %d linear layers as panels for the native kernels (%d in GGUF "
                    "Q4_K/Q6_K, %d in int8, %d in bfloat16, %d in float32)", count, num_kq,
                    num_int8, num_bf16, count - num_bf16 - num_int8 - num_kq)
    else:
        if weight_dtype == "bfloat16":
            logger.warning("weight dtype bfloat16 needs the native kernels: weights kept "
                           "in float32")
        logger.info("packed %d linear layers for oneDNN (batch hint %d; native linear "
                    "kernels unavailable: %s)", count, batch_hint,
                    cpu_kernels.unavailable_reason() or "no AVX2/FMA")
    return count


def _embed_from_int8_head(model: nn.Module) -> None:
    """A tied LM head held as int8 panels serves the embedding's lookups (the same values)."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if (config is None or not getattr(config, "tie_word_embeddings", False) or inner is None
            or not isinstance(head, PackedLinear) or head._scales is None
            or not isinstance(getattr(inner, "embed_tokens", None), nn.Embedding)):
        return
    inner.embed_tokens = PanelEmbedding(head)
