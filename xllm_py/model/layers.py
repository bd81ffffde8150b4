"""Small building blocks shared by the decoder models: RMSNorm, RoPE, gated MLP."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from xllm_py.model import cpu_kernels


class RMSNorm(nn.Module):
    """Normalises in float32, scales in the input dtype (as transformers does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``norm(x)``; with ``residual``: ``residual += x`` in place, returns
        ``norm(residual)`` (the pre-norm decoder's residual stream, one pass in C)."""
        out = cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
        if out is not None:
            return out
        if residual is not None:
            residual.add_(x)
            x = residual
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float,
                  scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32), with optional llama3 scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None or scaling.get("rope_type", "default") == "default":
        return inv_freq
    if scaling["rope_type"] != "llama3":
        raise ValueError(f"unsupported rope type {scaling['rope_type']!r}")
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a cos/sin table grown on demand."""

    def __init__(self, head_dim: int, theta: float, max_position: int,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self._inv_freq = rope_inv_freq(head_dim, theta, scaling)  # plain attr: survives meta
        self._cos: torch.Tensor | None = None  # [P, head_dim], in the model dtype
        self._sin: torch.Tensor | None = None

    def table(self, needed: int, device: torch.device,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [P >= needed, head_dim] for positions 0..P-1, in ``dtype``."""
        cos = self._cos
        if cos is None or cos.shape[0] < needed or cos.device != device or cos.dtype != dtype:
            size = max(needed, self.max_position)
            t = torch.arange(size, device=device, dtype=torch.int64).float()
            freqs = t[:, None] * self._inv_freq.to(device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = emb.cos().to(dtype)
            self._sin = emb.sin().to(dtype)
        return self._cos, self._sin  # type: ignore[return-value]

    def cos_sin(self, positions: torch.Tensor, max_position: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, head_dim] for ``positions``; computed once per step, used by
        every layer. ``max_position`` (host int) bounds the positions."""
        cos_t, sin_t = self.table(max_position, positions.device, dtype)
        return (cos_t.index_select(0, positions)[:, None, :],
                sin_t.index_select(0, positions)[:, None, :])

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor,
              cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, h, hd], k [T, kvh, hd] -> rotated (q, k)."""
        cos, sin = cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused in one matmul; act is SiLU (SwiGLU)
    or ``gelu_pytorch_tanh`` (GeGLU, Gemma)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 act: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.act = act
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        act = cpu_kernels.silu_and_mul(gate_up, gelu=self.act != "silu")
        if act is None:
            act = F.silu(gate) * up if self.act == "silu" else F.gelu(gate, approximate="tanh") * up
        return self.down_proj(act)
