"""The engine's grammar path on the tiny model (in process): a migrated request (its
generated tokens at the end of its prompt) replays them into a fresh matcher and goes on
exactly where it was; tokens that do not fit the grammar refuse it; the grammar that
completes ends the sequence with "stop"; a request aborted while its grammar compiles
never runs."""
from __future__ import annotations

import pytest

from tests.unit.sinks import DoneSink
from xllm_py.config import EngineConfig
from xllm_py.engine.kv_connector import RecvDone
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.sampling_params import SamplingParams
from xllm_py.structured.spec import GrammarSpec

pytestmark = pytest.mark.integration  # a real engine

ENUMS = {"type": "object", "additionalProperties": False, "required": ["color", "size"],
         "properties": {"color": {"enum": ["red", "green", "blue"]},
                        "size": {"enum": ["S", "M", "L"]}}}


@pytest.fixture(scope="module")
def engine():
    e = LLMEngine(EngineConfig(model="tiny"))
    e.start()
    yield e
    e.stop()


def _run(engine, rid, prompt, params, **kw):
    sink = DoneSink()
    engine.submit(EngineRequest(rid, prompt, params, sink, **kw))
    assert sink.done.wait(60)
    last = sink.outputs[-1]
    tokens = [t for o in sink.outputs for d in o.outputs for t in d.token_ids]
    reasons = [d.finish_reason for o in sink.outputs for d in o.outputs if d.finish_reason]
    return last, tokens, reasons


def test_migrated_request_resumes_its_grammar_exactly(engine):
    spec = GrammarSpec.json_schema(ENUMS)
    prompt = engine.tokenizer.encode("Describe it:")
    params = SamplingParams(max_tokens=80, temperature=0.0, structured=spec)
    _, tokens, reasons = _run(engine, "whole", prompt, params)
    assert reasons == ["stop"] and len(tokens) > 6
    for k in (1, len(tokens) // 2, len(tokens) - 1):
        last, rest, reasons = _run(engine, f"moved-{k}", prompt + tokens[:k], params,
                                   generated_offset=k, usage_prompt_tokens=len(prompt))
        assert not last.failed and reasons == ["stop"]
        assert rest == tokens[k:], k


def test_generated_tokens_that_break_the_grammar_are_refused(engine):
    params = SamplingParams(max_tokens=10, temperature=0.0,
                            structured=GrammarSpec.choices(["yes", "no"]))
    bad = engine.tokenizer.encode("maybe", add_special_tokens=False)
    last, _, _ = _run(engine, "bad", engine.tokenizer.encode("Q:") + bad, params,
                      generated_offset=len(bad), usage_prompt_tokens=2)
    assert last.error_code == 400 and "do not match the grammar" in last.error_message


def test_abort_while_compiling_drops_the_request(engine):
    spec = GrammarSpec("regex", "[a-z]{1,5} abort-test")
    sink = DoneSink()
    engine.submit(EngineRequest("aborted", engine.tokenizer.encode("Hi"), SamplingParams(
        max_tokens=20, temperature=0.0, structured=spec), sink))
    engine.abort("aborted")
    # the next request of the same grammar runs (compiled once, cached)
    last, tokens, reasons = _run(engine, "after", engine.tokenizer.encode("Hi"), SamplingParams(
        max_tokens=20, temperature=0.0, structured=spec))
    assert reasons == ["stop"] and engine.tokenizer.decode(tokens).endswith(" abort-test")
    assert "aborted" not in engine.outputs and engine.scheduler.get_request("aborted#0") is None


def test_a_pd_decode_takes_the_prefills_first_token_only_if_it_fits_the_grammar(engine):
    """RemoteKV at RecvDone: the request joins the decode batch, and the grammar says
    whether the prefill's first token fits it: one that does not ends the request there
    (its blocks freed; the prefill, under the same grammar, never sends one); one that
    does goes on under the grammar to "stop"."""
    params = SamplingParams(max_tokens=10, temperature=0.0,
                            structured=GrammarSpec.choices(["yes", "no"]))
    prompt = engine.tokenizer.encode("Q:")
    bad = engine.tokenizer.encode("maybe", add_special_tokens=False)[0]
    good = engine.tokenizer.encode("yes", add_special_tokens=False)[0]

    def on_engine(fn):
        return engine.call(fn).result(10)

    def take_over(rid: str, first: int, sink: DoneSink) -> None:
        req = EngineRequest(rid, prompt, params, sink)
        assert on_engine(lambda: engine.remote_kv.add_remote(req)).block_ids
        on_engine(lambda: engine.remote_kv.apply(RecvDone(rid, [first], [None])))

    take_over("pd-bad", bad, DoneSink())
    assert on_engine(lambda: (engine.scheduler.requests, "pd-bad" in engine.outputs,
                              engine.scheduler.kv_usage())) == ({}, False, 0.0)
    sink = DoneSink()
    take_over("pd-good", good, sink)
    assert sink.done.wait(60)
    reasons = [d.finish_reason for o in sink.outputs for d in o.outputs if d.finish_reason]
    assert reasons == ["stop"] and not sink.outputs[-1].error_code
