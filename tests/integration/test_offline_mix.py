"""Offline requests on a MIX engine process (tiny model): they finish beside online
streams with the greedy output they have when sent online, and the engine's offline
gauges go back to zero."""
from __future__ import annotations

import asyncio

import openai
import pytest

from tests.integration.cluster_harness import aclient, metric, wait_drained
from tests.waiting import wait_until
from xllm_py.utils.procs import engine_args, free_port, spawn

pytestmark = pytest.mark.integration

BODY = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    port = free_port()
    # few blocks and seats: online work must take both from the offline requests
    proc = spawn("engine-mix", "xllm_py.engine",
                 engine_args("MIX", port, extra=["--block-size", "8", "--num-blocks", "40",
                                                 "--max-num-seqs", "6"]),
                 tmp_path_factory.mktemp("logs"), http_url=f"http://127.0.0.1:{port}")
    try:
        proc.wait_ready(180)
        yield proc
    finally:
        proc.terminate()


async def test_offline_beside_online_keeps_greedy_output(engine):
    c = aclient(engine)
    prompts = [f"Offline prompt number {i}: once upon a time" for i in range(10)]

    async def one(prompt: str, offline: bool, max_tokens: int = 24) -> list[int]:
        r = await c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, extra_body={**BODY, "offline": offline})
        return r.choices[0].model_extra["token_ids"]

    offline = [asyncio.create_task(one(p, True, 120)) for p in prompts]
    await wait_until(lambda: metric(engine.http_url, "xllm_offline_requests_running") > 0, 30)
    online = await asyncio.gather(*(one(f"Online {i}: the quick brown fox", False, 40)
                                    for i in range(4)))
    offline_ids = await asyncio.gather(*offline)
    assert all(len(ids) == 40 for ids in online)
    assert metric(engine.http_url, "xllm_offline_suspensions_total") > 0
    alone = [await one(p, False, 120) for p in prompts]  # the same prompts, online, one by one
    assert offline_ids == alone
    await wait_drained([engine.http_url], 10)
    for name in ("waiting", "running", "preempted"):
        assert metric(engine.http_url, f"xllm_offline_requests_{name}") == 0


async def test_offline_flag_is_checked(engine):
    c = aclient(engine)
    with pytest.raises(openai.BadRequestError):
        await c.completions.create(model="tiny", prompt="x", max_tokens=2,
                                   extra_body={"offline": "maybe"})
