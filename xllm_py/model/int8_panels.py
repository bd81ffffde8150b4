"""Linear weights that are exactly int8 times a per-32 scale, held so (CPU panels).

A GGUF weight quantized as Q8_0 (a float16 scale and 32 int8 values a block) or Q5_0
(a float16 scale and 32 five-bit values, centred) dequantizes to float32 values that are
each ``scale * i`` for a small integer ``i``: a quarter of the bytes holds them exactly.
``int8_blocks`` finds such a weight (every 32-value block along the input dimension is
``s * i`` with ``|i| <= 127``, found as ``s = max|w| / 127`` or ``max|w| / 16``, the two
quantizers' largest integer) and returns the integers and scales; any other weight gets
None and keeps float32 panels. ``pack_int8_panels`` lays them out as the panel kernels read
them: ``[ceil(N/16), K, 16]`` int8 and ``[ceil(N/16), K/32, 16]`` float32 scales; the
kernel widens each value exactly (``cpu_kernels.linear_panels_int8``), so the sums are those
of float32 panels holding the same values. On gemma-3-270m's GGUF this holds the tied
embedding / LM head (Q8_0, 262,144 x 640: 671 MB -> 189 MB) and the q, k, v, gate and up
projections; the Q4_K and Q6_K tensors (an offset per block) stay float32.
"""
from __future__ import annotations

import torch

from xllm_py.model import cpu_kernels

BLOCK = 32


def int8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [N, K] int8, scales [N, K / 32] float32) with ``weight == q * scales`` (each
    scale repeated over its 32 values) exactly, or None (also without the native kernels,
    which int8 panels need): the search runs in C, one pass over the weight."""
    return cpu_kernels.int8_blocks(weight)


def pack_int8_panels(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K], scales [N, K/32]) -> panels [ceil(N/16), K, 16] int8 and scales
    [ceil(N/16), K/32, 16] float32 (zero padded rows)."""
    n, k = q.shape
    num = (n + 15) // 16
    pq = q.new_zeros(num * 16, k)
    pq[:n] = q
    ps = scales.new_zeros(num * 16, k // BLOCK)
    ps[:n] = scales
    return (pq.view(num, 16, k).transpose(1, 2).contiguous(),
            ps.view(num, 16, k // BLOCK).transpose(1, 2).contiguous())


def unpack_rows(panels: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The float32 weight rows ``rows`` [T] of int8 panels: [T, K] (an embedding lookup
    from the LM head's panels, exact)."""
    p, j = rows // 16, rows % 16
    q = panels[p, :, j].float()  # [T, K]
    s = scales[p, :, j]  # [T, K/32]
    return (q.view(q.shape[0], -1, BLOCK) * s[..., None]).view(q.shape[0], -1)


def dequantize_panels(panels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 panels [np, K, 16] holding the same values (the torch fallback)."""
    return panels.float() * scales.repeat_interleave(BLOCK, dim=1)


class PanelEmbedding(torch.nn.Module):
    """An embedding that reads its rows from a tied LM head's int8 panels (the float32
    table is not kept: gemma-3-270m's is 671 MB)."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head = [head]  # a list: not a submodule (the head is the model's lm_head)
        self.num_embeddings = head.out_features
        self.embedding_dim = head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        return unpack_rows(head._panels, head._scales, ids.reshape(-1)).view(
            *ids.shape, self.embedding_dim)


def vnni_tables(panels: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What csrc/head_vnni.c reads beside the panels: the weights as uint8 ``q + 128`` in
    VNNI order [np, K/4, 16, 4] (four consecutive k of a column in one 32-bit lane), and
    per block and column the bound's weight ``|scale| * sum |q|`` [np, K/32, 16], rounded
    up to float32 so the bound it gives is never below the true one."""
    num, k, _ = panels.shape
    v = (panels.view(num, k // 4, 4, 16).transpose(2, 3).to(torch.int16) + 128)
    sums = panels.view(num, k // BLOCK, BLOCK, 16).abs().sum(2, dtype=torch.int32)
    sa = (scales.double().abs() * sums.double()).float()
    sa = torch.nextafter(sa, torch.full_like(sa, float("inf")))
    return v.to(torch.uint8).contiguous(), sa.contiguous()
