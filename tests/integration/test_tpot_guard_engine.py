"""prompt_tpot_target_ms (the settings file) in a real engine: a prompt that arrives
while a stream decodes is held back while the stream is over the target, then computed once it has waited the
hold limit derived from the engine's latency profile (xllm_py/cluster/slo_defaults.py);
its greedy tokens equal those of the same prompt alone, the stream runs on, and
xllm_prompt_steps_held_total counts the held steps."""
from __future__ import annotations

import json
import threading
import time

import pytest

from tests.integration.cluster_harness import client, metric
from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.cluster.slo_defaults import hold_limit_ms
from xllm_py.utils.config_file import write_settings
from xllm_py.utils.procs import engine_args, free_port, spawn

pytestmark = pytest.mark.integration

# 0.1 ms a prompt token: a 2048-token prompt alone 0.2 s, so a hold limit of ~0.18 s,
# well inside the stream below however fast the machine steps it (2000 tokens: ~0.5 s
# at the tiny model's fastest), and far above a 30-token prompt's unheld TTFT
PROFILE = LatencyProfile(prefill_base_ms=0.0, prefill_ms_per_token=0.1, decode_base_ms=1.0,
                         decode_ms_per_seq=0.1, decode_ms_per_ctx_token=0.0)
HOLD_MS = hold_limit_ms(PROFILE)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs-tpot-guard")
    profile = logs / "profile.json"
    profile.write_text(json.dumps(PROFILE.to_dict()))
    port = free_port()
    # a target no stream can meet: every prompt beside a stream waits for the hold limit
    settings = write_settings(logs / "settings.yaml", {
        "prompt_tpot_target_ms": 0.001, "latency_profile": str(profile)})
    proc = spawn("mix-guard", "xllm_py.engine", engine_args("MIX", port, extra=settings), logs,
                 http_url=f"http://127.0.0.1:{port}")
    try:
        proc.wait_ready(180)
        yield proc
    finally:
        proc.terminate()


def greedy(c, prompt: list[int], max_tokens: int = 8) -> tuple[list[int], float]:
    """Tokens of a streamed greedy completion and its time to first token (s)."""
    t0 = time.monotonic()
    ttft, tokens = None, []
    for chunk in c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, stream=True,
                                      extra_body={"ignore_eos": True, "return_token_ids": True}):
        ids = chunk.choices[0].model_extra.get("token_ids") or [] if chunk.choices else []
        if ids and ttft is None:
            ttft = time.monotonic() - t0
        tokens += ids
    assert len(tokens) == max_tokens and ttft is not None
    return tokens, ttft


def test_a_prompt_beside_an_over_target_stream_waits_for_the_hold_limit(engine):
    c = client(engine)
    prompts = [list(range(100 + 40 * i, 130 + 40 * i)) for i in range(2)]
    alone = [greedy(c, p)[0] for p in prompts]  # no stream: nothing held
    assert metric(engine.http_url, "xllm_prompt_steps_held_total") == 0

    stream_tokens: list[int] = []
    started, done = threading.Event(), threading.Event()

    def run_stream() -> None:
        for chunk in c.completions.create(
                model="tiny", prompt=list(range(5, 20)), max_tokens=2000, temperature=0,
                stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}):
            stream_tokens.extend(chunk.choices[0].model_extra.get("token_ids") or []
                                 if chunk.choices else [])
            started.set()
        done.set()

    t = threading.Thread(target=run_stream, daemon=True)
    t.start()
    assert started.wait(60), "the stream never started"
    # the first prompt beside the stream teaches the guard what a prompt token costs
    first, _ = greedy(c, prompts[0])
    assert first == alone[0]
    second, ttft = greedy(c, prompts[1])
    assert second == alone[1]
    assert ttft >= HOLD_MS / 1000.0, f"answered in {ttft:.3f} s: not held"
    assert metric(engine.http_url, "xllm_prompt_steps_held_total") > 0
    assert not done.is_set(), "the stream ended before the held prompt: nothing to hold for"
    n = len(stream_tokens)
    deadline = time.monotonic() + 30
    while len(stream_tokens) == n:  # the stream runs on after the held prompt
        assert time.monotonic() < deadline, "the stream stalled"
        time.sleep(0.05)
    assert done.wait(60), "the stream did not end"
    assert len(stream_tokens) == 2000  # and it ran to its end
