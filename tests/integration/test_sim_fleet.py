"""A fleet of simulated engines (xllm_py/sim: the real engine process with a time model
for the forward) behind two services, through a master failover and a restart of every
engine, under streaming load: every request ends with all its tokens or a clean error
(an HTTP status or an SSE error event with a message), never a hang or a cut stream, and
the fleet serves again afterwards."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from xllm_py.sim.fleet import Fleet
from xllm_py.sim.time_model import TimeModel
from xllm_py.utils.config_file import write_settings

pytestmark = pytest.mark.integration

OUTPUT_LEN = 12
# A fast made-up model: the test is about the control plane, not the step times.
TIME_MODEL = TimeModel(prefill_base_ms=1.0, prefill_ms_per_token=0.02, decode_base_ms=2.0,
                       decode_ms_per_seq=0.1, decode_ms_per_ctx_token=0.0)


async def stream(http: httpx.AsyncClient, url: str, i: int) -> str:
    """'ok', 'clean: <message>' or 'unclean: <what happened>'."""
    body = {"model": "tiny", "prompt": [20 + i % 50] * 40, "max_tokens": OUTPUT_LEN,
            "ignore_eos": True, "temperature": 0, "stream": True, "return_token_ids": True}
    tokens, done = 0, False
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                message = json.loads(await r.aread())["error"]["message"]
                return f"clean: {r.status_code} {message}"
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return f"clean: stream error {chunk['error']['message']}"
                tokens += sum(len(c.get("token_ids") or []) for c in chunk["choices"])
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return f"unclean: {type(exc).__name__}: {exc}"
    if done and tokens == OUTPUT_LEN:
        return "ok"
    return f"unclean: stream ended after {tokens} tokens, [DONE] {'seen' if done else 'missing'}"


async def load_until(url: str, stop: asyncio.Event, concurrency: int = 6) -> list[str]:
    outcomes: list[str] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(60, connect=5), trust_env=False) as http:
        async def client(k: int) -> None:
            i = k
            while not stop.is_set():
                outcomes.append(await stream(http, url, i))
                i += concurrency

        await asyncio.gather(*(client(k) for k in range(concurrency)))
    return outcomes


def check(outcomes: list[str], what: str) -> None:
    unclean = [o for o in outcomes if o.startswith("unclean")]
    assert not unclean, f"{what}: {len(unclean)} of {len(outcomes)} requests: {unclean[:5]}"
    assert any(o == "ok" for o in outcomes), f"{what}: no request completed: {outcomes[:5]}"
    print(f"\n{what}: {len(outcomes)} requests, {outcomes.count('ok')} ok, "
          f"clean errors: {sorted(set(o for o in outcomes if o != 'ok'))[:3]}")


@pytest.fixture
def fleet(tmp_path):
    from xllm_py.model.tiny import ensure_tiny_model

    profile = tmp_path / "profile.json"
    TIME_MODEL.save(profile)
    f = Fleet(str(profile), str(ensure_tiny_model("tiny")), tmp_path / "logs", ttl_s=2.0,
              heartbeat_s=0.3, per_host=4, service_args=write_settings(tmp_path / "service.yaml", {"evict_grace_s": 2}),
              log_level="INFO")
    try:
        f.start(num_services=2)
        f.add_engines("PREFILL", 4)
        f.add_engines("DECODE", 4)
        yield f
    finally:
        f.stop()
        logs = "".join(p.read_text(errors="replace")
                       for p in (tmp_path / "logs").glob("*.log"))
        assert "simulated KV missing" not in logs  # every transfer moved its blocks


async def test_failover_and_mass_restart_under_load(fleet):
    waited, _ = await fleet.wait_all_active(120)
    print(f"\n8 simulated engines ACTIVE {waited:.1f}s after the wait began")
    for s in fleet.services:
        s.wait_ready(30, path="/readiness")

    # Master failover: load through the standby, kill the master.
    master = await fleet.master()
    standby = next(s for s in fleet.services if s is not master)
    stop = asyncio.Event()
    load = asyncio.create_task(load_until(standby.http_url, stop))
    await asyncio.sleep(1.5)
    master.kill()
    t0 = time.monotonic()
    took, _ = await fleet.wait_all_active(30, since=t0)
    assert await fleet.master() is standby
    await asyncio.sleep(1.5)  # load on the new master
    stop.set()
    check(await load, "master failover")
    print(f"standby is master with every engine ACTIVE {took:.1f}s after the kill")

    # Every engine killed and restarted under the same names.
    before = await fleet.incarnations()
    assert len(before) == 8
    stop = asyncio.Event()
    load = asyncio.create_task(load_until(standby.http_url, stop))
    await asyncio.sleep(1.5)
    t0 = time.monotonic()
    fleet.kill_engines()
    fleet.restart_engines()
    back, lowest = await fleet.wait_all_active(120, since=t0, replacing=before)
    await asyncio.sleep(1.5)  # load on the restarted fleet
    stop.set()
    check(await load, "mass engine restart")
    print(f"every engine registered again {back:.1f}s after the kill (fewest ACTIVE {lowest})")

    # Serves normally afterwards: a burst, all complete.
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        after = await asyncio.gather(*(stream(http, standby.http_url, i) for i in range(16)))
    assert after == ["ok"] * 16, after
