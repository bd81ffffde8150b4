"""Duty (engine/pd/duty.py): every edge of its table, what a flip leaves to finish, and
the RoleFollower's reading, following and acknowledging of assignments."""
from __future__ import annotations

import asyncio

import pytest

from xllm_py.cluster.role_assignment import RoleAssignment, RoleAssignmentError
from xllm_py.config import InstanceRole
from xllm_py.engine.pd.duty import (_ALLOWED, Duty, DutyState, RoleFollower,
                                    is_duty_transition_allowed)

P, D, M = InstanceRole.PREFILL, InstanceRole.DECODE, InstanceRole.MIX
S = DutyState


class Work:
    """What the two sides hold: (prefill requests not handed over, open placements)."""

    def __init__(self) -> None:
        self.prefill = 0
        self.decode = 0

    def __call__(self) -> tuple[int, int]:
        return self.prefill, self.decode


def test_table_allows_exactly_the_duty_changes_and_settling():
    for old in S:
        for new in S:
            leaving = "_LEAVING_" in old.value
            expected = (new.serves is not old.serves
                        or (leaving and new is DutyState(old.serves.value)))
            assert is_duty_transition_allowed(old, new) == expected, (old, new)
    assert set(_ALLOWED) == set(S)


def test_a_disallowed_transition_raises_and_changes_nothing():
    duty = Duty(Work())
    with pytest.raises(ValueError, match="MIX -> MIX_LEAVING_PREFILL"):
        duty.transition(S.MIX_LEAVING_PREFILL)
    assert duty.state is S.MIX


def test_prefill_turning_decode_finishes_its_queue_first():
    work = Work()
    duty = Duty(work)
    assert duty.assign(RoleAssignment(P, 1))
    assert duty.state is S.PREFILL and not duty.takes_placements
    work.prefill = 3
    assert duty.assign(RoleAssignment(D, 2))
    assert duty.state is S.DECODE_LEAVING_PREFILL
    assert duty.serves is D and duty.takes_placements  # new work as a decode at once
    duty.settle()
    assert duty.state is S.DECODE_LEAVING_PREFILL
    work.prefill = 0
    duty.settle()
    assert duty.state is S.DECODE


def test_decode_turning_prefill_keeps_open_placements():
    work = Work()
    duty = Duty(work)
    duty.assign(RoleAssignment(D, 1))
    work.decode = 2
    duty.assign(RoleAssignment(P, 2))
    assert duty.state is S.PREFILL_LEAVING_DECODE
    assert duty.serves is P and not duty.takes_placements
    work.decode = 0
    duty.settle()
    assert duty.state is S.PREFILL


def test_reassigned_while_leaving_and_to_mix():
    work = Work()
    duty = Duty(work)
    duty.assign(RoleAssignment(P, 1))
    work.prefill = 1
    duty.assign(RoleAssignment(M, 2))
    assert duty.state is S.MIX_LEAVING_PREFILL
    duty.assign(RoleAssignment(D, 3))
    assert duty.state is S.DECODE_LEAVING_PREFILL
    duty.assign(RoleAssignment(P, 4))  # back to prefill: takes prompts again
    assert duty.state is S.PREFILL


def test_old_or_same_epochs_are_ignored_and_same_duty_changes_nothing():
    duty = Duty(Work())
    assert duty.assign(RoleAssignment(D, 5))
    assert not duty.assign(RoleAssignment(P, 5))
    assert not duty.assign(RoleAssignment(P, 4))
    assert duty.state is S.DECODE and duty.epoch == 5
    assert duty.assign(RoleAssignment(D, 6))
    assert duty.state is S.DECODE and duty.epoch == 6


def test_assignment_json_round_trip_and_bad_values():
    a = RoleAssignment(P, 7, pinned=True)
    assert RoleAssignment.from_json(a.to_json()) == a
    with pytest.raises(RoleAssignmentError):
        RoleAssignment.from_json(b'{"role": "DEFAULT", "epoch": 1}')
    with pytest.raises(RoleAssignmentError):
        RoleAssignment.from_json(b"not json")
    with pytest.raises(RoleAssignmentError):
        RoleAssignment.from_json(b'{"epoch": 1}')


def test_follower_follows_acknowledges_once_and_survives_errors():
    work = Work()
    duty = Duty(work)
    stored: list[object] = [None]
    published: list[tuple[InstanceRole, int]] = []

    async def read():
        value = stored[0]
        if isinstance(value, Exception):
            raise value
        return value

    follower = RoleFollower(duty, read, lambda r, e: published.append((r, e)), 0.01)

    async def run():
        await follower.once()
        assert published == []  # nothing assigned yet: nothing to acknowledge
        stored[0] = RoleAssignment(P, 1)
        await follower.once()
        await follower.once()
        assert published == [(P, 1)]
        work.prefill = 1
        stored[0] = RoleAssignment(D, 2)
        await follower.once()
        assert published[-1] == (D, 2) and duty.state is S.DECODE_LEAVING_PREFILL
        stored[0] = RuntimeError("etcd down")
        work.prefill = 0
        await follower.once()  # an unreadable assignment: the duty still settles
        assert duty.state is S.DECODE and published == [(P, 1), (D, 2)]

    asyncio.run(run())


class FakeSide:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add_request(self, spec) -> None:
        self.calls.append(("prefill", spec.request_id))

    def num_pending(self) -> int:
        return 0

    def phase(self, request_id):
        return None

    async def add_new_requests(self, prefill_name, items):
        self.calls.append(("placed", prefill_name))
        return []


class FakeEngine:
    def __init__(self) -> None:
        self.submitted: list[str] = []

    def try_submit(self, req) -> bool:
        self.submitted.append(req.request_id)
        return True


class FakeReporter:
    def sink(self, *args, **kwargs):
        return None


def test_elastic_handler_routes_by_the_request_and_refuses_placements_as_prefill():
    from xllm_py.engine.pd.handlers import ElasticHandler
    from xllm_py.rpc.convert import EngineRequestSpec
    from xllm_py.sampling_params import SamplingParams
    from xllm_py.status import Status, StatusError

    side, engine, duty = FakeSide(), FakeEngine(), Duty(Work())
    handler = ElasticHandler(engine, FakeReporter(), side, side, links=None, duty=duty)

    def spec(rid: str, decode: str = "") -> EngineRequestSpec:
        return EngineRequestSpec(request_id=rid, service_request_id=rid, prompt_token_ids=[1, 2],
                                 params=SamplingParams(),
                                 source_xservice_addr="svc:1", decode_name=decode)

    duty.assign(RoleAssignment(D, 1))
    handler.generate(spec("pd", decode="other"))  # routed as a PD prompt: the prefill side
    handler.generate(spec("whole"))               # anything else runs whole
    assert side.calls == [("prefill", "pd")] and engine.submitted == ["whole"]
    asyncio.run(handler.add_new_requests("p", []))
    duty.assign(RoleAssignment(P, 2))
    with pytest.raises(StatusError) as exc:
        asyncio.run(handler.add_new_requests("p", []))
    assert exc.value.status is Status.FAILED_PRECONDITION and "PREFILL" in exc.value.message
    assert side.calls[-1] == ("placed", "p")  # (only the one taken as a decode)
    handler.check("FirstGeneration")  # open placements still complete
    handler.check("SendPullSignal")
