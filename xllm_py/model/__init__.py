"""Decoder-only models (Llama, Qwen2, Qwen3) with paged attention, loader and tokenizer."""

from xllm_py.model.attention import AttentionMetadata, allocate_kv_caches, build_positions
from xllm_py.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from xllm_py.model.loader import load_model
from xllm_py.model.tiny import build_model_dir, ensure_tiny_model
from xllm_py.model.tokenizer import Tokenizer

__all__ = [
    "AttentionMetadata", "ModelConfig", "SUPPORTED_ARCHITECTURES", "Tokenizer",
    "allocate_kv_caches", "build_model_dir", "build_positions", "ensure_tiny_model",
    "load_model",
]
