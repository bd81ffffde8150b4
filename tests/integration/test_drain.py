"""Graceful shutdown (SIGTERM drains): an engine finishes the requests it runs, takes no
new ones (503; in a cluster the service routes them elsewhere), then leaves; a second
signal cuts the drain short."""
from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest

from tests.integration.cluster_harness import (Harness, aclient, labelled, metric, migrations,
                                               start_mix_cluster, wait_until)
from xllm_py.utils.procs import engine_args, free_port, spawn

pytestmark = pytest.mark.integration


def instances(svc, state: str) -> int:
    return labelled(svc.http_url, "xllm_service_instances", f'state="{state}"')


def finished_requests(svc, engine) -> int:
    """Requests the service saw end well on `engine`."""
    name = engine.http_url.removeprefix("http://")
    return max(0, labelled(svc.http_url, "xllm_service_instance_requests_total",
                           f'instance="{name}",outcome="ok"'))


async def test_sigterm_drains_a_mix_engine_behind_the_service(etcd_server, tmp_path):
    """Streams on the stopping engine complete there (no error, no migration), new
    requests go to the other engine, and the engine exits once its streams are done."""
    h = Harness(etcd_server.endpoint, "drain/", tmp_path)
    try:
        svc, engines = start_mix_cluster(h, 2)
        c = aclient(svc)
        max_tokens, prompts = 1500, [f"a long story {i} begins" for i in range(3)]

        async def one(prompt: str) -> list[int]:
            r = await c.completions.create(
                model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
            return r.choices[0].model_extra["token_ids"]

        tasks = [asyncio.create_task(one(p)) for p in prompts]

        counts: list[float] = []

        def all_running() -> bool:
            counts[:] = [metric(e.http_url, "xllm_requests_running") for e in engines]
            return sum(counts) == len(prompts)

        await wait_until(all_running, 30)
        stopping, other = engines if counts[0] >= counts[1] else engines[::-1]
        on_stopping = int(max(counts))
        stopping.popen.send_signal(signal.SIGTERM)
        t0 = time.monotonic()

        # It says so at once, and the service stops routing to it.
        await wait_until(lambda: instances(svc, "DRAINING") == 1, 5, step_s=0.05)
        r = httpx.get(stopping.http_url + "/readiness", timeout=5, trust_env=False)
        assert r.status_code == 503 and "draining" in r.json()["reason"]
        with pytest.raises(openai.APIStatusError) as e:  # straight to it: 503
            await aclient(stopping).completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and "draining" in e.value.message
        news = await asyncio.gather(*(c.completions.create(
            model="tiny", prompt=f"short {i}", max_tokens=4,
            extra_body={"ignore_eos": True}) for i in range(4)))
        assert [n.usage.completion_tokens for n in news] == [4] * 4
        assert stopping.alive()  # still finishing its streams

        results = await asyncio.wait_for(asyncio.gather(*tasks), 90)
        assert [len(ids) for ids in results] == [max_tokens] * len(prompts)
        code = await asyncio.to_thread(stopping.popen.wait, 30)
        took = time.monotonic() - t0
        print(f"\ndrain: {on_stopping} stream(s) finished on the stopping engine, which "
              f"exited {took:.1f}s after SIGTERM (code {code})")
        assert code == 0
        assert migrations(svc, "ok") == 0 and migrations(svc, "failed") == 0
        # It ran its own streams and none of the new requests.
        assert finished_requests(svc, stopping) == on_stopping
        refs = await asyncio.gather(*(c.completions.create(  # the same, on the other engine
            model="tiny", prompt=p, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}) for p in prompts))
        assert results == [ref.choices[0].model_extra["token_ids"] for ref in refs]
    finally:
        h.stop()


async def test_a_second_signal_ends_the_drain(tmp_path):
    """Standalone engine: SIGTERM with a long stream running starts a drain (new requests
    503); a second SIGTERM stops the engine without waiting for the stream."""
    port = free_port()
    engine = spawn("mix", "xllm_py.engine", engine_args("MIX", port), tmp_path,
                   http_url=f"http://127.0.0.1:{port}")
    try:
        engine.wait_ready(180)
        got: list[str] = []

        async def long_stream() -> None:
            async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
                async with http.stream("POST", engine.http_url + "/v1/completions", json={
                        "model": "tiny", "prompt": "go on", "max_tokens": 1800,
                        "ignore_eos": True, "stream": True}) as resp:
                    async for line in resp.aiter_lines():
                        got.append(line)

        task = asyncio.create_task(long_stream())
        await wait_until(lambda: len(got) >= 5, 30)
        engine.popen.send_signal(signal.SIGTERM)
        await wait_until(lambda: httpx.get(engine.http_url + "/readiness", timeout=5,
                                           trust_env=False).status_code == 503, 5)
        assert httpx.get(engine.http_url + "/health", timeout=5, trust_env=False).is_success
        r = httpx.post(engine.http_url + "/v1/completions", timeout=5, trust_env=False,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        assert engine.alive() and not task.done()
        engine.popen.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code = await asyncio.to_thread(engine.popen.wait, 20)
        print(f"\nsecond signal: exited {time.monotonic() - t0:.1f}s later (code {code})")
        assert code == 0
        try:
            await asyncio.wait_for(task, 10)
        except (httpx.HTTPError, asyncio.TimeoutError):
            pass
        chunks = [line for line in got if line.startswith("data: {") and '"text"' in line]
        assert len(chunks) < 1800 and any("shutting down" in line for line in got), got[-3:]
    finally:
        engine.terminate()
