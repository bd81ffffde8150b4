"""A MIX engine killed mid-stream: its single-sequence requests migrate to the other MIX
engine (MultiGenerations, KV recomputed there) and end exactly as an uninterrupted run;
a MIX engine refuses a MultiGenerations that carries KV (it has no KV transfer)."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest

from tests.integration.cluster_harness import (Harness, aclient, metric, wait_drained,
                                               wait_until)
from tests.integration.test_pd_failures import migrations
from xllm_py.cluster.etcd_client import EtcdClient
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration


async def test_mix_killed_mid_stream_migrates_to_the_other_mix(etcd_server, tmp_path):
    """SIGKILL the MIX engine that serves more greedy streams: each pauses, then continues
    on the survivor, and ends with exactly the tokens (and text) of an uninterrupted run."""
    h = Harness(etcd_server.endpoint, "mix-migrate/", tmp_path)
    try:
        svc = h.service()
        engines = [h.engine("MIX", f"mix-{i}") for i in range(2)]
        for e in engines:
            e.wait_ready(180)
        svc.wait_ready(60, path="/readiness")
        await wait_until(lambda: 'xllm_service_instances{state="ACTIVE"} 2' in httpx.get(
            svc.http_url + "/metrics", timeout=5, trust_env=False).text, 30, step_s=0.1)
        c = aclient(svc)
        max_tokens, prompts = 800, [f"a mix story {i} begins" for i in range(4)]
        runs = [{"ids": [], "text": "", "times": []} for _ in prompts]

        async def one(prompt: str, run: dict) -> None:
            stream = await c.completions.create(
                model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
            async for chunk in stream:
                run["ids"] += chunk.choices[0].model_extra.get("token_ids") or []
                run["text"] += chunk.choices[0].text
                run["times"].append(time.monotonic())

        tasks = [asyncio.create_task(one(p, r)) for p, r in zip(prompts, runs)]

        # Kill when every stream has a token relayed (it can move) and an engine runs it.
        # Judged by the engines: on a loaded machine this client lags them by seconds.
        def running() -> list[float]:
            return [metric(e.http_url, "xllm_requests_running") for e in engines]

        def state() -> str:
            return (f"tokens per stream {[len(r['ids']) for r in runs]}, running "
                    f"{running()}, streams done {[t.done() for t in tasks]}")

        await _within(lambda: all(r["ids"] for r in runs), 30, "a token on every stream", state)
        await _within(lambda: sum(running()) == len(runs), 30, "every stream running", state)
        counts = running()
        victim, survivor = engines if counts[0] >= counts[1] else engines[::-1]
        victim.kill()
        num_moved = int(max(counts))
        killed = time.monotonic()
        done, pending = await asyncio.wait(tasks, timeout=30)
        assert not pending, f"streams still open 30 s after the kill: {state()}"
        for t in done:
            t.result()

        pauses = [max(b - a for a, b in zip(r["times"], r["times"][1:])) for r in runs]
        print(f"\nMIX engine killed with {num_moved} of {len(runs)} streams on it: all "
              f"completed {max(r['times'][-1] for r in runs) - killed:.1f}s after the kill; "
              f"longest pause per stream {[round(p, 1) for p in pauses]}s")
        assert migrations(svc, "ok") == num_moved and migrations(svc, "failed") == 0
        assert max(pauses) < h.ttl_s + 2.0 + 6.0  # lease TTL + eviction grace + recompute
        refs = await asyncio.gather(*(c.completions.create(  # on the survivor alone
            model="tiny", prompt=p, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}) for p in prompts))
        for run, ref in zip(runs, (r.choices[0] for r in refs)):
            assert len(run["ids"]) == max_tokens
            assert run["ids"] == ref.model_extra["token_ids"]
            assert run["text"] == ref.text  # also where the move split a UTF-8 character
        await wait_drained([survivor.http_url])
        await _assert_kv_refused(etcd_server.endpoint, h.namespace, survivor)
    finally:
        h.stop()


async def _within(pred, timeout_s: float, what: str, state) -> None:
    try:
        await wait_until(pred, timeout_s, step_s=0.05)
    except AssertionError:
        raise AssertionError(f"no {what} within {timeout_s:.0f}s: {state()}") from None


async def _assert_kv_refused(endpoint: str, namespace: str, engine) -> None:
    """MultiGenerations with `kv` on a MIX engine: INVALID_ARGUMENT that says why."""
    name = engine.http_url.removeprefix("http://")
    async with EtcdClient(endpoint, namespace=namespace) as etcd:
        kv = await etcd.get(f"XLLM:MIX:{name}")
    assert kv is not None, f"{name} not registered"
    req = pb.DisaggRequest(req_id="kv-1", service_req_id="kv-1", max_tokens=8, n=1,
                           source_xservice_addr="127.0.0.1:1")
    req.prompt_tokens.extend([5, 6, 7])
    item = pb.MultiGenerationsRequest(request=req, generated_token_ids=[1],
                                      kv=pb.DisaggGenerationsRequest(req_id="kv-1"))
    async with grpc.aio.insecure_channel(json.loads(kv.value)["rpc_address"]) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.DisaggPDServiceStub(ch).MultiGenerations(
                pb.MultiGenerationsRequests(reqs=[item]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv is set, but a MIX instance has no KV transfer" in e.value.details()
