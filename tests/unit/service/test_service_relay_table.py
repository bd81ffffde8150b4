"""relay.py: `classify` names every RelayEvent from the sub's state and the Generation, and
each row of STEPS moves the sub to its phase and takes its action (Relay with a recording
Relocator and client)."""
from __future__ import annotations

import asyncio

import pytest

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole
from xllm_py.outputs import CompletionDelta, RequestOutput
from xllm_py.rpc import service as wire
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.sampling_params import SamplingParams
from xllm_service.instance_table import InstanceInfo, InstanceState
from xllm_service.relay import KV_LOST, STEPS, UNAVAILABLE, Relay, RelayEvent, classify
from xllm_service.router import Route
from xllm_service.sub_request import SubPhase, SubRequest, SubRequests

E = RelayEvent


def info(name: str, role: InstanceRole) -> InstanceInfo:
    return InstanceInfo(InstanceMeta(name=name, type=role, rpc_address="127.0.0.1:1"),
                        InstanceState.ACTIVE, 0.0)


P, D, D2, M = (info("p", InstanceRole.PREFILL), info("d", InstanceRole.DECODE),
               info("d2", InstanceRole.DECODE), info("m", InstanceRole.MIX))
PD, MIX = Route(P, D), Route(M)


def sub(route: Route = PD, phase: SubPhase = SubPhase.DISPATCHED, generated: int = 0,
        held: int = 0, n: int = 1) -> SubRequest:
    spec = EngineRequestSpec(request_id="r", service_request_id="r", prompt_token_ids=[1, 2],
                             params=SamplingParams(n=n, max_tokens=8))
    s = SubRequest("r", 0, route, asyncio.Queue(), spec, request_id="r", phase=phase)
    s.generated = list(range(100, 100 + generated))
    s.held = [out([7])] * held
    return s


def out(tokens: list[int] = (), code: int = 0, unreachable: str = "") -> RequestOutput:
    return RequestOutput("r", outputs=[CompletionDelta(0, token_ids=list(tokens))],
                         finished=bool(code), error_code=code,
                         error_message="boom" if code else "", unreachable_instance=unreachable)


def gen(o: RequestOutput, on_prefill: bool = False) -> wire.Generation:
    return wire.Generation("r", o, on_prefill)


FIRST = dict(phase=SubPhase.FIRST_RELAYED, generated=1)  # prefill's token relayed, no decode's


def cases() -> list[tuple[RelayEvent, SubRequest | None, str, wire.Generation]]:
    """(event, sub, reporting instance, generation), fresh subs each call."""
    return [
        (E.STALE, None, "m", gen(out([1]))),
        (E.STALE, sub(MIX, SubPhase.CANCELLED), "m", gen(out([1]))),
        (E.DECODE_UNREACHABLE, sub(**FIRST), "p", gen(out(code=502, unreachable="d"))),
        (E.DROPPED, sub(MIX, SubPhase.STREAMING, generated=3), "m",
         gen(out(code=503, unreachable="m"))),
        (E.DROPPED, sub(PD, SubPhase.STREAMING, generated=3), "d",
         gen(out(code=503, unreachable="d"))),
        (E.KV_LOST, sub(**FIRST), "d", gen(out(code=KV_LOST))),
        (E.KV_LOST, sub(**FIRST), "p", gen(out(code=KV_LOST), on_prefill=True)),
        (E.KV_LOST_EARLY, sub(), "d", gen(out(code=KV_LOST))),
        (E.UNPLACED, sub(), "p", gen(out(code=KV_LOST), on_prefill=True)),
        (E.UNPLACED, sub(), "p", gen(out(code=UNAVAILABLE), on_prefill=True)),
        (E.FAILED_BEFORE_TAKE_OVER, sub(), "p", gen(out(code=500), on_prefill=True)),
        (E.FAILED_BEFORE_TAKE_OVER, sub(phase=SubPhase.HOLDING, held=1), "d", gen(out(code=500))),
        (E.FAILED_BEFORE_TAKE_OVER, sub(**FIRST), "d", gen(out(code=500))),
        (E.FAILED, sub(PD, SubPhase.STREAMING, generated=2), "d", gen(out(code=500))),
        (E.FAILED, sub(MIX), "m", gen(out(code=KV_LOST))),  # not PD: no KV to lose
        (E.FAILED, sub(MIX, SubPhase.STREAMING, generated=2, n=2), "m",  # two sequences
         gen(out(code=503, unreachable="m"))),
        (E.OUTPUT, sub(MIX), "m", gen(out([1]))),
        (E.OUTPUT, sub(Route(D, on_decode=True)), "d", gen(out([1]))),
        (E.PREFILL_FIRST, sub(), "p", gen(out([1]), on_prefill=True)),
        (E.PREFILL_FIRST_AFTER_HELD, sub(phase=SubPhase.HOLDING, held=2), "p",
         gen(out([1]), on_prefill=True)),
        (E.DECODE_OUTPUT, sub(**FIRST), "d", gen(out([2]))),
        (E.DECODE_OUTPUT, sub(PD, SubPhase.STREAMING, generated=2), "d", gen(out([3]))),
        (E.DECODE_EARLY, sub(), "d", gen(out([2]))),
        (E.DECODE_EARLY, sub(phase=SubPhase.HOLDING, held=1), "d", gen(out([3]))),
    ]


@pytest.mark.parametrize("i", range(len(cases())),
                         ids=[f"{c[0].name}-{i}" for i, c in enumerate(cases())])
def test_classify(i):
    event, s, name, g = cases()[i]
    assert classify(s, name, g) is event


def test_the_cases_cover_every_event_and_the_table_every_event():
    assert {c[0] for c in cases()} == set(RelayEvent) == set(STEPS)


class FakeRelocator:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def migrate(self, sub, dead, why=""):
        self.calls.append(("migrate", dead, why))

    def recompute_on_a_decode(self, sub, why):
        self.calls.append(("recompute", why))

    def serve_on_a_decode(self, sub, why):
        self.calls.append(("serve_on_a_decode", why))

    def cancel_on_decodes(self, sub, why):
        self.calls.append(("cancel_on_decodes", why))


def apply(s: SubRequest | None, name: str, g: wire.Generation):
    book, relocator, delivered = SubRequests(), FakeRelocator(), []
    if s is not None:
        book.add(s)


    def deliver(sub: SubRequest, o: RequestOutput) -> None:  # as ServiceBackend's does
        if o.finished:
            sub.transition(SubPhase.FINISHED)
        sub.generated.extend(o.outputs[0].token_ids)
        delivered.append(o.outputs[0].token_ids or o.error_code)

    relay = Relay(book, relocator, lambda: [D, D2], deliver)
    ok = relay.on_generation(name, g)
    return ok, relocator.calls, delivered, book


# event -> (phase after, relocator calls, client gets, reply ok, still depends on prefill)
ROWS = {
    E.STALE: (None, [], [], False, None),
    E.DECODE_UNREACHABLE: (SubPhase.FIRST_RELAYED,
                           [("migrate", "d", "decode instance d could not be reached (boom)")],
                           [], True, True),
    E.DROPPED: (SubPhase.STREAMING, [("migrate", "m", "boom")], [], True, None),
    E.KV_LOST: (SubPhase.FIRST_RELAYED,
                [("recompute", "its KV could not reach the decode (boom)")], [], True, True),
    E.KV_LOST_EARLY: (SubPhase.DISPATCHED, [], [], True, True),
    E.UNPLACED: (SubPhase.DISPATCHED, [("serve_on_a_decode", "boom")], [], True, True),
    E.FAILED_BEFORE_TAKE_OVER: (SubPhase.FINISHED, [("cancel_on_decodes", "boom")], [500],
                                True, True),
    E.FAILED: (SubPhase.FINISHED, [], [500], True, True),
    E.OUTPUT: (SubPhase.STREAMING, [], [[1]], True, None),
    E.PREFILL_FIRST: (SubPhase.FIRST_RELAYED, [], [[1]], True, True),
    E.PREFILL_FIRST_AFTER_HELD: (SubPhase.STREAMING, [], [[1], [7], [7]], True, False),
    E.DECODE_OUTPUT: (SubPhase.STREAMING, [], [[2]], True, False),
    E.DECODE_EARLY: (SubPhase.HOLDING, [], [], True, True),
}


@pytest.mark.parametrize("event", list(RelayEvent), ids=lambda e: e.name)
def test_each_row_of_the_table(event):
    # the first case of each event (STALE: the cancelled sub)
    _, s, name, g = next(c for c in cases() if c[0] is event and c[1] is not None)
    phase, calls, delivered, relayed, on_prefill = ROWS[event]
    ok, got_calls, got, book = apply(s, name, g)
    assert (ok, got_calls, got) == (relayed, calls, delivered)
    assert ok is STEPS[event].relayed
    if phase is not None:
        assert s.phase is phase
    if phase is not None and STEPS[event].phase is not None:
        assert s.phase >= STEPS[event].phase
    if on_prefill is not None:
        assert (book.inflight("p") == 1) is on_prefill


def test_a_noted_kv_loss_is_recomputed_once_the_prefill_token_is_relayed():
    s = sub()
    ok, calls, delivered, _ = apply(s, "d", gen(out(code=KV_LOST)))
    assert s.kv_lost == "boom" and calls == [] and delivered == []
    relay_calls = apply(s, "p", gen(out([1]), on_prefill=True))[1]
    assert relay_calls == [("recompute", "its KV could not reach the decode (boom)")]
    assert s.phase is SubPhase.FIRST_RELAYED and s.generated == [1]


def test_a_decode_output_from_another_decode_re_points_the_route_first():
    s = sub(**FIRST)
    ok, _, delivered, book = apply(s, "d2", gen(out([2])))
    assert s.route.decode is D2 and book.inflight("d2") == 1 and book.inflight("d") == 0
    assert delivered == [[2]] and s.phase is SubPhase.STREAMING


def test_an_output_does_not_move_a_sub_back():
    s = sub(PD, SubPhase.STREAMING, generated=2)  # a migrated sub, late prefill token
    apply(s, "p", gen(out([1]), on_prefill=True))
    assert s.phase is SubPhase.STREAMING
