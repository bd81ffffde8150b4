"""Elastic prefill/decode end to end, in PULL and in PUSH: two services with `--elastic-pd
on` and three engines started MIX (tiny model, each registering a latency profile) on a
real etcd. The master
assigns the split; under a shifting load (long prompts with short answers, then short
prompts with long answers) instances flip while requests are queued on the prefill and
streaming on the decode: every request gives the greedy tokens of the engines' own MIX
path, none fails, every KV pool ends empty. Then the master is killed: the next one
continues from etcd's assignments."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.integration.cluster_harness import (Harness, aclient, labelled, metric, migrations,
                                               wait_drained, wait_until)
from xllm_py.cluster.etcd_client import EtcdClient
from xllm_py.cluster.role_assignment import ROLE_PREFIX, RoleAssignment, role_key
from xllm_py.config import InstanceRole

pytestmark = pytest.mark.integration

PROFILE = {"prefill_base_ms": 1.0, "prefill_ms_per_token": 0.05, "decode_base_ms": 1.0,
           "decode_ms_per_seq": 0.1, "decode_ms_per_ctx_token": 0.0,
           "source": {"note": "test profile"}}
COMMON = ["--block-size", "16", "--num-blocks", "1024"]
P, D = InstanceRole.PREFILL, InstanceRole.DECODE


@pytest.fixture(scope="module", params=["PULL", "PUSH"])
def cluster(etcd_server, tmp_path_factory, request):
    mode = request.param
    logs = tmp_path_factory.mktemp(f"logs-elastic-{mode}")
    profile = logs / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    h = Harness(etcd_server.endpoint, f"elastic-{mode}/", logs)
    try:
        services = [h.service(f"service-{i}", extra=["--elastic-pd", "on"],
                              settings={"elastic_min_dwell_s": 600}) for i in range(2)]
        engines = [h.engine("MIX", f"mix-{i}", extra=[*COMMON, "--kv-cache-transfer-mode", mode],
                            settings={"latency_profile": str(profile)}) for i in range(3)]
        for e in engines:
            e.wait_ready(240)
        for s in services:
            s.wait_ready(60)
        yield h, services, engines
    finally:
        h.stop()


def name_of(engine) -> str:
    return engine.http_url.removeprefix("http://")


async def state(etcd: EtcdClient) -> dict[str, tuple[RoleAssignment | None, str, int]]:
    """name -> (its assignment, the duty it acknowledged, that epoch)."""
    assigned = {kv.key.removeprefix(ROLE_PREFIX): RoleAssignment.from_json(kv.value)
                for kv in (await etcd.get_prefix(ROLE_PREFIX))[0]}
    out = {}
    for kv in (await etcd.get_prefix("XLLM:MIX:"))[0]:
        meta = json.loads(kv.value)
        out[meta["name"]] = (assigned.get(meta["name"]), meta.get("duty", ""),
                             meta.get("duty_epoch", 0))
    return out


async def wait_settled(etcd: EtcdClient, names: list[str], timeout_s: float = 30.0) -> dict:
    """Every instance assigned and its assignment acknowledged: name -> role."""
    latest: dict = {}

    async def check() -> bool:
        latest.update(await state(etcd))
        return all(n in latest and latest[n][0] is not None
                   and latest[n][1] == latest[n][0].role.value
                   and latest[n][2] == latest[n][0].epoch for n in names)

    ok = False
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not ok:
        ok = await check()
        assert ok or asyncio.get_running_loop().time() < deadline, f"not settled: {latest}"
        await asyncio.sleep(0.1)
    return {n: latest[n][0].role for n in names}


def prompt(i: int, length: int) -> list[int]:
    return [(i * 31 + k * 7) % 400 + 20 for k in range(length)]


async def greedy(c: openai.AsyncOpenAI, tokens: list[int], max_tokens: int) -> list[int]:
    out = await c.completions.create(model="tiny", prompt=tokens, max_tokens=max_tokens,
                                     temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.usage.completion_tokens == max_tokens
    return out.choices[0].model_extra["token_ids"]


async def test_assigned_split_flips_under_shifting_load_exact_and_nothing_lost(
        cluster, etcd_server):
    h, services, engines = cluster
    names = [name_of(e) for e in engines]
    async with EtcdClient(etcd_server.endpoint, namespace=h.namespace) as etcd:
        roles = await wait_settled(etcd, names)
        assert P in roles.values() and D in roles.values()
        # the MIX path of each prompt (an engine's own HTTP API) is the reference
        load = ([(prompt(i, 1000), 4) for i in range(16)]         # long prompts, short answers
                + [(prompt(100 + i, 12), 120) for i in range(8)])  # short prompts, long answers
        direct = aclient(engines[0])
        reference = [await greedy(direct, p, n) for p, n in load]

        svc = aclient(services[0])
        prefill = next(n for n in names if roles[n] is P)
        decode = next(n for n in names if roles[n] is D)
        # streams on the decode first, then the prompts queue up on the prefill
        tasks = [asyncio.create_task(greedy(svc, p, n)) for p, n in load[16:]]
        await wait_until(lambda: metric(f"http://{decode}", "xllm_requests_running") > 0, 60)
        tasks += [asyncio.create_task(greedy(svc, p, n)) for p, n in load[:16]]
        await wait_until(lambda: metric(f"http://{prefill}", "xllm_pd_prefill_pending") >= 4, 60)
        # flip now: the prefill with queued prompts turns decode, a decode with streams
        # turns prefill (pinned: the master keeps them so)
        current = await state(etcd)
        for name, role in ((prefill, D), (decode, P)):
            epoch = current[name][0].epoch + 1
            await etcd.put(role_key(name), RoleAssignment(role, epoch, pinned=True).to_json())
        tasks = tasks[8:] + tasks[:8]  # (load's order)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed == []
        assert results == reference
        flipped = await wait_settled(etcd, names)
        assert flipped[decode] is P and flipped[prefill] is D
        # the prefill handed its queue over as a decode, then settled
        await wait_until(lambda: labelled(f"http://{prefill}", "xllm_pd_duty",
                                          'state="DECODE"') == 1, 30)
        log = engines[names.index(prefill)].log_path.read_text(errors="replace")
        assert "duty PREFILL -> DECODE_LEAVING_PREFILL" in log
        assert "duty DECODE_LEAVING_PREFILL -> DECODE" in log
        # after the flip: routed by the new split, still exact
        again = await asyncio.gather(*(greedy(svc, p, n) for p, n in load[::3]))
        assert again == reference[::3]
    assert await wait_drained([e.http_url for e in engines], 30) >= 0
    # every hand-over moved its KV (none recomputed elsewhere)
    assert [metric(e.http_url, "xllm_pd_transfer_failures_total") for e in engines] == [0] * 3
    assert migrations(services[0], "ok") == migrations(services[0], "failed") == 0
    for e in engines:
        assert "Traceback" not in e.log_path.read_text(errors="replace")


async def test_next_master_continues_from_the_assignments(cluster, etcd_server):
    h, services, engines = cluster
    names = [name_of(e) for e in engines]
    async with EtcdClient(etcd_server.endpoint, namespace=h.namespace) as etcd:
        before = await state(etcd)
        master = next(s for s in services if "(this service)" in s.log_path.read_text())
        other = next(s for s in services if s is not master)
        master.kill()
        await wait_until(lambda: "master continues from" in other.log_path.read_text(), 30)
        roles = await wait_settled(etcd, names)
        after = await state(etcd)
        assert {n: after[n][0] for n in names} == {n: before[n][0] for n in names}
        assert set(roles.values()) >= {P, D}
        tokens = prompt(7, 40)
        assert (await greedy(aclient(other), tokens, 16)
                == await greedy(aclient(engines[1]), tokens, 16))

