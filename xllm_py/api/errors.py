"""Errors of the OpenAI-compatible HTTP layer and their OpenAI error bodies.

Every error a client can see is an `APIError` carrying the HTTP status and the fields of
OpenAI's body `{"error": {"message", "type", "param", "code"}}`. Backends raise
`BackendBusyError` when they cannot take more work (mapped to 503). Bounded work:
a body over the limit is `RequestTooLargeError` (413), a request beyond the admission
limit `TooManyRequestsError` (429 with Retry-After).
"""
from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered to the client with `status_code` and an OpenAI error body."""

    status_code: int = 500
    error_type: str = "server_error"

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        error_type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status_code is not None:
            self.status_code = status_code
        if error_type is not None:
            self.error_type = error_type
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        """HTTP headers of the error response (Retry-After, ...)."""
        return {}


class InvalidRequestError(APIError):
    """400: the request is malformed or has invalid values."""

    status_code = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(APIError):
    """404: the request names a model that this server does not serve."""

    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )


class ServiceUnavailableError(APIError):
    """503: the backend is not ready (e.g. no instance registered) or overloaded."""

    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, code: str | int | None = "service_unavailable") -> None:
        super().__init__(message, code=code)


class BackendBusyError(ServiceUnavailableError):
    """Raised by a backend (from `generate` or its first iteration) when it cannot take more work."""

    def __init__(self, message: str = "server is busy, retry later") -> None:
        super().__init__(message, code="backend_busy")


class RequestTooLargeError(APIError):
    """413: the request body is over the server's limit (refused before it is read whole)."""

    status_code = 413
    error_type = "invalid_request_error"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is larger than the limit of {limit} bytes",
                         code="request_too_large")


class TooManyRequestsError(APIError):
    """429: the server holds as much work as it takes; retry after `retry_after_s`."""

    status_code = 429
    error_type = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class BackendError(APIError):
    """A failure reported by the backend (`RequestOutput.error_code`), 500 unless it says 4xx/5xx."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, status_code: int = 500) -> None:
        if not 400 <= status_code <= 599:
            status_code = 500
        error_type = "invalid_request_error" if status_code < 500 else "server_error"
        super().__init__(
            message or "backend failure", status_code=status_code, error_type=error_type,
            code=status_code,
        )


def error_body(
    message: str,
    error_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
