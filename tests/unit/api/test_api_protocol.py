"""Request parsing and validation of the OpenAI protocol models (no server)."""
import json

import pytest

from xllm_py.api.errors import InvalidRequestError
from xllm_py.api.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from xllm_py.api.testing import FakeTokenizer


def _parse(cls, **body):
    return parse_request(cls, json.dumps(body).encode())


def test_prompt_forms_each_element_is_a_prompt():
    assert _parse(CompletionRequest, prompt="hi").prompt_list() == ["hi"]
    assert _parse(CompletionRequest, prompt=[5, 6]).prompt_list() == [[5, 6]]
    assert _parse(CompletionRequest, prompt=["a", "b"]).prompt_list() == ["a", "b"]
    assert _parse(CompletionRequest, prompt=[[1], [2, 3]]).prompt_list() == [[1], [2, 3]]


def test_unknown_fields_ignored_and_defaults_converted():
    req = _parse(CompletionRequest, prompt="SECRET", foo=1, top_k=0, stop="s", logprobs=2)
    gen = req.to_generate_request(
        "cmpl-1", [1, 2], prompt_text="SECRET", max_tokens=5, x_request_id="t", arrival_time=0.0
    )
    s = gen.sampling
    assert (s.top_k, s.stop, s.logprobs, s.best_of, s.temperature, s.max_tokens) == \
        (-1, ["s"], 2, None, 1.0, 5)
    assert "SECRET" not in gen.anon_repr()


def test_generate_request_carries_sampling_params_and_no_copy_of_their_fields():
    """The sampling values travel as the one SamplingParams; GenerateRequest spells none of
    its fields again."""
    import dataclasses

    from xllm_py.api.backend import GenerateRequest
    from xllm_py.sampling_params import REQUEST_FIELDS, SamplingParams

    names = {f.name for f in dataclasses.fields(GenerateRequest)}
    assert not names & {f.name for f in dataclasses.fields(SamplingParams)}
    assert "eos_token_ids" not in REQUEST_FIELDS  # the engine's own
    assert GenerateRequest("r", [1]).sampling == SamplingParams()


def test_every_client_sampling_field_reaches_the_sampling_params():
    """Each field of REQUEST_FIELDS set in the HTTP body is in the GenerateRequest's
    SamplingParams (a field the mapping forgot would keep its default)."""
    from xllm_py.sampling_params import REQUEST_FIELDS
    from xllm_py.structured.spec import GrammarSpec

    body = dict(prompt="x", n=2, best_of=3, temperature=0.5, top_p=0.75, top_k=7, min_p=0.125,
                frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.25, seed=11,
                max_tokens=9, min_tokens=2, stop=["x"], stop_token_ids=[5], ignore_eos=True,
                logprobs=2, prompt_logprobs=3, echo=True, skip_special_tokens=False,
                include_stop_str_in_output=True, logit_bias={"5": 2.5},
                structured_outputs={"regex": "[ab]+"}, allowed_token_ids=[5, 6],
                bad_words=["ab"], prediction={"type": "content", "content": "xy"})
    expected = {k: v for k, v in body.items()
                if k not in ("prompt", "structured_outputs", "bad_words", "prediction")}
    expected.update(logit_bias={5: 2.5}, structured=GrammarSpec("regex", "[ab]+"),
                    bad_words_token_ids=[[97, 98], [32, 97, 98]],  # "ab" and " ab"
                    prediction_token_ids=[120, 121])
    assert set(expected) == set(REQUEST_FIELDS), "give the new field a value here"
    req = _parse(CompletionRequest, **body)
    req.apply_tokenizer(FakeTokenizer())
    gen = req.to_generate_request(
        "r", [1], prompt_text=None, max_tokens=9, x_request_id=None, arrival_time=0.0)
    assert {name: getattr(gen.sampling, name) for name in REQUEST_FIELDS} == expected


def test_sampling_params_own_refusal_is_a_400():
    req = _parse(CompletionRequest, prompt="x", repetition_penalty=1e5)  # positive, but
    with pytest.raises(InvalidRequestError) as info:                  # past float32's room
        req.to_generate_request("r", [1], prompt_text=None, max_tokens=4, x_request_id=None,
                                arrival_time=0.0)
    assert info.value.param == "repetition_penalty"


def test_sampling_fields_name_only_what_the_client_set():
    req = _parse(CompletionRequest, prompt="x", temperature=0.0, top_k=4, echo=True, n=2,
                 stop=["a", ""], stop_token_ids=[7], logprobs=0, max_tokens=9)
    assert req.sampling_fields() == {
        "n": 2, "temperature": 0.0, "top_k": 4, "min_tokens": 0, "stop": ["a"],
        "stop_token_ids": [7], "ignore_eos": False, "logprobs": 0, "echo": True,
        "skip_special_tokens": True, "include_stop_str_in_output": False,
        "prompt_logprobs": 0}  # echo + logprobs: the prompt tokens' own logprobs
    scored = _parse(CompletionRequest, prompt="x", logprobs=1, prompt_logprobs=3,
                    logit_bias={"5": 100, " 7": -2.5})
    fields = scored.sampling_fields()
    assert (fields["logprobs"], fields["prompt_logprobs"]) == (1, 3)
    assert fields["logit_bias"] == {5: 100.0, 7: -2.5}
    chat = _parse(ChatCompletionRequest, messages=[{"role": "user", "content": "a"}],
                  logprobs=True, top_logprobs=3, best_of=2)
    fields = chat.sampling_fields()
    assert (fields["logprobs"], fields["best_of"], "echo" in fields) == (3, 2, False)


def test_chat_max_completion_tokens_and_logprobs():
    req = _parse(
        ChatCompletionRequest,
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_tokens=9, max_completion_tokens=3, logprobs=True, top_logprobs=4,
    )
    assert req.requested_max_tokens() == 3
    assert req.num_logprobs() == 4
    assert req.template_messages() == [{"role": "user", "content": "a\nb"}]
    assert _parse(ChatCompletionRequest, messages=[{"role": "user", "content": "a"}]).num_logprobs() is None


@pytest.mark.parametrize(
    "cls, body, param",
    [
        (CompletionRequest, {"prompt": "x", "temperature": -0.5}, "temperature"),
        (CompletionRequest, {"prompt": "x", "n": 0}, "n"),
        (CompletionRequest, {"prompt": "x", "top_p": 0}, "top_p"),
        (CompletionRequest, {"prompt": "x", "top_p": 1.5}, "top_p"),
        (CompletionRequest, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (CompletionRequest, {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        (CompletionRequest, {"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of"),
        (CompletionRequest, {"prompt": "x", "temperature": "hot"}, "temperature"),
        (CompletionRequest, {"prompt": "", "max_tokens": 2}, "prompt"),
        (CompletionRequest, {"prompt": []}, "prompt"),
        (CompletionRequest, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        (ChatCompletionRequest, {"messages": []}, "messages"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 30,
                                 "logprobs": True}, "top_logprobs"),
        (ChatCompletionRequest, {"messages": "hello"}, "messages"),
    ],
)
def test_invalid_values_name_the_param(cls, body, param):
    with pytest.raises(InvalidRequestError) as info:
        parse_request(cls, json.dumps(body).encode())
    assert info.value.status_code == 400
    assert info.value.param == param
    assert info.value.to_dict()["error"]["type"] == "invalid_request_error"


def test_malformed_json_and_non_object():
    for raw in (b"{bad", b"", b"[1, 2]"):
        with pytest.raises(InvalidRequestError) as info:
            parse_request(CompletionRequest, raw)
        assert info.value.status_code == 400


def test_image_parts_rejected():
    req = _parse(ChatCompletionRequest, messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(InvalidRequestError) as info:
        req.template_messages()
    assert info.value.param == "messages"


def test_offline_reaches_the_generate_request():
    for cls, extra in ((CompletionRequest, {"prompt": "x"}),
                       (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})):
        for offline in (True, False):
            req = _parse(cls, offline=offline, **extra)
            gen = req.to_generate_request("r", [1], prompt_text=None, max_tokens=4,
                                          x_request_id=None, arrival_time=0.0)
            assert gen.offline is offline


def test_prediction_is_openais_shape_or_a_400():
    text = [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]
    for content, ids in (("abc", [97, 98, 99]), (text, [97, 98, 99]), ("", [])):
        req = _parse(ChatCompletionRequest, messages=[{"role": "user", "content": "a"}],
                     prediction={"type": "content", "content": content})
        req.apply_tokenizer(FakeTokenizer())
        assert req.extra_sampling_fields().get("prediction_token_ids", []) == ids
    for bad in ({"type": "file", "content": "x"}, {"content": "x"}, "abc",
                {"type": "content", "content": 5},
                {"type": "content", "content": [{"type": "image_url", "image_url": "u"}]},
                {"type": "content", "content": "x", "extra": 1}):
        with pytest.raises(InvalidRequestError) as info:  # (parsing checks the values)
            _parse(CompletionRequest, prompt="x", prediction=bad)
        assert info.value.param == "prediction"
