import pytest

from tests.unit.sched_utils import (
    FakeRunner,
    assert_scheduler_empty,
    create_requests,
    create_scheduler,
    default_next_token,
    output_tokens,
    run_to_completion,
)
from xllm_py.engine.scheduler import RequestUpdate, ScheduledSeq
from xllm_py.request import Request, RequestStatus
from xllm_py.sampling_params import SamplingParams

S = RequestStatus


def step(scheduler, runner):
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, runner.step(out))


def reference_outputs(prompts: dict[str, list[int]], max_tokens: int, **sampling) -> dict:
    """Outputs of each prompt run alone on a roomy scheduler."""
    result = {}
    for rid, prompt in prompts.items():
        s = create_scheduler(enable_prefix_caching=False)
        s.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sampling)))
        result[rid] = output_tokens(run_to_completion(s, FakeRunner(4))[rid])
        assert_scheduler_empty(s)
    return result


def test_admission_prefill_and_decode():
    s = create_scheduler()
    runner = FakeRunner(4)
    a, b = create_requests(2, 6, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    assert s.num_waiting == 2 and s.num_running == 0
    out, updates = step(s, runner)
    assert out.seqs == [
        ScheduledSeq("req-0", a.prompt_token_ids, 0, [1, 2], True),
        ScheduledSeq("req-1", b.prompt_token_ids, 0, [3, 4], True),
    ]
    assert out.num_batched_tokens == 12
    assert s.num_running == 2 and s.num_waiting == 0
    t0 = default_next_token("req-0", a.prompt_token_ids)
    assert updates[0] == RequestUpdate("req-0", [t0])
    assert a.num_computed_tokens == 6
    out, updates = step(s, runner)
    assert out.seqs[0] == ScheduledSeq("req-0", [t0], 6, [1, 2], True)
    assert out.num_batched_tokens == 2
    out, updates = step(s, runner)
    assert [u.finished for u in updates] == [True, True]
    assert [u.finish_reason for u in updates] == ["length", "length"]
    assert a.output_token_ids == reference_outputs({"req-0": a.prompt_token_ids}, 3)["req-0"]
    assert s.has_unfinished_requests() is False
    assert s.schedule().finished_ids == ["req-0", "req-1"]
    assert_scheduler_empty(s)


def test_chunked_prefill_exact_chunks_and_decode_first():
    s = create_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    runner = FakeRunner(4)
    a = create_requests(1, 40, max_tokens=2)[0]
    b = create_requests(1, 10, start=1, max_tokens=2)[0]
    s.add_request(a)
    s.add_request(b)
    plan = []
    for _ in range(4):
        out, _ = step(s, runner)
        plan.append([(q.request_id, q.start_pos, len(q.token_ids), q.sample) for q in out.seqs])
    assert plan == [
        [("req-0", 0, 16, False)],
        [("req-0", 16, 16, False)],
        [("req-0", 32, 8, True), ("req-1", 0, 8, False)],
        [("req-0", 40, 1, True), ("req-1", 8, 2, True)],
    ]
    assert a.num_output_tokens == 2 and a.is_finished()
    out, updates = step(s, runner)
    assert [(q.request_id, q.start_pos) for q in out.seqs] == [("req-1", 10)]
    assert updates[0].finished
    refs = reference_outputs({"req-0": a.prompt_token_ids, "req-1": b.prompt_token_ids}, 2)
    assert a.output_token_ids == refs["req-0"] and b.output_token_ids == refs["req-1"]
    assert_scheduler_empty(s)


def test_prompt_tokens_capped_while_decoding():
    """max_prefill_tokens_while_decoding: once a stream decodes, each step carries at most
    that many prompt tokens (running chunks and new admissions alike); alone, a prompt
    takes the whole budget. Tokens are those of the uncapped run."""
    s = create_scheduler(max_num_batched_tokens=32, max_num_seqs=4,
                         max_prefill_tokens_while_decoding=6)
    runner = FakeRunner(4)
    a = create_requests(1, 8, max_tokens=8)[0]
    b = create_requests(1, 20, start=1, max_tokens=2)[0]
    c = create_requests(1, 4, start=2, max_tokens=2)[0]
    s.add_request(a)
    plan = []
    out, _ = step(s, runner)
    plan.append([(q.request_id, len(q.token_ids)) for q in out.seqs])
    s.add_request(b)
    s.add_request(c)
    for _ in range(5):
        out, _ = step(s, runner)
        plan.append([(q.request_id, len(q.token_ids)) for q in out.seqs])
    assert plan == [
        [("req-0", 8)],                    # alone: the whole prompt
        [("req-0", 1), ("req-1", 6)],      # a decodes: 6 prompt tokens of b
        [("req-0", 1), ("req-1", 6)],
        [("req-0", 1), ("req-1", 6)],
        [("req-0", 1), ("req-1", 2), ("req-2", 4)],  # b's last 2, then c's 4 fit the cap
        [("req-0", 1), ("req-1", 1), ("req-2", 1)],
    ]
    run_to_completion(s, runner)
    refs = reference_outputs({"req-0": a.prompt_token_ids, "req-1": b.prompt_token_ids,
                              "req-2": c.prompt_token_ids}, 8)
    assert a.output_token_ids == refs["req-0"]
    assert b.output_token_ids == refs["req-1"][:2] and c.output_token_ids == refs["req-2"][:2]
    assert_scheduler_empty(s)


def test_prompt_cap_rejects_negative():
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        create_scheduler(max_prefill_tokens_while_decoding=-1)


def test_no_chunking_waits_for_a_whole_prompt():
    s = create_scheduler(max_num_batched_tokens=16, max_num_seqs=4, enable_chunked_prefill=False)
    runner = FakeRunner(4)
    a = create_requests(1, 10, max_tokens=2)[0]
    b = create_requests(1, 10, start=1, max_tokens=2)[0]
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s, runner)
    assert [(q.request_id, len(q.token_ids)) for q in out.seqs] == [("req-0", 10)]
    out, _ = step(s, runner)
    assert [(q.request_id, len(q.token_ids)) for q in out.seqs] == [("req-0", 1), ("req-1", 10)]
    run_to_completion(s, runner)
    assert_scheduler_empty(s)


def test_prefix_hit_skips_compute_and_shares_blocks():
    s = create_scheduler()
    runner = FakeRunner(4)
    prefix = list(range(500, 508))
    a = Request("a", prefix + [1, 2, 3], SamplingParams(max_tokens=4))
    b = Request("b", prefix + [9], SamplingParams(max_tokens=4))
    s.add_request(a)
    step(s, runner)
    s.add_request(b)
    out, _ = step(s, runner)
    seq_b = out.seqs[1]
    assert (seq_b.request_id, seq_b.start_pos, seq_b.token_ids) == ("b", 8, [9])
    assert seq_b.block_table[:2] == a.block_ids[:2] == [1, 2]
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert s.kv.block_pool.ref_count(1) == 2
    run_to_completion(s, runner)
    refs = reference_outputs({"a": a.prompt_token_ids, "b": b.prompt_token_ids}, 4)
    assert a.output_token_ids == refs["a"] and b.output_token_ids == refs["b"]
    assert s.kv.block_pool.num_prefix_hit_tokens == 8
    assert_scheduler_empty(s)


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_a_request_that_ends_in_its_first_step_carries_its_prefix_hit(max_tokens):
    """The update says how many prompt tokens were cached: the request is gone by the
    time the engine reads it (usage.prompt_tokens_details.cached_tokens)."""
    s = create_scheduler()
    runner = FakeRunner(4)
    prefix = list(range(500, 508))
    s.add_request(Request("a", prefix + [1], SamplingParams(max_tokens=2)))
    run_to_completion(s, runner)
    s.add_request(Request("b", prefix + [9], SamplingParams(max_tokens=max_tokens,
                                                            echo=max_tokens == 0)))
    _, updates = step(s, runner)
    assert [(u.request_id, u.finished, u.num_cached_tokens) for u in updates] == [("b", True, 8)]
    assert s.get_request("b") is None
    assert_scheduler_empty(s)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_recomputes_and_gives_identical_outputs(caching):
    # 4 usable blocks of 4 = 16 slots; two requests of 6 + 8 tokens need 4 blocks each.
    s = create_scheduler(num_blocks=5, enable_prefix_caching=caching)
    runner = FakeRunner(4)
    a, b = create_requests(2, 6, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    preempted_steps = []
    updates: dict[str, list] = {}
    for i in range(60):
        if not s.has_schedulable_requests():
            break
        out = s.schedule()
        if out.preempted_ids:
            preempted_steps.append((i, out.preempted_ids))
            # The most recently admitted request is the victim; it waits at the front.
            assert out.preempted_ids == ["req-1"]
            assert b.status == S.PREEMPTED and s.waiting[0] is b and b.block_ids == []
            assert b.num_computed_tokens == 0
            assert [q.request_id for q in out.seqs] == ["req-0"]
        for u in s.update_from_output(out, runner.step(out)):
            updates.setdefault(u.request_id, []).append(u)
    assert preempted_steps and preempted_steps[0][0] == 3
    assert b.num_preemptions >= 1
    refs = reference_outputs({"req-0": a.prompt_token_ids, "req-1": b.prompt_token_ids}, 8)
    assert output_tokens(updates["req-0"]) == refs["req-0"] == a.output_token_ids
    assert output_tokens(updates["req-1"]) == refs["req-1"] == b.output_token_ids
    assert len(refs["req-1"]) == 8
    assert_scheduler_empty(s)


def test_preempting_an_already_scheduled_decode_refunds_it():
    # Decode side: a joins with three hand-over tokens (a multi-token chunk), b joins
    # later with one (a decode). The decode pass schedules b first; a then needs a block,
    # and the victim (most recently admitted) is b, already in the batch: it is dropped
    # from the step and its tokens go back to the budget.
    s = create_scheduler(num_blocks=5)  # 4 usable blocks
    runner = FakeRunner(4)
    pa, pb, pd = [1, 2, 3], [11, 12, 13, 14, 15, 16, 17], [21, 22, 23]
    refs = reference_outputs({"a": pa, "b": pb}, 5)
    a = Request("a", pa, SamplingParams(max_tokens=5))
    b = Request("b", pb, SamplingParams(max_tokens=5))
    d = Request("d", pd, SamplingParams(max_tokens=5))
    for r in (a, b, d):
        runner.fill(s.remote.allocate_for_remote(r).block_ids, r.prompt_token_ids)
    assert (a.block_ids, b.block_ids, d.block_ids) == ([1], [2, 3], [4])
    s.remote.finish_remote_kvs("a", refs["a"][:3])
    s.remote.finish_remote_kvs("b", refs["b"][:1])
    out = s.schedule()
    assert out.preempted_ids == ["b"]
    assert [(q.request_id, q.start_pos, q.token_ids) for q in out.seqs] == [
        ("a", 3, refs["a"][:3])
    ]
    assert out.num_batched_tokens == 3
    assert a.block_ids == [1, 3] and b.block_ids == [] and b.status == S.PREEMPTED
    s.update_from_output(out, runner.step(out))
    run_to_completion(s, runner)
    assert a.output_token_ids == refs["a"]
    assert b.output_token_ids == refs["b"]
    s.abort_request("d")
    assert_scheduler_empty(s)


def test_abort_while_waiting_and_running():
    s = create_scheduler(max_num_seqs=1, max_num_batched_tokens=16)
    runner = FakeRunner(4)
    a, b, c = create_requests(3, 5)
    for r in (a, b, c):
        s.add_request(r)
    step(s, runner)
    assert a.status == S.RUNNING and s.num_waiting == 2
    assert s.abort_request("req-1") is True
    assert b.status == S.FINISHED_ABORTED and b.finish_reason == "abort"
    assert s.num_waiting == 1
    out = s.schedule()
    assert out.finished_ids == ["req-1"]
    # abort between schedule() and update_from_output(): the step result is dropped
    assert s.abort_request("req-0") is True
    assert a.block_ids == []
    assert s.update_from_output(out, runner.step(out)) == []
    assert s.abort_request("req-0") is False
    assert s.abort_request("nope") is False
    step(s, runner)
    s.abort_request("req-2", S.FINISHED_ERROR)
    assert c.finish_reason == "error"
    assert_scheduler_empty(s)


def test_finish_on_eos_respects_min_tokens_and_ignore_eos():
    eos = 7

    def model(rid, context):
        return eos  # always EOS

    for kwargs, n_out, reason in [
        ({}, 1, "stop"),
        ({"min_tokens": 3}, 3, "stop"),
        ({"ignore_eos": True, "max_tokens": 4}, 4, "length"),
    ]:
        s = create_scheduler()
        params = {"max_tokens": 8, "eos_token_ids": [eos], **kwargs}
        r = Request("r", [1, 2, 3], SamplingParams(**params))
        s.add_request(r)
        updates = run_to_completion(s, FakeRunner(4, model))["r"]
        assert r.output_token_ids == [eos] * n_out
        assert updates[-1].finished and updates[-1].finish_reason == reason
        assert updates[-1].stop_reason is None
        assert all(not u.finished for u in updates[:-1])
        assert_scheduler_empty(s)


def test_finish_on_stop_token_sets_stop_reason():
    s = create_scheduler()
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=8, stop_token_ids=[42]))
    s.add_request(r)
    updates = run_to_completion(s, FakeRunner(4, lambda rid, ctx: 42 if len(ctx) == 5 else 5))
    assert r.output_token_ids == [5, 5, 42]
    assert updates["r"][-1] == RequestUpdate("r", [42], True, "stop", 42)
    assert r.stop_reason == 42
    assert_scheduler_empty(s)


def test_finish_on_max_model_len():
    s = create_scheduler(max_model_len=10)
    r = Request("r", [1, 2, 3, 4, 5, 6, 7], SamplingParams())
    s.add_request(r)
    updates = run_to_completion(s, FakeRunner(4))["r"]
    assert r.num_tokens == 10 and r.num_output_tokens == 3
    assert updates[-1].finish_reason == "length"
    assert_scheduler_empty(s)


def test_finish_request_for_a_stop_string():
    s = create_scheduler()
    runner = FakeRunner(4)
    [r] = create_requests(1, 5)
    s.add_request(r)
    step(s, runner)
    assert s.finish_request("req-0", S.FINISHED_STOPPED, stop_reason="\n") is True
    assert r.finish_reason == "stop" and r.stop_reason == "\n"
    with pytest.raises(ValueError, match="FINISHED_"):
        s.finish_request("req-0", S.RUNNING)
    assert_scheduler_empty(s)


def test_missing_sampled_token_fails_only_that_request():
    s = create_scheduler()
    a, b = create_requests(2, 5)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    sampled = FakeRunner(4).step(out)
    del sampled["req-0"]
    updates = s.update_from_output(out, sampled)
    assert updates[0] == RequestUpdate("req-0", [], True, "error")
    assert a.status == S.FINISHED_ERROR and b.status == S.RUNNING
    s.abort_request("req-1")
    assert_scheduler_empty(s)


def test_priority_and_max_num_seqs():
    s = create_scheduler(max_num_seqs=2)
    reqs = create_requests(4, 3, max_tokens=1)
    for r, prio in zip(reqs, [1, 1, 0, 2]):
        r.priority = prio
        s.add_request(r)
    assert [r.request_id for r in s.waiting] == ["req-2", "req-0", "req-1", "req-3"]
    out = s.schedule()
    assert [q.request_id for q in out.seqs] == ["req-2", "req-0"]
    s.update_from_output(out, FakeRunner(4).step(out))
    run_to_completion(s, FakeRunner(4))
    assert_scheduler_empty(s)


def test_add_request_validation():
    s = create_scheduler(max_model_len=8)
    s.add_request(Request("a", [1] * 7, SamplingParams()))
    with pytest.raises(ValueError, match="already live"):
        s.add_request(Request("a", [1], SamplingParams()))
    with pytest.raises(ValueError, match="limit is 7"):
        s.add_request(Request("b", [1] * 8, SamplingParams()))
    s.abort_request("a")
    assert_scheduler_empty(s)


def test_kv_usage():
    s = create_scheduler(num_blocks=9)
    [r] = create_requests(1, 8)
    s.add_request(r)
    s.schedule()
    assert s.kv_usage() == pytest.approx(2 / 8)
    s.abort_request("req-0")
    assert s.kv_usage() == 0.0
    assert_scheduler_empty(s)


# -- PD: prefill side --------------------------------------------------------------------
def test_remote_decode_holds_blocks_until_sent():
    s = create_scheduler()
    runner = FakeRunner(4)
    [r] = create_requests(1, 6, remote_decode=True)
    s.add_request(r)
    out, updates = step(s, runner)
    t0 = default_next_token("req-0", r.prompt_token_ids)
    assert updates == [RequestUpdate("req-0", [t0], True, "length", None, kv_held=True,
                                           remote_decode=True)]
    assert r.status == S.SENDING_KV and r.block_ids == [1, 2]
    assert s.num_running == 0 and s.remote.num_sending_kv == 1
    assert s.has_schedulable_requests() is False and s.has_unfinished_requests() is True
    assert s.schedule().seqs == []
    assert s.kv.block_pool.num_used_blocks == 2
    assert s.remote.finish_sending("req-0") is True
    assert r.status == S.FINISHED_LENGTH_CAPPED
    assert s.remote.finish_sending("req-0") is False
    assert_scheduler_empty(s)


def test_remote_decode_abort_while_sending_and_stop_on_first_token():
    s = create_scheduler()
    runner = FakeRunner(4, lambda rid, ctx: 7)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=5), remote_decode=True)
    b = Request("b", [4, 5, 6], SamplingParams(eos_token_ids=[7]), remote_decode=True)
    s.add_request(a)
    s.add_request(b)
    _, updates = step(s, runner)
    assert updates == [
        RequestUpdate("a", [7], True, "length", None, kv_held=True, remote_decode=True),
        RequestUpdate("b", [7], True, "stop", None, kv_held=False, remote_decode=True),
    ]
    assert b.block_ids == []
    with pytest.raises(ValueError, match="not allowed"):
        s.finish_request("a", S.FINISHED_STOPPED)
    assert s.abort_request("a") is True and a.finish_reason == "abort"
    assert_scheduler_empty(s)


# -- PD: decode side -----------------------------------------------------------------------
def test_remote_kv_lifecycle_matches_local_run():
    prompt = list(range(300, 310))
    ref = reference_outputs({"r": prompt}, 5)["r"]
    s = create_scheduler()
    runner = FakeRunner(4)
    r = Request("r", prompt, SamplingParams(max_tokens=5))
    alloc = s.remote.allocate_for_remote(r)
    # 10 prompt tokens + 1 slot = 3 blocks; the peer fills all of them (no prefix hit).
    assert (alloc.block_ids, alloc.new_block_ids, alloc.num_cached_tokens) == ([1, 2, 3], [1, 2, 3], 0)
    assert r.status == S.WAITING_FOR_REMOTE_KVS
    assert s.num_waiting == 0 and s.remote.num_waiting_for_remote_kvs == 1
    assert s.schedule().seqs == []
    runner.fill(alloc.block_ids, prompt)  # the KV transfer
    assert s.remote.finish_remote_kvs("r", [ref[0]]) is None
    assert r.status == S.RUNNING and r.num_computed_tokens == 10
    out, _ = step(s, runner)
    assert out.seqs == [ScheduledSeq("r", [ref[0]], 10, [1, 2, 3], True)]
    run_to_completion(s, runner)
    assert r.output_token_ids == ref
    assert_scheduler_empty(s)


def test_remote_kv_prefix_hit_and_out_of_space():
    s = create_scheduler(num_blocks=7)  # 6 usable
    runner = FakeRunner(4)
    prefix = list(range(40, 48))
    a = Request("a", prefix + [1, 2], SamplingParams(max_tokens=4))
    alloc_a = s.remote.allocate_for_remote(a)
    assert alloc_a.block_ids == [1, 2, 3]
    runner.fill(alloc_a.block_ids, a.prompt_token_ids)
    s.remote.finish_remote_kvs("a", [99])  # caches a's two full prompt blocks
    b = Request("b", prefix + [5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
    alloc_b = s.remote.allocate_for_remote(b)
    assert alloc_b.num_cached_tokens == 8
    assert alloc_b.block_ids == [1, 2, 4, 5]
    assert alloc_b.new_block_ids == [4, 5]  # prompt positions 8..12; the first-token slot too
    assert b.num_cached_tokens == 0  # (usage reports the prefill's hit: it computed the rest)
    c = Request("c", list(range(900, 907)), SamplingParams())
    assert s.remote.allocate_for_remote(c) is None  # needs 2 blocks, 1 free
    assert c.block_ids == [] and "c" not in s.requests and s.kv.num_free_blocks == 1
    assert s.remote.fail_remote_kvs("b", "peer went away") is True
    assert b.status == S.FINISHED_ERROR and b.error_message == "peer went away"
    assert s.remote.fail_remote_kvs("b", "again") is False
    s.abort_request("a")
    assert_scheduler_empty(s)


def test_remote_kv_tokens_that_already_finish():
    s = create_scheduler()
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=1))
    s.remote.allocate_for_remote(r)
    update = s.remote.finish_remote_kvs("r", [55])
    assert update == RequestUpdate("r", [], True, "length", None)
    with pytest.raises(ValueError, match="unknown request"):
        s.remote.finish_remote_kvs("r", [55])
    assert_scheduler_empty(s)


def test_finish_remote_kvs_wrong_state():
    s = create_scheduler()
    [r] = create_requests(1, 3)
    s.add_request(r)
    with pytest.raises(ValueError, match="not WAITING_FOR_REMOTE_KVS"):
        s.remote.finish_remote_kvs("req-0", [1])
    with pytest.raises(ValueError, match="not SENDING_KV"):
        s.remote.finish_sending("req-0")
    s.abort_request("req-0")
    assert_scheduler_empty(s)


@pytest.mark.integration  # (a fresh interpreter)
def test_core_modules_import_neither_torch_nor_grpc():
    import subprocess
    import sys

    code = (
        "import sys; import xllm_py.engine.scheduler, xllm_py.request, xllm_py.sampling_params; "
        "print(sorted(m for m in ('torch', 'grpc', 'numpy') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_under_pressure_matches_reference(seed):
    import random

    rng = random.Random(seed)
    s = create_scheduler(num_blocks=13, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=48)
    runner = FakeRunner(4)
    shared = [rng.randrange(2000, 3000) for _ in range(8)]
    prompts, max_tokens, aborted = {}, {}, set()
    for i in range(10):
        head = shared[: rng.choice([0, 4, 8])]
        prompts[f"r{i}"] = head + [rng.randrange(3000, 4000) for _ in range(rng.randrange(1, 20))]
        max_tokens[f"r{i}"] = rng.randrange(1, 12)
    pending = list(prompts)
    got: dict[str, list[int]] = {}
    num_preempted = 0
    for _ in range(500):
        if pending and rng.random() < 0.5:
            rid = pending.pop(0)
            s.add_request(Request(rid, prompts[rid], SamplingParams(max_tokens=max_tokens[rid])))
        if s.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(s.requests))
            s.abort_request(rid)
            aborted.add(rid)
        if not pending and not s.has_schedulable_requests():
            break
        out = s.schedule()
        num_preempted += len(out.preempted_ids)
        pool = s.kv.block_pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_usable_blocks
        for u in s.update_from_output(out, runner.step(out)):
            got.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert not pending
    assert num_preempted > 0 and s.kv.block_pool.num_prefix_hit_tokens > 0
    for rid, prompt in prompts.items():
        if rid in aborted:
            continue
        ref = reference_outputs({rid: prompt}, max_tokens[rid])[rid]
        assert got[rid] == ref, rid
    assert_scheduler_empty(s)


def test_waiting_fills_a_step_by_tokens_or_sequences():
    scheduler = create_scheduler(max_num_batched_tokens=64, max_num_seqs=3)
    assert not scheduler.waiting_fills_a_step()
    for request in create_requests(2, 20):  # 40 of 64 tokens, 2 of 3 sequences
        scheduler.add_request(request)
    assert not scheduler.waiting_fills_a_step()
    scheduler.add_request(create_requests(1, 24, start=2)[0])  # 64 tokens
    assert scheduler.waiting_fills_a_step()
    few_tokens = create_scheduler(max_num_batched_tokens=64, max_num_seqs=3)
    for request in create_requests(3, 4):  # 12 tokens, but 3 sequences
        few_tokens.add_request(request)
    assert few_tokens.waiting_fills_a_step()
