"""Prompt scoring in the HTTP layer, over the scripted backend: prompt logprobs (OpenAI echo format
and vLLM's prompt_logprobs), max_tokens 0, logit_bias intake, continuous usage, stop_reason,
the model / tokenizer / version routes, and a 400 naming each parameter the server does
not implement."""
import json

import httpx
import openai
import pytest

from tests.unit.conftest import MODEL
from xllm_py.api.testing import BOS_ID, FakeTokenizer, ScriptedBackend

P = ScriptedBackend.prompt_logprob_of




@pytest.fixture
def http(server, backend):
    with httpx.Client(base_url=server[1].base_url, timeout=10, trust_env=False) as c:
        yield c


@pytest.fixture
def client(server, backend):
    with openai.OpenAI(base_url=f"{server[1].base_url}/v1", api_key="x", max_retries=0,
                       timeout=10) as c:
        yield c


def _error(resp, status=400):
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


# -- prompt logprobs and max_tokens 0 ---------------------------------------------------


def test_lm_eval_request_shape_scores_every_prompt_token_but_the_first(http, backend):
    body = {"model": MODEL, "prompt": [[51, 87, 99, 100]], "max_tokens": 1, "logprobs": 1,
            "echo": True, "temperature": 0}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [None, P(1), P(2), P(3), -0.5]
    assert lp["tokens"] == ["3", "W", "c", "d", "a"]
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][2] == {"c": P(2)}
    assert backend.requests[0].sampling.prompt_logprobs == 1  # the engine was asked for them


def test_max_tokens_zero_with_echo_returns_the_prompt_and_its_logprobs(http, backend):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 0, "logprobs": 0, "echo": True}
    out = http.post("/v1/completions", json=body).json()
    (choice,) = out["choices"]
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, P(1), P(2), P(3)]
    assert out["usage"]["completion_tokens"] == 0
    # streamed: one chunk with the echoed prompt and its logprobs
    chunks = _sse(http, {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc"
    streamed = [v for c in chunks if c["choices"][0]["logprobs"]
                for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == [None, P(1), P(2), P(3)]


def test_max_tokens_zero_needs_echo_or_prompt_logprobs(http):
    err = _error(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 0}))
    assert err["param"] == "max_tokens"
    assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 0,
                                              "prompt_logprobs": 1}).status_code == 200
    err = _error(http.post("/v1/completions", json={"prompt": "a", "max_tokens": -1,
                                                    "echo": True}))
    assert err["param"] == "max_tokens"


def test_vllm_prompt_logprobs_format(http, backend):
    out = http.post("/v1/completions", json={"prompt": "xy", "max_tokens": 1,
                                             "prompt_logprobs": 2}).json()
    plp = out["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 3
    assert plp[1] == {str(ord("x")): {"logprob": P(1), "rank": 1, "decoded_token": "x"},
                      str(ord("A")): {"logprob": P(1) - 1, "rank": 2, "decoded_token": "A"}}
    assert out["choices"][0]["logprobs"] is None  # logprobs not asked
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "prompt_logprobs": 0}).json()
    plp = chat["prompt_logprobs"]
    assert plp[0] is None and list(plp[1].values())[0]["logprob"] == P(1)
    assert all(len(p) == 1 for p in plp[1:])
    err = _error(http.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 1,
                                                    "stream": True}))
    assert err["param"] == "prompt_logprobs"
    err = _error(http.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": -1}))
    assert err["param"] == "prompt_logprobs"


# -- logit_bias ---------------------------------------------------------------------------


def test_logit_bias_reaches_the_backend_with_integer_ids(http, backend):
    resp = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1,
                                              "logit_bias": {"5": 100, "7": -100, "9": 0.5}})
    assert resp.status_code == 200, resp.text
    assert backend.requests[0].sampling.logit_bias == {5: 100.0, 7: -100.0, 9: 0.5}


@pytest.mark.parametrize("bias", [{"x": 1}, {"-3": 1}, {"5": 100.5}, {"5": -101}, {"5": "1"},
                                  [1, 2]])
def test_bad_logit_bias_is_a_400_naming_it(http, backend, bias):
    for route, extra in (("/v1/completions", {"prompt": "a"}),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):
        err = _error(http.post(route, json={**extra, "logit_bias": bias}))
        assert err["param"].startswith("logit_bias"), err
    assert backend.requests == []


# -- stream usage and stop_reason ---------------------------------------------------------


def _sse(http, body, route="/v1/completions"):
    resp = http.post(route, json=body)
    assert resp.status_code == 200, resp.text
    lines = [ln[len("data: "):] for ln in resp.text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_continuous_usage_stats_puts_usage_on_every_chunk(http):
    prompt_tokens = len(FakeTokenizer().encode("hi"))
    chunks = _sse(http, {"prompt": "hi", "max_tokens": 3, "stream": True,
                         "stream_options": {"include_usage": True,
                                            "continuous_usage_stats": True}})
    with_choices = [c for c in chunks if c["choices"]]
    assert [c["usage"]["completion_tokens"] for c in with_choices] == [1, 2, 3]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == prompt_tokens + 3
    chat = _sse(http, {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
                       "stream": True, "stream_options": {"continuous_usage_stats": True}},
                "/v1/chat/completions")
    assert all(c["usage"] is not None for c in chat)
    plain = _sse(http, {"prompt": "hi", "max_tokens": 2, "stream": True,
                        "stream_options": {"include_usage": True}})
    assert [c["usage"] for c in plain if c["choices"]] == [None, None]


def test_stop_reason_is_the_matched_stop_string_or_token(client):
    by_str = client.completions.create(model=MODEL, prompt="x", max_tokens=5, stop=["c"])
    assert by_str.choices[0].finish_reason == "stop"
    assert by_str.choices[0].model_extra["stop_reason"] == "c"
    by_id = client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                      extra_body={"stop_token_ids": [ord("b")]})
    assert by_id.choices[0].model_extra["stop_reason"] == ord("b")
    by_len = client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert by_len.choices[0].model_extra["stop_reason"] is None


# -- routes -------------------------------------------------------------------------------


def test_models_retrieve_and_unknown_model_404(client, http):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    err = _error(http.get("/v1/models/nope"), 404)
    assert err["code"] == "model_not_found" and "nope" in err["message"]


def test_tokenize_and_detokenize(http):
    out = http.post("/tokenize", json={"model": MODEL, "prompt": "ab"}).json()
    assert out == {"count": 3, "max_model_len": 256, "tokens": [BOS_ID, 97, 98],
                   "token_strs": None}
    out = http.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False,
                                       "return_token_strs": True}).json()
    assert (out["tokens"], out["token_strs"]) == ([97, 98], ["a", "b"])
    messages = [{"role": "user", "content": "hi"}]
    out = http.post("/tokenize", json={"messages": messages}).json()
    expected = FakeTokenizer().apply_chat_template(messages, add_generation_prompt=True)
    assert out["tokens"] == [ord(c) for c in expected]
    out = http.post("/tokenize", json={"messages": messages,
                                       "add_generation_prompt": False}).json()
    assert not "".join(map(chr, out["tokens"])).endswith("<|assistant|>")
    assert http.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}


def test_tokenize_errors(http):
    assert _error(http.post("/tokenize", json={}))["param"] == "prompt"
    assert _error(http.post("/tokenize", json={"prompt": "a", "messages": []}))["param"] == "prompt"
    assert _error(http.post("/tokenize", json={"prompt": 5}))["param"] == "prompt"
    assert _error(http.post("/tokenize", json={"prompt": "a", "model": "m2"}), 404)
    assert _error(http.post("/detokenize", json={"tokens": ["a"]}))["param"].startswith("tokens")
    assert _error(http.post("/detokenize", json={"tokens": [-1]}))["param"] == "tokens"
    assert _error(http.post("/detokenize", content=b"{"))["message"].startswith("malformed JSON")


def test_version(http):
    import xllm_py

    assert http.get("/version").json() == {"version": xllm_py.__version__}


# -- parameters the server does not implement ------------------------------------------


@pytest.mark.parametrize("param,value", [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("prompt_embeds", "x"),
    ("lora_request", {"lora_name": "a"}),
])
def test_unsupported_parameter_is_a_400_naming_it(http, backend, param, value):
    for route, extra in (("/v1/completions", {"prompt": "a"}),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):
        err = _error(http.post(route, json={**extra, param: value}))
        assert err["param"] == param and param in err["message"]
    assert backend.requests == []


@pytest.mark.parametrize("param,value", [
    ("response_format", {"type": "text"}), ("tools", []), ("tool_choice", "none"),
    ("functions", None), ("use_beam_search", False), ("some_unknown_field", 1),
])
def test_values_that_ask_for_nothing_are_accepted(http, param, value):
    resp = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a"}], "max_tokens": 1, param: value})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("param,value", [("echo", True), ("continue_final_message", True),
                                         ("add_generation_prompt", False)])
def test_unimplemented_chat_extensions_are_a_400(http, backend, param, value):
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
    err = _error(http.post("/v1/chat/completions", json={**body, param: value}))
    assert err["param"] == param
    resp = http.post("/v1/chat/completions", json={**body, param: not value})
    assert resp.status_code == 200, resp.text
    assert backend.requests[-1].sampling.echo is False
