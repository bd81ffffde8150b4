"""Loading an engine's model: weights (one process, or TP ranks: xllm_py/parallel/),
tokenizer, KV pool, model runner and sampler, returned as a `LoadedModel` the engine is
built from. Torch is imported here, not by the engine loop (a simulated engine,
xllm_py/sim/engine.py, builds its LoadedModel without it).

Stages: seed + threads -> model dir -> model (packed weights, or TP shards) -> tokenizer ->
KV pool size (--num-blocks, else `kv_pool_bytes` per rank) -> storage -> runner.
"""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable

from xllm_py.config import CacheConfig, EngineConfig
from xllm_py.engine.engine_request import resolve_model_dir
from xllm_py.engine.kv_tiering_setup import available_memory_bytes
from xllm_py.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from xllm_py.model.config import ModelConfig
    from xllm_py.model.kv_groups import KVGroups
    from xllm_py.parallel.executor import TPExecutor

# A host engine's KV pool when neither --num-blocks nor kv_cache_memory_mb sets it: this
# much, at most a quarter of the memory available once the weights are loaded (the KV
# tiers below the pool take the host memory beyond it: kv_tiering_setup.py). On a GPU:
# this share of the device memory free once the weights are loaded (the rest: a step's
# activations).
HOST_POOL_BYTES = 256 << 20
DEVICE_POOL_SHARE = 0.9


@dataclasses.dataclass
class LoadedModel:
    """What an engine is built from (LLMEngine(config, loaded))."""
    model_dir: str
    model_config: ModelConfig
    tokenizer: Tokenizer
    storage: Any  # the KV pool (KVCacheStorage; simulated: SimKVStorage)
    runner: Any  # execute_step(seqs) -> StepLogits (ModelRunner; simulated: SimulatedRunner)
    sampler: Callable  # sampler(logits, rows, masks=None) -> SamplerOutput
    num_blocks: int
    kv_groups: KVGroups | None = None  # the model's KV groups (None: simulated)
    model: Any = None  # the torch module (None: simulated)
    tp: TPExecutor | None = None  # TP > 1: the other ranks, behind `model`
    # What a step is timed by for the latency profile (self_profile.py): the engine
    # thread's CPU time where it computes alone, else the wall clock.
    step_clock: Callable[[], float] = time.perf_counter


def kv_pool_bytes(cache: CacheConfig, free_device_bytes: int | None) -> int:
    """The KV pool's memory (per rank): kv_cache_memory_mb where given, else derived
    (HOST_POOL_BYTES above); `free_device_bytes` None: a host pool."""
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    if free_device_bytes is not None:
        return int(DEVICE_POOL_SHARE * free_device_bytes)
    available = available_memory_bytes()
    return min(HOST_POOL_BYTES, available // 4) if available else HOST_POOL_BYTES


def load_model(config: EngineConfig) -> LoadedModel:
    """The model, tokenizer, KV pool, runner and sampler of `config`. A hybrid model's
    pool holds kv_groups.num_slots cache tensors, not one per layer (model/kv_groups.py)."""
    import torch

    from xllm_py.engine.model_runner import ModelRunner
    from xllm_py.engine.sampler import Sampler
    from xllm_py.kv_transfer.factory import pool_allocator
    from xllm_py.kv_transfer.kv_storage import KVCacheStorage, parse_dtype
    from xllm_py.model.kv_groups import kv_groups
    from xllm_py.model.loader import load_model as load_weights
    from xllm_py.model.packed import pack_linears

    torch.manual_seed(config.seed)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_dir = resolve_model_dir(config.model)
    tp = None
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        from xllm_py.parallel.executor import TPExecutor

        tp = TPExecutor.start(config, model_dir)
        model, mc = tp.model, tp.model_config
    else:
        model, mc = load_weights(model_dir, dtype=config.dtype, device=config.device)
        if config.pack_weights:
            pack_linears(model, weight_dtype=config.weight_dtype)
    tokenizer = Tokenizer.from_dir(model_dir)
    # the scheduler's tables are the model's groups; a pipeline stage's pool holds the
    # slots of its layers only
    groups = kv_groups([mc.layer_window(i) for i in range(mc.num_layers)])
    pool = groups.stage(*tp.layers) if tp else groups
    block_size = config.cache.block_size
    num_blocks = config.cache.num_blocks
    dtype = parse_dtype(config.dtype)
    num_kv_heads = tp.num_local_kv_heads if tp else mc.num_kv_heads
    if num_blocks is None:
        free = (torch.cuda.mem_get_info(torch.device(config.device))[0]
                if str(config.device).startswith("cuda") else None)
        block_bytes = (2 * pool.num_slots * block_size * num_kv_heads * mc.head_dim
                       * torch.finfo(dtype).bits // 8)
        num_blocks = max(2, kv_pool_bytes(config.cache, free) // block_bytes)
    storage = KVCacheStorage(pool.num_slots, num_blocks, block_size, num_kv_heads,
                             mc.head_dim, dtype, device=config.device,
                             allocator=pool_allocator(config))
    if tp:
        tp.init_kv(num_blocks)
    runner = ModelRunner(model, pool.layer_caches(storage.layer_caches()), block_size,
                         config.device)
    alone = (str(config.device).startswith("cpu") and torch.get_num_threads() == 1
             and tp is None)  # (a core of its own: CPU time, which other load does not move)
    return LoadedModel(model_dir, mc, tokenizer, storage, runner,
                       Sampler(), num_blocks, kv_groups=groups, model=model, tp=tp,
                       step_clock=time.thread_time if alone else time.perf_counter)
