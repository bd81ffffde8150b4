"""Predicted Outputs in the engine without a model: the lookup of the output's end in the
prediction, the Speculator proposing from a prediction with and without a configured
method, and the scheduler's verify step reporting the prediction's kept and rejected
guesses."""
from __future__ import annotations

import dataclasses

from tests.unit.sched_utils import DEFAULTS
from xllm_py.config import CacheConfig, SchedulerConfig
from xllm_py.speculative_config import SpeculativeConfig
from xllm_py.engine.scheduler import ContinuousScheduler
from xllm_py.engine.spec_decode import speculator as spec_mod
from xllm_py.engine.spec_decode.prediction import PredictionLookup
from xllm_py.engine.spec_decode.speculator import Speculator
from xllm_py.request import Request
from xllm_py.sampling_params import SamplingParams

PREDICTION = [10, 11, 12, 13, 14, 11, 12, 15, 16, 17]


def _req(rid: str, prompt: list[int], **params) -> Request:
    params.setdefault("max_tokens", 32)
    params.setdefault("temperature", 0.0)
    params.setdefault("ignore_eos", True)
    return Request(rid, prompt, SamplingParams(**params))


def test_lookup_starts_at_the_prediction_and_follows_the_output():
    lookup = PredictionLookup(PREDICTION)
    assert lookup.propose([], 3) == [10, 11, 12]
    assert lookup.propose([10, 11], 3) == [12, 13, 14]
    # (11, 12) occurs twice: the occurrence after the last guess's place is taken
    assert lookup.propose([10, 11, 12, 13, 14, 11, 12], 8) == [15, 16, 17]
    assert lookup.propose([99], 3) == []  # nowhere in the prediction
    assert lookup.propose([17], 3) == []  # the prediction's end: nothing follows
    assert PredictionLookup([]).propose([], 3) == [] and lookup.propose([10], 0) == []


def test_lookup_resyncs_after_an_insertion():
    lookup = PredictionLookup(PREDICTION)
    # the output inserted 50, 51 after 13, then went on with the prediction's 14
    assert lookup.propose([10, 11, 12, 13, 50, 51], 3) == []
    assert lookup.propose([10, 11, 12, 13, 50, 51, 14], 3) == [11, 12, 15]


def test_a_prediction_proposes_without_a_configured_method():
    spec = Speculator(None)
    plain = _req("a", [1, 2, 3])
    predicted = _req("b", [1, 2, 3], prediction_token_ids=PREDICTION)
    scored = _req("c", [1, 2, 3], prediction_token_ids=PREDICTION, logprobs=1)
    handover = Request("h", [1, 2, 3], SamplingParams(max_tokens=32, temperature=0.0,
                                                      prediction_token_ids=PREDICTION),
                       remote_decode=True)  # (a PD prefill's: one token, never guesses)
    predicted.append_output_token(10)
    assert spec.propose([plain, predicted, scored, handover], 256) == {
        "b": PREDICTION[1:1 + spec_mod.PREDICTION_TOKENS],
        "c": PREDICTION[:spec_mod.PREDICTION_TOKENS]}
    # with a method, the prediction still wins for its request; the others use the method
    spec = Speculator(SpeculativeConfig(prompt_lookup_min=1))
    repeating = _req("d", [5, 6, 7, 5, 6])
    assert spec.propose([predicted, repeating], 256) == {
        "b": PREDICTION[1:1 + spec_mod.PREDICTION_TOKENS], "d": [7, 5, 6]}


def test_verify_step_reports_the_predictions_kept_and_rejected_guesses():
    sched = ContinuousScheduler(
        SchedulerConfig(**{k: v for k, v in {**DEFAULTS, "num_blocks": 65}.items()
                           if k in {f.name for f in dataclasses.fields(SchedulerConfig)}}),
        CacheConfig(block_size=4, num_blocks=65, enable_prefix_caching=True), 65,
        speculator=Speculator(None))
    req = _req("a", [1, 2, 3, 4, 5], prediction_token_ids=PREDICTION)
    sched.add_request(req)
    sched.update_from_output(sched.schedule(), {"a": 10})  # the first token: no guess
    out = sched.schedule()
    assert out.seqs[0].spec_token_ids == PREDICTION[1:9]
    # The model agrees with 11 and 12, then says 40: 2 kept, 6 rejected.
    [upd] = sched.update_from_output(out, {"a": 11}, {"a": [12, 40]})
    assert upd.new_token_ids == [11, 12, 40] and upd.predicted == (2, 6)
    assert sched.speculator.stats["prediction"].proposed == 8
    assert "ngram" not in sched.speculator.stats
    sched.abort_request("a")
    stopped = _req("b", [1, 2, 3, 4, 5], prediction_token_ids=PREDICTION, stop_token_ids=[12])
    sched.add_request(stopped)
    sched.update_from_output(sched.schedule(), {"b": 10})
    # The model agrees with 11, 12 and 13, but 12 ends the output: 2 of it in the output.
    [upd] = sched.update_from_output(sched.schedule(), {"b": 11}, {"b": [12, 13, 40]})
    assert upd.new_token_ids == [11, 12] and upd.finished and upd.predicted == (2, 6)
    assert sched.kv.block_pool.num_used_blocks == 0


def test_a_prediction_outside_the_vocabulary_is_refused_at_intake():
    """Guesses are the model's input: an id past the vocabulary (possible over gRPC,
    where no tokenizer made it) is refused when the request arrives, not in a step."""
    from xllm_py.engine.engine_request import EngineRequest, admit

    params = SamplingParams(max_tokens=4, prediction_token_ids=[5, 1000])
    error = admit(EngineRequest("r", [1, 2], params, sink=None), None, [2], 1000, 64,
                  "at most {}")
    assert "token id 1000 (logit_bias / allowed_token_ids / prediction) is out of range" in error
