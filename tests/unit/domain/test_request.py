import itertools

import pytest

from xllm_py.request import (
    _ALLOWED,
    FINISH_REASONS,
    Request,
    RequestStatus,
    finish_reason,
    is_transition_allowed,
)
from xllm_py.sampling_params import SamplingParams

S = RequestStatus

EXPECTED_EDGES = {
    (S.WAITING, S.RUNNING),
    (S.WAITING, S.WAITING_FOR_REMOTE_KVS),
    (S.WAITING, S.FINISHED_ABORTED),
    (S.WAITING, S.FINISHED_ERROR),
    (S.WAITING_FOR_REMOTE_KVS, S.RUNNING),
    (S.WAITING_FOR_REMOTE_KVS, S.FINISHED_ABORTED),
    (S.WAITING_FOR_REMOTE_KVS, S.FINISHED_ERROR),
    # PD prefill record: placed on a decode before the engine computes it
    (S.WAITING, S.DISPATCHING),
    (S.DISPATCHING, S.RUNNING),
    (S.DISPATCHING, S.FINISHED_ABORTED),
    (S.DISPATCHING, S.FINISHED_ERROR),
    # PD decode record: the KV moves into the blocks set aside; a cancel waits for any
    # transfer that may touch them
    (S.WAITING_FOR_REMOTE_KVS, S.RECEIVING_KVS),
    (S.WAITING_FOR_REMOTE_KVS, S.REMOTE_KVS_CANCELLED),
    (S.REMOTE_KVS_CANCELLED, S.FINISHED_ABORTED),
    (S.RECEIVING_KVS, S.RUNNING),
    (S.RECEIVING_KVS, S.RECEIVING_KVS_CANCELLED),
    (S.RECEIVING_KVS, S.FINISHED_ERROR),
    (S.RECEIVING_KVS_CANCELLED, S.FINISHED_ABORTED),
    (S.RECEIVING_KVS_CANCELLED, S.FINISHED_ERROR),
    (S.RUNNING, S.PREEMPTED),
    (S.RUNNING, S.SUSPENDED),
    (S.RUNNING, S.SENDING_KV),
    (S.RUNNING, S.FINISHED_STOPPED),
    (S.RUNNING, S.FINISHED_LENGTH_CAPPED),
    (S.RUNNING, S.FINISHED_ABORTED),
    (S.RUNNING, S.FINISHED_ERROR),
    (S.PREEMPTED, S.RUNNING),
    (S.PREEMPTED, S.FINISHED_STOPPED),
    (S.PREEMPTED, S.FINISHED_LENGTH_CAPPED),
    (S.PREEMPTED, S.FINISHED_ABORTED),
    (S.PREEMPTED, S.FINISHED_ERROR),
    (S.SENDING_KV, S.FINISHED_LENGTH_CAPPED),
    (S.SENDING_KV, S.FINISHED_ABORTED),
    (S.SENDING_KV, S.FINISHED_ERROR),
    # offline work: out of the batch for online work, KV kept
    (S.SUSPENDED, S.RUNNING),
    (S.SUSPENDED, S.PREEMPTED),
    (S.SUSPENDED, S.FINISHED_STOPPED),
    (S.SUSPENDED, S.FINISHED_LENGTH_CAPPED),
    (S.SUSPENDED, S.FINISHED_ABORTED),
    (S.SUSPENDED, S.FINISHED_ERROR),
}


def make_request(**kwargs) -> Request:
    return Request("r1", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=0.0, **kwargs)


def test_table_covers_every_status():
    assert set(_ALLOWED) == set(RequestStatus)


@pytest.mark.parametrize("old, new", sorted(itertools.product(RequestStatus, RequestStatus)))
def test_every_edge(old, new):
    request = make_request()
    request.status = old  # set up the source state directly
    if (old, new) in EXPECTED_EDGES:
        request.transition(new)
        assert request.status == new
        assert is_transition_allowed(old, new)
    else:
        with pytest.raises(ValueError, match=f"{old.name} -> {new.name}"):
            request.transition(new)
        assert request.status == old
        assert not is_transition_allowed(old, new)


def test_is_finished_exactly_the_finished_states():
    finished = {s for s in RequestStatus if s.is_finished()}
    assert finished == {
        S.FINISHED_STOPPED, S.FINISHED_LENGTH_CAPPED, S.FINISHED_ABORTED, S.FINISHED_ERROR
    }
    assert all(_ALLOWED[s] == set() for s in finished)


def test_finish_reasons():
    assert FINISH_REASONS == {
        S.FINISHED_STOPPED: "stop",
        S.FINISHED_LENGTH_CAPPED: "length",
        S.FINISHED_ABORTED: "abort",
        S.FINISHED_ERROR: "error",
    }
    assert finish_reason(S.RUNNING) is None
    request = make_request()
    request.transition(S.RUNNING)
    assert request.finish_reason is None
    request.transition(S.FINISHED_LENGTH_CAPPED)
    assert request.finish_reason == "length"
    assert request.is_finished()


def test_token_views():
    request = make_request()
    assert request.num_tokens == 3 and request.num_output_tokens == 0
    request.append_output_token(9)
    request.append_output_token(8)
    assert request.output_token_ids == [9, 8]
    assert request.all_token_ids == [1, 2, 3, 9, 8]
    assert request.num_tokens == 5 and request.num_output_tokens == 2
    assert request.num_prompt_tokens == 3
    assert request.prompt_token_ids == [1, 2, 3]


def test_anon_repr_has_no_token_contents():
    request = Request("abc", [123456, 654321], SamplingParams())
    request.append_output_token(777777)
    text = request.anon_repr()
    assert "abc" in text and "num_prompt_tokens=2" in text and "num_output_tokens=1" in text
    for token in ("123456", "654321", "777777"):
        assert token not in text
    assert repr(request) == text


def test_bad_input():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("r", [], SamplingParams())
    with pytest.raises(ValueError, match="request_id"):
        Request("", [1], SamplingParams())
