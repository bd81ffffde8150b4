"""server.drain on a real engine (no cluster): it waits for the requests in flight, also
one submitted but not yet picked up, and a second signal or the timeout ends it."""
from __future__ import annotations

import asyncio
import types

import pytest

from xllm_py.api.errors import BackendBusyError
from xllm_py.config import EngineConfig
from xllm_py.engine.async_engine import AsyncEngine
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.engine.server import DRAIN_SETTLE_S, drain, in_flight
from xllm_py.sampling_params import SamplingParams
from tests.unit.sinks import DoneSink

pytestmark = pytest.mark.integration  # a real engine


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(EngineConfig(model="tiny"))
    engine.start()
    yield engine
    engine.stop()


def _submit(engine: LLMEngine, rid: str, max_tokens: int) -> DoneSink:
    sink = DoneSink()
    engine.submit(EngineRequest(rid, [5, 6, 7, 8], SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0), sink))
    return sink


async def test_drain_waits_for_the_requests_in_flight(engine):
    backend = AsyncEngine(engine)
    sink = _submit(engine, "r1", 64)
    assert in_flight(engine, None) >= 1  # queued for the engine thread: already counted
    assert await drain(engine, backend, None, 30.0, asyncio.Event())
    assert sink.done.is_set() and in_flight(engine, None) == 0
    assert backend.draining and not backend.check_ready()[0] and backend.check_live()[0]
    with pytest.raises(BackendBusyError, match="draining"):
        await anext(backend.generate(type("Req", (), {"request_id": "r2", "stream": True,
                                                      "prompt_token_ids": [5]})()))


async def test_second_signal_or_timeout_ends_the_drain(engine):
    sink = _submit(engine, "long-1", 1500)
    force = asyncio.Event()
    asyncio.get_running_loop().call_later(0.3, force.set)
    assert not await asyncio.wait_for(drain(engine, AsyncEngine(engine), None, 30.0, force), 5)
    assert not sink.done.is_set()
    assert not await asyncio.wait_for(
        drain(engine, AsyncEngine(engine), None, 0.3, asyncio.Event()), 5)
    engine.abort("long-1")
    assert await asyncio.wait_for(drain(engine, AsyncEngine(engine), None, 30.0,
                                        asyncio.Event()), 5 + DRAIN_SETTLE_S)


def test_outputs_no_service_answered_yet_keep_the_engine_in_flight(engine):
    """In a cluster, an idle engine whose last outputs are still on their way to the
    service is not drained yet: leaving then would make the service move finished
    streams (GenerationsReporter.num_unsent)."""
    reporter = types.SimpleNamespace(num_unsent=lambda: 3)
    cluster = types.SimpleNamespace(pd=None, reporter=reporter)
    assert in_flight(engine, None) == 0
    assert in_flight(engine, cluster) == 1
    reporter.num_unsent = lambda: 0
    assert in_flight(engine, cluster) == 0
