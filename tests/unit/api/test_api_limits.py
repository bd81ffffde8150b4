"""Bounded work and values at the HTTP edge, through the real app over a
scripted backend: wire widths and non-finite numbers are 400s naming the parameter, the
body limit is a 413 (declared or streamed), the admission limit a 429 with Retry-After,
and /openapi.json describes the real request bodies."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from xllm_py.api.app import build_app
from xllm_py.api.errors import InvalidRequestError
from xllm_py.api.limits import Admission
from xllm_py.api.protocol import MAX_BEST_OF, MAX_FANOUT, CompletionRequest, parse_request
from xllm_py.api.server import serve_in_thread
from xllm_py.api.testing import ScriptedBackend
from xllm_py.config import APILimits


@pytest.fixture(scope="module")
def server():
    backend = ScriptedBackend(max_model_len=4096)
    app = build_app(backend, limits=APILimits(
        max_body_bytes=1 << 20, max_pending_requests=2, max_pending_tokens=10_000))
    handle = serve_in_thread(app)
    handle.app = app
    yield handle, backend
    handle.stop()


def _post(base: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) or hasattr(body, "__next__") \
        else json.dumps(body)
    return httpx.post(base + "/v1/completions", content=content, trust_env=False, timeout=30,
                      headers={"Content-Type": "application/json"}, **kw)


@pytest.mark.parametrize("field, value", [
    ("seed", 2 ** 64 + 5), ("seed", -(2 ** 63) - 1), ("seed", 2 ** 63), ("top_k", 2 ** 31),
    ("stop_token_ids", [1, 2 ** 31]), ("best_of", 2 ** 31), ("n", -(2 ** 31) - 1),
    ("max_tokens", 2 ** 31), ("min_tokens", 2 ** 40), ("prompt", [1, 2 ** 31]),
    ("temperature", 1e39), ("best_of", MAX_BEST_OF + 1), ("logit_bias", {"99999999999": 1}),
    ("logit_bias", {"5": float("1e39")}),
])
def test_values_the_wire_cannot_hold_name_their_param(field, value):
    body = {"prompt": "x", "max_tokens": 4, field: value}
    with pytest.raises(InvalidRequestError) as info:
        parse_request(CompletionRequest, json.dumps(body).encode())
    assert info.value.param == field


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN"])
@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p", "min_p",
                                   "presence_penalty"])
def test_non_finite_numbers_are_400(field, literal):
    raw = ('{"prompt": "x", "%s": %s}' % (field, literal)).encode()
    with pytest.raises(InvalidRequestError) as info:
        parse_request(CompletionRequest, raw)
    assert info.value.param == field


def test_the_largest_values_that_fit_are_taken():
    req = parse_request(CompletionRequest, json.dumps({
        "prompt": "x", "seed": 2 ** 63 - 1, "top_k": 2 ** 31 - 1, "stop_token_ids": [2 ** 31 - 1],
        "temperature": 3.0e38}).encode())
    assert req.seed == 2 ** 63 - 1


def test_fan_out_is_bounded():
    ok = {"prompt": ["a"] * (MAX_FANOUT // 4), "n": 4}
    parse_request(CompletionRequest, json.dumps(ok).encode())
    with pytest.raises(InvalidRequestError) as info:
        parse_request(CompletionRequest, json.dumps({**ok, "best_of": 5}).encode())
    assert info.value.param == "best_of"


@pytest.mark.parametrize("value", [1e-300, 1e-5, 1e5])
def test_repetition_penalty_that_would_overflow_the_logits_is_400(server, value):
    """Found by the fuzz: 1e-300 is 0 in float32, logit / 0 is inf and sampling failed
    the whole engine step. SamplingParams' range is checked at the HTTP edge."""
    handle, _ = server
    resp = _post(handle.base_url, {"prompt": "x", "max_tokens": 2, "repetition_penalty": value})
    assert (resp.status_code, resp.json()["error"]["param"]) == (400, "repetition_penalty")


def test_stop_list_limit_over_http(server):
    handle, _ = server
    resp = _post(handle.base_url, {"prompt": "x", "stop": ["s"] * 17})
    assert (resp.status_code, resp.json()["error"]["param"]) == (400, "stop")
    resp = _post(handle.base_url, {"prompt": "x", "temperature": 5.0, "max_tokens": 2})
    assert resp.status_code == 200


def test_declared_body_over_the_limit_is_413_unread(server):
    handle, backend = server
    backend.reset()
    resp = _post(handle.base_url, {"prompt": "a" * (2 << 20)})
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"
    assert backend.requests == []


def test_streamed_body_over_the_limit_is_413(server):
    handle, backend = server
    backend.reset()

    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    resp = _post(handle.base_url, chunks())
    assert resp.status_code == 413
    assert backend.requests == []


def test_admission_limit_is_429_with_retry_after_and_frees_when_requests_end(server):
    handle, backend = server
    backend.reset()
    backend.token_delay = 0.05
    admission: Admission = handle.app.state.admission
    results: list[int] = []

    def slow() -> None:
        results.append(_post(handle.base_url, {"prompt": "x", "max_tokens": 40}).status_code)

    threads = [threading.Thread(target=slow) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = 200
    while admission.num_pending_requests < 2 and deadline:
        threading.Event().wait(0.01)
        deadline -= 1
    busy = _post(handle.base_url, {"prompt": "x", "max_tokens": 2})
    assert busy.status_code == 429
    assert busy.headers["Retry-After"] == "1"
    assert busy.json()["error"]["type"] == "rate_limit_exceeded"
    for t in threads:
        t.join(30)
    assert results == [200, 200]
    assert (admission.num_pending_requests, admission.num_pending_tokens) == (0, 0)
    # A stream holds its ticket until it ends, however it ends.
    with httpx.stream("POST", handle.base_url + "/v1/completions", trust_env=False, timeout=30,
                      json={"prompt": "x", "max_tokens": 40, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:"):
                assert admission.num_pending_requests == 1
                break
    deadline = 500
    while admission.num_pending_requests and deadline:
        threading.Event().wait(0.01)
        deadline -= 1
    assert admission.num_pending_requests == 0
    backend.reset()


def test_tokens_limit_admits_one_large_request_alone():
    admission = Admission(APILimits(max_pending_requests=10, max_pending_tokens=100))
    big = admission.admit(500)  # alone: admitted, or it could never run
    with pytest.raises(Exception) as info:
        admission.admit(1)
    assert info.value.status_code == 429
    big.release()
    big.release()  # idempotent
    assert (admission.num_pending_requests, admission.num_pending_tokens) == (0, 0)


def test_openapi_describes_the_request_bodies(server):
    handle, _ = server
    schema = httpx.get(handle.base_url + "/openapi.json", trust_env=False).json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/CompletionRequest"
    comps = schema["components"]["schemas"]
    assert {"prompt", "best_of", "seed", "temperature"} <= set(comps["CompletionRequest"]["properties"])
    chat = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert chat["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert "ChatMessage" in comps
