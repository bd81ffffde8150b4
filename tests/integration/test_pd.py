"""PD disaggregation end to end: service + PREFILL + DECODE processes on a real etcd, KV
moved over UCX, compared token for token (and logprob for logprob) with a MIX engine."""
from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.integration.cluster_harness import (Harness, aclient, client,
                                               drop_stream_after_first_chunk, labelled, metric,
                                               wait_drained)
from xllm_py.utils.procs import engine_args, free_port, spawn

pytestmark = pytest.mark.integration

BLOCK = 8
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
         "pi rho sigma tau upsilon phi chi psi omega").split()
SHARED = "System: you are a careful assistant who answers in short sentences. "


def varied_prompts(tok) -> list[list[int]]:
    """Token-id prompts of 1 token up to several blocks, on and across block boundaries,
    plus prompts that share long prefixes (prefix-cache hits on decode)."""
    base = tok.encode(" ".join(WORDS * 4), add_special_tokens=False)
    prompts = [base[:n] for n in (1, 2, 7, 8, 9, 15, 16, 17, 23, 24, 25, 31, 33, 40, 47, 64)]
    shared = tok.encode(SHARED * 3, add_special_tokens=False)
    for i in range(10):
        prompts.append(shared + tok.encode(f" question {i}: {WORDS[i]}?", add_special_tokens=False))
    prompts += [base[i:i + 12] for i in range(0, 72, 12)]
    return prompts


@pytest.fixture(scope="module", params=["PULL", "PUSH"])
def pd(request, etcd_server, tmp_path_factory):
    mode = request.param
    logs = tmp_path_factory.mktemp(f"logs-{mode}")
    h = Harness(etcd_server.endpoint, f"pd-{mode}/", logs)
    common = ["--block-size", str(BLOCK), "--kv-cache-transfer-mode", mode,
              "--num-blocks", "1024"]
    mix_port = free_port()
    mix = spawn("mix-ref", "xllm_py.engine", engine_args("MIX", mix_port, extra=common), logs,
                http_url=f"http://127.0.0.1:{mix_port}")
    h.procs.append(mix)
    try:
        svc = h.service()
        prefill = h.engine("PREFILL", "prefill", extra=common)
        decode = h.engine("DECODE", "decode", extra=common)
        for p in (mix, prefill, decode):
            p.wait_ready(180)
        svc.wait_ready(60, path="/readiness")
        yield h, svc, prefill, decode, mix, mode
    finally:
        h.stop()


def _kwargs(prompt, **extra):
    body = {"ignore_eos": True, "return_token_ids": True}
    body.update(extra.pop("extra_body", {}))
    return dict(model="tiny", prompt=prompt, max_tokens=extra.pop("max_tokens", 12),
                temperature=0, extra_body=body, **extra)


def test_greedy_pd_equals_mix(pd):
    h, svc, prefill, decode, mix, mode = pd
    from xllm_py.engine.llm_engine import resolve_model_dir
    from xllm_py.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_dir("tiny"))
    via_pd, ref = client(svc), client(mix)
    prompts = varied_prompts(tok)
    assert len(prompts) >= 32
    for prompt in prompts:
        a = via_pd.completions.create(**_kwargs(prompt, logprobs=2))
        b = ref.completions.create(**_kwargs(prompt, logprobs=2))
        ca, cb = a.choices[0], b.choices[0]
        assert ca.model_extra["token_ids"] == cb.model_extra["token_ids"], f"prompt len {len(prompt)}"
        assert ca.text == cb.text
        for x, y in zip(ca.logprobs.token_logprobs, cb.logprobs.token_logprobs):
            assert abs(x - y) < 1e-3
        assert a.usage.completion_tokens == b.usage.completion_tokens == 12
    # Shared prefixes hit decode's prefix cache.
    assert metric(decode.http_url, "xllm_prefix_cache_hit_tokens_total") > 0
    # Same host, UCX: the transferring side mapped its peer's pool (one memcpy per transfer).
    mover = decode if mode == "PULL" else prefill
    log = mover.log_path.read_text(errors="replace")
    op = "pull" if mode == "PULL" else "push"
    assert f"kv {op} req=" in log and "path=mapped" in log and "path=iov" not in log


def test_n_stop_and_chat_equal_mix(pd):
    h, svc, prefill, decode, mix, mode = pd
    via_pd, ref = client(svc), client(mix)
    a = via_pd.completions.create(**_kwargs("The quick brown fox", n=3))
    b = ref.completions.create(**_kwargs("The quick brown fox", n=3))
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in sorted(a.choices, key=lambda c: c.index)] == \
        [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert a.usage.completion_tokens == 36
    full = ref.completions.create(**_kwargs("Once upon a time", max_tokens=16)).choices[0].text
    stop = full[5:8]
    assert stop.strip(), "the tiny model's greedy text changed: pick another stop substring"
    a = via_pd.completions.create(**_kwargs("Once upon a time", max_tokens=16, stop=[stop]))
    b = ref.completions.create(**_kwargs("Once upon a time", max_tokens=16, stop=[stop]))
    assert a.choices[0].text == b.choices[0].text == full[: full.index(stop)]
    assert a.choices[0].finish_reason == "stop"
    msgs = [{"role": "user", "content": "Write a haiku about the sea."}]
    ca = via_pd.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0)
    cb = ref.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0)
    assert ca.choices[0].message.content == cb.choices[0].message.content
    # A one-token answer finishes on prefill; nothing leaks on decode.
    one = via_pd.completions.create(**_kwargs("Hi", max_tokens=1))
    assert one.usage.completion_tokens == 1



def test_cached_tokens_of_a_one_token_answer(pd):
    """max_tokens 1 finishes on prefill in the step that admits it; its usage still
    reports the prompt tokens the prefill served from its prefix cache."""
    h, svc, prefill, decode, mix, mode = pd
    body = {"model": "tiny", "prompt": [400 + 3 * i for i in range(30)], "max_tokens": 1,
            "temperature": 0}
    cached = []
    for _ in range(2):
        r = httpx.post(svc.http_url + "/v1/completions", json=body, timeout=60, trust_env=False)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 24]  # the whole 8-token blocks before the last prompt token


def test_logit_bias_reaches_the_first_token(pd):
    """The token sampled at the end of the prompt (on the prefill, or on
    MIX) carries the bias as every later one does, streamed or not."""
    h, svc, prefill, decode, mix, mode = pd
    body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 3,
            "temperature": 0, "logit_bias": {"123": 100}, "return_token_ids": True}
    for url in (svc.http_url, mix.http_url):
        r = httpx.post(url + "/v1/completions", json=body, timeout=60, trust_env=False)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == [123, 123, 123], url
        streamed = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=60, trust_env=False) as resp:
            for line in resp.iter_lines():
                m = re.search(r'"token_ids":\[([0-9, ]*)\]', line)
                if m and m.group(1):
                    streamed += [int(t) for t in m.group(1).split(",")]
        assert streamed == [123, 123, 123], url


def test_min_tokens_pd_equals_mix(pd):
    """min_tokens reaches prefill and decode: the first token (sampled on prefill) is a
    stop token but must not end the request, and decode counts it towards min_tokens."""
    h, svc, prefill, decode, mix, mode = pd
    via_pd, ref = client(svc), client(mix)
    greedy = ref.completions.create(**_kwargs("Once upon a time")).choices[0] \
        .model_extra["token_ids"]
    stop = {"stop_token_ids": greedy[:6]}
    early = via_pd.completions.create(**_kwargs("Once upon a time", extra_body=stop))
    assert early.usage.completion_tokens == 1  # finished on prefill
    body = {**stop, "min_tokens": 6}
    a = via_pd.completions.create(**_kwargs("Once upon a time", extra_body=body))
    b = ref.completions.create(**_kwargs("Once upon a time", extra_body=body))
    assert a.usage.completion_tokens == b.usage.completion_tokens == 6
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    assert a.choices[0].finish_reason == b.choices[0].finish_reason == "stop"

async def test_64_concurrent_streams_and_pools_drain(pd):
    h, svc, prefill, decode, mix, mode = pd
    c = aclient(svc)

    async def one(i: int) -> int:
        stream = await c.completions.create(
            model="tiny", prompt=f"{WORDS[i % len(WORDS)]} {i} " * (1 + i % 5), max_tokens=10,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        n = 0
        async for chunk in stream:
            if chunk.usage:
                n = chunk.usage.completion_tokens
        return n

    results = await asyncio.gather(*(one(i) for i in range(64)))
    assert results == [10] * 64
    await wait_drained([prefill.http_url, decode.http_url], timeout_s=10)
    for p in (prefill, decode):
        assert metric(p.http_url, "xllm_kv_cache_blocks_used") == 0
    # PULL: decode's worker moved the bytes; PUSH: prefill's.
    mover = decode if mode == "PULL" else prefill
    text = httpx.get(mover.http_url + "/metrics", trust_env=False).text
    moved = sum(float(v) for v in re.findall(r"^xllm_kv_transfer_bytes_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M))
    assert moved > 0


async def test_dropped_stream_frees_both_pools(pd):
    h, svc, prefill, decode, mix, mode = pd
    await drop_stream_after_first_chunk(svc.http_url, prompt="alpha beta " * 20)
    await wait_drained([prefill.http_url, decode.http_url])


async def test_clients_hanging_up_at_any_stage_free_both_pools(pd):
    """Clients hang up at staggered times: before dispatch, during prefill, during the
    hand-over and during decode. Whatever the stage, both pools end empty and the pair
    serves the next request."""
    h, svc, prefill, decode, mix, mode = pd

    async def hang_up_after(delay_s: float, i: int) -> None:
        async with httpx.AsyncClient(base_url=svc.http_url, timeout=30, trust_env=False) as http:
            async def read() -> None:
                async with http.stream("POST", "/v1/completions", json={
                        "model": "tiny", "prompt": f"{WORDS[i % len(WORDS)]} " * (20 + 9 * i),
                        "max_tokens": 400, "stream": True, "ignore_eos": True}) as resp:
                    async for _ in resp.aiter_lines():
                        pass
            try:
                await asyncio.wait_for(read(), delay_s)
            except asyncio.TimeoutError:
                pass  # the connection closes with the client

    await asyncio.gather(*(hang_up_after(0.005 * (i * i % 41), i) for i in range(24)))
    await wait_drained([prefill.http_url, decode.http_url], timeout_s=15.0)
    out = client(svc).completions.create(**_kwargs("alpha beta gamma", max_tokens=4))
    assert out.usage.completion_tokens == 4


def _logprobs(content) -> list:
    return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
            for t in content]


def test_predicted_outputs_through_pd_and_mix(pd):
    """A chat completion with a `prediction` (the plain answer with a word changed) answers
    what it answers without one, with the same logprobs and top logprobs, through the
    service (the decode guesses from it) and on MIX; the decode reports the prediction's
    kept and rejected tokens in the usage."""
    h, svc, prefill, decode, mix, mode = pd
    msgs = [{"role": "user", "content": "Repeat after me: one two three four five six."}]
    kwargs = dict(model="tiny", messages=msgs, max_tokens=32, temperature=0, logprobs=True,
                  top_logprobs=2, extra_body={"ignore_eos": True})
    first = client(mix).chat.completions.create(**kwargs).choices[0]
    plain, plain_logprobs = first.message.content, _logprobs(first.logprobs.content)
    assert len(plain_logprobs) == 32
    words = plain.split(" ")
    assert len(words) > 4, "the tiny model's greedy text changed: pick another prompt"
    edited = " ".join(words[:3] + ["zebra"] + words[4:])
    for proc in (svc, mix):
        for stream in (False, True):
            reply = client(proc).chat.completions.create(
                **kwargs, prediction={"type": "content", "content": edited}, stream=stream,
                stream_options={"include_usage": True} if stream else None)
            if stream:
                chunks = list(reply)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                logprobs = _logprobs([t for c in chunks if c.choices and c.choices[0].logprobs
                                      for t in c.choices[0].logprobs.content])
                usage = chunks[-1].usage
            else:
                text, usage = reply.choices[0].message.content, reply.usage
                logprobs = _logprobs(reply.choices[0].logprobs.content)
            assert text == plain, (proc.name, stream)
            assert logprobs == plain_logprobs, (proc.name, stream)
            details = usage.completion_tokens_details
            # (guesses are verified where the step's price pays for them: how many of
            # the edited part's were tried depends on the machine's step times)
            assert details.accepted_prediction_tokens > 0, (proc.name, stream)
            assert usage.completion_tokens == 32
    assert labelled(decode.http_url, "xllm_spec_decode_accepted_tokens_total",
                    'method="prediction"') > 0
