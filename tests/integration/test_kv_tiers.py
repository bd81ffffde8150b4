"""KV tiers below the pool (xllm_py/kv_tiers/, engine/kv_tiering.py) on MIX engines, on a
Llama and on a hybrid Gemma 3 (a 6-token window over blocks of 4: the sliding groups'
windows are stored and loaded), random checkpoints against transformers: a prompt whose
blocks the pool evicted comes back from host memory, from disk (also after a restart of
the engine), from the shared Mooncake Store (a real master and segment host; computed by
another engine), with the same greedy tokens as transformers; a corrupt disk file is a
miss, never wrong KV; two models sharing a store never read each other's blocks; a killed
master makes prompts be computed, exactly, and hits come back when it does. PD through
the tiers: test_kv_tiers_pd.py."""
from __future__ import annotations

import pathlib

import pytest
import torch

from tests.integration.test_tensor_parallel import _hf_greedy, _Sink
from tests.integration.tp_models import VOCAB, build_hf_model
from tests.waiting import wait_until_sync
from xllm_py.config import CacheConfig, EngineConfig, TierConfig
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

BLOCK = 4
POOL = 40  # blocks: a 50-token prompt and two 60-token fillers do not fit together
FAMILIES = ("llama-bias", "gemma3-kv1")


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    """(family, checkpoint dir, prompt, fillers, transformers' greedy tokens)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = build_hf_model(transformers, request.param, path)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, VOCAB, (50,), generator=g).tolist()
    fillers = [torch.randint(0, VOCAB, (60,), generator=g).tolist() for _ in range(3)]
    return request.param, path, prompt, fillers, _hf_greedy(hf, prompt)[0]


def _engine(path, tiers: TierConfig) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(path), num_threads=1, tiers=tiers,
                                    cache=CacheConfig(block_size=BLOCK, num_blocks=POOL)))
    engine.start()
    return engine


def _run(engine: LLMEngine, prompt: list[int], tag: str) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens not computed (pool and tiers)."""
    sink = _Sink()
    engine.submit(EngineRequest(tag, prompt, SamplingParams(max_tokens=10, temperature=0.0,
                                                            ignore_eos=True), sink))
    assert sink.done.wait(60), "request timed out"
    assert not sink.last.failed, sink.last.error_message
    return sink.token_ids, sink.last.num_cached_tokens


def _evict(engine: LLMEngine, fillers: list[list[int]]) -> None:
    for i, f in enumerate(fillers):
        _run(engine, f, f"filler{i}")
    engine.tiering.stack.flush()


def _hits(engine: LLMEngine, tier: str) -> int:
    return engine.tiering.stack.counters[tier].hits


def _full_hit(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_an_evicted_prefix_comes_back_from_a_local_tier(model, tier, tmp_path):
    family, path, prompt, fillers, expected = model
    tiers = TierConfig(host_bytes=(64 << 20) if tier == "host" else 0,
                       disk_dir=str(tmp_path), disk_bytes=(64 << 20) if tier == "disk" else 0)
    engine = _engine(path, tiers)
    try:
        assert _run(engine, prompt, "first") == (expected, 0)
        _evict(engine, fillers)
        assert engine.scheduler.kv.get_computed_blocks(_probe(prompt))[1] == 0  # gone from the pool
        assert _run(engine, prompt, "again") == (expected, _full_hit(prompt))
        assert _hits(engine, tier) > 0
        # (blocks held for a copy to the tiers go back after the engine's next turn)
        wait_until_sync(lambda: engine.stats()["kv_blocks_used"] == 0, 5)
    finally:
        engine.stop()


def _probe(prompt: list[int]):
    from xllm_py.request import Request

    return Request("probe", prompt)


def test_the_disk_tier_outlives_a_restart_and_a_corrupt_file_is_a_miss(model, tmp_path):
    family, path, prompt, fillers, expected = model
    tiers = TierConfig(host_bytes=0, disk_dir=str(tmp_path), disk_bytes=64 << 20)
    engine = _engine(path, tiers)
    try:
        assert _run(engine, prompt, "first") == (expected, 0)
        engine.tiering.stack.flush()
    finally:
        engine.stop()
    engine = _engine(path, tiers)  # a new process's view: an empty pool, the same disk
    try:
        assert _run(engine, prompt, "restart") == (expected, _full_hit(prompt))
        assert _hits(engine, "disk") > 0
    finally:
        engine.stop()
    files = sorted(pathlib.Path(tmp_path).rglob("*.kv"))
    assert files
    for f in files:  # every block: truncated or with a flipped byte
        raw = bytearray(f.read_bytes())
        if len(raw) % 2:
            raw[-1] ^= 0xFF
            f.write_bytes(bytes(raw))
        else:
            f.write_bytes(bytes(raw[:-7]))
    engine = _engine(path, tiers)
    try:
        assert _run(engine, prompt, "corrupt") == (expected, 0)
        assert engine.tiering.stack.disk.num_corrupt > 0
    finally:
        engine.stop()


def test_another_engine_loads_the_prefix_from_the_store(model, mooncake_store):
    family, path, prompt, fillers, expected = model
    tiers = TierConfig(host_bytes=0, disk_bytes=0, store=mooncake_store.master_addr,
                       store_metadata=mooncake_store.metadata)
    first, second = _engine(path, tiers), _engine(path, tiers)
    try:
        assert _run(first, prompt, f"{family}-p") == (expected, 0)
        first.tiering.stack.flush()
        assert _run(second, prompt, f"{family}-p") == (expected, _full_hit(prompt))
        assert _hits(second, "store") > 0 and _hits(second, "host") == 0
    finally:
        first.stop()
        second.stop()


def test_models_sharing_a_store_never_read_each_others_blocks(mooncake_store, tmp_path):
    """Same shapes, other weights: the keys differ, so the prompt is computed."""
    a, b = tmp_path / "a", tmp_path / "b"
    build_hf_model(transformers, "llama-bias", a)
    hf_b = build_hf_model(transformers, "qwen2-kv1", b)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (50,), generator=g).tolist()
    tiers = TierConfig(host_bytes=0, disk_bytes=0, store=mooncake_store.master_addr,
                       store_metadata=mooncake_store.metadata)
    first, second = _engine(a, tiers), _engine(b, tiers)
    try:
        _run(first, prompt, "a")
        first.tiering.stack.flush()
        assert _run(second, prompt, "b") == (_hf_greedy(hf_b, prompt)[0], 0)
        assert _hits(second, "store") == 0
    finally:
        first.stop()
        second.stop()


def test_a_killed_master_costs_compute_not_tokens(model, mooncake_store):
    """While the master is down every prompt is computed (exact, no error); once it is back
    (empty: its blocks died with it) what an engine computes is found by the other."""
    family, path, prompt, fillers, expected = model
    tiers = TierConfig(host_bytes=0, disk_bytes=0, store=mooncake_store.master_addr,
                       store_metadata=mooncake_store.metadata, store_timeout_s=1.0)
    first, second = _engine(path, tiers), _engine(path, tiers)
    try:
        mooncake_store.kill_master()
        for engine, tag in ((first, "down-1"), (second, "down-2")):
            assert _run(engine, prompt, f"{family}-{tag}") == (expected, 0)
        assert second.tiering.stack.store.num_errors > 0
        mooncake_store.start_master()
        g = torch.Generator().manual_seed(99)
        written = first.tiering.stack.counters["store"].written

        def put_one() -> bool:  # (the breaker lets a trial through after its retry time)
            put_one.prompt = torch.randint(0, VOCAB, (50,), generator=g).tolist()
            put_one.tokens = _run(first, put_one.prompt, f"{family}-{len(put_one.prompt)}-"
                                  f"{put_one.prompt[0]}")[0]
            first.tiering.stack.flush()
            return first.tiering.stack.counters["store"].written > written

        wait_until_sync(put_one, 30, step_s=0.5)
        assert _run(second, put_one.prompt, f"{family}-back") == (
            put_one.tokens, _full_hit(put_one.prompt))
    finally:
        if not mooncake_store.master_alive():
            mooncake_store.start_master()
        first.stop()
        second.stop()
