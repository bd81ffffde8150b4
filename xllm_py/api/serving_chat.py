"""POST /v1/chat/completions: one prompt from the chat template, an assistant message per
choice (streamed as deltas after a role chunk), logprobs in the chat format."""
from __future__ import annotations

from typing import Any

from xllm_py.api.backend import TokenizerLike
from xllm_py.api.context import Choice, Prompt, RequestContext
from xllm_py.api.errors import InvalidRequestError
from xllm_py.api.logprobs import chat_logprobs, entries_for
from xllm_py.api.protocol import ChatCompletionRequest
from xllm_py.api.serving_base import OpenAIServing
from xllm_py.outputs import CompletionDelta, TokenLogprob


class OpenAIServingChat(OpenAIServing):
    request_cls = ChatCompletionRequest
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    prompt_param = "messages"

    def _prompts(self, req: ChatCompletionRequest, tokenizer: TokenizerLike) -> list[Prompt]:
        messages = req.template_messages()
        try:
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # e.g. jinja: "roles must alternate user/assistant"
            raise InvalidRequestError(
                f"chat template could not be applied: {str(e)[:200]}", param="messages"
            ) from e
        if isinstance(rendered, str):
            ids = list(tokenizer.encode(rendered, add_special_tokens=False))
        else:  # a tokenizer that returns ids directly
            ids = [int(t) for t in rendered]
        return [Prompt(token_ids=ids, text=None)]

    def _render_choice(self, ctx: RequestContext, choice: Choice) -> dict[str, Any]:
        return {
            "index": choice.index,
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": self._logprobs(ctx, choice.token_ids, choice.logprobs, allow_empty=True),
        }

    def _stream_preamble(self, ctx: RequestContext) -> list[dict[str, Any]]:
        return [
            {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}
            for c in ctx.choices
        ]

    def _render_delta(
        self, ctx: RequestContext, choice: Choice, delta: CompletionDelta, first: bool
    ) -> dict[str, Any]:
        return {
            "index": choice.index,
            "delta": {"content": delta.text} if delta.text else {},
            "logprobs": self._logprobs(ctx, delta.token_ids, delta.logprobs, allow_empty=False),
        }

    @staticmethod
    def _logprobs(
        ctx: RequestContext, token_ids: list[int], logprobs: list[TokenLogprob] | None,
        *, allow_empty: bool,
    ) -> dict[str, Any] | None:
        """{"content": [...]}; None when the client asked for none (or, for a stream
        chunk, when the chunk has no token)."""
        num_top = ctx.num_logprobs
        if num_top is None:
            return None
        entries = entries_for(token_ids, logprobs)
        if not entries and not allow_empty:
            return None
        return {"content": chat_logprobs(entries, num_top, ctx.token_text)}
