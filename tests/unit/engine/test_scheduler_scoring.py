"""ContinuousScheduler for requests that score their prompt: the logits rows asked of the
runner per chunk (prompt logprobs), no prefix-cache hit for them, and max_tokens 0 ending
right after the prefill."""
from __future__ import annotations

import pytest

from tests.unit.sched_utils import (
    FakeRunner,
    assert_scheduler_empty,
    create_requests,
    create_scheduler,
    run_to_completion,
)
from xllm_py.engine.scheduler import RequestUpdate
from xllm_py.request import Request
from xllm_py.sampling_params import SamplingParams


def _plan(scheduler, runner, steps: int) -> list[list[tuple]]:
    plan = []
    for _ in range(steps):
        out = scheduler.schedule()
        plan.append([(q.request_id, q.start_pos, len(q.token_ids), q.sample,
                      q.num_prompt_logprob_rows) for q in out.seqs])
        scheduler.update_from_output(out, runner.step(out))
    return plan


def test_chunks_ask_for_every_row_that_scores_a_prompt_token():
    s = create_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    runner = FakeRunner(4)
    a = create_requests(1, 40, max_tokens=2, prompt_logprobs=2)[0]
    b = create_requests(1, 10, start=1, max_tokens=2)[0]
    s.add_request(a)
    s.add_request(b)
    # rows at positions 0..38 score tokens 1..39; position 39 samples; decode asks none
    assert _plan(s, runner, 4) == [
        [("req-0", 0, 16, False, 16)],
        [("req-0", 16, 16, False, 16)],
        [("req-0", 32, 8, True, 7), ("req-1", 0, 8, False, 0)],
        [("req-0", 40, 1, True, 0), ("req-1", 8, 2, True, 0)],
    ]
    run_to_completion(s, runner)
    assert_scheduler_empty(s)


def test_a_one_token_prompt_has_nothing_to_score():
    s = create_scheduler()
    runner = FakeRunner(4)
    s.add_request(Request("a", [7], SamplingParams(max_tokens=1, prompt_logprobs=0)))
    assert _plan(s, runner, 1) == [[("a", 0, 1, True, 0)]]
    assert_scheduler_empty(s)


def test_a_request_scoring_its_prompt_takes_no_prefix_hit_and_others_still_do():
    s = create_scheduler()
    runner = FakeRunner(4)
    prefix = list(range(500, 508))
    s.add_request(Request("a", prefix + [1, 2, 3], SamplingParams(max_tokens=4)))
    _plan(s, runner, 1)  # a's full blocks are cached now
    scoring = Request("b", prefix + [9], SamplingParams(max_tokens=4, prompt_logprobs=1))
    plain = Request("c", prefix + [9, 10], SamplingParams(max_tokens=4))
    s.add_request(scoring)
    s.add_request(plain)
    out = s.schedule()
    seqs = {q.request_id: q for q in out.seqs}
    assert (seqs["b"].start_pos, len(seqs["b"].token_ids), seqs["b"].num_prompt_logprob_rows) == (
        0, 9, 8)
    assert (seqs["c"].start_pos, seqs["c"].token_ids) == (8, [9, 10])
    assert scoring.num_cached_tokens == 0 and plain.num_cached_tokens == 8
    assert seqs["b"].block_table[:2] != seqs["c"].block_table[:2]  # recomputed, not shared
    s.update_from_output(out, runner.step(out))
    run_to_completion(s, runner)
    assert scoring.num_output_tokens == 4
    assert_scheduler_empty(s)


def test_max_tokens_zero_ends_after_the_prefill_without_a_token():
    s = create_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    runner = FakeRunner(4)
    score = Request("s", list(range(100, 112)),
                    SamplingParams(max_tokens=0, prompt_logprobs=0))
    other = create_requests(1, 3, max_tokens=2)[0]
    s.add_request(score)
    s.add_request(other)
    out = s.schedule()
    assert [(q.request_id, q.start_pos, len(q.token_ids), q.sample) for q in out.seqs] == [
        ("s", 0, 8, False)]
    assert s.update_from_output(out, runner.step(out)) == []
    out = s.schedule()
    assert [(q.request_id, q.start_pos, len(q.token_ids), q.sample, q.num_prompt_logprob_rows)
            for q in out.seqs] == [("s", 8, 4, False, 3), ("req-0", 0, 3, True, 0)]
    updates = s.update_from_output(out, runner.step(out))
    assert updates[0] == RequestUpdate("s", [], True, "length")
    assert score.output_token_ids == [] and score.is_finished()
    assert "s" not in s.requests and not score.block_ids
    run_to_completion(s, runner)
    assert other.num_output_tokens == 2
    assert_scheduler_empty(s)


def test_max_tokens_zero_on_a_prefill_instance_holds_no_kv():
    s = create_scheduler()
    runner = FakeRunner(4)
    s.add_request(Request("p", [5, 6, 7], SamplingParams(max_tokens=0, echo=True),
                          remote_decode=True))
    out = s.schedule()
    assert s.update_from_output(out, runner.step(out)) == [
        RequestUpdate("p", [], True, "length", remote_decode=True)]
    assert s.remote.num_sending_kv == 0
    assert_scheduler_empty(s)


@pytest.mark.parametrize("num_blocks, prompt_len, budget, mid_prefill", [
    (7, 12, 8, True),  # 6 usable blocks of 4: b is preempted before its first token
    (5, 6, 64, False),  # 4 usable blocks: b is preempted while it decodes
])
def test_preempted_scoring_requests_ask_again_until_their_first_token_only(
        num_blocks, prompt_len, budget, mid_prefill):
    s = create_scheduler(num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=4)
    runner = FakeRunner(4)
    a, b = create_requests(2, prompt_len, max_tokens=8, prompt_logprobs=1)
    s.add_request(a)
    s.add_request(b)
    rows: dict[str, list[tuple[int, int, bool]]] = {"req-0": [], "req-1": []}
    preempted = []
    for _ in range(100):
        if not s.has_schedulable_requests():
            break
        out = s.schedule()
        preempted += [(rid, s.requests[rid].num_output_tokens > 0) for rid in out.preempted_ids]
        for q in out.seqs:
            rows[q.request_id].append((q.start_pos, q.num_prompt_logprob_rows,
                                       bool(s.requests[q.request_id].output_token_ids)))
        s.update_from_output(out, runner.step(out))
    assert ("req-1", not mid_prefill) in preempted
    for rid, chunks in rows.items():
        assert all(n == 0 for _, n, has_output in chunks if has_output)
        # the last pass over the prompt before the first token scores positions 0..P-2
        passes = [i for i, (start, _, has_output) in enumerate(chunks)
                  if start == 0 and not has_output]
        covered = [p for start, n, _ in chunks[passes[-1]:] for p in range(start, start + n)]
        assert covered == list(range(prompt_len - 1)), rid
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert_scheduler_empty(s)
