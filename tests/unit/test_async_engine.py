"""AsyncEngine's admission control and request -> SamplingParams mapping, with a stub engine."""
from __future__ import annotations

import types

import pytest

from xllm_py.api.backend import GenerateRequest
from xllm_py.api.errors import BackendBusyError
from xllm_py.engine.async_engine import AsyncEngine, sampling_params_from


def stub_engine(num_waiting: int):
    submitted = []
    return types.SimpleNamespace(
        config=types.SimpleNamespace(model="/models/qwen3-0.6b/"), max_model_len=2048,
        scheduler=types.SimpleNamespace(num_waiting=num_waiting),
        submit=submitted.append, abort=lambda rid: None, submitted=submitted)


async def test_full_queue_answers_busy_and_submits_nothing():
    engine = stub_engine(num_waiting=8)
    backend = AsyncEngine(engine, max_waiting=8)
    assert backend.model_name == "qwen3-0.6b"
    with pytest.raises(BackendBusyError, match="8 waiting requests"):
        async for _ in backend.generate(GenerateRequest(request_id="r", prompt_token_ids=[1])):
            pass
    assert engine.submitted == []


def test_generate_request_maps_to_sampling_params():
    p = sampling_params_from(GenerateRequest(
        request_id="r", prompt_token_ids=[1], n=2, best_of=1, temperature=0.0, top_k=5,
        stop=["x"], logprobs=3, seed=9, max_tokens=7))
    assert (p.n, p.best_of, p.temperature, p.top_k, p.stop, p.logprobs, p.seed, p.max_tokens) == \
        (2, None, 0.0, 5, ["x"], 3, 9, 7)
    assert sampling_params_from(GenerateRequest(request_id="r", prompt_token_ids=[1], n=1,
                                                best_of=3)).best_of == 3


def test_every_request_field_reaches_sampling_params():
    """GenerateRequest -> SamplingParams carries every field of REQUEST_FIELDS (the copies
    of the list had drifted: echo and prompt_logprobs were dropped)."""
    from xllm_py.sampling_params import REQUEST_FIELDS

    values = dict(n=2, best_of=3, temperature=0.5, top_p=0.75, top_k=7, min_p=0.125,
                  frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.25, seed=11,
                  max_tokens=9, min_tokens=2, stop=["x"], stop_token_ids=[5], ignore_eos=True,
                  logprobs=2, prompt_logprobs=1, echo=True, skip_special_tokens=False,
                  include_stop_str_in_output=True)
    assert set(values) == set(REQUEST_FIELDS), "give the new field a value here"
    p = sampling_params_from(GenerateRequest(request_id="r", prompt_token_ids=[1], **values))
    assert {name: getattr(p, name) for name in REQUEST_FIELDS} == values


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
