"""The PD records (xllm_py/engine/pd/phases.py) take statuses of the one request status
(xllm_py/request.py), checked against its one table (every edge of which
tests/unit/domain/test_request.py takes): each side's phases are named statuses, every phase
change a side makes is an edge of that table, the changes that would free blocks under
a KV transfer are not, and a refused change leaves the record as it was."""
from __future__ import annotations

import itertools

import pytest

from xllm_py.engine.pd.phases import DecodePhase, DecodeRequest, PrefillPhase, PrefillRequest
from xllm_py.request import RequestStatus, is_transition_allowed
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.sampling_params import SamplingParams

P, D, S = PrefillPhase, DecodePhase, RequestStatus

# Every change prefill.py and decode.py make (their docstrings' diagrams).
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


def test_phases_are_distinct_statuses_of_the_one_machine():
    for side in (P.ALL, D.ALL):
        assert len(set(side)) == len(side) and all(isinstance(p, RequestStatus) for p in side)
    assert (P.QUEUED, P.PREFILLING, P.HANDING_OVER) == (S.WAITING, S.RUNNING, S.SENDING_KV)
    assert (D.ALLOCATED, D.DECODING) == (S.WAITING_FOR_REMOTE_KVS, S.RUNNING)


@pytest.mark.parametrize("old, new", sorted(PREFILL_EDGES | DECODE_EDGES))
def test_every_change_a_side_makes_is_an_edge_of_the_table(old, new):
    assert is_transition_allowed(old, new)
    record = (DecodeRequest(_spec(), "prefill:1", [0], 0, phase=old) if old in D.ALL
              and (old, new) in DECODE_EDGES else PrefillRequest(_spec(), phase=old))
    record.transition(new)
    assert record.phase is new


@pytest.mark.parametrize("old, new", [
    (D.PULLING, D.DROPPED),  # the pull may still write into its blocks
    (D.CANCELLED, D.PULLING), (D.CANCELLED, D.FAILED), (D.GONE, D.DECODING),
    (P.QUEUED, P.HANDING_OVER), (P.DISPATCHING, P.HANDING_OVER),
])
def test_no_shortcut_past_a_transfer_or_a_placement(old, new):
    assert not is_transition_allowed(old, new)


@pytest.mark.parametrize("old, new", sorted(
    (a, b) for a, b in itertools.product(D.ALL, D.ALL) if (a, b) not in DECODE_EDGES
    and not is_transition_allowed(a, b)))
def test_a_refused_change_leaves_the_record_as_it_was(old, new):
    record = DecodeRequest(_spec(), "prefill:1", [0], 0, phase=old)
    with pytest.raises(ValueError, match=f"r1: transition {old.name} -> {new.name}"):
        record.transition(new)
    assert record.phase is old


def test_the_decode_record_leaves_where_the_table_has_it_run_or_end():
    assert D.LEAVES == (S.RUNNING, S.FINISHED_ABORTED, S.FINISHED_ERROR)
    assert all(p.is_finished() for p in D.LEAVES[1:])


def test_records_start_where_each_side_starts():
    assert PrefillRequest(_spec()).phase is P.QUEUED
    assert DecodeRequest(_spec(), "prefill:1", [0], 0).phase is D.ALLOCATED
