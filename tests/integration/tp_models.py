"""Random tiny HF checkpoints of the four families, for the tensor-parallel tests.

Each has 4 attention heads (split over 2 or 4 ranks) and non-trivial norms and biases, so
a weight put in the wrong rank or added twice shows. ``qwen2-kv1`` has one KV head:
replicated on every rank at TP 2. ``llama-bias`` has o_proj and down_proj biases (added
by rank 0 only; ``llama-bias-4l`` the same with 4 layers, for 3 uneven pipeline stages).
``gemma3-kv1``: Gemma 3 with one KV head and a 6-token sliding window;
``gemma3-6l`` the same with 6 layers (sliding, sliding, full, ...: KV groups of 2 slots),
for pipeline stages of sliding layers, full ones, or both.
"""
from __future__ import annotations

import pathlib

import torch

VOCAB = 1024
_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
               initializer_range=0.05, eos_token_id=None, bos_token_id=None,
               pad_token_id=None, max_position_embeddings=256)


def _configs(transformers) -> dict:
    return {
        "llama-bias": lambda: transformers.LlamaConfig(
            **_COMMON, attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
        "llama-bias-4l": lambda: transformers.LlamaConfig(
            **{**_COMMON, "num_hidden_layers": 4}, attention_bias=True, mlp_bias=True,
            tie_word_embeddings=False),
        "qwen2-kv1": lambda: transformers.Qwen2Config(
            **{**_COMMON, "num_key_value_heads": 1}, tie_word_embeddings=True),
        "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=16,
                                                  tie_word_embeddings=False),
        "gemma3-kv1": lambda: transformers.Gemma3TextConfig(
            **{**_COMMON, "num_key_value_heads": 1}, head_dim=16, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
            tie_word_embeddings=True),
        "gemma3-6l": lambda: transformers.Gemma3TextConfig(
            **{**_COMMON, "num_key_value_heads": 1, "num_hidden_layers": 6}, head_dim=16,
            sliding_window=6, layer_types=["sliding_attention"] * 2 + ["full_attention"]
            + ["sliding_attention"] * 2 + ["full_attention"], query_pre_attn_scalar=16,
            tie_word_embeddings=True),
    }


FAMILIES = ("llama-bias", "qwen2-kv1", "qwen3", "gemma3-kv1")


def build_hf_model(transformers, family: str, path: pathlib.Path):
    """Save a random ``family`` checkpoint (+ tokenizer) to ``path``; returns the HF model."""
    return save_random_checkpoint(transformers, _configs(transformers)[family](), path)


def save_random_checkpoint(transformers, config, path: pathlib.Path):
    """An HF model of ``config`` with random weights, non-trivial norms and biases (seed 0),
    saved with a tokenizer in ``path``; returns the model."""
    from xllm_py.model.tiny import build_tokenizer_files

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "bias" in name:
                p.normal_(0, 0.1)
    hf.save_pretrained(path)
    build_tokenizer_files(pathlib.Path(path))
    return hf
