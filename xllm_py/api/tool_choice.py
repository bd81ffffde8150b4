"""Tools on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls` checked
(a 400 naming the problem: a malformed tool, an unknown tool name) and turned into what
the request needs:

  none      the tools are not passed to the chat template; plain text
  auto      the tools go to the chat template; the model's own tool-call format is
            parsed out of the text (tool_parsers.py, by model family)
  required  constrained by a grammar: a JSON array of {"name", "parameters"} objects, one
            alternative per tool with its parameter schema (one item unless
            parallel_tool_calls)
  named     constrained by the named tool's parameter schema: the output is its arguments
Both grammars are compact JSON (no whitespace between tokens). The same on every API that
takes tools (chat completions, Responses, Messages: they share this path).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from xllm_py.api.errors import InvalidRequestError
from xllm_py.structured.spec import GrammarSpec

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 128
# No free whitespace in a tool call's JSON: a weak model otherwise wanders in it
# ("[\n     {\n  ...") until max_tokens and the response has no tool call at all.
_COMPACT = ""


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict[str, Any], ...]  # the "function" objects
    mode: str  # auto | required | named
    name: str | None = None  # named: the tool
    parallel: bool = True

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.tools]

    def grammar(self) -> GrammarSpec | None:
        if self.mode == "named":
            return GrammarSpec.json_schema(_parameters(self._tool(self.name)), _COMPACT)
        if self.mode != "required":
            return None
        alternatives = [{
            "type": "object", "additionalProperties": False, "required": ["name", "parameters"],
            "properties": {"name": {"const": f["name"]}, "parameters": _parameters(f)}}
            for f in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": alternatives[0] if len(alternatives) == 1
                                  else {"anyOf": alternatives}}
        if not self.parallel:
            schema["maxItems"] = 1
        return GrammarSpec.json_schema(schema, _COMPACT)

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(f for f in self.tools if f["name"] == name)


def tool_request(tools: Any, tool_choice: Any, parallel: Any) -> ToolRequest | None:
    """None when the request asks for no tool use (no tools, or tool_choice "none")."""
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean",
                                  param="parallel_tool_calls")
    functions = _functions(tools)
    if tool_choice is None:
        mode, name = ("auto" if functions else "none"), None
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice must be none, auto, required or a named function, got "
                f"{tool_choice!r}", param="tool_choice")
        mode, name = tool_choice, None
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)
          and isinstance(tool_choice["function"].get("name"), str)):
        mode, name = "named", tool_choice["function"]["name"]
    else:
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}', param="tool_choice")
    if mode == "none":
        return None
    if not functions:
        raise InvalidRequestError(f"tool_choice {mode} needs tools", param="tool_choice")
    if mode == "named" and name not in {f["name"] for f in functions}:
        raise InvalidRequestError(
            f"tool_choice names the function {name!r}, which is not in tools "
            f"({', '.join(f['name'] for f in functions)})", param="tool_choice")
    return ToolRequest(tuple(functions), mode, name, True if parallel is None else parallel)


def _functions(tools: Any) -> list[dict[str, Any]]:
    if tools is None or tools == []:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools must be a list of at most {MAX_TOOLS} tools",
                                  param="tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise InvalidRequestError(f'{param} must be {{"type": "function", "function": '
                                      '{...}}', param=param)
        f = tool["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"{param}.function.name must be 1-64 letters, digits, "
                                      f"_ . or -, got {name!r}", param=f"{param}.function.name")
        if name in seen:
            raise InvalidRequestError(f"tools has two functions named {name!r}", param=param)
        seen.add(name)
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(f"{param}.function.parameters must be a JSON schema "
                                      "object", param=f"{param}.function.parameters")
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise InvalidRequestError(f"{param}.function.description must be a string",
                                      param=f"{param}.function.description")
        out.append({k: v for k, v in f.items() if v is not None})
    return out


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}
