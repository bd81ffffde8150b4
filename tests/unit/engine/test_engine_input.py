"""LLMEngine refuses a prompt it cannot run (400 to that request) without failing the
other requests of the step it would have joined (requests can arrive over gRPC, past
the HTTP layer's checks)."""
from __future__ import annotations

import threading

import pytest

from xllm_py.config import EngineConfig
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.sampling_params import SamplingParams

pytestmark = pytest.mark.integration  # a real engine


class _Sink:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.last = None

    def emit(self, output) -> None:
        if output.finished:
            self.last = output
            self.done.set()


def test_out_of_vocabulary_prompt_is_refused_alone():
    engine = LLMEngine(EngineConfig(model="tiny"))
    engine.start()
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        vocab = engine.model_config.vocab_size
        bad, good, negative = _Sink(), _Sink(), _Sink()
        engine.submit(EngineRequest("bad", [5, vocab], params, bad))
        engine.submit(EngineRequest("neg", [-1, 5], params, negative))
        engine.submit(EngineRequest("good", [5, 6, 7], params, good))
        assert bad.done.wait(30) and good.done.wait(30) and negative.done.wait(30)
        assert bad.last.error_code == 400 and str(vocab) in bad.last.error_message
        assert negative.last.error_code == 400
        assert not good.last.failed and good.last.num_generated_tokens == 3
    finally:
        engine.stop()
