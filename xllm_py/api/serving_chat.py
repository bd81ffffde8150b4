"""POST /v1/chat/completions: one prompt from the chat template, an assistant message per
choice (streamed as deltas after a role chunk), logprobs in the chat format. With tools
(tool_choice.py) the template gets them and each choice's text is read for tool calls
(tool_parsers.py): message.tool_calls, or delta.tool_calls as they stream; a choice that
called a tool finishes with "tool_calls"."""
from __future__ import annotations

from typing import Any

from xllm_py.api.backend import TokenizerLike
from xllm_py.api.context import Choice, Prompt, RequestContext
from xllm_py.api.errors import InvalidRequestError
from xllm_py.api.logprobs import chat_logprobs, entries_for, vllm_prompt_logprobs
from xllm_py.api.protocol import ChatCompletionRequest
from xllm_py.api.serving_base import OpenAIServing
from xllm_py.api.tool_parsers import ToolStream, format_for, message_tool_calls, parse
from xllm_py.outputs import CompletionDelta, TokenLogprob


class OpenAIServingChat(OpenAIServing):
    request_cls = ChatCompletionRequest
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    prompt_param = "messages"

    # A request's own chat_template is rendered only where the server trusts them.
    trust_chat_template = False

    def _prompts(self, req: ChatCompletionRequest, tokenizer: TokenizerLike) -> list[Prompt]:
        if req.chat_template is not None and not self.trust_chat_template:
            raise InvalidRequestError(
                "chat_template is not accepted by this server (start it with "
                "--trust-request-chat-template)", param="chat_template")
        tools = req.tool_request()
        if tools is not None:
            req._tool_format = {"auto": format_for(tokenizer), "required": "json_array",
                                "named": "arguments"}[tools.mode]
        return [Prompt(token_ids=render_chat(
            tokenizer, req.template_messages(),
            tools=tools.template_tools() if tools is not None else None,
            chat_template=req.chat_template, template_kwargs=req.chat_template_kwargs),
            text=None)]

    def _render_choice(self, ctx: RequestContext, choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        fmt = ctx.req._tool_format
        if fmt is not None:
            content, calls = parse(choice.text, fmt, True, tool_name(ctx))
            if calls:
                message = {"role": "assistant", "content": content.strip() or None,
                           "tool_calls": message_tool_calls(calls)}
                choice.num_tool_calls = len(calls)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(ctx, choice.token_ids, choice.logprobs, allow_empty=True),
        }

    def _finish_reason(self, ctx: RequestContext, choice: Choice, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and choice.num_tool_calls else reason

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
        text = delta.text
        out: dict[str, Any] = {}
        fmt = ctx.req._tool_format
        if fmt is not None:
            if choice.tool_stream is None:
                choice.tool_stream = ToolStream(fmt, tool_name(ctx))
            text, calls = choice.tool_stream.feed(delta.text, delta.finish_reason is not None)
            if calls:
                out["tool_calls"] = calls
            choice.num_tool_calls = choice.tool_stream.num_calls
        if text:
            out = {"content": text, **out}
        return {
            "index": choice.index,
            "delta": out,
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


def tool_name(ctx: RequestContext) -> str | None:
    tools = ctx.req.tool_request()
    return tools.name if tools is not None else None


def render_chat(tokenizer: TokenizerLike, messages: list[dict[str, Any]], *,
                add_generation_prompt: bool = True, add_special_tokens: bool = False,
                tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of messages through the chat template (400 if the template refuses them);
    `tools` reach the template (HF templates render them) when given; `chat_template`
    replaces the model's, `template_kwargs` are more variables of it."""
    extra: dict[str, Any] = {**(template_kwargs or {})}
    if tools:
        extra["tools"] = tools
    if chat_template is not None:
        extra["chat_template"] = chat_template
    try:
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **extra)
    except Exception as e:  # e.g. jinja: "roles must alternate user/assistant"
        raise InvalidRequestError(
            f"chat template could not be applied: {str(e)[:200]}",
            param="messages" if chat_template is None else "chat_template"
        ) from e
    if isinstance(rendered, str):
        return list(tokenizer.encode(rendered, add_special_tokens=add_special_tokens))
    return [int(t) for t in rendered]  # a tokenizer that returns ids directly
