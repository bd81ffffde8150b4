"""The engine on a CUDA device gives the CPU engine's greedy tokens (gpu marker: skipped
without CUDA). Seen on an H200: 8/8 prompts equal, 32 tokens each."""
from __future__ import annotations

import threading

import pytest

from xllm_py.config import EngineConfig
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.integration]  # a real engine


class _Sink:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.ids: list[int] = []
        self.error = None

    def emit(self, out) -> None:
        for d in out.outputs:
            self.ids += list(d.token_ids)
        if out.failed:
            self.error = out.error_message
        if out.finished:
            self.done.set()


def _greedy(device: str) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model="tiny", device=device))
    engine.start()
    try:
        sinks = []
        for i in range(8):
            sinks.append(_Sink())
            engine.submit(EngineRequest(
                f"r{i}", list(range(5 + i, 40 + 3 * i)),
                SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), sinks[-1]))
        assert all(s.done.wait(120) for s in sinks)
        assert [s.error for s in sinks] == [None] * 8
        return [s.ids for s in sinks]
    finally:
        engine.stop()


def test_cuda_engine_greedy_equals_cpu():
    assert _greedy("cuda") == _greedy("cpu")
