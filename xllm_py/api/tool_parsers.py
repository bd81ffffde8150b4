"""Tool calls out of a chat completion's text, whole or as it streams.

Formats (`format_for` picks one from the chat template, i.e. the model family):
  hermes       Qwen / Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
               any number, text around them is content
  llama3_json  Llama 3: the whole message is {"name": ..., "parameters": {...}} (several
               separated by ";"); a message that does not start with "{" is content
  pythonic     Gemma: [name(arg=value, ...), ...], bare or in a ```tool_code block
  json_array   tool_choice required (our grammar): [{"name": ..., "parameters": {...}}]
  arguments    a named tool_choice (our grammar): the whole text is the arguments

`parse(text, fmt, final)` is prefix-stable: as `text` grows, the content and each call's
arguments only grow (a possible start of a tool-call marker is held back until it is
settled), so `ToolStream` streams the differences: content deltas and OpenAI's
delta.tool_calls (index, id, type and name once, then argument fragments). Arguments are
the raw JSON text of the model's value, the same in a stream and in a full response.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import random
from typing import Any

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_ARG_KEYS = ("arguments", "parameters")


@dataclasses.dataclass
class ParsedCall:
    name: str | None  # None until the name is complete
    arguments: str  # raw JSON text of the arguments so far
    done: bool


def format_for(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = ""
    if _OPEN in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    if "tool_code" in template or "<start_of_turn>" in template:
        return "pythonic"
    return "hermes"


def new_call_id() -> str:
    return f"call_{random.getrandbits(96):024x}"


def parse(text: str, fmt: str, final: bool, name: str | None = None
          ) -> tuple[str, list[ParsedCall]]:
    """(content so far, tool calls so far) of `text`; `final`: the text is complete (a
    malformed call then falls back to content)."""
    if fmt == "arguments":
        return "", [ParsedCall(name, text, final)]
    if fmt == "json_array":
        return _json_array(text, final)
    if fmt == "llama3_json":
        return _llama3(text, final)
    if fmt == "pythonic":
        return _pythonic(text, final)
    return _hermes(text, final)


def _hermes(text: str, final: bool) -> tuple[str, list[ParsedCall]]:
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        k = text.find(_OPEN, pos)
        if k < 0:
            tail = text[pos:]
            content.append(tail if final else tail[:len(tail) - _held_back(tail, _OPEN)])
            break
        content.append(text[pos:k])
        j = _skip_ws(text, k + len(_OPEN))
        if j >= len(text):
            break
        if text[j] != "{":
            return (text, []) if final else ("".join(content), calls)
        call, end = _object_call(text, j)
        calls.append(call)
        if end is None:
            break
        close = text.find(_CLOSE, end)
        if close < 0:
            if final:  # a call without its closing tag at the end: take it
                pos = len(text)
                continue
            break
        pos = close + len(_CLOSE)
    if final and any(c.name is None or not c.done for c in calls):
        return text, []
    return "".join(content), calls


def _llama3(text: str, final: bool) -> tuple[str, list[ParsedCall]]:
    start = _skip_ws(text, 0)
    if start >= len(text):
        return (text, []) if final else ("", [])
    if text[start] != "{":
        return text, []
    calls: list[ParsedCall] = []
    pos = start
    while pos < len(text):
        call, end = _object_call(text, pos)
        calls.append(call)
        if end is None:
            break
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ";":
            pos = _skip_ws(text, pos + 1)
        elif pos < len(text):
            return (text, []) if final else ("", calls)
    if final and (not calls or any(c.name is None or not c.done for c in calls)):
        return text, []
    return "", calls


def _json_array(text: str, final: bool) -> tuple[str, list[ParsedCall]]:
    pos = _skip_ws(text, 0)
    calls: list[ParsedCall] = []
    if pos >= len(text) or text[pos] != "[":
        return (text, []) if final else ("", [])
    pos += 1
    while True:
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        if pos >= len(text) or text[pos] != "{":
            break
        call, end = _object_call(text, pos)
        calls.append(call)
        if end is None:
            break
        pos = end
    if final and (not calls or any(c.name is None or not c.done for c in calls)):
        return text, []
    return "", calls


def _pythonic(text: str, final: bool) -> tuple[str, list[ParsedCall]]:
    body = text.strip()
    fenced = body.startswith("```")
    if not final and "```".startswith(body):  # (empty, or a fence's start)
        return "", []
    if not (body.startswith("[") or fenced):
        return (text if final or body else ""), []
    if not final:
        return "", []  # a Python call list is only read whole
    if fenced:
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0].strip()
    try:
        tree = ast.parse(body, mode="eval").body
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = []
        for node in nodes:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return text, []
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            calls.append(ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False), True))
    except (SyntaxError, ValueError, TypeError):
        return text, []
    return ("", calls) if calls else (text, [])


def _object_call(text: str, start: int) -> tuple[ParsedCall, int | None]:
    """The call of the JSON object at text[start] == "{": its name once complete, the raw
    text of its arguments value so far; and the index after the object (None: open)."""
    fields, end = _scan_object(text, start)
    name, args, done = None, "", end is not None
    for key, vs, ve in fields:
        if key == "name" and ve is not None:
            try:
                value = json.loads(text[vs:ve])
            except ValueError:
                value = None
            name = value if isinstance(value, str) else None
        elif key in _ARG_KEYS:
            args = text[vs:len(text) if ve is None else ve]
    return ParsedCall(name, args, done), end


def _scan_object(text: str, start: int) -> tuple[list[tuple[str, int, int | None]], int | None]:
    """Top-level fields of the JSON object at `start`: (key, value start, value end or
    None while open); and the index after its closing brace (None: not closed yet)."""
    fields: list[tuple[str, int, int | None]] = []
    i, n = start + 1, len(text)
    while True:
        i = _skip_ws(text, i)
        if i >= n:
            return fields, None
        if text[i] == "}":
            return fields, i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return fields, None
        key_end = _string_end(text, i)
        if key_end is None:
            return fields, None
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            return fields, None
        i = _skip_ws(text, key_end)
        if i >= n or text[i] != ":":
            return fields, None
        vs = _skip_ws(text, i + 1)
        if vs >= n:
            return fields, None
        ve = _value_end(text, vs)
        fields.append((key, vs, ve))
        if ve is None:
            return fields, None
        i = ve


def _value_end(text: str, i: int) -> int | None:
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j, n = 0, i, len(text)
        while j < n:
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \n\r\t":
        j += 1
    return j if j < len(text) else None


def _string_end(text: str, i: int) -> int | None:
    j, n = i + 1, len(text)
    while j < n:
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _held_back(tail: str, marker: str) -> int:
    """Length of the longest suffix of `tail` that could start `marker`."""
    for k in range(min(len(marker) - 1, len(tail)), 0, -1):
        if marker.startswith(tail[-k:]):
            return k
    return 0


class ToolStream:
    """One choice's stream: `feed(delta_text, final)` -> (content delta, tool_calls
    deltas in OpenAI's shape)."""

    def __init__(self, fmt: str, name: str | None = None) -> None:
        self.fmt, self.name = fmt, name
        self.text = ""
        self._content_sent = 0
        self._sent: list[list[Any]] = []  # per call: [id, arguments chars sent]

    @property
    def num_calls(self) -> int:
        return len(self._sent)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        content, calls = parse(self.text, self.fmt, final, self.name)
        content_delta = content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(content))
        out: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
            if call.name is None:
                break
            entry: dict[str, Any] = {"index": i, "function": {}}
            if i >= len(self._sent):
                self._sent.append([new_call_id(), 0])
                entry.update(id=self._sent[i][0], type="function")
                entry["function"] = {"name": call.name, "arguments": ""}
            fragment = call.arguments[self._sent[i][1]:]
            if fragment:
                self._sent[i][1] = len(call.arguments)
                entry["function"]["arguments"] = fragment
            if "id" in entry or fragment:
                out.append(entry)
        return content_delta, out


def message_tool_calls(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    return [{"id": new_call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
