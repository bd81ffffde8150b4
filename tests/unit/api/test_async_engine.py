"""AsyncEngine's admission control, and the request's SamplingParams reaching the engine as
they are, with a stub engine."""
from __future__ import annotations

import types

import pytest

from xllm_py.api.backend import GenerateRequest
from xllm_py.api.errors import TooManyRequestsError
from xllm_py.engine.async_engine import AsyncEngine
from xllm_py.sampling_params import SamplingParams


def stub_engine(num_waiting: int):
    submitted = []
    return types.SimpleNamespace(
        config=types.SimpleNamespace(model="/models/qwen3-0.6b/"), max_model_len=2048,
        scheduler=types.SimpleNamespace(num_waiting=num_waiting,
                                        kv=types.SimpleNamespace(held_blocks=dict)),
        submit=submitted.append, abort=lambda rid: None, submitted=submitted, tiering=None,
        speculator=None)


async def test_full_queue_answers_429_and_submits_nothing():
    engine = stub_engine(num_waiting=8)
    backend = AsyncEngine(engine, max_waiting=8)
    assert backend.model_name == "qwen3-0.6b"
    with pytest.raises(TooManyRequestsError, match="8 waiting requests") as info:
        async for _ in backend.generate(GenerateRequest(request_id="r", prompt_token_ids=[1])):
            pass
    assert info.value.status_code == 429 and "Retry-After" in info.value.headers()
    assert engine.submitted == []


async def test_the_requests_sampling_params_reach_the_engine_as_they_are():
    import asyncio

    engine = stub_engine(num_waiting=0)
    params = SamplingParams(n=2, temperature=0.0, top_k=5, seed=9, max_tokens=7)
    gen = AsyncEngine(engine).generate(GenerateRequest("r", [1], sampling=params))
    with pytest.raises(asyncio.TimeoutError):  # (the stub engine never answers)
        await asyncio.wait_for(gen.__anext__(), 0.05)
    await gen.aclose()
    (submitted,) = engine.submitted
    assert submitted.params is params


async def test_non_streaming_requests_get_a_final_only_sink():
    import asyncio

    engine = stub_engine(num_waiting=0)
    backend = AsyncEngine(engine)
    for stream in (False, True):
        gen = backend.generate(GenerateRequest(request_id=f"r{stream}", prompt_token_ids=[1],
                                               stream=stream))
        with pytest.raises(asyncio.TimeoutError):  # (the stub engine never answers)
            await asyncio.wait_for(gen.__anext__(), 0.05)
        await gen.aclose()
    assert [r.sink.final_only for r in engine.submitted] == [True, False]


# -- metrics: one registry per engine process, rendered by prometheus_client -----------------


def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


async def test_engine_metrics_page_is_one_registry_with_the_old_names():
    import httpx

    from xllm_py.api.app import build_app

    engine = stub_engine(num_waiting=0)
    engine.stats = lambda: dict(running=2, waiting=3, kv_blocks_used=5, kv_blocks_total=64,
                                prefix_hit_tokens=7, generated_tokens=11)
    backend = AsyncEngine(engine)
    app = build_app(backend)
    assert app.state.metrics.registry is backend.metrics_registry
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as c:
        text = (await c.get("/metrics")).text
    samples = _samples(text)
    for name, value in (("xllm_requests_running", 2), ("xllm_requests_waiting", 3),
                        ("xllm_kv_cache_blocks_used", 5), ("xllm_kv_cache_blocks_total", 64),
                        ("xllm_prefix_cache_hit_tokens_total", 7),
                        ("xllm_generation_tokens_total", 11)):
        assert samples[(name, ())] == value, name
    assert ("xllm_e2e_request_latency_seconds_count", ()) in samples  # the HTTP layer's
    assert "# TYPE xllm_requests_running gauge" in text


def test_kv_transfer_metrics_register_into_the_engine_registry_under_their_names():
    from prometheus_client import CollectorRegistry, generate_latest

    from xllm_py.kv_transfer.metrics import KVTransferMetrics

    m = KVTransferMetrics()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(m)
    m.observe_success("pull", 1000, 2, 0.003)
    m.observe_success("pull", 500, 1, 0.02)
    m.observe_success("push", 64, 1, 20.0)
    m.observe_failure("push", "timeout")
    ours = _samples(generate_latest(registry).decode())
    assert ours[("xllm_kv_transfer_bytes_total", (("op", "pull"), ("rank", "0")))] == 1500
    assert ours[("xllm_kv_transfer_blocks_total", (("op", "push"), ("rank", "0")))] == 1
    assert ours[("xllm_kv_transfer_failures_total",
                 (("op", "push"), ("rank", "0"), ("reason", "timeout")))] == 1
    assert ours[("xllm_kv_transfer_seconds_bucket", (("le", "0.005"), ("op", "pull"), ("rank", "0")))] == 1
    assert ours[("xllm_kv_transfer_seconds_bucket", (("le", "+Inf"), ("op", "push"), ("rank", "0")))] == 1
    assert ours[("xllm_kv_transfer_seconds_count", (("op", "pull"), ("rank", "0")))] == 2
