"""POST /v1/messages (Anthropic's Messages API) through the chat path.

A request becomes a chat completion request (messages_protocol.py) served as the chat
endpoint serves its own; the one choice renders as content blocks (output_blocks.py): text
and tool_use. stop_reason: end_turn, max_tokens, stop_sequence (with the sequence) or
tool_use. A stream sends Anthropic's events, each named: message_start, per block
content_block_start, content_block_delta (text_delta / input_json_delta) and
content_block_stop, then message_delta (stop_reason, usage) and message_stop. Errors have
Anthropic's shape, {"type": "error", "error": {"type", "message"}}, before the stream
and in it (an `error` event).
"""
from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from xllm_py.api.context import RequestContext
from xllm_py.api.errors import APIError
from xllm_py.api.messages_protocol import parse_messages_request
from xllm_py.api.output_blocks import TEXT, Block, OutputBlocks, blocks_of
from xllm_py.api.protocol import ChatCompletionRequest
from xllm_py.api.serving_base import error_response
from xllm_py.api.serving_chat import OpenAIServingChat, tool_name
from xllm_py.api.serving_responses import named_event
from xllm_py.outputs import CompletionDelta

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(e: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(e.status_code,
                            "invalid_request_error" if e.status_code < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


class AnthropicServingMessages(OpenAIServingChat):
    id_prefix = "msg"
    id_sep = "_"
    object_name = "message"
    prompt_param = "messages"

    async def _parse(self, body: bytes, large: bool) -> ChatCompletionRequest:
        req = parse_messages_request(body)
        self.check_model(req.model)
        return req.to_chat()

    def _error_response(self, e: APIError, headers: dict[str, str] | None = None) -> Response:
        return error_response(e, headers, anthropic_error(e))

    # -- rendering ------------------------------------------------------------------------

    @staticmethod
    def _block(block: Block, started: bool = False) -> dict[str, Any]:
        if block.kind == TEXT:
            return {"type": "text", "text": "" if started else block.text}
        return {"type": "tool_use", "id": "toolu_" + (block.call_id or "").removeprefix("call_"),
                "name": block.name, "input": {} if started else _input(block.text)}

    @staticmethod
    def _stop(ctx: RequestContext, has_tool_calls: bool) -> tuple[str, str | None]:
        choice = ctx.choices[0]
        if choice.finish_reason == "length":
            return "max_tokens", None
        if has_tool_calls:
            return "tool_use", None
        if isinstance(choice.stop_reason, str):
            return "stop_sequence", choice.stop_reason
        return "end_turn", None

    @staticmethod
    def _usage(ctx: RequestContext) -> dict[str, Any]:
        u = ctx.usage()
        cached = u["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

    def _message(self, ctx: RequestContext, content: list[dict[str, Any]],
                 stop: tuple[str | None, str | None], usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": ctx.request_id, "type": "message", "role": "assistant", "model": ctx.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": usage}

    async def _full_response(self, ctx: RequestContext) -> dict[str, Any]:
        blocks = blocks_of(ctx.choices[0].text, ctx.req._tool_format, tool_name(ctx))
        calls = any(b.kind != TEXT for b in blocks)
        return self._message(ctx, [self._block(b) for b in blocks], self._stop(ctx, calls),
                             self._usage(ctx))

    # -- stream ---------------------------------------------------------------------------

    def _sse_open(self, ctx: RequestContext) -> list[str]:
        ctx.state = OutputBlocks(ctx.req._tool_format, tool_name(ctx))
        usage = {**self._usage(ctx), "output_tokens": 0}
        return [named_event("message_start", {"type": "message_start", "message": self._message(
            ctx, [], (None, None), usage)})]

    def _sse_delta(self, ctx: RequestContext, choice: Any, delta: CompletionDelta) -> list[str]:
        blocks: OutputBlocks = ctx.state
        events = []
        for what, block, fragment in blocks.feed(delta.text, delta.finish_reason is not None):
            i = block.index
            if what == "open":
                events.append(named_event("content_block_start", {
                    "type": "content_block_start", "index": i,
                    "content_block": self._block(block, started=True)}))
            elif what == "delta":
                change = ({"type": "text_delta", "text": fragment} if block.kind == TEXT
                          else {"type": "input_json_delta", "partial_json": fragment})
                events.append(named_event("content_block_delta", {
                    "type": "content_block_delta", "index": i, "delta": change}))
            else:
                events.append(named_event("content_block_stop",
                                          {"type": "content_block_stop", "index": i}))
        return events

    def _sse_error(self, ctx: RequestContext, e: APIError) -> list[str]:
        return [named_event("error", anthropic_error(e))]

    async def _sse_close(self, ctx: RequestContext) -> list[str]:
        blocks: OutputBlocks = ctx.state
        events = [named_event("content_block_stop", {"type": "content_block_stop",
                                                     "index": block.index})
                  for _, block, _ in blocks.feed("", True)]
        stop = self._stop(ctx, blocks.has_tool_calls)
        events.append(named_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
            "usage": {"output_tokens": self._usage(ctx)["output_tokens"]}}))
        events.append(named_event("message_stop", {"type": "message_stop"}))
        return events


def _input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as tool_use input (an object; {} if the model's are not)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
