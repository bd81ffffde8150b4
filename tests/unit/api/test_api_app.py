"""The OpenAI HTTP layer end to end: uvicorn on 127.0.0.1, official openai client, fake backend."""
import json
import time

import httpx
import openai
import pytest

from xllm_py.api.app import build_app
from tests.unit.conftest import MODEL
from xllm_py.api.testing import BOS_ID, FakeTokenizer, ScriptedBackend

pytestmark = pytest.mark.integration  # uvicorn





@pytest.fixture
def base_url(server):
    return server[1].base_url


@pytest.fixture
def client(base_url, backend):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=10) as c:
        yield c


def _letters(n, choice=0):
    return "".join(chr(ScriptedBackend.token_for(k, choice)) for k in range(n))


def _sse_events(resp):
    return [line[len("data: "):] for line in resp.text.split("\n") if line.startswith("data: ")]


# -- happy paths -------------------------------------------------------------------------


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_stream_matches_non_stream_and_usage(client, backend):
    full = client.completions.create(model=MODEL, prompt="hello", max_tokens=5)
    assert full.choices[0].text == _letters(5)
    assert full.choices[0].finish_reason == "length"
    assert full.id.startswith("cmpl-")
    prompt_tokens = len(FakeTokenizer().encode("hello"))  # BOS + 5 chars
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        prompt_tokens, 5, prompt_tokens + 5)
    assert backend.requests[0].prompt_token_ids[0] == BOS_ID

    chunks = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_response_ids_are_prefixed_random_hex_and_distinct(client, backend):
    import re

    ids = [client.completions.create(model=MODEL, prompt="hi", max_tokens=1).id
           for _ in range(3)]
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids), ids
    assert len(set(ids)) == 3
    assert [r.request_id for r in backend.requests] == ids  # the id the backend saw


def test_chat_stream_matches_non_stream_and_template(client, backend):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == _letters(4)
    assert full.id.startswith("chatcmpl-")
    expected_ids = FakeTokenizer().encode(
        FakeTokenizer().apply_chat_template(messages), add_special_tokens=False)
    assert backend.requests[0].prompt_token_ids == expected_ids
    assert full.usage.prompt_tokens == len(expected_ids)

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == _letters(4)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_and_multiple_prompts_are_numbered_prompt_major(client, backend):
    out = client.completions.create(model=MODEL, prompt=["ab", "cd"], n=2, max_tokens=3)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [_letters(3, 0), _letters(3, 1)] * 2
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == 6
    assert len({r.request_id for r in backend.requests}) == 2

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], n=2, max_tokens=3, stream=True))
    texts = {0: "", 1: ""}
    finish = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {0: _letters(3, 0), 1: _letters(3, 1)}
    assert finish == {0: "length", 1: "length"}


def test_return_token_ids(client):
    out = client.completions.create(
        model=MODEL, prompt=[7, 8, 9], max_tokens=3, extra_body={"return_token_ids": True})
    choice = out.choices[0].model_dump()
    assert choice["prompt_token_ids"] == [7, 8, 9]
    assert choice["token_ids"] == [ScriptedBackend.token_for(k, 0) for k in range(3)]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
        extra_body={"return_token_ids": True})
    assert chat.choices[0].model_dump()["token_ids"] == [ScriptedBackend.token_for(k, 0) for k in range(2)]


def test_completion_logprobs_format_and_echo(client):
    out = client.completions.create(model=MODEL, prompt="xy", max_tokens=3, logprobs=2, echo=True)
    c = out.choices[0]
    assert c.text == "xy" + _letters(3)
    lp = c.logprobs
    assert lp.tokens == ["<s>", "x", "y"] + list(_letters(3))
    # the prompt's own logprobs: null for the first token only (as vLLM)
    p = ScriptedBackend.prompt_logprob_of
    assert lp.token_logprobs[:3] == [None, p(1), p(2)]
    assert lp.top_logprobs[:3] == [None, {"x": p(1), "A": p(1) - 1}, {"y": p(2), "A": p(2) - 1}]
    assert lp.token_logprobs[3:] == [-0.5] * 3
    assert lp.text_offset == [0, 3, 4, 5, 6, 7]
    # top-2 plus the sampled token (which is also the best one here)
    assert lp.top_logprobs[3] == {"a": -0.5, "b": -1.0}


def test_completion_stream_echo_logprobs_match_non_stream(client):
    kwargs = dict(model=MODEL, prompt="xy", max_tokens=3, logprobs=1, echo=True)
    full = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
    assert "".join(c.text for c in chunks) == full.text
    with_lp = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for lp in with_lp for t in lp.tokens] == full.logprobs.tokens
    assert [o for lp in with_lp for o in lp.text_offset] == full.logprobs.text_offset
    assert [v for lp in with_lp for v in lp.token_logprobs] == full.logprobs.token_logprobs


def test_chat_logprobs_format(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
        logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert [e.token for e in content] == list(_letters(2))
    assert content[0].logprob == -0.5 and content[0].bytes == [ord("a")]
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [("b", -0.5), ("c", -1.0)]
    stream = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
        logprobs=True, top_logprobs=1, stream=True))
    streamed = [e.token for ch in stream for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert streamed == list(_letters(2))


def test_stop_and_finish_reason_passthrough(client, backend):
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=10, stop=["c"])
    assert out.choices[0].text == "ab"
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_dump()["stop_reason"] == "c"
    assert backend.requests[-1].sampling.stop == ["c"]
    out = client.completions.create(
        model=MODEL, prompt="x", max_tokens=10, extra_body={"stop_token_ids": [ord("b")]})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_dump()["stop_reason"] == ord("b")


def test_sampling_params_reach_backend(client, backend):
    client.completions.create(
        model=MODEL, prompt="x", max_tokens=2, temperature=0.5, top_p=0.9, seed=7,
        presence_penalty=0.1, n=1, best_of=2, user="u",
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True,
                    "min_tokens": 1, "skip_special_tokens": False, "include_stop_str_in_output": True})
    r = backend.requests[-1].sampling
    assert (r.temperature, r.top_p, r.top_k, r.min_p, r.seed, r.presence_penalty) == (0.5, 0.9, 5, 0.1, 7, 0.1)
    assert (r.repetition_penalty, r.ignore_eos, r.min_tokens, r.best_of) == (1.2, True, 1, 2)
    assert (r.skip_special_tokens, r.include_stop_str_in_output, r.max_tokens) == (False, True, 2)


def test_include_usage_chunk_and_cached_tokens(client, backend):
    backend.num_cached_tokens = 3
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, n=2, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 6
    assert last.usage.total_tokens == last.usage.prompt_tokens + 6
    assert last.usage.prompt_tokens_details.cached_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


def test_predicted_outputs_reach_the_backend_and_usage_reports_them(client, backend):
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert plain.usage.completion_tokens_details is None  # (no prediction: as before)
    backend.predicted = (2, 5)
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
            prediction={"type": "content", "content": "ab"}, stream=stream,
            stream_options={"include_usage": True} if stream else None)
        usage = list(reply)[-1].usage if stream else reply.usage
        assert backend.requests[-1].sampling.prediction_token_ids == [97, 98]
        details = usage.completion_tokens_details
        assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (2, 5)
    done = client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                     extra_body={"prediction": {"type": "content", "content": "a"}})
    assert done.usage.completion_tokens_details.accepted_prediction_tokens == 2


def test_x_request_id_honoured(base_url, backend):
    r = httpx.post(f"{base_url}/v1/completions", headers={"X-Request-Id": "trace-42"},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trace-42"
    assert backend.requests[-1].x_request_id == "trace-42"
    assert backend.requests[-1].request_id == r.json()["id"] != "trace-42"


# -- errors ------------------------------------------------------------------------------


def _assert_error(exc_info, status, param=None, code=None, type_="invalid_request_error"):
    e = exc_info.value
    assert e.status_code == status
    body = e.body
    assert body["type"] == type_
    assert body["message"]
    if param is not None:
        assert body["param"] == param
    if code is not None:
        assert body["code"] == code


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=-1), "temperature"),
        (dict(n=0), "n"),
        (dict(top_p=1.5), "top_p"),
        (dict(logprobs=21), "logprobs"),
        (dict(n=2, best_of=1), "best_of"),
        (dict(best_of=2, stream=True), "best_of"),
    ],
)
def test_invalid_values_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kwargs)
    _assert_error(info, 400, param=param)


def test_empty_messages_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[])
    _assert_error(info, 400, param="messages")


def test_context_length_400_names_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x" * 100, max_tokens=200)
    msg = info.value.body["message"]
    assert "256" in msg and "301" in msg  # max_model_len and 101 + 200 requested


@pytest.mark.parametrize("raw", [b"{not json", b'{"model": "fake-model", "prompt": "x", "n": "two"}'])
def test_malformed_json_and_wrong_types_400(base_url, backend, raw):
    r = httpx.post(f"{base_url}/v1/completions", content=raw,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="other", prompt="x", max_tokens=1)
    _assert_error(info, 404, param="model", code="model_not_found")


def test_not_ready_503_and_health(client, base_url, backend):
    assert httpx.get(f"{base_url}/health").status_code == 200
    backend.ready = (False, "no prefill/decode instance registered")
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    _assert_error(info, 503, type_="service_unavailable")
    assert "no prefill/decode" in info.value.body["message"]
    for path in ("/health", "/readiness"):
        r = httpx.get(f"{base_url}{path}")
        assert r.status_code == 503 and "no prefill/decode" in r.json()["reason"]


@pytest.mark.parametrize("stream", [False, True])
def test_backend_busy_503(client, backend, stream):
    backend.busy = True
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=stream)
    _assert_error(info, 503, code="backend_busy", type_="service_unavailable")


@pytest.mark.parametrize("code", [500, 429])
def test_backend_failure_status(client, backend, code):
    backend.fail_after, backend.fail_code = 0, code
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert info.value.status_code == code
    assert info.value.body["message"] == "fake backend failure"


def test_backend_failure_mid_stream_is_an_sse_error_event(base_url, backend):
    backend.fail_after = 2
    r = httpx.post(f"{base_url}/v1/completions",
                   json={"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True})
    assert r.status_code == 200
    events = _sse_events(r)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] == "fake backend failure" and error["code"] == 500
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == _letters(2)


# -- cancellation --------------------------------------------------------------------------


def test_dropped_stream_cancels_backend(client, backend):
    backend.token_delay = 0.02
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=200, stream=True)
    next(iter(stream))
    t0 = time.monotonic()
    stream.close()
    assert backend.cancelled_event.wait(1.0), "backend never saw the cancellation"
    assert time.monotonic() - t0 < 1.0
    assert backend.cancelled == [backend.requests[-1].request_id]


def _cancelled_count(base_url) -> float:
    import re

    m = re.search(r'^xllm_requests_total\{outcome="cancelled"\} ([0-9.]+)$',
                  httpx.get(f"{base_url}/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_dropped_non_stream_request_cancels_backend(base_url, backend):
    backend.token_delay = 0.02
    before = _cancelled_count(base_url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", timeout=0.3,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 200})
    assert backend.cancelled_event.wait(1.0), "backend never saw the cancellation"
    # Counted as cancelled (it used to end in InvalidStateError, an unhandled 500).
    deadline = time.monotonic() + 2.0
    while _cancelled_count(base_url) != before + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _cancelled_count(base_url) == before + 1


# -- metrics -------------------------------------------------------------------------------


def test_metrics_and_per_app_registry(client, base_url):
    client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    text = httpx.get(f"{base_url}/metrics").text
    for name in ("xllm_time_to_first_token_seconds_count", "xllm_time_per_output_token_seconds_count",
                 "xllm_e2e_request_latency_seconds_count", 'xllm_requests_total{outcome="success"}',
                 "fake_backend_waiting 0"):
        assert name in text
    # A second app in the same process has its own registry.
    other = build_app(ScriptedBackend("other"))
    assert other.state.metrics.registry is not build_app(ScriptedBackend("third")).state.metrics.registry
