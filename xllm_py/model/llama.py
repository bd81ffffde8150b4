"""Decoder-only transformer for the Llama, Qwen2, Qwen3 and Gemma 3 families.

One implementation with per-family flags from ``ModelConfig``: Qwen2 adds q/k/v biases,
Qwen3 adds per-head q/k RMSNorm, Llama may use llama3 RoPE scaling; Gemma 3 has its own
block (gemma3.py), a scaled embedding and sliding-window layers (each attention type gets
its own plan and RoPE table per step). q/k/v and gate/up are fused into one matmul each;
the loader maps the HF tensor names onto the fused weights.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from xllm_py.model import cpu_kernels
from xllm_py.model.attention import (AttentionMetadata, AttentionPlan, attend, plan_attention,
                                     plan_rows, retable, write_kv)
from xllm_py.model.config import SLIDING, ModelConfig
from xllm_py.model.fused_decode import FusedDecoder
from xllm_py.model.gemma3 import Gemma3DecoderLayer
from xllm_py.model.gemma3_decode import Gemma3DecodeRunner
from xllm_py.model.kv_groups import kv_groups
from xllm_py.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from xllm_py.model.lm_head import HeadRows

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        # the kernels scale by head_dim ** -0.5; another scale multiplies q first
        ratio = config.attention_scale / config.head_dim ** -0.5
        self.q_scale = None if abs(ratio - 1.0) < 1e-12 else ratio
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        qkv_bias = config.qkv_bias or config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None

    def forward(self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: KVCache, plan: AttentionPlan, rows: torch.Tensor | None = None,
                rows_plan: AttentionPlan | None = None) -> torch.Tensor:
        """Stores every token's K/V; the output has a row per token, or with ``rows``
        only those tokens' (attending by ``rows_plan``)."""
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # One C pass when it can: q/k norm, RoPE, K/V into the cache (cpu_kernels.py).
        q = cpu_kernels.qk_norm_rope_store(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            self.q_norm.eps if self.q_norm is not None else 0.0,
            cos_sin[0], cos_sin[1], kv_cache[0], kv_cache[1], plan.slot_mapping)
        if q is None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(t, self.num_heads, self.head_dim)
            k = k.reshape(t, self.num_kv_heads, self.head_dim)
            v = v.reshape(t, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q, k = RotaryEmbedding.apply(q, k, cos_sin)
            write_kv(kv_cache[0], kv_cache[1], k, v, plan.slot_mapping)
        if rows is not None:
            q, plan, t = q[rows], rows_plan, int(rows.shape[0])
        if self.q_scale is not None:
            q = q * self.q_scale
        out = attend(q, kv_cache[0], kv_cache[1], plan)
        return self.o_proj(out.reshape(t, self.q_size).to(hidden.dtype))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                plan: AttentionPlan, rows: torch.Tensor | None = None,
                rows_plan: AttentionPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block on the residual stream. ``hidden`` is the previous block's MLP
        output, still to be added to ``residual`` (None for the first layer, where
        ``hidden`` is the embedding and becomes the stream). Returns (mlp out, residual),
        with ``rows``: for those tokens only (every token's K/V is stored all the same)."""
        if residual is None:
            residual = hidden
            h = self.input_layernorm(hidden)
        else:
            h = self.input_layernorm(hidden, residual)
        h = self.self_attn(h, cos_sin, kv_cache, plan, rows, rows_plan)
        if rows is not None:
            residual = residual[rows]
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # _weight skips normal_ init (slow on the meta device; the loader fills it anyway)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        if config.sandwich_norm:
            self.layers = nn.ModuleList(Gemma3DecoderLayer(config, Attention(config))
                                        for _ in range(config.num_layers))
        else:
            self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], attn_metadata, kv_caches) -> [T, hidden]``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta,
                                          config.max_position_embeddings, config.rope_scaling)
        # sliding-window layers: their own RoPE base (Gemma 3), else the one table
        self.windows = [config.layer_window(i) for i in range(config.num_layers)]
        # per layer its KV group (hybrid models: sliding and full layers have block tables
        # of their own, AttentionMetadata.for_group)
        self.kv_groups = kv_groups(self.windows)
        self.layer_keys = list(zip(self.windows, self.kv_groups.layer_group))
        self.rotary_local = None
        if config.layer_types and SLIDING in config.layer_types and config.rope_local_theta:
            self.rotary_local = RotaryEmbedding(config.head_dim, config.rope_local_theta,
                                                config.max_position_embeddings)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # Decode batches through one native call per layer (fused_decode.py); False: off.
        self.fused_decode = True
        self._fused: tuple[int, FusedDecoder | None] = (0, None)
        self._gemma_runner: tuple[int, Gemma3DecodeRunner | None] = (0, None)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_caches: list[KVCache],
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden], or with ``keep_rows`` ([N] int64 token
        indices) only those rows [N, hidden], in that order. Every token's K/V is stored
        either way; with a prefill in the batch the last layer then runs its attention
        output and MLP for the kept rows only (the others reach no logits)."""
        return self._forward(input_ids, positions, attn_metadata, kv_caches, keep_rows, False)

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       attn_metadata: AttentionMetadata, kv_caches: list[KVCache],
                       keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``compute_logits(forward(...))``: float32 logits [N, vocab] of the kept rows.
        A decode batch whose rows are all kept runs its layers, final norm and LM head in
        one native call when it can (fused_decode.py)."""
        return self._forward(input_ids, positions, attn_metadata, kv_caches, keep_rows, True)

    def forward_head(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     attn_metadata: AttentionMetadata, kv_caches: list[KVCache],
                     keep_rows: torch.Tensor | None = None) -> HeadRows:
        """``forward_logits`` with the LM head left to its reader (lm_head.HeadRows: a
        greedy row's argmax without its logits); where the step's native call computes
        the logits anyway (fused_decode.py), those."""
        return self._forward(input_ids, positions, attn_metadata, kv_caches, keep_rows, None)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: AttentionMetadata, kv_caches: list[KVCache],
                 keep_rows: torch.Tensor | None, logits: bool | None
                 ) -> torch.Tensor | HeadRows:
        """``logits``: True the logits, False the final hidden states, None HeadRows."""
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(
                f"expected {self.config.num_layers} (K, V) caches, got {len(kv_caches)}")
        block_size = int(kv_caches[0][0].shape[1])
        plan = plan_attention(attn_metadata, block_size)
        fused = self._fused_decoder()
        if fused is not None and logits is not False and keep_rows is None and fused.has_head:
            tables = self.rotary_emb.table(attn_metadata.max_seq_len, input_ids.device,
                                           self.model.embed_tokens.weight.dtype)
            out = fused.logits(input_ids, positions, tables, kv_caches, plan)
            if out is not None:
                return out if logits else HeadRows.of_logits(out)
            fused = None  # this batch does not qualify
        hidden = self.model.embed_tokens(input_ids)  # a new tensor: the residual stream
        if self.config.embed_scale != 1.0:
            hidden.mul_(torch.tensor(self.config.embed_scale, dtype=hidden.dtype))
        cos_sin = self.rotary_emb.cos_sin(positions, attn_metadata.max_seq_len, hidden.dtype)
        done = fused.run(hidden, cos_sin, kv_caches, plan) if fused is not None else None
        rows = rows_plan = None
        if done is None:
            plans = self.layer_plans(attn_metadata, plan, block_size, self.layer_keys)
            groups = self.kv_groups.layer_group
            local = self.local_cos_sin(positions, attn_metadata.max_seq_len, hidden.dtype)
            last = len(self.model.layers) - 1
            if (keep_rows is not None and plan.prefill is not None
                    and keep_rows.numel() < plan.num_tokens):
                # no row kept: one stands in (the last layer still stores every K/V)
                rows = keep_rows if keep_rows.numel() else keep_rows.new_full(
                    (1,), plan.num_tokens - 1)
                rows_plan = plan_rows(attn_metadata.for_group(groups[last]), rows, positions,
                                      block_size, self.windows[last])
            runner = self._decode_runner() if rows is None else None
            if runner is not None:  # Gemma 3 decode steps: the same kernels, less Python
                # (its plans and RoPE tables per layer key: (window, KV group))
                done = runner.run(hidden, {k: local if k[0] and local is not None else cos_sin
                                           for k in plans}, kv_caches, plans, self.layer_keys)
        if done is None:
            residual = None
            for i, (layer, cache) in enumerate(zip(self.model.layers, kv_caches)):
                r, rp = (rows, rows_plan) if i == last else (None, None)
                w = self.windows[i]
                cs = local if w and local is not None else cos_sin
                hidden, residual = layer(hidden, residual, cs, cache, plans[w, groups[i]], r, rp)
            done = hidden, residual
        out = self.model.norm(*done)
        if keep_rows is not None:
            out = out[keep_rows] if rows is None else out[:keep_rows.numel()]
        if logits is None:
            return HeadRows(out, self.lm_head, self.compute_logits, self.config.vocab_size)
        return self.compute_logits(out) if logits else out

    def layer_plans(self, attn_metadata: AttentionMetadata, plan: AttentionPlan,
                    block_size: int, keys: list[tuple[int, int]]
                    ) -> dict[tuple[int, int], AttentionPlan]:
        """A plan per (window, KV group) in ``keys`` (sliding layers: their window; ``plan``
        is plan_attention's of the step, full attention, group 0). Without the groups'
        tables (e.g. a warm-up step) every group reads group 0's."""
        grouped = attn_metadata.group_slots is not None
        plans: dict[tuple[int, int], AttentionPlan] = {}
        for w, g in sorted(set(keys)):
            src = (w, g if grouped else 0)
            if src not in plans:  # another group of this window: its plan re-tabled
                same = next((plans[k] for k in plans if k[0] == w), None)
                md = attn_metadata.for_group(src[1])
                plans[src] = (plan if src == (0, 0) else plan_attention(md, block_size, w)
                              if same is None else retable(same, md, block_size))
            plans[w, g] = plans[src]
        return plans

    def local_cos_sin(self, positions: torch.Tensor, max_seq_len: int, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The RoPE table of the sliding layers where they have their own base, else None."""
        if self.rotary_local is None:
            return None
        return self.rotary_local.cos_sin(positions, max_seq_len, dtype)

    def _fused_decoder(self) -> FusedDecoder | None:
        """Built on first use and again when the layers' linears are replaced (packing)."""
        if not self.fused_decode or self.config.sandwich_norm or any(self.windows):
            return None  # the native decode stack runs the Llama block, full attention
        key = id(self.model.layers[0].self_attn.qkv_proj) if len(self.model.layers) else 0
        if self._fused[0] != key:
            self._fused = (key, FusedDecoder.build(self))
        return self._fused[1]

    def _decode_runner(self) -> Gemma3DecodeRunner | None:
        """Built on first use and again when the layers' linears are replaced (packing)."""
        if not self.fused_decode or not self.config.sandwich_norm or not len(self.model.layers):
            return None
        key = id(self.model.layers[0].self_attn.qkv_proj)
        if self._gemma_runner[0] != key:
            self._gemma_runner = (key, Gemma3DecodeRunner.build(self))
        return self._gemma_runner[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden).float()


# Qwen2/Qwen3/Gemma 3 differ by flags in ModelConfig (Gemma 3: its block, gemma3.py).
Qwen2ForCausalLM = LlamaForCausalLM
Qwen3ForCausalLM = LlamaForCausalLM
Gemma3ForCausalLM = LlamaForCausalLM
