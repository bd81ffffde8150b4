"""SimulatedEngine: LLMEngine (scheduler, block pool, prefix cache, output processing,
and with --etcd everything ClusterNode runs) over a time model instead of the model.

Start-up (`load_simulated`: the LoadedModel the engine is built from): read the profile
-> the model directory's config.json and tokenizer (no weights) -> size the block pool as
the real engine would for that model (model_setup.kv_pool_bytes) -> SimKVStorage,
SimulatedRunner, SimulatedSampler. Imports no torch (tests/unit/sim/test_sim_engine.py checks
it).
"""
from __future__ import annotations

import logging
import pathlib
import subprocess
import sys

from xllm_py.config import EngineConfig
from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.engine.model_setup import LoadedModel, kv_pool_bytes
from xllm_py.model.config import ModelConfig
from xllm_py.model.tokenizer import Tokenizer
from xllm_py.sim.runner import SimulatedRunner, SimulatedSampler
from xllm_py.sim.storage import SimKVStorage
from xllm_py.sim.time_model import TimeModel

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def sim_model_dir(model: str) -> str:
    """A model directory for config.json and the tokenizer. A built-in tiny model is
    built (once per cache) by a child process, so that this one never imports torch."""
    if not model.startswith("tiny") or pathlib.Path(model).is_dir():
        return model
    code = f"from xllm_py.model.tiny import ensure_tiny_model; print(ensure_tiny_model({model!r}))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=600)
    return out.stdout.strip().splitlines()[-1]


def emitted_vocab(tokenizer: Tokenizer, vocab_size: int, eos: list[int]) -> list[int]:
    """Tokens the simulated model emits: every token but the special ones (no EOS, so a
    request runs to its max_tokens, as benchmarks want)."""
    banned = set(tokenizer.all_special_ids) | set(eos)
    return [t for t in range(min(vocab_size, tokenizer.vocab_size)) if t not in banned]


def load_simulated(config: EngineConfig, burn_cpu: bool = False) -> LoadedModel:
    """The simulated model of `config` (the setting simulate: PROFILE): the real tokenizer and
    config.json, a pool of tokens, the time model's runner (spending its time on the CPU
    with `burn_cpu`, else sleeping)."""
    time_model = TimeModel.load(config.simulate or "")
    model_dir = sim_model_dir(config.model)
    mc = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    block_size = config.cache.block_size
    num_blocks = config.cache.num_blocks
    if num_blocks is None:  # the real engine's pool for this model and memory
        block_bytes = (2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim
                       * _DTYPE_BYTES.get(config.dtype, 4))
        num_blocks = max(2, kv_pool_bytes(config.cache, None) // block_bytes)
    storage = SimKVStorage(num_blocks, block_size, mc.num_layers, mc.num_kv_heads,
                           mc.head_dim, config.dtype)
    eos = list(mc.eos_token_ids or []) + list(tokenizer.eos_token_ids or [])
    runner = SimulatedRunner(time_model, storage, emitted_vocab(tokenizer, mc.vocab_size, eos),
                             burn_cpu=burn_cpu)
    logger.info("simulated engine: time model %s (prefill %.3f ms/token, decode %.2f ms "
                "+ %.3f ms/seq)", config.simulate, time_model.prefill_ms_per_token,
                time_model.decode_base_ms, time_model.decode_ms_per_seq)
    return LoadedModel(model_dir, mc, tokenizer, storage, runner, SimulatedSampler(),
                       num_blocks)


class SimulatedEngine(LLMEngine):
    """LLMEngine over `load_simulated(config)`: no sampling rows (the simulated model
    picks the tokens), its runner's KV misses among the stats."""

    def __init__(self, config: EngineConfig, burn_cpu: bool = False) -> None:
        super().__init__(config, load_simulated(config, burn_cpu))

    def _sampling_row(self, request) -> None:
        return None  # (the simulated model picks the tokens: no sampling parameters)

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s["sim_kv_misses"] = self.runner.num_kv_misses
        return s
