"""Decoder-only models (Llama, Qwen2, Qwen3) with paged attention, loader and tokenizer.

The names below load on first use (PEP 562), so importing a torch-free submodule
(`xllm_py.model.config`, `.tokenizer`, `.tiny`: what the master needs) does not import
torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "AttentionMetadata": "attention", "allocate_kv_caches": "attention",
    "build_positions": "attention", "SUPPORTED_ARCHITECTURES": "config",
    "ModelConfig": "config", "load_model": "loader", "build_model_dir": "tiny",
    "ensure_tiny_model": "tiny", "Tokenizer": "tokenizer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
