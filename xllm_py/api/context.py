"""Per-HTTP-request state of a generation endpoint: its prompts, its choices, and the fold
of backend outputs into them (`RequestContext.apply`). Rendering lives in the endpoints."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from xllm_py.api.errors import BackendError
from xllm_py.api.logprobs import TokenText
from xllm_py.api.protocol import _CommonRequest
from xllm_py.outputs import CompletionDelta, RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # for echo only; never log it
    num_cached_tokens: int = 0
    # Predicted Outputs: the prediction's guessed tokens kept and not kept (all choices).
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    # With prompt logprobs: one entry per prompt token, None for the first (the backend's
    # first output carries them).
    logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass
class Choice:
    index: int
    prompt_index: int
    text_parts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    started: bool = False  # stream: the first chunk (echo / prompt_token_ids) was sent
    text_offset: int = 0  # completions logprobs text_offset of the next token
    tool_stream: Any = None  # chat with tools: the stream's tool-call parser (ToolStream)
    num_tool_calls: int = 0  # chat with tools: calls rendered (finish_reason tool_calls)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, delta: CompletionDelta) -> None:
        if delta.text:
            self.text_parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclasses.dataclass
class RequestContext:
    """Everything about one HTTP request that rendering needs."""

    request_id: str
    x_request_id: str | None
    created: int
    model: str
    req: _CommonRequest
    prompts: list[Prompt]
    choices: list[Choice]
    token_text: TokenText
    arrival_time: float
    first_token_time: float | None = None
    # The endpoint's own state of this response (Responses / Messages: its output blocks).
    state: Any = None

    @property
    def n(self) -> int:
        return self.req.n

    @property
    def num_logprobs(self) -> int | None:
        return self.req.num_logprobs()

    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.x_request_id or self.request_id}

    def apply(self, prompt_index: int, out: RequestOutput) -> list[tuple[Choice, CompletionDelta]]:
        """Fold one backend output into the choices; returns the (choice, delta) pairs to emit."""
        if out.failed:
            raise BackendError(out.error_message, out.error_code)
        prompt = self.prompts[prompt_index]
        prompt.num_cached_tokens = max(prompt.num_cached_tokens, out.num_cached_tokens)
        prompt.num_accepted_prediction_tokens = max(prompt.num_accepted_prediction_tokens,
                                                    out.num_accepted_prediction_tokens)
        prompt.num_rejected_prediction_tokens = max(prompt.num_rejected_prediction_tokens,
                                                    out.num_rejected_prediction_tokens)
        if out.prompt_logprobs is not None and prompt.logprobs is None:
            prompt.logprobs = out.prompt_logprobs
        if self.first_token_time is None and any(d.token_ids or d.text for d in out.outputs):
            self.first_token_time = time.time()
        emitted: list[tuple[Choice, CompletionDelta]] = []
        for delta in out.outputs:
            if not 0 <= delta.index < self.n:
                logger.warning(
                    "request %s: backend sent choice index %d with n=%d; dropped",
                    self.request_id, delta.index, self.n,
                )
                continue
            choice = self.choices[prompt_index * self.n + delta.index]
            if choice.finish_reason is not None:
                continue
            choice.add(delta)
            emitted.append((choice, delta))
        if out.finished:
            # A finished request ends all its choices, even if the backend left one open.
            for j in range(self.n):
                choice = self.choices[prompt_index * self.n + j]
                if choice.finish_reason is None:
                    delta = CompletionDelta(index=j, finish_reason="stop")
                    choice.add(delta)
                    emitted.append((choice, delta))
        return emitted

    def usage(self) -> dict[str, Any]:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {
                "cached_tokens": sum(p.num_cached_tokens for p in self.prompts)
            },
        }
        if self.req.prediction is not None:  # (as OpenAI reports Predicted Outputs)
            usage["completion_tokens_details"] = {
                "reasoning_tokens": 0,
                "accepted_prediction_tokens": sum(
                    p.num_accepted_prediction_tokens for p in self.prompts),
                "rejected_prediction_tokens": sum(
                    p.num_rejected_prediction_tokens for p in self.prompts)}
        return usage

    def max_choice_tokens(self) -> int:
        return max((len(c.token_ids) for c in self.choices), default=0)
