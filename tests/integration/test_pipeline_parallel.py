"""Pipeline parallelism (parallel/pipeline.py) on a MIX engine: PP 2 and PP 3 with an
uneven split give the greedy tokens (and logprobs) of PP 1, on the Qwen and the Llama
family, with prompt chunks and decodes in the same steps; rank 0's KV pool holds only its
stage's layers; a hybrid model and a PD role are refused with the reason."""
from __future__ import annotations

import pytest

from tests.integration.test_tensor_parallel import _submit_all
from xllm_py.config import CacheConfig, EngineConfig, InstanceRole, SchedulerConfig
from xllm_py.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.integration

# 23 and 33 tokens: several chunks of a 16-token step, next to the others' decodes
PROMPTS = [list(range(40, 40 + n)) for n in (5, 8, 9, 23, 33)]


def _run(model: str, pp: int, partition=None) -> tuple[list, int]:
    engine = LLMEngine(EngineConfig(
        model=model, pipeline_parallel_size=pp, pp_layer_partition=partition, num_threads=1,
        cache=CacheConfig(block_size=8),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8)))
    engine.start()
    try:
        sinks = _submit_all(engine, PROMPTS, f"pp{pp}-")
        return [(s.token_ids, s.logprobs) for s in sinks], engine.storage.num_layers
    finally:
        engine.stop()


@pytest.mark.parametrize("model,pp,partition,rank0_layers", [
    ("tiny", 2, None, 2), ("tiny", 3, (2, 1, 1), 1), ("tiny-llama", 2, (1, 3), 3)])
def test_pipeline_stages_equal_one_process(model, pp, partition, rank0_layers):
    ref, layers = _run(model, 1)
    assert layers == 4
    got, layers = _run(model, pp, partition)
    assert layers == rank0_layers  # the last stage's pool: its layers only
    for (tokens, logprobs), (want, want_lp) in zip(got, ref):
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(logprobs, want_lp)) < 1e-4


def test_what_pipeline_parallelism_does_not_run_is_refused():
    with pytest.raises(ValueError, match="MIX engines only"):
        EngineConfig(model="tiny", pipeline_parallel_size=2, role=InstanceRole.PREFILL)
    with pytest.raises(ValueError, match="tensor parallel size 1"):
        EngineConfig(model="tiny", pipeline_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="does not split 4 layers"):
        LLMEngine(EngineConfig(model="tiny", pipeline_parallel_size=2,
                               pp_layer_partition=(1, 1)))
