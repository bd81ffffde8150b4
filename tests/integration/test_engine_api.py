"""A MIX engine process (tiny model) through the official openai client."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.integration.cluster_harness import drop_stream_after_first_chunk, metric, wait_drained
from xllm_py.utils.procs import engine_args, free_port, spawn

pytestmark = pytest.mark.integration

PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time, in a land far away,",
           "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    port = free_port()
    proc = spawn("engine-mix", "xllm_py.engine",
                 engine_args("MIX", port, extra=["--block-size", "8", "--num-blocks", "512"]),
                 tmp_path_factory.mktemp("logs"), http_url=f"http://127.0.0.1:{port}")
    try:
        proc.wait_ready(180)
        yield proc
    finally:
        proc.terminate()


@pytest.fixture()
def client(engine):
    return openai.OpenAI(base_url=engine.http_url + "/v1", api_key="x", max_retries=0)


def test_models_and_health(engine, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(engine.http_url + "/health", trust_env=False).status_code == 200


def test_completion_stream_equals_non_stream(client):
    for prompt in PROMPTS:
        full = client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                         temperature=0, extra_body={"ignore_eos": True,
                                                                    "return_token_ids": True})
        choice = full.choices[0]
        assert full.usage.completion_tokens == 24
        assert full.usage.total_tokens == full.usage.prompt_tokens + 24
        token_ids = choice.model_extra["token_ids"]
        assert len(token_ids) == 24
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                          temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n_and_seed(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, n=3,
                                  temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 36
    again = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, n=3,
                                      temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == \
        [c.text for c in sorted(again.choices, key=lambda c: c.index)]


def test_best_of_returns_n_of_best_of(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, n=1, best_of=3,
                                  temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.usage.completion_tokens == 8  # the returned choice (as vLLM counts)
    # The chosen one is one of the seeded candidates: seed + i for i in 0..2.
    candidates = {client.completions.create(model="tiny", prompt="Hello", max_tokens=8,
                                            temperature=1.0, seed=3 + i,
                                            extra_body={"ignore_eos": True}).choices[0].text
                  for i in range(3)}
    assert r.choices[0].text in candidates


def test_stop_string_and_logprobs(client):
    base = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=16,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[3:6]
    assert stop.strip(), "the tiny model's greedy text changed: pick another stop substring"
    cut = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=16,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    lp = client.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0,
                                   logprobs=3, extra_body={"ignore_eos": True})
    assert len(lp.choices[0].logprobs.token_logprobs) == 4
    assert all(len(t) == 3 for t in lp.choices[0].logprobs.top_logprobs)


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_cached_tokens_of_a_request_that_ends_in_its_first_step(engine, max_tokens):
    """max_tokens 1 (and 0: score the prompt) ends in the step that admits the request;
    its usage still reports the prompt tokens served from the prefix cache."""
    prompt = [300 + max_tokens + 2 * i for i in range(30)]  # its own: nothing cached yet
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "echo": max_tokens == 0}
    cached = []
    for _ in range(2):
        r = httpx.post(engine.http_url + "/v1/completions", json=body, timeout=60,
                       trust_env=False)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == max_tokens
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0
    assert cached[1] == 24  # the whole 8-token blocks before the last prompt token


def test_errors(engine, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature" or "temperature" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x " * 3000, max_tokens=10)
    with pytest.raises(openai.BadRequestError) as e:  # token ids outside the vocabulary
        client.completions.create(model="tiny", prompt=[5, 10**6], max_tokens=2, echo=True)
    assert "out of range" in e.value.message
    r = httpx.post(engine.http_url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"}, trust_env=False)
    assert r.status_code == 400 and "error" in r.json()
    # The loop keeps serving.
    ok = client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert ok.choices[0].text is not None


async def test_concurrent_streams_and_blocks_freed(engine):
    expected = {}
    aclient = openai.AsyncOpenAI(base_url=engine.http_url + "/v1", api_key="x", max_retries=0)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    for p in set(prompts[:4]):
        r = await aclient.completions.create(model="tiny", prompt=p, max_tokens=16,
                                             temperature=0, extra_body={"ignore_eos": True})
        expected[p] = r.choices[0].text

    async def one(p: str) -> str:
        stream = await aclient.completions.create(model="tiny", prompt=p, max_tokens=16,
                                                  temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    results = await asyncio.gather(*(one(p) for p in prompts))
    for p, text in zip(prompts, results):
        if p in expected:
            assert text == expected[p]
        assert text
    await wait_drained([engine.http_url])
    assert metric(engine.http_url, "xllm_kv_cache_blocks_used") == 0
    assert metric(engine.http_url, "xllm_requests_running") == 0


async def test_dropped_stream_frees_blocks(engine):
    await drop_stream_after_first_chunk(engine.http_url, max_tokens=2000)
    await wait_drained([engine.http_url])
