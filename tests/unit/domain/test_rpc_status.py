"""Status (xllm_py/status.py): one table of gRPC codes and HTTP statuses."""
from __future__ import annotations

import grpc
import pytest

from xllm_py.status import Status, StatusError


def test_the_table():
    assert {s.name: (s.grpc_code, s.http_status) for s in Status} == {
        "OK": (grpc.StatusCode.OK, 200),
        "INVALID_ARGUMENT": (grpc.StatusCode.INVALID_ARGUMENT, 400),
        "NOT_FOUND": (grpc.StatusCode.NOT_FOUND, 404),
        "FAILED_PRECONDITION": (grpc.StatusCode.FAILED_PRECONDITION, 412),
        "RESOURCE_EXHAUSTED": (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        "CANCELLED": (grpc.StatusCode.CANCELLED, 499),
        "INTERNAL": (grpc.StatusCode.INTERNAL, 500),
        "UNIMPLEMENTED": (grpc.StatusCode.UNIMPLEMENTED, 501),
        "UNAVAILABLE": (grpc.StatusCode.UNAVAILABLE, 503),
        "BAD_GATEWAY": (grpc.StatusCode.UNAVAILABLE, 502),
        "DEADLINE_EXCEEDED": (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    }


@pytest.mark.parametrize("status", list(Status))
def test_http_round_trip(status):
    assert Status.from_http(status.http_status) is status


@pytest.mark.parametrize("status", list(Status))
def test_grpc_round_trip_gives_the_first_row_of_a_code(status):
    back = Status.from_grpc(status.grpc_code)
    assert back.grpc_code == status.grpc_code
    assert back is (Status.UNAVAILABLE if status is Status.BAD_GATEWAY else status)
    assert Status.from_grpc(status.grpc_code.name) is back


def test_unknown_codes():
    assert Status.from_http(0) is Status.OK  # an unset proto3 field
    assert Status.from_http(418) is Status.INVALID_ARGUMENT
    assert Status.from_http(599) is Status.INTERNAL
    assert Status.from_grpc(grpc.StatusCode.DATA_LOSS) is Status.INTERNAL
    assert Status.OK.ok and not Status.INTERNAL.ok


def test_status_error_carries_status_and_message():
    exc = StatusError(Status.BAD_GATEWAY, "KV pull failed: boom")
    assert (exc.status, exc.message, str(exc)) == (Status.BAD_GATEWAY, "KV pull failed: boom",
                                                   "KV pull failed: boom")
