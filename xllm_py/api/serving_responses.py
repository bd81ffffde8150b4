"""POST /v1/responses (OpenAI's Responses API) through the chat path, and the stored
responses behind GET / DELETE /v1/responses/{id} and previous_response_id.

A request becomes a chat completion request (responses_protocol.py; the stored
conversation of previous_response_id first), which the chat endpoint serves as it serves
its own: template, tools and their parsers, structured outputs, admission. The one choice
renders as output items (output_blocks.py): a message with its output_text, and a
function_call per tool call. A stream sends the Responses events: response.created,
response.in_progress, then per item response.output_item.added, its content
(response.content_part.added, response.output_text.delta / .done, response.content_part.done
or response.function_call_arguments.delta / .done) and response.output_item.done, and last
response.completed (response.incomplete when max_output_tokens cut it). With `store` the
finished response and its conversation are kept (response_store.py).
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any

from starlette.responses import Response

from xllm_py.api import metrics as m
from xllm_py.api.backend import GenerateBackend
from xllm_py.api.context import RequestContext
from xllm_py.api.errors import APIError
from xllm_py.api.limits import Admission
from xllm_py.api.output_blocks import TEXT, Block, OutputBlocks, blocks_of
from xllm_py.api.protocol import ChatCompletionRequest
from xllm_py.api.response_store import ResponseNotFoundError, ResponseStore
from xllm_py.api.responses_protocol import (ResponsesRequest, input_messages,
                                            parse_responses_request, renamed)
from xllm_py.api.serving_chat import OpenAIServingChat, tool_name
from xllm_py.api.sse import dumps
from xllm_py.outputs import CompletionDelta


def _item_id(prefix: str) -> str:
    return f"{prefix}_{random.getrandbits(128):032x}"


def named_event(kind: str, body: dict[str, Any]) -> str:
    """One SSE event with its type as the event name (as OpenAI and Anthropic send them)."""
    return f"event: {kind}\ndata: {dumps(body)}\n\n"


@dataclasses.dataclass
class _StreamState:
    blocks: OutputBlocks
    item_ids: list[str] = dataclasses.field(default_factory=list)
    sequence_number: int = 0


class OpenAIServingResponses(OpenAIServingChat):
    id_prefix = "resp"
    id_sep = "_"
    object_name = "response"
    prompt_param = "input"

    def __init__(self, backend: GenerateBackend, metrics: m.APIMetrics,
                 served_model_name: str | None, admission: Admission | None,
                 store: ResponseStore) -> None:
        super().__init__(backend, metrics, served_model_name, admission)
        self.store = store

    # -- intake ---------------------------------------------------------------------------

    async def _parse(self, body: bytes, large: bool) -> ChatCompletionRequest:
        req = parse_responses_request(body)
        self.check_model(req.model)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            record = await self.store.get(req.previous_response_id)
            if record is None:
                raise ResponseNotFoundError(req.previous_response_id, "previous_response_id")
            history = record["conversation"]
        chat, _ = req.to_chat(history)
        return chat

    def _error_response(self, e: APIError, headers: dict[str, str] | None = None) -> Response:
        return super()._error_response(renamed(e), headers)

    # -- the stored responses -------------------------------------------------------------

    async def get(self, response_id: str) -> dict[str, Any]:
        record = await self.store.get(response_id)
        if record is None:
            raise ResponseNotFoundError(response_id)
        return record["response"]

    async def delete(self, response_id: str) -> dict[str, Any]:
        if not await self.store.delete(response_id):
            raise ResponseNotFoundError(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def _keep(self, ctx: RequestContext, body: dict[str, Any]) -> None:
        """Store the finished response (its conversation: the turn's and its output)."""
        origin: ResponsesRequest = ctx.req._origin
        if not origin.store:
            return
        record = {"response": body,
                  "conversation": [*origin._turn, *input_messages(body["output"])]
                  if body["output"] else origin._turn}
        if not await self.store.put(ctx.request_id, record):
            body["store"] = False

    # -- rendering ------------------------------------------------------------------------

    def _response(self, ctx: RequestContext, status: str, output: list[dict[str, Any]],
                  usage: dict[str, Any] | None) -> dict[str, Any]:
        origin: ResponsesRequest = ctx.req._origin
        fmt = (origin.text or {}).get("format") if isinstance(origin.text, dict) else None
        return {
            "id": ctx.request_id, "object": "response", "created_at": ctx.created,
            "status": status, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": origin.instructions, "max_output_tokens": origin.max_output_tokens,
            "model": ctx.model, "output": output,
            "parallel_tool_calls": origin.parallel_tool_calls is not False,
            "previous_response_id": origin.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": origin.store,
            "temperature": origin.temperature, "top_p": origin.top_p,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": origin.tool_choice if origin.tool_choice is not None else "auto",
            "tools": origin.tools or [], "truncation": "disabled",
            "usage": usage, "metadata": origin.metadata or {}, "user": origin.user,
        }

    @staticmethod
    def _status(ctx: RequestContext) -> str:
        return "incomplete" if ctx.choices[0].finish_reason == "length" else "completed"

    @staticmethod
    def _item(block: Block, item_id: str, status: str) -> dict[str, Any]:
        if block.kind == TEXT:
            return {"id": item_id, "type": "message", "status": status, "role": "assistant",
                    "content": [_text_part(block.text)] if status != "in_progress" else []}
        return {"id": item_id, "type": "function_call", "status": status,
                "call_id": block.call_id, "name": block.name,
                "arguments": block.text if status != "in_progress" else ""}

    @staticmethod
    def _usage(ctx: RequestContext) -> dict[str, Any]:
        u = ctx.usage()
        return {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens":
                                         u["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"]}

    async def _full_response(self, ctx: RequestContext) -> dict[str, Any]:
        status = self._status(ctx)
        blocks = blocks_of(ctx.choices[0].text, ctx.req._tool_format, tool_name(ctx))
        output = [self._item(b, _item_id("msg" if b.kind == TEXT else "fc"), status)
                  for b in blocks]
        body = self._response(ctx, status, output, self._usage(ctx))
        await self._keep(ctx, body)
        return body

    # -- stream ---------------------------------------------------------------------------

    def _event(self, ctx: RequestContext, kind: str, **fields: Any) -> str:
        state: _StreamState = ctx.state
        body = {"type": kind, "sequence_number": state.sequence_number, **fields}
        state.sequence_number += 1
        return named_event(kind, body)

    def _sse_open(self, ctx: RequestContext) -> list[str]:
        ctx.state = _StreamState(OutputBlocks(ctx.req._tool_format, tool_name(ctx)))
        snapshot = self._response(ctx, "in_progress", [], None)
        return [self._event(ctx, "response.created", response=snapshot),
                self._event(ctx, "response.in_progress", response=snapshot)]

    def _sse_delta(self, ctx: RequestContext, choice: Any, delta: CompletionDelta) -> list[str]:
        state: _StreamState = ctx.state
        events = []
        final = delta.finish_reason is not None
        status = self._status(ctx) if final else "in_progress"
        for what, block, fragment in state.blocks.feed(delta.text, final):
            i = block.index
            if what == "open":
                state.item_ids.append(_item_id("msg" if block.kind == TEXT else "fc"))
                events.append(self._event(ctx, "response.output_item.added", output_index=i,
                                          item=self._item(block, state.item_ids[i],
                                                          "in_progress")))
                if block.kind == TEXT:
                    events.append(self._event(
                        ctx, "response.content_part.added", item_id=state.item_ids[i],
                        output_index=i, content_index=0, part=_text_part("")))
            elif what == "delta":
                kind = ("response.output_text.delta" if block.kind == TEXT
                        else "response.function_call_arguments.delta")
                extra = {"content_index": 0, "logprobs": []} if block.kind == TEXT else {}
                events.append(self._event(ctx, kind, item_id=state.item_ids[i], output_index=i,
                                          delta=fragment, **extra))
            else:
                events.extend(self._close(ctx, block, state.item_ids[i],
                                          "completed" if status == "in_progress" else status))
        return events

    def _close(self, ctx: RequestContext, block: Block, item_id: str, status: str) -> list[str]:
        i = block.index
        if block.kind == TEXT:
            events = [
                self._event(ctx, "response.output_text.done", item_id=item_id, output_index=i,
                            content_index=0, text=block.text, logprobs=[]),
                self._event(ctx, "response.content_part.done", item_id=item_id,
                            output_index=i, content_index=0, part=_text_part(block.text))]
        else:
            events = [self._event(ctx, "response.function_call_arguments.done",
                                  item_id=item_id, output_index=i, name=block.name,
                                  arguments=block.text)]
        events.append(self._event(ctx, "response.output_item.done", output_index=i,
                                  item=self._item(block, item_id, status)))
        return events

    def _sse_error(self, ctx: RequestContext, e: APIError) -> list[str]:
        return [self._event(ctx, "error", code=e.code, message=e.message, param=e.param)]

    async def _sse_close(self, ctx: RequestContext) -> list[str]:
        state: _StreamState = ctx.state
        events = []
        status = self._status(ctx)
        for _, block, _ in state.blocks.feed("", True):  # (closes what is still open)
            events.extend(self._close(ctx, block, state.item_ids[block.index], status))
        output = [self._item(b, state.item_ids[b.index], status) for b in state.blocks.blocks]
        body = self._response(ctx, status, output, self._usage(ctx))
        await self._keep(ctx, body)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(ctx, kind, response=body)]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
