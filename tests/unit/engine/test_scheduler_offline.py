"""Offline requests in ContinuousScheduler: only in the room online work leaves, suspended
(KV kept) or preempted (KV freed, recomputed exactly) when online work needs it, resumed
when it leaves, full batch without online work. Every new edge of the request machine
(RUNNING -> SUSPENDED -> RUNNING | PREEMPTED | FINISHED_*) is taken here by the scheduler."""
from __future__ import annotations

import math

from tests.unit.sched_utils import (FakeRunner, assert_scheduler_empty, create_requests,
                                    create_scheduler, output_tokens, run_to_completion)
from xllm_py.config import CacheConfig, SchedulerConfig
from xllm_py.engine.offline_gate import OfflineGate
from xllm_py.engine.scheduler import ContinuousScheduler
from xllm_py.request import RequestStatus as S


def _step(sched, runner):
    out = sched.schedule()
    sched.update_from_output(out, runner.step(out))
    return out


def _ids(out):
    return [s.request_id for s in out.seqs]


def test_offline_runs_at_full_batch_without_online_work():
    sched = create_scheduler(max_num_seqs=8)
    runner = FakeRunner(sched.block_size)
    for r in create_requests(8, 6, offline=True, max_tokens=4):
        sched.add_request(r)
    out = _step(sched, runner)
    assert len(out.seqs) == 8
    assert sched.offline.num_running == 8 and sched.offline.num_waiting == 0
    run_to_completion(sched, runner)
    assert_scheduler_empty(sched)


def test_online_goes_first_and_offline_takes_the_seats_left():
    sched = create_scheduler(max_num_seqs=4)
    runner = FakeRunner(sched.block_size)
    for r in create_requests(4, 6, offline=True, start=10):
        sched.add_request(r)
    for r in create_requests(3, 6):
        sched.add_request(r)
    out = _step(sched, runner)
    assert _ids(out) == ["req-0", "req-1", "req-2", "req-10"]
    assert sched.offline.num_waiting == 3


def test_online_takes_a_seat_from_offline_which_resumes_with_its_kv():
    sched = create_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched.block_size)
    off = create_requests(2, 6, offline=True, start=10, max_tokens=20)
    for r in off:
        sched.add_request(r)
    _step(sched, runner)
    _step(sched, runner)
    [online] = create_requests(1, 6, max_tokens=2)
    sched.add_request(online)
    out = _step(sched, runner)
    victim = off[1]  # the latest admitted offline request gives its seat
    assert victim.status is S.SUSPENDED and victim.block_ids
    computed = victim.num_computed_tokens
    assert "req-0" in _ids(out) and victim.request_id not in _ids(out)
    assert sched.offline.num_preempted == 1
    while online.request_id in sched.requests:
        _step(sched, runner)
    out = _step(sched, runner)  # online left: the suspended request resumes, KV intact
    assert victim.status is S.RUNNING and victim.request_id in _ids(out)
    assert victim.num_preemptions == 0 and out.seqs[-1].start_pos >= computed
    run_to_completion(sched, runner)
    assert_scheduler_empty(sched)


def test_online_takes_kv_from_offline_and_greedy_output_is_unchanged():
    """Alone, offline requests produce some tokens; squeezed by online work that needs
    their KV (suspended ones freed first, then running ones), they are recomputed and
    produce exactly the same tokens."""
    def run(with_online: bool) -> dict[str, list[int]]:
        sched = create_scheduler(num_blocks=17, max_num_seqs=4)  # 16 usable blocks of 4
        runner = FakeRunner(sched.block_size)
        for r in create_requests(3, 12, offline=True, start=10, max_tokens=12):
            sched.add_request(r)
        updates = {}
        for _ in range(3):
            out = sched.schedule()
            for u in sched.update_from_output(out, runner.step(out)):
                updates.setdefault(u.request_id, []).append(u)
        if with_online:
            for r in create_requests(2, 20, max_tokens=8):
                sched.add_request(r)
        for rid, ups in run_to_completion(sched, runner).items():
            updates.setdefault(rid, []).extend(ups)
        assert_scheduler_empty(sched)
        if with_online:
            assert sched.offline.num_preemptions >= 1
        return {rid: output_tokens(u) for rid, u in updates.items() if rid in ("req-10", "req-11", "req-12")}

    alone, squeezed = run(False), run(True)
    assert squeezed == alone and all(len(t) == 12 for t in alone.values())


def test_suspended_request_gives_its_kv_to_online_work():
    sched = create_scheduler(num_blocks=9, max_num_seqs=1)  # 8 usable blocks, one seat
    runner = FakeRunner(sched.block_size)
    [off] = create_requests(1, 12, offline=True, start=10, max_tokens=8)
    sched.add_request(off)
    _step(sched, runner)
    [online] = create_requests(1, 24, max_tokens=4)
    sched.add_request(online)
    out = _step(sched, runner)
    # first the seat (suspended, KV kept), then its KV (preempted: freed, recomputed later)
    assert off.status is S.PREEMPTED and off.block_ids == [] and off.num_computed_tokens == 0
    assert out.preempted_ids == [off.request_id] and _ids(out) == [online.request_id]
    assert sched.offline.num_preempted == 1 and sched.offline.num_suspensions == 1
    run_to_completion(sched, runner)
    assert_scheduler_empty(sched)


def test_offline_never_preempts_online_work():
    sched = create_scheduler(num_blocks=9, max_num_seqs=4)  # 8 usable blocks
    runner = FakeRunner(sched.block_size)
    [online] = create_requests(1, 20, max_tokens=12)
    sched.add_request(online)
    _step(sched, runner)
    [off] = create_requests(1, 8, offline=True, start=10, max_tokens=12)
    sched.add_request(off)
    for _ in range(12):
        _step(sched, runner)
        assert online.status is S.RUNNING or online.is_finished()
        assert online.num_preemptions == 0
    run_to_completion(sched, runner)
    assert_scheduler_empty(sched)


def test_abort_and_stop_of_a_suspended_request_free_its_kv():
    for status in (S.FINISHED_ABORTED, S.FINISHED_STOPPED):
        sched = create_scheduler(max_num_seqs=1)
        runner = FakeRunner(sched.block_size)
        [off] = create_requests(1, 6, offline=True, start=10, max_tokens=20)
        sched.add_request(off)
        _step(sched, runner)
        [online] = create_requests(1, 6, max_tokens=2)
        sched.add_request(online)
        _step(sched, runner)
        assert off.status is S.SUSPENDED
        sched.finish_request(off.request_id, status)
        assert off.status is status and off.block_ids == []
        run_to_completion(sched, runner)
        assert_scheduler_empty(sched)


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _timed_scheduler(clock, **sched_kwargs):
    return ContinuousScheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256,
                        **sched_kwargs),
        CacheConfig(block_size=4, enable_prefix_caching=True), num_blocks=129, clock=clock)


def test_gate_keeps_online_steps_within_the_tpot_target():
    """Steps slower than 0.9 x the online stream's TPOT target shrink the offline share of
    the batch (the rest suspended, KV kept); faster ones grow it back."""
    clock = _Clock()
    sched = _timed_scheduler(clock)
    runner = FakeRunner(sched.block_size)
    for r in create_requests(8, 6, offline=True, start=10, max_tokens=200):
        sched.add_request(r)
    clock.t += 0.05
    assert len(_step(sched, runner).seqs) == 8  # alone: full batch
    [online] = create_requests(1, 6, max_tokens=200, tpot_slo_ms=10.0)
    sched.add_request(online)
    counts = []
    for i in range(40):
        clock.t += 0.012 if i < 20 else 0.005  # too slow, then well within 10 ms
        out = _step(sched, runner)
        assert "req-0" in _ids(out)
        counts.append(sum(1 for rid in _ids(out) if rid != "req-0"))
        if i == 19:
            assert len(sched.offline.suspended) == 8  # gate closed: all suspended, KV kept
            assert all(r.block_ids for r in sched.offline.suspended)
    assert counts[19] == 0
    assert counts[-1] == 8  # reopened: all back, none preempted
    assert sched.offline.num_preemptions == 0


def test_offline_has_room_is_the_pull_condition():
    clock = _Clock()
    sched = _timed_scheduler(clock)
    runner = FakeRunner(sched.block_size)
    assert sched.offline.has_room()
    [online] = create_requests(1, 6, max_tokens=200, tpot_slo_ms=10.0)
    sched.add_request(online)
    _step(sched, runner)  # its prompt
    _step(sched, runner)  # its first decode step
    assert sched.offline.has_room()
    clock.t += 0.0095  # over 0.9 x 10 ms
    _step(sched, runner)
    assert not sched.offline.has_room()
    clock.t += 0.005
    _step(sched, runner)
    assert sched.offline.has_room()
    clock.t += 0.05  # a slow last step, then the stream ends and the engine idles: an
    _step(sched, runner)  # idle decode must still pull (it was starved once for 120 s)
    assert not sched.offline.has_room()
    sched.finish_request(online.request_id, S.FINISHED_ABORTED)
    assert sched.offline.has_room()


def test_allocate_for_remote_takes_kv_from_offline_for_online_only():
    sched = create_scheduler(num_blocks=9, max_num_seqs=4)  # 8 usable blocks
    runner = FakeRunner(sched.block_size)
    [off] = create_requests(1, 24, offline=True, start=10, max_tokens=8)
    sched.add_request(off)
    _step(sched, runner)
    [late_off] = create_requests(1, 16, offline=True, start=20)
    assert sched.remote.allocate_for_remote(late_off) is None  # offline: waits for room
    [online] = create_requests(1, 16)
    alloc = sched.remote.allocate_for_remote(online)
    assert alloc is not None and off.status is S.PREEMPTED and off.block_ids == []
    runner.fill(alloc.block_ids, online.prompt_token_ids)
    sched.remote.finish_remote_kvs(online.request_id, [5])
    run_to_completion(sched, runner)
    assert_scheduler_empty(sched)


def test_gate_limits():
    gate = OfflineGate(max_tokens=64)
    assert gate.limit(streams_present=False, target_s=0.01) == math.inf
    assert gate.limit(streams_present=True, target_s=None) == 0  # streams not measured yet
    t = 0.0
    for _ in range(30):  # steady online steps of 1 ms: the allowance grows to the budget
        gate.begin_step(t, 0.01)
        gate.carried(1, 0)
        t += 0.001
    assert gate.allowed == 64 and gate.base_s is not None and abs(gate.base_s - 0.001) < 1e-9
    gate.begin_step(t + 0.005, 0.01)  # a step of 5 ms: past 1.25 x base, though within T
    assert gate.allowed == 32 and not gate.has_room(0.01)
    gate.carried(0, 0)
    gate.begin_step(t + 1.0, 0.01)  # a step without online decodes measures nothing
    assert gate.allowed == 32 and gate.has_room(0.01)


def test_gate_keeps_offline_within_a_slack_of_the_streams_alone():
    """No TPOT target: steps with offline tokens that cost the streams more than 1.25x
    their steps alone shrink the allowance, cheaper ones (a flat cost curve) grow it;
    the streams' base is measured on steps without offline tokens only."""
    gate = OfflineGate(max_tokens=64)
    t = 0.0

    def step(interval_s: float, offline: int) -> None:
        nonlocal t
        gate.begin_step(t, None)
        gate.carried(4, offline)
        t += interval_s

    for _ in range(5):
        step(0.010, 0)  # the streams alone: 10 ms
    for _ in range(40):  # offline rides at no cost (a flat step cost): it fills the budget
        step(0.0105, gate.limit(True, None))
    assert gate.allowed == 64 and abs(gate.base_s - 0.010) < 1e-3
    for _ in range(10):  # offline makes the steps 1.5x: it is cut back
        step(0.015 if gate.limit(True, None) else 0.010, gate.limit(True, None))
    assert gate.allowed < 4
def test_gate_counts_online_work_present_for_a_grace_period():
    """Between the requests of a closed loop of online streams, offline work stays
    limited; past GRACE_S without online work it runs at full batch."""
    from xllm_py.engine.offline_gate import GRACE_S

    gate = OfflineGate(max_tokens=64)
    gate.allowed = 8
    gate.begin_step(10.0, 0.01)
    assert gate.limit(streams_present=True, target_s=0.01) == 8
    gate.begin_step(10.0 + GRACE_S / 2, None)
    assert gate.limit(streams_present=False, target_s=None) == 8
    gate.allowed = 0
    assert gate.limit(streams_present=False, target_s=None) == 1  # never an empty step
    gate.begin_step(10.0 + GRACE_S * 1.5, None)
    assert gate.limit(streams_present=False, target_s=None) == math.inf
