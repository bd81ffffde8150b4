"""Decoder-only models (Llama, Qwen2, Qwen3) with paged attention, loader and tokenizer.

The names below load on first use (PEP 562), so that importing a torch-free submodule
(config, tokenizer: the simulated engine's) does not import torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "AttentionMetadata": "attention", "allocate_kv_caches": "attention",
    "build_positions": "attention", "SUPPORTED_ARCHITECTURES": "config",
    "ModelConfig": "config", "load_model": "loader", "build_model_dir": "tiny",
    "ensure_tiny_model": "tiny", "Tokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
