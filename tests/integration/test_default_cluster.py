"""A cluster started without tuning flags: a service with its defaults, one
PREFILL and one DECODE engine that measure their latency profiles at start-up, on a real
etcd. The engines log the profile they measured and the scheduler settings derived from
it; the service states TTFT / TPOT targets derived from the profiles; a mixed workload
takes both paths (short prompts prefilled on the decode, long ones on the prefill), and
the greedy tokens are a MIX engine's on both."""
from __future__ import annotations

import random

import httpx
import pytest

from tests.integration.cluster_harness import Harness, client, labelled
from tests.waiting import wait_until_sync
from xllm_py.utils.procs import engine_args, free_port, spawn

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(etcd_server, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs-default")
    h = Harness(etcd_server.endpoint, "default/", logs)
    mix_port = free_port()
    mix = spawn("mix-ref", "xllm_py.engine", engine_args("MIX", mix_port), logs,
                http_url=f"http://127.0.0.1:{mix_port}")
    h.procs.append(mix)
    try:
        svc = h.service(pd_always=False)
        # one torch thread each, as a pinned engine has: the profile is then timed by the
        # engine thread's CPU clock (with two threads on a loaded machine, by the wall
        # clock, and two instances' profiles can differ 100-fold)
        one = {"num_threads": 1}
        prefill = h.engine("PREFILL", "prefill", profile=True, settings=one)
        decode = h.engine("DECODE", "decode", profile=True, settings=one)
        for p in (mix, prefill, decode):
            p.wait_ready(240)
        svc.wait_ready(60, path="/readiness")
        yield svc, prefill, decode, mix
    finally:
        h.stop()


def greedy(c, prompt: list[int], max_tokens: int = 12) -> list[int]:
    out = c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                               temperature=0,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.usage.completion_tokens == max_tokens
    return out.choices[0].model_extra["token_ids"]


def target(svc, name: str) -> float:
    text = httpx.get(svc.http_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'xllm_service_slo_target_ms{{target="{name}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no xllm_service_slo_target_ms{{target={name!r}}} on /metrics")


def test_engines_measure_their_profiles_and_derive_their_settings(cluster):
    svc, prefill, decode, _ = cluster
    for proc in (prefill, decode):
        assert "latency profile measured in" in proc.log_path.read_text(errors="replace")
    assert "'max_num_batched_tokens'" in prefill.log_path.read_text(errors="replace")
    decode_log = decode.log_path.read_text(errors="replace")
    assert "'prompt_tpot_target_ms'" in decode_log
    assert "'max_prefill_tokens_while_decoding'" in decode_log
    # the service states the targets the profiles support (both registered: > 0)
    wait_until_sync(lambda: target(svc, "ttft") > 0 and target(svc, "tpot") > 0, 30)


def test_a_mixed_workload_takes_both_paths_with_the_mix_tokens(cluster):
    svc, _, _, mix = cluster
    via_svc, ref = client(svc), client(mix)

    def decisions(path: str) -> int:
        return labelled(svc.http_url, "xllm_service_pd_decisions_total", f'path="{path}"')

    d0, p0 = decisions("decode"), decisions("pd")
    # random tokens: no prompt shares a block with another; short ones first (under the
    # 256-token default threshold), then long ones (never on the decode's streams)
    rng = random.Random(31)
    short, long = ([[rng.randrange(16, 1000) for _ in range(n)] for n in lengths]
                   for lengths in ((12, 30), (300, 500)))
    for prompt in short + long:
        assert greedy(via_svc, prompt) == greedy(ref, prompt), f"prompt of {len(prompt)}"
    assert decisions("decode") > d0, "no prompt was prefilled on the decode"
    assert decisions("pd") >= p0 + len(long), "a long prompt did not go to the prefill"
    log = svc.log_path.read_text(errors="replace")
    assert "path decode on " in log and "path pd on " in log
