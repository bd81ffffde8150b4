"""API keys on the OpenAI HTTP API (`--api-key`, `--api-key-file`): OpenAI-style
`Authorization: Bearer <key>` (or Anthropic-style `x-api-key: <key>`), 401 with an OpenAI
error body otherwise.

Open without a key: the probes (/health, /readiness) and, unless `protect_metrics`, /metrics.
Keys are compared in constant time (hmac.compare_digest, against every key) and never logged:
`APIKeys` keeps them out of its repr.
"""
from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from typing import Any, Awaitable, Callable

OPEN_PATHS = frozenset({"/health", "/readiness"})
METRICS_PATH = "/metrics"

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


class APIKeys:
    """The accepted keys; `matches` is constant-time in the key compared."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(k.encode() for k in keys)
        if not self._keys:
            raise ValueError("APIKeys needs at least one key")

    def __repr__(self) -> str:
        return f"APIKeys(<{len(self._keys)} keys>)"

    def matches(self, presented: bytes) -> bool:
        ok = False
        for key in self._keys:  # every key, no early exit: the time does not tell which one
            ok |= hmac.compare_digest(presented, key)
        return ok


def bearer_token(scope: Scope) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header, else of an `x-api-key`
    header (how Anthropic's clients send it), else None."""
    api_key = None
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
        if name == b"x-api-key" and value.strip():
            api_key = value.strip()
    return api_key


_UNAUTHORIZED = json.dumps({"error": {
    "message": "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()


class APIKeyMiddleware:
    """ASGI middleware: HTTP requests outside the open paths need a valid bearer key."""

    def __init__(self, app: ASGIApp, keys: APIKeys, protect_metrics: bool = False) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = OPEN_PATHS if protect_metrics else OPEN_PATHS | {METRICS_PATH}

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        if token is not None and self.keys.matches(token):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
