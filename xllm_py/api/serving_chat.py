"""POST /v1/chat/completions: one prompt from the chat template, an assistant message per
choice (streamed as deltas after a role chunk), logprobs in the chat format."""
from __future__ import annotations

from typing import Any

from xllm_py.api.backend import TokenizerLike
from xllm_py.api.context import Choice, Prompt, RequestContext
from xllm_py.api.errors import InvalidRequestError
from xllm_py.api.logprobs import chat_logprobs, entries_for, vllm_prompt_logprobs
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
        return [Prompt(token_ids=render_chat(tokenizer, req.template_messages()), text=None)]

    def _render_choice(self, ctx: RequestContext, choice: Choice) -> dict[str, Any]:
        return {
            "index": choice.index,
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": self._logprobs(ctx, choice.token_ids, choice.logprobs, allow_empty=True),
        }

    def _response_fields(self, ctx: RequestContext) -> dict[str, Any]:
        """vLLM's prompt_logprobs of the chat prompt, at the top level of the response."""
        if ctx.req.prompt_logprobs is None:
            return {}
        prompt = ctx.prompts[0]
        return {"prompt_logprobs": vllm_prompt_logprobs(
            prompt.logprobs or [None] * len(prompt.token_ids), ctx.req.prompt_logprobs,
            ctx.token_text)}

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


def render_chat(tokenizer: TokenizerLike, messages: list[dict[str, Any]], *,
                add_generation_prompt: bool = True, add_special_tokens: bool = False) -> list[int]:
    """Token ids of messages through the chat template (400 if the template refuses them)."""
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # e.g. jinja: "roles must alternate user/assistant"
        raise InvalidRequestError(
            f"chat template could not be applied: {str(e)[:200]}", param="messages"
        ) from e
    if isinstance(rendered, str):
        return list(tokenizer.encode(rendered, add_special_tokens=add_special_tokens))
    return [int(t) for t in rendered]  # a tokenizer that returns ids directly
