"""The Gemma 3 text decoder block (``Gemma3ForCausalLM``, model type ``gemma3_text``).

What differs from the Llama block (llama.py runs both; ``ModelConfig`` has the facts):
four RMSNorms a layer (before and after attention, before and after the MLP: "sandwich"),
each scaling by (1 + w) -- the loader folds the 1 into the weights, so the norms here are
the plain ones -- a GELU-tanh gated MLP, per-head q/k norms, and on the layers
``layer_types`` calls sliding, attention over the last ``sliding_window`` positions with
its own RoPE base (the caller hands each layer its plan and cos/sin table).
"""

from __future__ import annotations

import torch
from torch import nn

from xllm_py.model.attention import AttentionPlan
from xllm_py.model.config import ModelConfig
from xllm_py.model.layers import GatedMLP, RMSNorm


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: nn.Module) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = attention
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias,
                            act=config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: tuple[torch.Tensor, torch.Tensor],
                plan: AttentionPlan, rows: torch.Tensor | None = None,
                rows_plan: AttentionPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as llama.DecoderLayer: ``hidden`` is the previous block's output
        still to be added to ``residual`` (None: the embedding); returns (out, residual)."""
        if residual is None:
            residual = hidden
            h = self.input_layernorm(hidden)
        else:
            h = self.input_layernorm(hidden, residual)
        h = self.self_attn(h, cos_sin, kv_cache, plan, rows, rows_plan)
        if rows is not None:
            residual = residual[rows]
        h = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual
