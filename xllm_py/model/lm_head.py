"""The LM head of a step's sampled rows, computed as far as the sampler needs it.

Gemma 3's head has 262,144 outputs: for a greedy row the step used to write all of them
(1 MB) only for the sampler to read them back and keep one index. ``HeadRows`` holds the
rows' final hidden states instead, and the sampler asks per row: ``argmax`` (greedy rows
without logprobs, logit processors or a grammar) runs the head's panel kernel with a
running max per row (csrc/head_argmax.c: the same sums as the logits, the first index on
a tie, as torch.argmax), ``logits`` computes the full float32 rows of the others. Where
the native argmax does not apply (no kernels, K-quant or oneDNN weights, more rows than
the panel kernel takes) it is the argmax of ``logits``: the same tokens. int8 panels on a
CPU with AVX512-VNNI take an integer pass first (csrc/head_vnni.c: bounded approximate
sums, then the exact sums of the few columns that can still win; the same index).

``sample_rows`` is the sampler's native draw (csrc/sample.c): temperature, top-k, top-p
and min-p by selection, not a sort of the whole row.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from xllm_py.model import cpu_kernels


def head_argmax(head: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """argmax over the outputs of ``head(x)`` per row of x [M, K] (int64 [M]), without
    the outputs; None where the native kernel does not apply (then: the logits' argmax)."""
    panels = getattr(head, "_panels", None)
    if (panels is None or getattr(head, "_kq", None) is not None or x.dim() != 2
            or not 0 < x.shape[0] <= cpu_kernels.PANEL_MAX_ROWS or x.dtype != torch.float32
            or not x.is_contiguous() or x.shape[1] != head.in_features
            or not cpu_kernels.linear_available()):
        return None
    lib = cpu_kernels._load()
    bias = head.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    b = 0 if bias is None else bias.data_ptr()
    ids = torch.empty(x.shape[0], dtype=torch.int64)
    m, n, k = x.shape[0], head.out_features, head.in_features
    kind = 2 if head._scales is not None else {torch.float32: 0, torch.bfloat16: 1}.get(
        panels.dtype)
    if kind is None:
        return None
    # one row streams the weights once whatever the arithmetic: the integer pass pays
    # where the head is compute-bound, from two rows on
    if kind == 2 and bias is None and m >= 2 and cpu_kernels.vnni_available():
        tables, sa = head.vnni_tables()
        if lib.xllm_head_argmax_vnni(x.data_ptr(), tables.data_ptr(), head._scales.data_ptr(),
                                     sa.data_ptr(), panels.data_ptr(), ids.data_ptr(),
                                     m, n, k) == 0:
            return ids
    rc = lib.xllm_head_argmax(kind, x.data_ptr(), panels.data_ptr(),
                              0 if head._scales is None else head._scales.data_ptr(), b,
                              ids.data_ptr(), m, n, k)
    return ids if rc == 0 else None


class HeadRows:
    """A step's sampled rows before the LM head: ``hidden`` [N, hidden] (the final norm's
    output), ``head`` the model's LM head module and ``to_logits`` the model's
    ``compute_logits``. Or, where the step computed them already, their ``logits``."""

    def __init__(self, hidden: torch.Tensor | None, head: torch.nn.Module | None,
                 to_logits: Callable[[torch.Tensor], torch.Tensor] | None,
                 vocab_size: int, logits: torch.Tensor | None = None) -> None:
        self._hidden = hidden
        self._head = head
        self._to_logits = to_logits
        self._logits = logits
        rows = logits.shape[0] if logits is not None else hidden.shape[0]
        self.shape = (rows, vocab_size)

    @classmethod
    def of_logits(cls, logits: torch.Tensor) -> "HeadRows":
        return cls(None, None, None, logits.shape[1], logits)

    def __len__(self) -> int:
        return self.shape[0]

    def rows(self, lo: int, hi: int) -> "HeadRows":
        """Rows lo..hi-1 (a view)."""
        if self._logits is not None:
            return HeadRows.of_logits(self._logits[lo:hi])
        return HeadRows(self._hidden[lo:hi], self._head, self._to_logits, self.shape[1])

    def logits(self, rows: Sequence[int] | None = None) -> torch.Tensor:
        """float32 logits [len(rows), vocab] of ``rows`` (default: all), what the model's
        ``forward_logits`` gives for them."""
        if self._logits is not None:
            return self._logits if rows is None else self._logits[list(rows)]
        h = self._hidden if rows is None else self._hidden[list(rows)]
        return self._to_logits(h)

    def argmax(self, rows: Sequence[int] | None = None) -> list[int]:
        """The index of each row's largest logit (the first on a tie)."""
        if self._logits is None:
            h = self._hidden if rows is None else self._hidden[list(rows)]
            ids = head_argmax(self._head, h.contiguous())
            if ids is not None:
                return ids.tolist()
        logits = self.logits(rows)
        if logits.dtype == torch.float32 and not logits.requires_grad:
            return logits.numpy().argmax(axis=-1).tolist()  # numpy: no thread-pool hand-off
        return logits.argmax(dim=-1).tolist()


def sample_rows(logits: torch.Tensor, temperatures: Sequence[float], top_k: Sequence[int],
                top_p: Sequence[float], min_p: Sequence[float],
                uniforms: Sequence[float]) -> list[int] | None:
    """One token per row of ``logits`` [N, V] float32 (csrc/sample.c: the distribution
    and draw of sampler.compute_probs + the inverse-CDF draw, by selection): per row its
    temperature (> 0), top_k (0: none), top_p (1: none), min_p (0: none) and uniform in
    [0, 1). None: not handled (no kernels, another dtype, a row without a finite logit)."""
    lib = cpu_kernels._load()
    if (lib is None or logits.dim() != 2 or logits.dtype != torch.float32
            or not logits.is_cpu or logits.stride(1) != 1 or logits.shape[0] == 0):
        return None
    n, v = logits.shape
    temps = torch.tensor(temperatures, dtype=torch.float32)
    ks = torch.tensor(top_k, dtype=torch.int32)
    ps = torch.tensor(top_p, dtype=torch.float32)
    mps = torch.tensor(min_p, dtype=torch.float32)
    us = torch.tensor(uniforms, dtype=torch.float64)
    ids = torch.empty(n, dtype=torch.int64)
    rc = lib.xllm_sample_rows_f32(logits.data_ptr(), logits.stride(0), n, v, temps.data_ptr(),
                                  ks.data_ptr(), ps.data_ptr(), mps.data_ptr(), us.data_ptr(),
                                  ids.data_ptr())
    return ids.tolist() if rc == 0 else None
