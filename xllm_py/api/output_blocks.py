"""A choice's output as a sequence of blocks, text and tool calls, whole or as it streams:
the output shape of the Responses API (output items) and of Anthropic's Messages API
(content blocks), both read from the chat path's text with its tool parsers.

`OutputBlocks.feed(delta, final)` returns what changed: ("open", block, ""), ("delta",
block, fragment) and ("close", block, ""), in the order a stream sends them; fed the
whole text at once it gives the same blocks, so a full response and its stream agree.
With tools, text that is only whitespace (between or around tool calls) opens no block
until something else follows it; without tools there is always one text block.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from xllm_py.api.tool_parsers import ToolStream

TEXT, TOOL_CALL = "text", "tool_call"


@dataclasses.dataclass
class Block:
    index: int
    kind: str  # TEXT | TOOL_CALL
    text: str = ""  # the text, or a tool call's arguments (JSON text)
    call_id: str | None = None
    name: str | None = None
    done: bool = False


Event = tuple[str, Block, str]


class OutputBlocks:
    def __init__(self, tool_format: str | None, tool_name: str | None = None) -> None:
        self._tools = ToolStream(tool_format, tool_name) if tool_format else None
        self.blocks: list[Block] = []
        self._calls: dict[int, Block] = {}  # the tool stream's call index -> its block
        self._held = ""  # whitespace not yet given to a block (with tools)

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._calls)

    def feed(self, delta: str, final: bool) -> list[Event]:
        events: list[Event] = []
        if self._tools is None:
            content, calls = delta, []
            if not self.blocks:
                self._open(TEXT, events)
        else:
            content, calls = self._tools.feed(delta, final)
        if content:
            self._text(content, events)
        for call in calls:
            if "id" in call:
                block, self._held = self._open(TOOL_CALL, events), ""
                block.call_id, block.name = call["id"], call["function"]["name"]
                self._calls[call["index"]] = block
            fragment = call["function"].get("arguments") or ""
            if fragment:
                block = self._calls[call["index"]]
                block.text += fragment
                events.append(("delta", block, fragment))
        if final:
            for block in self.blocks:
                if not block.done:
                    block.done = True
                    events.append(("close", block, ""))
        return events

    def _text(self, content: str, events: list[Event]) -> None:
        current = self.blocks[-1] if self.blocks else None
        if current is None or current.kind != TEXT or current.done:
            if self._tools is not None and not (self._held + content).strip():
                self._held += content
                return
            current = self._open(TEXT, events)
        fragment, self._held = self._held + content, ""
        current.text += fragment
        events.append(("delta", current, fragment))

    def _open(self, kind: str, events: list[Event]) -> Block:
        if self.blocks and not self.blocks[-1].done:
            self.blocks[-1].done = True
            events.append(("close", self.blocks[-1], ""))
        block = Block(len(self.blocks), kind)
        self.blocks.append(block)
        events.append(("open", block, ""))
        return block


def blocks_of(text: str, tool_format: str | None, tool_name: str | None = None
              ) -> list[Block]:
    """The blocks of a finished choice's whole text."""
    blocks = OutputBlocks(tool_format, tool_name)
    blocks.feed(text, True)
    return blocks.blocks


def chat_tool_calls(blocks: list[Block]) -> list[dict[str, Any]]:
    """The tool calls of `blocks` in the chat shape (an assistant message's tool_calls)."""
    return [{"id": b.call_id, "type": "function",
             "function": {"name": b.name, "arguments": b.text}}
            for b in blocks if b.kind == TOOL_CALL]
