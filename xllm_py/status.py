"""Status: what went wrong with a request or an RPC, with its gRPC code and HTTP status
in one table.

The cluster speaks two status vocabularies: gRPC codes between processes, HTTP statuses
towards clients (and in the integer `code` / `status_code` fields of xLLM's messages).
Code that fails raises `StatusError(Status.X, message)`; the layer that answers turns it
into `status.grpc_code` (a servicer's `context.abort`) or `status.http_status` (an
OpenAI error, an engine output's `error_code`). No other module keeps a mapping.

    Status               gRPC code            HTTP   used for
    OK                   OK                   200
    INVALID_ARGUMENT     INVALID_ARGUMENT     400    bad request (also: decode refused it)
    NOT_FOUND            NOT_FOUND            404    unknown request / instance
    FAILED_PRECONDITION  FAILED_PRECONDITION  412    wrong role, incompatible peers
    RESOURCE_EXHAUSTED   RESOURCE_EXHAUSTED   429    no KV space now (retry)
    CANCELLED            CANCELLED            499    the caller gave up
    INTERNAL             INTERNAL             500    a bug or an unexpected failure
    UNIMPLEMENTED        UNIMPLEMENTED        501
    UNAVAILABLE          UNAVAILABLE          503    nobody can take it now
    BAD_GATEWAY          UNAVAILABLE          502    a peer failed (KV transfer, decode)
    DEADLINE_EXCEEDED    DEADLINE_EXCEEDED    504

gRPC has no code of its own for "a peer failed": BAD_GATEWAY travels as UNAVAILABLE
and comes back as UNAVAILABLE (`from_grpc` answers a code's first row). Unknown
HTTP statuses map to INVALID_ARGUMENT (4xx) or INTERNAL (anything else); unknown gRPC
codes to INTERNAL. grpc is imported only when `grpc_code` is read, so the HTTP side can
use this module without it.
"""
from __future__ import annotations

import enum
from typing import Any


class Status(enum.Enum):
    # (gRPC code name, HTTP status): the value, unique per member.
    OK = ("OK", 200)
    INVALID_ARGUMENT = ("INVALID_ARGUMENT", 400)
    NOT_FOUND = ("NOT_FOUND", 404)
    FAILED_PRECONDITION = ("FAILED_PRECONDITION", 412)
    RESOURCE_EXHAUSTED = ("RESOURCE_EXHAUSTED", 429)
    CANCELLED = ("CANCELLED", 499)
    INTERNAL = ("INTERNAL", 500)
    UNIMPLEMENTED = ("UNIMPLEMENTED", 501)
    UNAVAILABLE = ("UNAVAILABLE", 503)  # (before BAD_GATEWAY: from_grpc's answer)
    BAD_GATEWAY = ("UNAVAILABLE", 502)
    DEADLINE_EXCEEDED = ("DEADLINE_EXCEEDED", 504)

    def __init__(self, grpc_name: str, http_status: int) -> None:
        self.grpc_name = grpc_name
        self.http_status = http_status

    @property
    def grpc_code(self) -> Any:
        """The grpc.StatusCode."""
        import grpc

        return grpc.StatusCode[self.grpc_name]

    @property
    def ok(self) -> bool:
        return self is Status.OK

    @classmethod
    def from_http(cls, code: int) -> "Status":
        """The status of an HTTP status (0 counts as OK: an unset proto3 field)."""
        if code in (0, 200):
            return cls.OK
        for status in cls:
            if status.http_status == code:
                return status
        return cls.INVALID_ARGUMENT if 400 <= code < 500 else cls.INTERNAL

    @classmethod
    def from_grpc(cls, code: Any) -> "Status":
        """The status of a grpc.StatusCode (or its name)."""
        name = code if isinstance(code, str) else code.name
        for status in cls:
            if status.grpc_name == name:
                return status
        return cls.INTERNAL


class StatusError(Exception):
    """A failure with its Status and a message for the client (no prompt text in it)."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __repr__(self) -> str:
        return f"StatusError({self.status.name}, {self.message!r})"
