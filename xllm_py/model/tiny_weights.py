"""Random weights of a tiny model (torch + safetensors): the part of `tiny.py` that
needs torch, kept apart so the master can write a tiny model's tokenizer and config
without importing it."""

from __future__ import annotations

import pathlib

import torch
from safetensors.torch import save_file


def write_random_weights(path: pathlib.Path, *, family: str, vocab: int, hidden_size: int,
                         num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         intermediate_size: int, tie_word_embeddings: bool, seed: int,
                         init_std: float, dtype: str = "float32") -> None:
    """model.safetensors: normal(0, init_std) from a fixed seed; norms are ones. Stored in
    ``dtype`` (float32, or bfloat16: the same draws rounded)."""
    hd = head_dim
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * init_std

    q, kv = num_heads * hd, num_kv_heads * hd
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(q, hidden_size)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, hidden_size)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, hidden_size)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden_size, q)
        if family == "qwen2":
            tensors[p + "self_attn.q_proj.bias"] = normal(q)
            tensors[p + "self_attn.k_proj.bias"] = normal(kv)
            tensors[p + "self_attn.v_proj.bias"] = normal(kv)
        if family == "qwen3":
            tensors[p + "self_attn.q_norm.weight"] = torch.ones(hd)
            tensors[p + "self_attn.k_norm.weight"] = torch.ones(hd)
        tensors[p + "mlp.gate_proj.weight"] = normal(intermediate_size, hidden_size)
        tensors[p + "mlp.up_proj.weight"] = normal(intermediate_size, hidden_size)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden_size, intermediate_size)
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden_size)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden_size)
    tensors["model.norm.weight"] = torch.ones(hidden_size)
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = normal(vocab, hidden_size)
    tensors = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
