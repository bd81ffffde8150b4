"""POST /v1/completions: prompts as text or token ids (several per request), echo, and
logprobs in the completions format (parallel lists with text offsets). With echo and
logprobs the prompt tokens carry their own logprobs (the engine computes them, see
`CompletionRequest.num_prompt_logprobs`), null for the first; vLLM's `prompt_logprobs`
renders them in vLLM's format on each choice. max_tokens 0 with echo or prompt_logprobs
scores the prompt and generates nothing. `use_beam_search` (n beams, length_penalty): each
prompt's choices are its best n beams (beam_search.py)."""
from __future__ import annotations

from typing import Any

from xllm_py.api.backend import GenerateRequest, TokenizerLike
from xllm_py.api.beam_search import beam_stream, candidates_per_step
from xllm_py.api.context import Choice, Prompt, RequestContext
from xllm_py.api.errors import InvalidRequestError
from xllm_py.api.logprobs import completion_logprobs, entries_for, vllm_prompt_logprobs
from xllm_py.api.protocol import CompletionRequest
from xllm_py.api.serving_base import OpenAIServing
from xllm_py.api.validation import check
from xllm_py.outputs import CompletionDelta, TokenLogprob
from xllm_py.sampling_params import MAX_LOGPROBS
from xllm_py.request import prompt_token_error

_DEFAULT_MAX_TOKENS = 16  # OpenAI legacy completions default


class OpenAIServingCompletion(OpenAIServing):
    request_cls = CompletionRequest
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    prompt_param = "prompt"

    def _prompts(self, req: CompletionRequest, tokenizer: TokenizerLike) -> list[Prompt]:
        prompts = []
        for p in req.prompt_list():
            if isinstance(p, str):
                prompts.append(Prompt(list(tokenizer.encode(p, add_special_tokens=True)), p))
                continue
            error = prompt_token_error(p, getattr(tokenizer, "vocab_size", None))
            if error is not None:
                raise InvalidRequestError(error, param="prompt")
            prompts.append(Prompt(list(p), tokenizer.decode(p) if req.echo else None))
        return prompts

    def _streams(self, req: CompletionRequest, gen_reqs: list[GenerateRequest]) -> list[Any]:
        if not req.use_beam_search:
            return super()._streams(req, gen_reqs)
        tokenizer = self.backend.tokenizer()
        check(candidates_per_step(req.n, len(tokenizer.eos_token_ids)) <= MAX_LOGPROBS, "n",
              f"beam search with n={req.n} beams needs more than {MAX_LOGPROBS} logprobs "
              "a step on this model; use fewer beams")
        return [beam_stream(self.backend, tokenizer, g, req.length_penalty) for g in gen_reqs]

    def _default_max_tokens(self, num_prompt_tokens: int, max_model_len: int) -> int:
        return min(max_model_len - num_prompt_tokens, _DEFAULT_MAX_TOKENS)

    def _render_choice(self, ctx: RequestContext, choice: Choice) -> dict[str, Any]:
        lp, _ = self._logprobs(ctx, choice, choice.token_ids, choice.logprobs, echo=ctx.req.echo,
                                allow_empty=True)
        text = choice.text
        if ctx.req.echo:
            text = (ctx.prompts[choice.prompt_index].text or "") + text
        out = {"index": choice.index, "text": text, "logprobs": lp}
        if ctx.req.prompt_logprobs is not None:
            prompt = ctx.prompts[choice.prompt_index]
            out["prompt_logprobs"] = vllm_prompt_logprobs(
                prompt.logprobs or [None] * len(prompt.token_ids), ctx.req.prompt_logprobs,
                ctx.token_text)
        return out

    def _opens_with_prompt(self, ctx: RequestContext) -> bool:
        return ctx.req.echo

    def _render_delta(
        self, ctx: RequestContext, choice: Choice, delta: CompletionDelta, first: bool
    ) -> dict[str, Any]:
        echo_now = ctx.req.echo and first
        lp, offset = self._logprobs(ctx, choice, delta.token_ids, delta.logprobs, echo=echo_now,
                                    text_offset=choice.text_offset, allow_empty=False)
        if lp is not None:
            choice.text_offset = offset
        text = delta.text
        if echo_now:
            text = (ctx.prompts[choice.prompt_index].text or "") + text
        return {"index": choice.index, "text": text, "logprobs": lp}

    @staticmethod
    def _logprobs(
        ctx: RequestContext, choice: Choice, token_ids: list[int],
        logprobs: list[TokenLogprob] | None, *, echo: bool, allow_empty: bool, text_offset: int = 0,
    ) -> tuple[dict[str, Any] | None, int]:
        """Completions logprobs of `token_ids`, after the prompt's tokens (logprob null) if
        `echo`; None when the client asked for none (or, for a stream chunk, when the chunk
        has no token)."""
        num_top = ctx.num_logprobs
        if num_top is None:
            return None, text_offset
        ids = list(token_ids)
        entries: list[TokenLogprob | None] = list(entries_for(ids, logprobs))
        if echo:
            prompt = ctx.prompts[choice.prompt_index]
            ids = prompt.token_ids + ids
            entries = list(prompt.logprobs or [None] * len(prompt.token_ids)) + entries
        if not ids and not allow_empty:
            return None, text_offset
        return completion_logprobs(entries, num_top, ctx.token_text, ids, text_offset)
