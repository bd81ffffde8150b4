"""LLMEngine's batch window: requests reaching an idle engine close together start as one
step; the window ends early once a step's budget is waiting, is capped, and is off at 0.

The gap between arrivals that keeps the window open (llm_engine.BURST_GAP_S) is widened
here so that no assertion depends on how fast this machine schedules threads."""
from __future__ import annotations

import threading
import time

import pytest

from xllm_py.config import CacheConfig, EngineConfig, SchedulerConfig
from xllm_py.engine import llm_engine
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.sampling_params import SamplingParams

pytestmark = pytest.mark.integration  # a real engine


class _Sink:
    final_only = True

    def __init__(self) -> None:
        self.done = threading.Event()
        self.finished_at = 0.0

    def emit(self, output) -> None:
        if output.finished:
            self.finished_at = time.monotonic()
            self.done.set()


@pytest.fixture
def make_engine():
    engines: list[LLMEngine] = []

    def make(window_ms: float, max_num_seqs: int = 8) -> LLMEngine:
        engine = LLMEngine(EngineConfig(
            model="tiny", cache=CacheConfig(enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, batch_window_ms=window_ms)))
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


def _submit(engine: LLMEngine, name: str) -> _Sink:
    sink = _Sink()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.submit(EngineRequest(name, [5, 6, 7, 8], params, sink))
    return sink


def test_requests_arriving_close_together_start_as_one_step(make_engine, monkeypatch):
    monkeypatch.setattr(llm_engine, "BURST_GAP_S", 1.0)
    engine = make_engine(window_ms=30_000)
    first = _submit(engine, "a")
    time.sleep(0.1)  # well inside the gap
    second = _submit(engine, "b")
    assert first.done.wait(20) and second.done.wait(20)
    assert engine.num_steps == 1  # one token each: both prefilled in the same step


def test_without_a_window_the_first_request_starts_at_once(make_engine, monkeypatch):
    monkeypatch.setattr(llm_engine, "BURST_GAP_S", 1.0)
    engine = make_engine(window_ms=0)
    first = _submit(engine, "a")
    assert first.done.wait(20)
    second = _submit(engine, "b")
    assert second.done.wait(20)
    assert engine.num_steps == 2


def test_the_window_ends_once_a_step_is_waiting(make_engine, monkeypatch):
    monkeypatch.setattr(llm_engine, "BURST_GAP_S", 30.0)
    engine = make_engine(window_ms=60_000, max_num_seqs=2)
    t0 = time.monotonic()
    sinks = [_submit(engine, "a"), _submit(engine, "b")]  # max_num_seqs: a full step
    assert all(s.done.wait(20) for s in sinks)
    assert max(s.finished_at for s in sinks) - t0 < 20  # did not wait out the gap
    assert engine.num_steps == 1


def test_the_window_is_capped(make_engine, monkeypatch):
    monkeypatch.setattr(llm_engine, "BURST_GAP_S", 30.0)
    engine = make_engine(window_ms=300)
    t0 = time.monotonic()
    sink = _submit(engine, "a")
    assert sink.done.wait(20)
    assert 0.3 <= sink.finished_at - t0 < 20  # waited the window, not the gap


def test_negative_window_is_rejected() -> None:
    with pytest.raises(ValueError, match="batch_window_ms"):
        SchedulerConfig(batch_window_ms=-1)
