"""Conditional disaggregation end to end: service with SLO_AWARE + PREFILL +
DECODE processes (each registering a latency profile) on a real etcd. Short prompts, and
a long one once it is in the decode's prefix cache, are prefilled on the decode; long
ones on the prefill. Greedy tokens equal a MIX engine's on both paths, and the service's
decision counter shows both were taken. The decode caps the prompt tokens of a step beside
running streams (max_prefill_tokens_while_decoding): prompts prefilled there while a
stream runs still give the MIX tokens."""
from __future__ import annotations

import json
import threading
import time

import pytest

from tests.integration.cluster_harness import Harness, client, labelled
from xllm_py.utils.procs import engine_args, free_port, spawn

pytestmark = pytest.mark.integration

BLOCK = 8
LOCAL_MAX = 24  # prompts with at most this many uncached tokens: prefilled on the decode
DECODE_CAP = 4  # the decode's prompt tokens per step beside running streams
PROFILE = {"prefill_base_ms": 1.0, "prefill_ms_per_token": 0.05, "decode_base_ms": 1.0,
           "decode_ms_per_seq": 0.1, "decode_ms_per_ctx_token": 0.0,
           "source": {"note": "test profile"}}


@pytest.fixture(scope="module")
def cluster(etcd_server, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs-cond")
    profile = logs / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    h = Harness(etcd_server.endpoint, "pd-cond/", logs)
    common = ["--block-size", str(BLOCK), "--num-blocks", "1024"]
    mix_port = free_port()
    mix = spawn("mix-ref", "xllm_py.engine", engine_args("MIX", mix_port, extra=common), logs,
                http_url=f"http://127.0.0.1:{mix_port}")
    h.procs.append(mix)
    try:
        # Lax targets: the path follows the prompt's uncached length alone (a large PD
        # overhead: a short prompt never answers first through an idle prefill).
        svc = h.service(extra=["--load-balance-policy", "SLO_AWARE", "--ttft-slo-ms", "100000",
                               "--tpot-slo-ms", "100000"],
                        settings={"local_prefill_max_tokens": LOCAL_MAX, "pd_overhead_ms": 1000})
        with_profile = {"latency_profile": str(profile)}
        prefill = h.engine("PREFILL", "prefill", extra=common, settings=with_profile)
        # (no TPOT guard: the test profile is not this engine's cost, a guard derived
        # from it would hold every prompt)
        decode = h.engine("DECODE", "decode", extra=common, settings={
            **with_profile, "max_prefill_tokens_while_decoding": DECODE_CAP,
            "prompt_tpot_target_ms": 0})
        for p in (mix, prefill, decode):
            p.wait_ready(180)
        svc.wait_ready(60, path="/readiness")
        yield h, svc, prefill, decode, mix
    finally:
        h.stop()


def decisions(svc, path: str) -> int:
    n = labelled(svc.http_url, "xllm_service_pd_decisions_total", f'path="{path}"')
    assert n >= 0, "xllm_service_pd_decisions_total not in the service's /metrics"
    return n


def greedy(c, prompt: list[int], max_tokens: int = 12) -> list[int]:
    out = c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                               temperature=0,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.usage.completion_tokens == max_tokens
    return out.choices[0].model_extra["token_ids"]


def test_both_paths_give_the_mix_tokens(cluster):
    h, svc, prefill, decode, mix = cluster
    via_svc, ref = client(svc), client(mix)
    # no prompt shares a block with another (a cached prefix would shorten the uncached part)
    short = [list(range(300 + 40 * i, 300 + 40 * i + n)) for i, n in enumerate((1, 7, 8, 9, 16, 24))]
    long = [list(range(600 + 100 * i, 600 + 100 * i + n)) for i, n in enumerate((25, 40, 64, 80))]
    d0, p0 = decisions(svc, "decode"), decisions(svc, "pd")
    for prompt in short + long:
        assert greedy(via_svc, prompt) == greedy(ref, prompt), f"prompt of {len(prompt)}"
    assert decisions(svc, "decode") - d0 == len(short)
    assert decisions(svc, "pd") - p0 == len(long)
    log = svc.log_path.read_text(errors="replace")
    assert "prompt tokens, path decode on " in log and "SLO_AWARE short prompt" in log
    assert "prompt tokens, path pd on " in log and "SLO_AWARE long prompt" in log


def test_a_long_prompt_cached_on_the_decode_is_prefilled_there(cluster):
    h, svc, prefill, decode, mix = cluster
    via_svc, ref = client(svc), client(mix)
    prompt = list(range(20, 20 + 70))  # 70 tokens > LOCAL_MAX
    p0 = decisions(svc, "pd")

    def cached_on_decode() -> float:
        return labelled(svc.http_url, "xllm_service_prefix_cached_blocks",
                        f'instance="{decode.http_url.removeprefix("http://")}"')

    # Other tests' prompts may be cached there, their last blocks still on the way in a
    # heartbeat (every 0.3 s): start from a count that has settled.
    c0, deadline = cached_on_decode(), time.monotonic() + 20
    while True:
        time.sleep(1.0)  # > 3 heartbeats
        c1 = cached_on_decode()
        if c1 == c0:
            break
        assert time.monotonic() < deadline, "the decode's cached block count never settled"
        c0 = c1
    expected = greedy(ref, prompt)
    assert greedy(via_svc, prompt) == expected
    assert decisions(svc, "pd") == p0 + 1
    # Its KV is now in the decode's prefix cache; the service hears of it by heartbeat.
    deadline = time.monotonic() + 20
    while cached_on_decode() < c0 + 70 // BLOCK:
        assert time.monotonic() < deadline, "the decode's cache events never reached the service"
        time.sleep(0.1)
    d0 = decisions(svc, "decode")
    assert greedy(via_svc, prompt + [7, 8]) == greedy(ref, prompt + [7, 8])
    assert decisions(svc, "decode") == d0 + 1 and decisions(svc, "pd") == p0 + 1


def test_prompts_prefilled_beside_a_running_stream_give_the_mix_tokens(cluster):
    """While a long stream decodes on the decode, short prompts are computed there in
    chunks of DECODE_CAP tokens mixed into its steps: every output equals MIX's."""
    h, svc, prefill, decode, mix = cluster
    via_svc, ref = client(svc), client(mix)
    # lengths no other test here uses: the service's log line of each names its path
    stream_prompt = list(range(900, 911))
    shorts = [list(range(920 + 30 * i, 920 + 30 * i + n)) for i, n in enumerate((13, 19, 23))]
    expected_stream = greedy(ref, stream_prompt, max_tokens=200)
    expected = [greedy(ref, p) for p in shorts]
    got: dict[str, list[int]] = {}
    first = threading.Event()

    def run_stream() -> None:
        tokens: list[int] = []
        for chunk in via_svc.completions.create(
                model="tiny", prompt=stream_prompt, max_tokens=200, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True}):
            tokens += chunk.choices[0].model_extra.get("token_ids") or []
            first.set()
        got["stream"] = tokens

    t = threading.Thread(target=run_stream)
    t.start()
    try:
        assert first.wait(60), "the stream never started"
        outs = [greedy(via_svc, p) for p in shorts]
        assert "stream" not in got, "the stream ended before the prompts ran beside it"
    finally:
        t.join(120)
    assert outs == expected
    assert got["stream"] == expected_stream
    log = svc.log_path.read_text(errors="replace")
    for n in (11, 13, 19, 23):
        assert f" {n} prompt tokens, path decode on " in log, f"the {n}-token prompt's path"

