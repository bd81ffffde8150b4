"""The Responses API's request (POST /v1/responses) and its translation into a chat
completion request, which the chat path serves (template, tools, structured outputs).

  input          a string (one user message) or a list of items: messages (user, system,
                 developer, assistant; text parts), function_call (an earlier call of the
                 model) and function_call_output (its result)
  instructions   a system message first; not inherited through previous_response_id
  text.format    text | json_object | json_schema {name, schema, strict}: response_format
  tools          function tools {type, name, description, parameters}; tool_choice none,
                 auto, required or {"type": "function", "name"}
  max_output_tokens, temperature, top_p, parallel_tool_calls, store, previous_response_id,
  metadata, user; and vLLM's sampling extensions (top_k, min_p, seed, ...)

Items and chat messages: `input_messages` maps items to chat messages (a function_call
joins the assistant message before it as one of its tool_calls), and the output items of a
stored response map the same way, so a conversation continued through
previous_response_id renders exactly as the same conversation sent whole.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from xllm_py.api.errors import APIError, InvalidRequestError
from xllm_py.api.protocol import ChatCompletionRequest
from xllm_py.api.validation import check, parse_model

# Fields of the API this server does not implement -> "this value asks for nothing".
_REFUSED = {
    "background": lambda v: not v,
    "conversation": lambda v: v is None,
    "prompt": lambda v: v is None,
    "include": lambda v: not v,
    "reasoning": lambda v: v is None or not any(v.get(k) for k in ("effort", "summary"))
    if isinstance(v, dict) else v is None,
    "top_logprobs": lambda v: not v,
    "max_tool_calls": lambda v: v is None,
    "truncation": lambda v: v in (None, "disabled"),
}
# Sampling values passed to the chat request under the same name.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
             "frequency_penalty", "presence_penalty", "stop", "ignore_eos", "min_tokens",
             "ttft_slo_ms", "tpot_slo_ms", "parallel_tool_calls", "user")
# A chat request's param -> the Responses request's (the param of a 400).
_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input",
           "response_format": "text.format"}
_TEXT_TYPES = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    # This turn's conversation as chat messages (set by to_chat; see chat_body).
    _turn: list[dict[str, Any]] = PrivateAttr(default_factory=list)

    model: str | None = None
    input: Any = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    text: Any = None
    tools: Any = None
    tool_choice: Any = None
    metadata: dict[str, str] | None = None
    # sampling (as on chat completions; checked there)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    # not implemented: a 400 unless they ask for nothing
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    include: Any = None
    reasoning: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    truncation: Any = None

    def check_values(self) -> None:
        for name, asks_nothing in _REFUSED.items():
            check(asks_nothing(getattr(self, name)), name,
                  f"{name} is not supported by this server")
        check(self.input is not None, "input", "input is required")
        if self.metadata is not None:
            check(len(self.metadata) <= 16, "metadata", "metadata has at most 16 keys")

    def chat_body(self, history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict]]:
        """(the chat completion request's body, this turn's conversation: `history` and
        this request's input as chat messages, without the instructions)."""
        turn = [*history, *input_messages(self.input)]
        messages = ([{"role": "system", "content": self.instructions}]
                    if self.instructions else []) + turn
        body: dict[str, Any] = {"messages": messages, "stream": self.stream}
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        for name in _SAMPLING:
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.tools:
            body["tools"] = _chat_tools(self.tools)
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        response_format = _response_format(self.text)
        if response_format is not None:
            body["response_format"] = response_format
        return body, turn

    def to_chat(self, history: list[dict[str, Any]]
                ) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        """The checked chat request of this turn (400s name this API's params) and the
        turn's conversation (see chat_body)."""
        body, turn = self.chat_body(history)
        try:
            req = parse_model(ChatCompletionRequest, json.dumps(body).encode())
            req.check_values()
        except InvalidRequestError as e:
            raise renamed(e) from None
        req._origin, self._turn = self, turn
        return req, turn


def renamed(e: APIError) -> APIError:
    """`e` naming this API's param where the chat path named its own."""
    if not isinstance(e, InvalidRequestError):
        return e
    param = e.param or ""
    head, dot, rest = param.partition(".")
    if head in _PARAMS:
        param = _PARAMS[head] + dot + rest
        return InvalidRequestError(e.message.replace(head, _PARAMS[head], 1), param=param)
    return e


def parse_responses_request(body: bytes) -> ResponsesRequest:
    req = parse_model(ResponsesRequest, body)
    req.check_values()
    return req


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Chat messages of a Responses `input` (or of a response's output items)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    check(isinstance(items, list), "input", "input must be a string or a list of items")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input.{i}"
        check(isinstance(item, dict), param, f"{param} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            check(role in ("user", "system", "developer", "assistant"), f"{param}.role",
                  f"{param}.role must be user, system, developer or assistant, got {role!r}")
            messages.append({"role": role, "content": _text_of(item.get("content"),
                                                               f"{param}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": _string(item, "name", param),
                                 "arguments": _string(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                             "content": _text_of(item.get("output"), f"{param}.output")})
        else:
            raise InvalidRequestError(
                f"{param}: input items of type {kind!r} are not supported (message, "
                "function_call and function_call_output are)", param=f"{param}.type")
    check(bool(messages), "input", "input must not be empty")
    return messages


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    check(isinstance(content, list), param, f"{param} must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        ok = isinstance(part, dict) and part.get("type") in _TEXT_TYPES \
            and isinstance(part.get("text"), str)
        check(ok, f"{param}.{j}", f"{param}.{j}: only text parts are served "
              f"({', '.join(_TEXT_TYPES)})")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    check(isinstance(value, str), f"{param}.{key}", f"{param}.{key} must be a string")
    return value


def _chat_tools(tools: Any) -> Any:
    if not isinstance(tools, list):
        return tools  # (the chat check names it)
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        check(kind == "function", f"tools.{i}.type",
              f"tools.{i}: tools of type {kind!r} are not supported (function tools are)")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters") if k in tool}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        check(choice.get("type") == "function" and isinstance(choice.get("name"), str),
              "tool_choice", 'tool_choice must be "none", "auto", "required" or '
              '{"type": "function", "name": ...}')
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    check(isinstance(text, dict), "text", "text must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    check(isinstance(fmt, dict) and isinstance(fmt.get("type"), str), "text.format",
          "text.format must be an object with a type (text, json_object or json_schema)")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {
        k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
