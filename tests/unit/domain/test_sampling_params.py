import pytest

from xllm_py.sampling_params import SamplingParams, SamplingParamsError


def test_defaults_are_valid_and_not_greedy():
    p = SamplingParams()
    assert p.n == 1 and p.max_tokens is None and p.logprobs is None
    assert p.stop == [] and p.eos_token_ids == []
    assert p.is_greedy is False


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy is True
    assert SamplingParams(temperature=0.5).is_greedy is False


def test_stop_string_is_wrapped_in_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"n": 0}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),  # generating nothing needs echo or prompt_logprobs
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -101}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: "1"}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"n": True}, "n"),
    ],
)
def test_invalid_values_name_the_parameter(kwargs, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)
    assert param in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1}, {"top_k": 0}, {"top_k": 1}, {"top_p": 1.0}, {"min_p": 0.0},
        {"frequency_penalty": -2.0}, {"presence_penalty": 2.0}, {"logprobs": 0},
        {"logprobs": 20}, {"n": 2, "best_of": 2}, {"seed": -5}, {"max_tokens": 1, "min_tokens": 1},
        {"max_tokens": 0, "echo": True}, {"max_tokens": 0, "prompt_logprobs": 0},
        {"logit_bias": {0: -100, 5: 100.0}},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_validate_catches_later_mutation():
    params = SamplingParams()
    params.top_p = 2.0
    with pytest.raises(SamplingParamsError) as info:
        params.validate()
    assert info.value.param == "top_p"


def test_logit_bias_string_keys_become_token_ids():
    assert SamplingParams(logit_bias={"5": 100, "12": -1.5}).logit_bias == {5: 100, 12: -1.5}
