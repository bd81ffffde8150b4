"""SubRequest's phase machine (every edge of _ALLOWED, illegal steps rejected) and
SubRequests, the service's book of sub-requests (add, release, move, rekey, forget,
pop_instance)."""
from __future__ import annotations

import asyncio

import pytest

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole
from xllm_service.instance_table import InstanceInfo, InstanceState
from xllm_service.router import Route
from xllm_service.sub_request import (_ALLOWED, InvalidSubTransition, SubPhase, SubRequest,
                                      SubRequests)


def info(name: str, role: InstanceRole) -> InstanceInfo:
    return InstanceInfo(InstanceMeta(name=name, type=role, rpc_address="127.0.0.1:1"),
                        InstanceState.ACTIVE, 0.0)


P, D, D2, M = (info("p", InstanceRole.PREFILL), info("d", InstanceRole.DECODE),
               info("d2", InstanceRole.DECODE), info("m", InstanceRole.MIX))


def sub(rid: str = "r", route: Route = Route(P, D), phase: SubPhase = SubPhase.DISPATCHED):
    s = SubRequest(rid, 0, route, asyncio.Queue())
    s.phase = phase
    return s


def test_table_covers_every_phase_and_only_done_phases_are_final():
    assert set(_ALLOWED) == set(SubPhase)
    for phase, targets in _ALLOWED.items():
        assert (targets == set()) == phase.is_done, phase
        if not phase.is_done:
            assert {SubPhase.FINISHED, SubPhase.CANCELLED} <= targets


@pytest.mark.parametrize("src,dst", [(a, b) for a in SubPhase for b in SubPhase])
def test_every_edge(src, dst):
    s = sub(phase=src)
    if dst in _ALLOWED[src]:
        s.transition(dst)
        assert s.phase is dst
    else:
        with pytest.raises(InvalidSubTransition, match=f"{src.name} -> {dst.name}"):
            s.transition(dst)
        assert s.phase is src


def test_documented_paths():
    for path in ([SubPhase.STREAMING, SubPhase.FINISHED],  # MIX
                 [SubPhase.FIRST_RELAYED, SubPhase.STREAMING, SubPhase.FINISHED],  # PD
                 [SubPhase.HOLDING, SubPhase.STREAMING, SubPhase.FINISHED]):  # decode first
        s = sub()
        for phase in path:
            s.transition(phase)
        assert s.finished


@pytest.mark.parametrize("src", list(SubPhase))
def test_advance_only_moves_forward_and_never_out_of_an_end(src):
    for dst in SubPhase:
        s = sub(phase=src)
        if src.is_done or dst <= src:
            s.advance(dst)
            assert s.phase is src
        elif dst in _ALLOWED[src]:
            s.advance(dst)
            assert s.phase is dst


def test_repr_keeps_tokens_out():
    s = sub()
    s.generated = [123456]
    assert "123456" not in repr(s) and "generated=1" in repr(s)


def test_add_counts_the_sub_on_every_instance_of_its_route():
    book = SubRequests()
    a, b = sub("a"), sub("b", Route(M))
    book.add(a)
    book.add(b)
    assert book.get("a") is a and book.get("b") is b and len(book) == 2
    assert (book.inflight("p"), book.inflight("d"), book.inflight("m")) == (1, 1, 1)


def test_release_ends_the_dependence_on_one_instance_but_keeps_the_route():
    book = SubRequests()
    a = sub("a")
    book.add(a)
    book.release(a, "p")
    assert (book.inflight("p"), book.inflight("d")) == (0, 1)
    assert a.route.instance_names == ("p", "d")
    assert book.pop_instance("p") == []


def test_move_repoints_a_pd_sub_to_another_decode():
    book = SubRequests()
    a = sub("a")
    book.add(a)
    book.move(a, D2)
    assert a.route == Route(P, D2)
    assert (book.inflight("p"), book.inflight("d"), book.inflight("d2")) == (1, 0, 1)


def test_rekey_forgets_the_old_id_and_depends_on_the_new_instance_only():
    book = SubRequests()
    a = sub("a")
    book.add(a)
    book.rekey(a, "a2", Route(P, D2))
    assert book.get("a") is None and book.get("a2") is a and a.engine_request_id == "a2"
    assert (book.inflight("p"), book.inflight("d"), book.inflight("d2")) == (0, 0, 1)


def test_forget_and_pop_instance():
    book = SubRequests()
    a, b = sub("a"), sub("b")
    book.add(a)
    book.add(b)
    assert book.pop_instance("d") == [a, b]  # by id
    assert book.inflight("d") == 0 and book.inflight("p") == 2
    book.forget(a)
    assert book.get("a") is None and book.inflight("p") == 1
    book.forget(b)
    book.forget(b)  # twice: nothing left to drop
    assert len(book) == 0
    # An instance stays listed with 0 until evicted (the gauge keeps its series).
    assert book.inflight_by_instance() == [("p", 0)]
