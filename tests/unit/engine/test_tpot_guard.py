"""TpotGuard (prompt tokens beside decoding streams under a TPOT target) alone and in the
scheduler, on a fake clock."""
from __future__ import annotations

import pytest

from tests.unit.sched_utils import FakeRunner, create_requests, create_scheduler
from xllm_py.engine.tpot_guard import Stream, TpotGuard


def _measured(target_ms: float = 20.0, **kw) -> TpotGuard:
    g = TpotGuard(target_ms, **kw)
    g.observe_step(0.015, 0, 2)  # a decode step: 15 ms
    g.observe_step(0.015 + 64 * 0.0005, 64, 2)  # 64 prompt tokens beside: 0.5 ms each
    return g


def test_costs_come_from_the_steps_and_nothing_is_held_before():
    g = TpotGuard(20.0)
    assert g.prompt_tokens_allowed(0.0, [Stream("a", 64)], 0.0) is None
    g.observe_step(0.030, 64, 0)  # no stream rode it: teaches nothing
    g.observe_step(0.015, 0, 3)
    assert g.step_s == pytest.approx(0.015) and g.token_s is None
    assert g.prompt_tokens_allowed(0.0, [Stream("a", 64)], 0.0) is None
    g.observe_step(0.047, 64, 3)
    assert g.token_s == pytest.approx(0.0005)


def test_a_stream_with_slack_lets_a_chunk_through_by_its_size():
    g = _measured()
    g.stream_token("a", 0.0)
    for i in range(10):  # 10 tokens at 15 ms: 50 ms saved against 20 ms a token
        g.stream_token("a", 0.015 * (i + 1))
    # slack = 20 ms x (10 + 54) - 150 ms - 54 x 15 ms = 320 ms -> 640 tokens at 0.5 ms
    assert g.prompt_tokens_allowed(0.150, [Stream("a", 54)], 0.0) == 640


def test_a_stream_over_its_budget_holds_prompts_until_the_hold_limit():
    g = _measured(max_hold_ms=500)
    g.stream_token("a", 0.0)
    for i in range(10):  # 10 tokens in 500 ms: 50 ms a token so far
        g.stream_token("a", 0.05 * (i + 1))
    assert g.prompt_tokens_allowed(0.5, [Stream("a", 54)], 0.2) == 0
    assert g.num_held == 1
    # the slowest stream decides; a fresh one alone would allow a chunk
    assert g.prompt_tokens_allowed(0.5, [Stream("b", 54)], 0.2) > 0
    assert g.prompt_tokens_allowed(0.5, [Stream("b", 54), Stream("a", 54)], 0.2) == 0
    assert g.prompt_tokens_allowed(0.5, [Stream("a", 54)], 0.5) is None  # held long enough
    g.forget("a")
    assert g.prompt_tokens_allowed(0.5, [Stream("a", 54)], 0.2) > 0  # unknown again


def test_a_chunk_smaller_than_the_minimum_is_not_taken():
    g = _measured(min_chunk=16)
    g.stream_token("a", 0.0)
    # 1 token left: slack = 20 x 2 - 17 - 15 = 8 ms -> 16 tokens; 2 ms less -> 12: none
    g.stream_token("a", 0.017)
    assert g.prompt_tokens_allowed(0.017, [Stream("a", 1)], 0.0) == 16
    assert g.prompt_tokens_allowed(0.019, [Stream("a", 1)], 0.0) == 0


def test_the_horizon_caps_the_tokens_a_stream_is_counted_on():
    g = _measured(horizon_tokens=8)
    # 8 tokens counted, not 1000: slack = 8 x (20 - 15) ms = 40 ms -> 80 tokens
    assert g.prompt_tokens_allowed(0.0, [Stream("a", 1000)], 0.0) == 80


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        TpotGuard(0.0)
    with pytest.raises(ValueError):
        TpotGuard(20.0, min_chunk=0)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _step(s, runner, clock, step_s: float, per_prompt_token_s: float):
    out = s.schedule()
    decode = sum(1 for q in out.seqs if len(q.token_ids) == 1)
    prompt = out.num_batched_tokens - decode
    clock.t += step_s + prompt * per_prompt_token_s
    s.update_from_output(out, runner.step(out))
    return out


def test_the_scheduler_holds_a_prompt_while_streams_run_over_their_target():
    s = create_scheduler(prompt_tpot_target_ms=20.0, prompt_hold_max_ms=300.0,
                         max_prefill_tokens_while_decoding=32)
    clock = s.clock = FakeClock()
    s.tpot_guard.min_chunk = 4
    runner = FakeRunner(4)
    streams = create_requests(2, 8, max_tokens=40)
    for r in streams:
        s.add_request(r)
    _step(s, runner, clock, 0.010, 0.0005)  # their prompts
    for _ in range(4):  # decode-only steps at 30 ms: over the 20 ms target
        _step(s, runner, clock, 0.030, 0.0005)
    s.tpot_guard.observe_step(0.030 + 32 * 0.0005, 32, 2)  # a prompt token's cost known
    late, = create_requests(1, 24, start=5, max_tokens=4)
    s.add_request(late)
    held = 0
    while True:
        out = _step(s, runner, clock, 0.030, 0.0005)
        if any(q.request_id == late.request_id for q in out.seqs):
            break
        held += 1
        assert {q.request_id for q in out.seqs} == {r.request_id for r in streams}
    # held until the hold limit (300 ms at 30 ms a step), then taken in chunks of the cap
    assert held == 10
    assert s.tpot_guard.num_held >= held


def test_the_scheduler_lets_a_prompt_ride_streams_with_slack():
    s = create_scheduler(prompt_tpot_target_ms=50.0, max_prefill_tokens_while_decoding=32)
    clock = s.clock = FakeClock()
    runner = FakeRunner(4)
    streams = create_requests(2, 8, max_tokens=40)
    for r in streams:
        s.add_request(r)
    for _ in range(5):
        _step(s, runner, clock, 0.010, 0.0005)
    s.tpot_guard.observe_step(0.010 + 32 * 0.0005, 32, 2)
    late, = create_requests(1, 24, start=5, max_tokens=4)
    s.add_request(late)
    out = _step(s, runner, clock, 0.010, 0.0005)
    assert late.request_id in {q.request_id for q in out.seqs}
    assert s.tpot_guard.num_held == 0
