"""The PD phase machines (xllm_py/engine/pd/phases.py): every edge of both tables, legal
ones taken, illegal ones refused without a change."""
from __future__ import annotations

import itertools

import pytest

from xllm_py.engine.pd.phases import (_DECODE_ALLOWED, _PREFILL_ALLOWED, DecodePhase,
                                      DecodeRequest, PrefillPhase, PrefillRequest,
                                      is_transition_allowed)
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.sampling_params import SamplingParams

P, D = PrefillPhase, DecodePhase

PREFILL_EDGES = {
    (P.QUEUED, P.DISPATCHING), (P.QUEUED, P.CANCELLED),
    (P.DISPATCHING, P.PREFILLING), (P.DISPATCHING, P.FAILED), (P.DISPATCHING, P.CANCELLED),
    (P.PREFILLING, P.HANDING_OVER), (P.PREFILLING, P.FAILED), (P.PREFILLING, P.CANCELLED),
    (P.HANDING_OVER, P.FINISHED), (P.HANDING_OVER, P.FAILED),
}
DECODE_EDGES = {
    (D.ALLOCATED, D.PULLING), (D.ALLOCATED, D.CANCELLED), (D.ALLOCATED, D.DROPPED),
    (D.ALLOCATED, D.FAILED),
    (D.CANCELLED, D.DROPPED),
    (D.PULLING, D.DECODING), (D.PULLING, D.GONE), (D.PULLING, D.FAILED),
    (D.GONE, D.DROPPED), (D.GONE, D.FAILED),
}


def _spec() -> EngineRequestSpec:
    return EngineRequestSpec("r1", "r1", [1, 2, 3], SamplingParams(max_tokens=4))


def _record(phase):
    if isinstance(phase, PrefillPhase):
        return PrefillRequest(_spec(), phase=phase)
    return DecodeRequest(_spec(), "prefill:1", [0], 0, phase=phase)


def test_tables_cover_every_phase():
    assert set(_PREFILL_ALLOWED) == set(PrefillPhase)
    assert set(_DECODE_ALLOWED) == set(DecodePhase)


@pytest.mark.parametrize("old, new", [*itertools.product(PrefillPhase, PrefillPhase),
                                      *itertools.product(DecodePhase, DecodePhase)],
                         ids=lambda p: f"{type(p).__name__[:-5]}.{p.name}")
def test_every_edge(old, new):
    record = _record(old)
    if (old, new) in PREFILL_EDGES | DECODE_EDGES:
        record.transition(new)
        assert record.phase is new and is_transition_allowed(old, new)
    else:
        with pytest.raises(ValueError, match=f"r1: illegal PD phase change {old.name} -> "
                                             f"{new.name}"):
            record.transition(new)
        assert record.phase is old and not is_transition_allowed(old, new)


def test_final_phases_are_the_ones_without_a_way_out():
    assert {p for p in PrefillPhase if p.is_final()} == {P.FINISHED, P.FAILED, P.CANCELLED}
    assert {p for p in DecodePhase if p.is_final()} == {D.DECODING, D.DROPPED, D.FAILED}


def test_a_phase_of_one_side_is_never_a_step_of_the_other():
    assert not is_transition_allowed(P.QUEUED, D.ALLOCATED)
    with pytest.raises(ValueError):
        _record(D.ALLOCATED).transition(P.DISPATCHING)


def test_records_start_where_each_side_starts():
    assert PrefillRequest(_spec()).phase is P.QUEUED
    assert DecodeRequest(_spec(), "prefill:1", [0], 0).phase is D.ALLOCATED
