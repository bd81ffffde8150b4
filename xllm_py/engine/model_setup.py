"""Loading an engine's model: weights (one process, or TP ranks: xllm_py/parallel/),
tokenizer, KV pool, model runner and sampler. Torch is imported here, not by the engine
loop (a simulated engine, xllm_py/sim/engine.py, replaces this step).

Stages: seed + threads -> model dir -> model (packed weights, or TP shards) -> tokenizer ->
KV pool size (--num-blocks, else --kv-cache-memory-mb per rank) -> storage -> runner.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from xllm_py.config import EngineConfig
from xllm_py.engine.engine_request import resolve_model_dir
from xllm_py.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from xllm_py.engine.llm_engine import LLMEngine


def load_engine_model(engine: "LLMEngine", config: EngineConfig) -> int:
    """Sets engine.model_dir, model, model_config, tokenizer, kv_groups, storage, runner,
    sampler (and tp at TP > 1); returns the number of KV blocks. A hybrid model's pool
    holds kv_groups.num_slots cache tensors, not one per layer (model/kv_groups.py)."""
    import torch

    from xllm_py.engine.model_runner import ModelRunner
    from xllm_py.engine.sampler import Sampler
    from xllm_py.kv_transfer.factory import pool_allocator
    from xllm_py.kv_transfer.kv_storage import KVCacheStorage, parse_dtype
    from xllm_py.model.kv_groups import kv_groups
    from xllm_py.model.loader import load_model
    from xllm_py.model.packed import pack_linears

    torch.manual_seed(config.seed)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_dir = resolve_model_dir(config.model)
    engine.model_dir = model_dir
    if config.tensor_parallel_size > 1:
        from xllm_py.parallel.executor import TPExecutor

        engine.tp = TPExecutor.start(config, model_dir)
        engine.model, engine.model_config = engine.tp.model, engine.tp.model_config
    else:
        engine.model, engine.model_config = load_model(model_dir, dtype=config.dtype,
                                                       device=config.device)
        if config.pack_weights:
            pack_linears(engine.model, weight_dtype=config.weight_dtype)
    engine.tokenizer = Tokenizer.from_dir(model_dir)
    mc = engine.model_config
    groups = engine.kv_groups = kv_groups([mc.layer_window(i) for i in range(mc.num_layers)])
    block_size = config.cache.block_size
    num_blocks = config.cache.num_blocks
    dtype = parse_dtype(config.dtype)
    num_kv_heads = engine.tp.num_local_kv_heads if engine.tp else mc.num_kv_heads
    if num_blocks is None:  # (TP: --kv-cache-memory-mb per rank)
        block_bytes = (2 * groups.num_slots * block_size * num_kv_heads * mc.head_dim
                       * torch.finfo(dtype).bits // 8)
        num_blocks = max(2, config.cache.kv_cache_memory_bytes // block_bytes)
    engine.storage = KVCacheStorage(groups.num_slots, num_blocks, block_size, num_kv_heads,
                                    mc.head_dim, dtype, device=config.device,
                                    allocator=pool_allocator(config))
    if engine.tp:
        engine.tp.init_kv(num_blocks)
    engine.runner = ModelRunner(engine.model, groups.layer_caches(engine.storage.layer_caches()),
                                block_size, config.device)
    engine.sampler = Sampler()
    return num_blocks
