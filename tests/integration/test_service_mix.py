"""xllm_service in front of two MIX engines, all real processes on a real etcd."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from xllm_py.cluster.etcd_client import EtcdClient
from tests.integration.cluster_harness import (Harness, aclient, client,
                                               drop_stream_after_first_chunk, long_stream,
                                               metric, start_mix_cluster, wait_drained, wait_until)

pytestmark = pytest.mark.integration

PROMPTS = ["Hello there", "The quick brown fox jumps", "Once upon a time",
           "1 2 3 4 5 6 7 8 9 10", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def cluster(etcd_server, tmp_path_factory):
    h = Harness(etcd_server.endpoint, "svc-mix/", tmp_path_factory.mktemp("logs"))
    try:
        svc, engines = start_mix_cluster(h, 2)
        yield h, svc, engines
    finally:
        h.stop()


async def test_registration_keys(cluster, etcd_server):
    h, svc, engines = cluster
    async with EtcdClient(etcd_server.endpoint, namespace=h.namespace) as etcd:
        kvs, _ = await etcd.get_prefix("XLLM:MIX:")
    names = sorted(kv.key.split(":", 2)[2] for kv in kvs)
    assert names == sorted(e.http_url.removeprefix("http://") for e in engines)
    meta = json.loads(kvs[0].value)
    assert meta["type"] == "MIX" and meta["model"] == "tiny" and meta["block_size"] == 16
    assert meta["incarnation_id"] and meta["rpc_address"]


def test_greedy_through_service_equals_engine(cluster):
    h, svc, engines = cluster
    via_service, direct = client(svc), client(engines[0])
    for prompt in PROMPTS:
        kwargs = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                      extra_body={"ignore_eos": True, "return_token_ids": True})
        a = via_service.completions.create(**kwargs)
        b = direct.completions.create(**kwargs)
        assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
        assert a.choices[0].text == b.choices[0].text
        assert a.usage.completion_tokens == 24
    chat = dict(model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=16,
                temperature=0)
    assert client(svc).chat.completions.create(**chat).choices[0].message.content == \
        client(engines[1]).chat.completions.create(**chat).choices[0].message.content



def test_min_tokens_through_service(cluster):
    """min_tokens reaches the engine over gRPC: stop tokens (here every token greedy makes
    first) end generation no earlier than min_tokens, exactly as on a standalone engine."""
    h, svc, engines = cluster
    via_service, direct = client(svc), client(engines[0])
    kwargs = dict(model="tiny", prompt=PROMPTS[2], max_tokens=16, temperature=0)
    greedy = direct.completions.create(**kwargs, extra_body={
        "ignore_eos": True, "return_token_ids": True}).choices[0].model_extra["token_ids"]
    body = {"ignore_eos": True, "return_token_ids": True, "stop_token_ids": greedy[:6]}
    early = via_service.completions.create(**kwargs, extra_body=body)
    assert early.usage.completion_tokens == 1  # the stop condition alone ends at once
    body["min_tokens"] = 6
    a = via_service.completions.create(**kwargs, extra_body=body)
    b = direct.completions.create(**kwargs, extra_body=body)
    assert a.usage.completion_tokens == b.usage.completion_tokens == 6
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    assert a.choices[0].finish_reason == b.choices[0].finish_reason == "stop"

async def test_fifty_concurrent_streams(cluster):
    h, svc, engines = cluster
    c = aclient(svc)

    async def one(i: int) -> tuple[str, int]:
        stream = await c.completions.create(
            model="tiny", prompt=f"{PROMPTS[i % len(PROMPTS)]} #{i}", max_tokens=12,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, usage = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage

    results = await asyncio.gather(*(one(i) for i in range(50)))
    assert all(text and usage == 12 for text, usage in results)
    served = httpx.get(svc.http_url + "/metrics", trust_env=False).text
    for e in engines:  # both engines served some, as the service counts them
        name = e.http_url.removeprefix("http://")
        m = re.search(rf'xllm_service_instance_requests_total{{instance="{name}",outcome="ok"}} (\d+)',
                      served)
        assert m and int(m.group(1)) > 0
    # Both engines served some of them.
    for e in engines:
        m = httpx.get(e.http_url + "/metrics", trust_env=False).text
        assert metric(e.http_url, "xllm_kv_cache_blocks_used") == 0


def test_bad_input(cluster):
    h, svc, engines = cluster
    c = client(svc)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x", top_p=1.5)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-nope", prompt="x")
    r = httpx.post(svc.http_url + "/v1/chat/completions", content=b"[",
                   headers={"content-type": "application/json"}, trust_env=False)
    assert r.status_code == 400 and r.json()["error"]["message"]


async def test_dropped_stream_through_service_frees_engine_blocks(cluster):
    h, svc, engines = cluster
    await drop_stream_after_first_chunk(svc.http_url)
    # The next Generations reply says ok=false; the engine cancels and frees the blocks.
    await wait_drained([e.http_url for e in engines])

async def test_kill_engine_fails_inflight_and_keeps_serving(cluster, etcd_server):
    h, svc, engines = cluster
    victim, survivor = engines
    c = aclient(svc)

    # n=2: two sequences cannot move to the other engine, so the killed engine's requests
    # end with an error (single-sequence ones would move: see test_mix_migration).
    tasks = [asyncio.create_task(long_stream(c, f"long {i}", n=2)) for i in range(4)]
    # the victim runs some of them when it dies
    await wait_until(lambda: metric(victim.http_url, "xllm_requests_running") > 0, 60, 0.1)
    victim.kill()  # SIGKILL: no deregistration
    killed_at = time.monotonic()
    victim_name = victim.http_url.removeprefix("http://")
    async with EtcdClient(etcd_server.endpoint, namespace=h.namespace) as etcd:
        while await etcd.get(f"XLLM:MIX:{victim_name}") is not None:
            assert time.monotonic() - killed_at < h.ttl_s + 2, "key outlived its lease"
            await asyncio.sleep(0.1)
    key_gone_s = time.monotonic() - killed_at
    # Bound: lease TTL (2 s) + eviction grace (2 s) + probe/slack (2 s).
    bound_s = h.ttl_s + 2.0 + 2.0
    done, pending = await asyncio.wait(tasks, timeout=bound_s + 2)
    errored = [t.result() for t in done if t.result()[0].startswith("error")]
    # The victim's requests ended with an error within the bound; the survivor's go on.
    assert errored, "no in-flight request of the killed engine ended with an error"
    error_s = max(t_end for _, t_end in errored) - killed_at
    assert error_s < bound_s
    assert all("left the cluster" in msg and "cannot be migrated" in msg for msg, _ in errored)
    for t in pending:
        t.cancel()
    print(f"\nkey gone after {key_gone_s:.1f}s, in-flight errors within {error_s:.1f}s")
    sync = client(svc)
    for i in range(6):
        r = sync.completions.create(model="tiny", prompt=f"after {i}", max_tokens=4)
        assert r.choices[0].finish_reason in ("length", "stop")

