"""A tensor-parallel rank killed under load takes its instance out, and nothing hangs.

Alone: every stream ends within the bound with an error (the failed step's, or one naming
the lost rank), and the engine exits with 1. In a cluster: the instance dies as a crashed one
would; its streams move to the other MIX instance and complete with the tokens of an
uninterrupted run; the survivor ends with no KV block used."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest

from tests.integration.cluster_harness import (Harness, aclient, labelled, metric, migrations,
                                               wait_drained, wait_until)
from xllm_py.utils.procs import ChildProcess, engine_args, free_port, spawn

pytestmark = pytest.mark.integration

TP2 = ["--tensor-parallel-size", "2"]
MAX_TOKENS = 1500  # long enough that the streams still run when the rank is killed
# From the kill: the rank's exit is seen within 0.2 s (executor watch) or at the next
# collective; the server then ends the streams and stops (each stop step <= 5 s).
ALONE_BOUND_S = 15.0


def rank_pids(proc: ChildProcess) -> list[int]:
    m = re.search(r"tensor parallel: \d+ ranks \(pids \[([\d, ]+)\]\)", proc.log_tail(400))
    assert m, proc.log_tail()
    return [int(p) for p in m.group(1).split(",")]


async def _stream(url: str, prompt: str, max_tokens: int, out: dict) -> dict:
    """One greedy stream straight to an engine: its tokens and how it ended, into ``out``."""
    out.update(ids=[], error=None, end=None)
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
        async with http.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}) as resp:
            if resp.status_code != 200:
                out["error"] = (await resp.aread()).decode()
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                if '"error"' in line:
                    out["error"] = line
                    continue
                m = re.search(r'"token_ids":\[([\d,]*)\]', line)
                if m and m.group(1):
                    out["ids"] += [int(t) for t in m.group(1).split(",")]
    out["end"] = time.monotonic()
    return out


async def test_lost_rank_ends_a_lone_instance_cleanly(tmp_path):
    port = free_port()
    proc = spawn("engine-tp2", "xllm_py.engine", engine_args("MIX", port, extra=TP2),
                 tmp_path, http_url=f"http://127.0.0.1:{port}")
    try:
        await asyncio.to_thread(proc.wait_ready, 240)
        outs: list[dict] = [{} for _ in range(3)]
        tasks = [asyncio.create_task(_stream(proc.http_url, f"story {i}", 1500, out))
                 for i, out in enumerate(outs)]
        await wait_until(lambda: all(o.get("ids") for o in outs), 30)
        os.kill(rank_pids(proc)[0], signal.SIGKILL)
        killed = time.monotonic()
        done, pending = await asyncio.wait(tasks, timeout=ALONE_BOUND_S)
        assert not pending, "a stream still open past the bound"
        results = [t.result() for t in done]
        for r in results:
            assert r["end"] - killed < ALONE_BOUND_S
            # the step that hit the dead peer fails its requests, or the server's abort does
            assert len(r["ids"]) < 1500 and r["error"] is not None, r
            assert "engine step failed" in r["error"] or "tensor-parallel rank" in r["error"]
        code = await asyncio.to_thread(proc.popen.wait, ALONE_BOUND_S)
        assert code == 1
        assert "tensor-parallel instance broken" in proc.log_tail(400)
    finally:
        proc.kill()


async def test_lost_rank_in_a_cluster_moves_its_streams(etcd_server, tmp_path):
    h = Harness(etcd_server.endpoint, "tp-lost-rank/", tmp_path)
    try:
        svc = h.service()
        tp2 = h.engine("MIX", "mix-tp2", extra=TP2)
        tp1 = h.engine("MIX", "mix-tp1")
        for e in (tp2, tp1):
            await asyncio.to_thread(e.wait_ready, 240)
        await asyncio.to_thread(svc.wait_ready, 60, "/readiness")
        await wait_until(lambda: labelled(svc.http_url, "xllm_service_instances",
                                          'state="ACTIVE"') == 2, 30)
        c = aclient(svc)
        prompts = [f"a tp story {i} begins" for i in range(4)]
        runs: list[list[int]] = [[] for _ in prompts]
        body = {"ignore_eos": True, "return_token_ids": True}

        async def one(prompt: str, ids: list[int]) -> None:
            stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, extra_body=body)
            async for chunk in stream:
                ids += chunk.choices[0].model_extra.get("token_ids") or []

        tasks = [asyncio.create_task(one(p, r)) for p, r in zip(prompts, runs)]
        on = lambda e: metric(e.http_url, "xllm_requests_running")  # noqa: E731
        for what, pred in (("a token on every stream", lambda: all(runs)),
                           ("a stream running on the TP 2 instance", lambda: on(tp2) >= 1)):
            try:
                await wait_until(pred, 60)
            except AssertionError:
                raise AssertionError(f"no {what} within 60 s: tokens {[len(r) for r in runs]}, "
                                     f"running {on(tp2)} + {on(tp1)}, done "
                                     f"{[t.done() for t in tasks]}") from None
        for t in tasks:  # one that ended already must have ended well (checked below)
            if t.done():
                t.result()
        num_moved = int(on(tp2))
        assert num_moved >= 1, f"the TP 2 instance's streams ended before the kill: tokens " \
                               f"{[len(r) for r in runs]}"
        os.kill(rank_pids(tp2)[0], signal.SIGKILL)
        done, pending = await asyncio.wait(tasks, timeout=40)
        assert not pending, f"streams still open 40 s after the kill: {[len(r) for r in runs]}"
        for t in done:
            t.result()
        assert await asyncio.to_thread(tp2.popen.wait, 10) == 1
        assert migrations(svc, "ok") == num_moved and migrations(svc, "failed") == 0
        await wait_drained([tp1.http_url])
        refs = await asyncio.gather(*(c.completions.create(
            model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0, extra_body=body)
            for p in prompts))
        for ids, ref in zip(runs, refs):
            assert ids == ref.choices[0].model_extra["token_ids"]
    finally:
        h.stop()
