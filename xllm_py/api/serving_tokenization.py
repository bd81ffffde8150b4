"""POST /tokenize and POST /detokenize in vLLM's shapes, over the backend's tokenizer.

/tokenize takes either a completion prompt (`prompt`, `add_special_tokens` default true)
or chat `messages` (rendered with the chat template, `add_generation_prompt` default
true, `add_special_tokens` default false) and answers
`{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` only with
`return_token_strs`). /detokenize takes `{"tokens": [ids]}` and answers `{"prompt"}`.
Bad input is an OpenAI-style 400; an unknown `model` a 404.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from xllm_py.api.backend import GenerateBackend
from xllm_py.api.errors import InvalidRequestError
from xllm_py.api.protocol import ChatMessage, parse_model
from xllm_py.api.serving_chat import render_chat
from xllm_py.request import prompt_token_error


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


class OpenAIServingTokenization:
    def __init__(self, backend: GenerateBackend, check_model) -> None:
        self.backend = backend
        self.check_model = check_model

    def tokenize(self, body: bytes) -> dict[str, Any]:
        req = parse_model(TokenizeRequest, body)
        self.check_model(req.model)
        tokenizer = self.backend.tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise InvalidRequestError("messages must not be empty", param="messages")
            ids = render_chat(tokenizer, [m.to_template_dict() for m in req.messages],
                              add_generation_prompt=req.add_generation_prompt,
                              add_special_tokens=bool(req.add_special_tokens))
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = list(tokenizer.encode(req.prompt, add_special_tokens=add_special))
        strs = [tokenizer.decode([t]) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.backend.max_model_len,
                "tokens": ids, "token_strs": strs}

    def detokenize(self, body: bytes) -> dict[str, Any]:
        req = parse_model(DetokenizeRequest, body)
        self.check_model(req.model)
        tokenizer = self.backend.tokenizer()
        error = prompt_token_error(req.tokens, getattr(tokenizer, "vocab_size", None))
        if any(t < 0 for t in req.tokens):
            error = "token ids must be non-negative"
        if error is not None:
            raise InvalidRequestError(error.replace("prompt token", "token"), param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}
