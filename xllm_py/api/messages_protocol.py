"""Anthropic's Messages API request (POST /v1/messages) and its translation into a chat
completion request, which the chat path serves.

  system          a string or text blocks: the system message
  messages        user / assistant turns; content a string or blocks: text, tool_use (an
                  assistant's call: a chat tool call, its input as the JSON arguments) and
                  tool_result (a user's answer to one: a chat tool message)
  tools           {name, description, input_schema}; tool_choice auto | any (required) |
                  tool {name} (a named function) | none; disable_parallel_tool_use
  max_tokens (required), stop_sequences, temperature, top_p, top_k, stream, metadata
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from xllm_py.api.protocol import ChatCompletionRequest
from xllm_py.api.validation import check, parse_model

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Fields of the API this server does not implement -> "this value asks for nothing".
_REFUSED = {
    "thinking": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "disabled"),
    "container": lambda v: v is None,
    "mcp_servers": lambda v: not v,
}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = None
    messages: Any = None
    system: Any = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: Any = None
    tool_choice: Any = None
    metadata: Any = None
    thinking: Any = None
    container: Any = None
    mcp_servers: Any = None

    def check_values(self) -> None:
        for name, asks_nothing in _REFUSED.items():
            check(asks_nothing(getattr(self, name)), name,
                  f"{name} is not supported by this server")
        check(self.max_tokens is not None, "max_tokens", "max_tokens: Field required")
        check(isinstance(self.messages, list) and len(self.messages) > 0, "messages",
              "messages must be a non-empty list")

    def to_chat(self) -> ChatCompletionRequest:
        """The checked chat request of this request (its 400s name this API's fields)."""
        messages = _system(self.system)
        for i, message in enumerate(self.messages):
            messages.extend(_chat_messages(message, f"messages.{i}"))
        body: dict[str, Any] = {"messages": messages, "max_tokens": self.max_tokens,
                                "stream": self.stream}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.tools:
            body["tools"] = _chat_tools(self.tools)
        if self.tool_choice is not None:
            body.update(_chat_tool_choice(self.tool_choice))
        req = parse_model(ChatCompletionRequest, json.dumps(body).encode())
        req.check_values()
        req._origin = self
        return req


def parse_messages_request(body: bytes) -> MessagesRequest:
    req = parse_model(MessagesRequest, body)
    req.check_values()
    return req


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "" or system == []:
        return []
    return [{"role": "system", "content": _text_of(system, "system")}]


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    check(isinstance(content, list), param, f"{param} must be a string or a list of blocks")
    texts = []
    for j, block in enumerate(content):
        ok = isinstance(block, dict) and block.get("type") == "text" \
            and isinstance(block.get("text"), str)
        check(ok, f"{param}.{j}", f"{param}.{j}: only text blocks are served here")
        texts.append(block["text"])
    return "\n".join(texts)


def _chat_messages(message: Any, param: str) -> list[dict[str, Any]]:
    check(isinstance(message, dict), param, f"{param} must be an object")
    role = message.get("role")
    check(role in ("user", "assistant"), f"{param}.role",
          f"{param}.role must be user or assistant, got {role!r}")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    check(isinstance(content, list), f"{param}.content",
          f"{param}.content must be a string or a list of blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{param}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            check(isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                  and isinstance(block.get("input"), dict), where,
                  f"{where}: a tool_use block has a string id and name and an object input")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"],
                                                               ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            check(isinstance(block.get("tool_use_id"), str), f"{where}.tool_use_id",
                  f"{where}.tool_use_id must be a string")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _text_of(block.get("content", ""), f"{where}.content")})
        else:
            check(False, f"{where}.type", f"{where}: {kind!r} blocks are not supported in "
                  f"{role} messages (text, tool_use from the assistant, tool_result from "
                  "the user are)")
    out = list(results)
    if role == "assistant":
        msg: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts else None}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif texts or not results:
        out.append({"role": role, "content": "\n".join(texts)})
    return out


def _chat_tools(tools: Any) -> Any:
    check(isinstance(tools, list), "tools", "tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        ok = isinstance(tool, dict) and tool.get("type", "custom") == "custom"
        check(ok, f"tools.{i}.type", f"tools.{i}: only custom (client) tools are supported")
        out.append({"type": "function", "function": {
            "name": tool.get("name"), "parameters": tool.get("input_schema"),
            **({"description": tool["description"]} if "description" in tool else {})}})
    return out


def _chat_tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    check(kind in ("auto", "any", "tool", "none"), "tool_choice",
          'tool_choice must be {"type": "auto" | "any" | "tool" | "none"}')
    out: dict[str, Any] = {}
    if kind == "tool":
        check(isinstance(choice.get("name"), str), "tool_choice.name",
              "tool_choice.name must be a string")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        out["tool_choice"] = _CHOICES[kind]
    if choice.get("disable_parallel_tool_use") and kind != "none":
        out["parallel_tool_calls"] = False
    return out
