"""Bounded work of one OpenAI HTTP server: the body size limit and the
admission limit, configured by `xllm_py.config.APILimits`.

- `BodyLimitMiddleware` (ASGI): a Content-Length over the limit is answered 413 before
  any of the body is read; a body without one (chunked) is counted as it streams and
  fails with `RequestTooLargeError` (413) at the first byte over the limit, so no
  request holds more than the limit in memory.
- `Admission`: HTTP requests and their prompt tokens (x sequences) admitted and not
  finished yet; beyond either limit a new request gets `TooManyRequestsError` (429 with
  Retry-After). Each admitted request holds a `Ticket` it releases once, however it ends.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Awaitable, Callable

from xllm_py.api.errors import RequestTooLargeError, TooManyRequestsError
from xllm_py.config import APILimits

# A refused body up to this size is read and dropped (never held) before the 413, so that
# clients that send the whole body before reading get the answer; a larger one gets the
# 413 at once and a closed connection.
MAX_DRAIN_BYTES = 64 << 20

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            if length <= MAX_DRAIN_BYTES:
                await _drain(receive)
            await _send_error(send, RequestTooLargeError(self.max_body_bytes),
                              close=length > MAX_DRAIN_BYTES)
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise RequestTooLargeError(self.max_body_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except RequestTooLargeError as e:  # read by a route that did not answer it itself
            if not started:
                await _send_error(send, e, close=True)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_error(send, e: RequestTooLargeError, close: bool) -> None:
    body = json.dumps(e.to_dict()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": e.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _drain(receive) -> None:
    """Read and drop a refused body (chunk by chunk, never held), so that a client still
    sending it reads the 413 instead of a reset connection."""
    drained = 0
    while drained <= MAX_DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class Ticket:
    """One admitted request's share of the admission limit; `release` is idempotent."""

    def __init__(self, admission: "Admission", num_tokens: int) -> None:
        self._admission = admission
        self.num_tokens = num_tokens
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self)


class Admission:
    """Pending HTTP requests and tokens of one server (one event loop: no lock needed)."""

    def __init__(self, limits: APILimits) -> None:
        self.limits = limits
        self.num_pending_requests = 0
        self.num_pending_tokens = 0

    def admit(self, num_tokens: int) -> Ticket:
        """A ticket for a request of `num_tokens` (prompt tokens x sequences), or
        TooManyRequestsError. One request alone is always admitted when nothing is pending,
        so a request larger than the token limit is not refused forever."""
        lim = self.limits
        if self.num_pending_requests >= lim.max_pending_requests:
            raise TooManyRequestsError(
                f"server has {self.num_pending_requests} requests in flight (limit "
                f"{lim.max_pending_requests}); retry later", lim.retry_after_s)
        if self.num_pending_requests and (self.num_pending_tokens + num_tokens
                                          > lim.max_pending_tokens):
            raise TooManyRequestsError(
                f"server has {self.num_pending_tokens} prompt tokens in flight (limit "
                f"{lim.max_pending_tokens}); retry later", lim.retry_after_s)
        self.num_pending_requests += 1
        self.num_pending_tokens += num_tokens
        return Ticket(self, num_tokens)

    def _release(self, ticket: Ticket) -> None:
        self.num_pending_requests -= 1
        self.num_pending_tokens -= ticket.num_tokens


def add_limit_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The APILimits flags, shared by the engine's and the service's command lines."""
    from xllm_py.utils.cli import add_flag

    d = APILimits()
    add_flag(parser, "--max-body-bytes", type=int, default=d.max_body_bytes,
             help="HTTP request bodies over this many bytes get 413")
    add_flag(parser, "--max-pending-requests", type=int, default=d.max_pending_requests,
             help="HTTP requests in flight beyond which new ones get 429 + Retry-After")
    add_flag(parser, "--max-pending-tokens", type=int, default=d.max_pending_tokens,
             help="prompt tokens (x sequences) in flight beyond which new requests get 429")
    add_flag(parser, "--retry-after", type=int, default=d.retry_after_s,
             help="Retry-After (s) of a 429")
    add_flag(parser, "--trust-request-chat-template", action="store_true",
             help="render a chat request's own chat_template (else a 400): a template is code")


def limits_from_args(args: argparse.Namespace) -> APILimits:
    return APILimits(max_body_bytes=args.max_body_bytes,
                     max_pending_requests=args.max_pending_requests,
                     max_pending_tokens=args.max_pending_tokens,
                     retry_after_s=args.retry_after,
                     trust_request_chat_template=args.trust_request_chat_template)
