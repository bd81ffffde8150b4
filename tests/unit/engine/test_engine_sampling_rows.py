"""sampler.request_row: a request's sampler row is made once, carries the request's
own SamplingParams (not a copy of its fields) and follows its output (the seeded draw's
step index and the penalties' token history)."""
from __future__ import annotations

from xllm_py.engine.sampler import request_row
from xllm_py.request import Request
from xllm_py.sampling_params import SamplingParams


def _row(request: Request):
    return request_row(request)


def test_the_row_is_built_once_and_counts_the_outputs():
    request = Request("r#0", [5, 6, 7], SamplingParams(temperature=0.7, seed=3,
                                                       frequency_penalty=0.5))
    row = _row(request)
    assert row.params is request.sampling_params
    assert row.num_output_tokens_so_far == 0 and row.params.seed == 3
    request.append_output_token(11)
    request.append_output_token(12)
    again = _row(request)
    assert again is row
    assert row.num_output_tokens_so_far == 2
    assert list(row.output_token_ids) == [11, 12]  # the penalties see the new tokens
    assert list(row.prompt_token_ids) == [5, 6, 7]


def test_without_penalties_the_row_carries_no_history():
    request = Request("r#0", [5, 6, 7], SamplingParams(temperature=0.0))
    request.append_output_token(11)
    row = _row(request)
    assert row.is_greedy and not row.has_penalties
    assert tuple(row.output_token_ids) == () and tuple(row.prompt_token_ids) == ()
    assert row.num_output_tokens_so_far == 1
