"""Parameters of the OpenAI / vLLM APIs this server knows it does not implement.

Each is a field of the request models (`UnsupportedFields`, typed loosely) so that it is
not dropped with the unknown ones; `check_unsupported()` answers a 400 naming it unless its
value asks for nothing (`UNSUPPORTED`: name -> "this value is plain generation", e.g.
tool_choice "none"). Never silently ignored. (Structured outputs: structured_request.py.)
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict

from xllm_py.api.errors import InvalidRequestError


def _absent(value: Any) -> bool:
    return value is None or value == [] or value == {}


# Parameters of the OpenAI / vLLM APIs this server does not implement: name -> "this value
# asks for nothing", e.g. response_format {"type": "text"} is plain generation. Any other
# value is a 400 naming the parameter (never silently ignored).
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": _absent,
    "tool_choice": lambda v: v is None or v == "none",
    "parallel_tool_calls": lambda v: v is None or v is False,
    "functions": _absent,
    "function_call": lambda v: v is None or v == "none",
    "audio": _absent,
    "modalities": lambda v: v is None or v == ["text"],
    "web_search_options": _absent,
    "reasoning_effort": _absent,
    "use_beam_search": lambda v: v is None or v is False,
    "prompt_embeds": _absent,
    "chat_template": _absent,
    "documents": _absent,
    "lora_request": _absent,
}


class UnsupportedFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    use_beam_search: Any = None
    prompt_embeds: Any = None
    chat_template: Any = None
    documents: Any = None
    lora_request: Any = None

    # Fields of UNSUPPORTED that this endpoint does implement (chat: the tools).
    SUPPORTED: ClassVar[tuple[str, ...]] = ()

    def check_unsupported(self) -> None:
        for name, asks_nothing in UNSUPPORTED.items():
            if name not in self.SUPPORTED and not asks_nothing(getattr(self, name)):
                raise InvalidRequestError(f"{name} is not supported by this server", param=name)
