"""The shared base of the OpenAI generation endpoints: request intake, the non-stream and
stream responses, errors and metrics. `serving_completions` and `serving_chat` say how
their prompts are built and how their choices render.

Stages of one HTTP request:
  1. intake: readiness check (503), the body read within its limit (413, see limits.py),
     parse + validate (400), model check (404);
  2. prompts: the endpoint tokenizes (`_prompts`; chat applies its template), max_tokens is
     resolved against max_model_len (400), the sampling values checked as the engine will
     (400); a body over OFFLOOP_BODY_BYTES is parsed and tokenized in a worker thread, so
     no request holds the event loop; then admission (429 + Retry-After, limits.py), whose
     ticket the request holds until it ends;
  3. one GenerateRequest per prompt; each backend stream is drained by its own pump task
     into one queue (`Generations`), so choices of all prompts interleave; choice index =
     prompt_index * n + CompletionDelta.index;
  4. non-stream: aggregate per choice, racing a client-disconnect watcher, then
     `_render_choice` each; stream: wait for the first output (errors before it are still
     HTTP errors), then SSE chunks from `_render_delta` (after `_stream_preamble`);
  5. on any exit the pump tasks are cancelled, which closes the backend streams (the
     backend aborts the request).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, AsyncIterator, ClassVar

from starlette.requests import Request
from starlette.responses import Response

from xllm_py.api import metrics as m
from xllm_py.api.backend import GenerateBackend, GenerateRequest, TokenizerLike
from xllm_py.api.context import Choice, Prompt, RequestContext
from xllm_py.api.errors import (
    APIError,
    InvalidRequestError,
    ModelNotFoundError,
    ServiceUnavailableError,
)
from xllm_py.api.limits import Admission, Ticket
from xllm_py.api.generations import (
    ClientDisconnected,
    Generations,
    await_or_disconnect,
    start_streams,
)
from xllm_py.api.logprobs import TokenText
from xllm_py.api.protocol import _CommonRequest, parse_request
from xllm_py.api.sse import DONE_EVENT, SSEResponse, dumps, sse_event
from xllm_py.api.structured_request import check_spec
from xllm_py.structured import grammar
from xllm_py.outputs import CompletionDelta

logger = logging.getLogger(__name__)

# Bodies larger than this are parsed and tokenized off the event loop (a 1 MB prompt
# takes ~0.1-1 s to parse, check and tokenize; under that it is not worth a thread hop).
OFFLOOP_BODY_BYTES = 64 << 10


class OpenAIServing:
    """One generation endpoint over a GenerateBackend; subclasses fill in the class
    attributes and the `_prompts` / `_render_*` hooks."""

    request_cls: ClassVar[type[_CommonRequest]]
    id_prefix: ClassVar[str]  # response ids: "<prefix><id_sep><32 hex>"
    id_sep: ClassVar[str] = "-"
    object_name: ClassVar[str]  # "object" of a full response
    chunk_object_name: ClassVar[str]  # "object" of a stream chunk
    prompt_param: ClassVar[str]  # the request field a too-long prompt is blamed on

    def __init__(
        self, backend: GenerateBackend, metrics: m.APIMetrics, served_model_name: str | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.backend = backend
        self.metrics = metrics
        self.model_name = served_model_name or backend.model_name
        self.admission = admission

    # -- hooks of an endpoint -------------------------------------------------------------

    def _prompts(self, req: Any, tokenizer: TokenizerLike) -> list[Prompt]:
        """The request's prompts, tokenized (400 on bad input)."""
        raise NotImplementedError

    def _default_max_tokens(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """max_tokens when the client gave none (the prompt fits: num < max_model_len)."""
        return max_model_len - num_prompt_tokens

    def _render_choice(self, ctx: RequestContext, choice: Choice) -> dict[str, Any]:
        """A finished choice of the full response, less the fields common to both endpoints."""
        raise NotImplementedError

    def _response_fields(self, ctx: RequestContext) -> dict[str, Any]:  # (top-level extras)
        return {}

    def _stream_preamble(self, ctx: RequestContext) -> list[dict[str, Any]]:  # (before output)
        return []

    def _opens_with_prompt(self, ctx: RequestContext) -> bool:  # (echo)
        return False

    def _render_delta(
        self, ctx: RequestContext, choice: Choice, delta: CompletionDelta, first: bool
    ) -> dict[str, Any]:
        """One stream chunk's choice, less the fields common to both endpoints."""
        raise NotImplementedError

    def _finish_reason(self, ctx: RequestContext, choice: Choice, reason: str | None) -> str | None:
        """The finish_reason a client sees (chat: "tool_calls" when the model called one);
        called after the choice's render."""
        return reason

    # -- intake ---------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.backend.model_name):
            raise ModelNotFoundError(model)

    def check_ready(self) -> None:
        ok, reason = self.backend.check_ready()
        if not ok:
            raise ServiceUnavailableError(reason or "backend not ready")

    async def handle(self, raw: Request) -> Response:
        arrival_time = time.time()
        x_request_id = raw.headers.get("x-request-id")
        ticket: Ticket | None = None
        try:
            self.check_ready()
            body = await raw.body()
            large = len(body) > OFFLOOP_BODY_BYTES
            req = await self._parse(body, large)
            if large:
                ctx, gen_reqs = await asyncio.to_thread(
                    self._prepare, req, x_request_id, arrival_time)
            else:
                ctx, gen_reqs = self._prepare(req, x_request_id, arrival_time)
            spec = gen_reqs[0].sampling.structured if gen_reqs else None
            if spec is not None:  # compiled off the loop unless its verdict is cached
                if grammar.is_checked(spec):
                    check_spec(spec, req.output_param())
                else:
                    await asyncio.to_thread(check_spec, spec, req.output_param())
            if self.admission is not None:
                ticket = self.admission.admit(
                    sum(len(g.prompt_token_ids) for g in gen_reqs) * max(req.n, req.best_of or 1))
        except APIError as e:
            self._count_error(e)
            return self._error_response(e)
        except Exception as e:  # tokenizer / template failures: a 500 with an OpenAI body
            logger.exception("preparing a %s request failed", self.object_name)
            err = APIError(f"internal error ({type(e).__name__})", status_code=500)
            self._count_error(err)
            return self._error_response(err)

        logger.debug("request %s: %d prompt(s), n=%d", ctx.request_id, len(gen_reqs), req.n)
        try:
            gens = Generations(self._streams(req, gen_reqs),
                               on_cancel=ticket.release if ticket is not None else None)
        except APIError as e:
            if ticket is not None:
                ticket.release()
            self._count_error(e)
            return self._error_response(e, ctx.headers())

        if req.stream:
            return await self._stream(raw, ctx, gens)
        return await self._complete(raw, ctx, gens)

    def _streams(self, req: Any, gen_reqs: list[GenerateRequest]) -> list[Any]:
        """One stream of RequestOutputs per prompt (completions' beam search: its own)."""
        return start_streams(self.backend, gen_reqs)

    async def _parse(self, body: bytes, large: bool) -> _CommonRequest:
        """The checked request of `body` (400 / 404 on a bad one); a large body is parsed
        in a worker thread. Endpoints that must look something up first (a stored
        conversation) override it."""
        if large:
            return await asyncio.to_thread(self._parse_body, body)
        return self._parse_body(body)

    def _parse_body(self, body: bytes) -> _CommonRequest:
        """Parse and check (thread-safe: may run off the event loop)."""
        req = parse_request(self.request_cls, body)
        self.check_model(req.model)
        return req

    def _prepare(
        self, req: _CommonRequest, x_request_id: str | None, arrival_time: float
    ) -> tuple[RequestContext, list[GenerateRequest]]:
        tokenizer = self.backend.tokenizer()
        prompts = self._prompts(req, tokenizer)
        req.apply_tokenizer(tokenizer)  # (vllm_extras.py: bad_words, truncate_prompt_tokens)
        for p in prompts:
            p.token_ids = req.truncated(p.token_ids, self.backend.max_model_len)
        max_tokens = [self._max_tokens(req, len(p.token_ids)) for p in prompts]
        base_id = f"{self.id_prefix}{self.id_sep}{_random_hex()}"
        gen_reqs = [
            req.to_generate_request(
                base_id if len(prompts) == 1 else f"{base_id}-{i}",
                p.token_ids,
                prompt_text=p.text,
                max_tokens=max_tokens[i],
                x_request_id=x_request_id,
                arrival_time=arrival_time,
            )
            for i, p in enumerate(prompts)
        ]
        choices = [
            Choice(index=i * req.n + j, prompt_index=i)
            for i in range(len(prompts)) for j in range(req.n)
        ]
        ctx = RequestContext(
            request_id=base_id, x_request_id=x_request_id, created=int(arrival_time),
            model=self.model_name, req=req, prompts=prompts, choices=choices,
            token_text=TokenText(tokenizer), arrival_time=arrival_time,
        )
        return ctx, gen_reqs

    def _max_tokens(self, req: _CommonRequest, num: int) -> int:
        """The prompt's max_tokens, or a 400 if the prompt and the completion do not fit."""
        max_model_len = self.backend.max_model_len
        requested = req.requested_max_tokens()
        if num == 0:
            raise InvalidRequestError("prompt is empty after tokenization", param="prompt")
        if requested is None:
            if num >= max_model_len:
                raise InvalidRequestError(
                    f"This model's maximum context length is {max_model_len} tokens. "
                    f"However, your prompt has {num} tokens, leaving no room for completion.",
                    param=self.prompt_param,
                )
            return self._default_max_tokens(num, max_model_len)
        if num + requested > max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens. "
                f"However, you requested {num + requested} tokens ({num} in the prompt, "
                f"{requested} in the completion). Please reduce the prompt or the "
                f"completion length.",
                param="max_tokens",
            )
        return requested

    def _error_response(self, e: APIError, headers: dict[str, str] | None = None) -> Response:
        """An error answered before the response started (the endpoint's error shape)."""
        return error_response(e, headers)

    # -- non-stream -----------------------------------------------------------------------

    async def _complete(self, raw: Request, ctx: RequestContext, gens: Generations) -> Response:
        async def collect() -> None:
            while (item := await gens.next()) is not None:
                ctx.apply(*item)

        try:
            await await_or_disconnect(raw, collect())
        except ClientDisconnected:
            logger.info("request %s: client disconnected, cancelled", ctx.request_id)
            self.metrics.count(m.OUTCOME_CANCELLED)
            return Response(status_code=499)
        except APIError as e:
            self._count_error(e)
            logger.warning("request %s failed: %d %s", ctx.request_id, e.status_code, e.message)
            return self._error_response(e, ctx.headers())
        finally:
            gens.cancel()

        self._observe(ctx)
        try:
            body = await self._full_response(ctx)
        except APIError as e:
            self._count_error(e)
            return self._error_response(e, ctx.headers())
        return Response(dumps(body), media_type="application/json", headers=ctx.headers())

    async def _full_response(self, ctx: RequestContext) -> dict[str, Any]:
        """The non-stream response body of a finished request."""
        return {
            "id": ctx.request_id,
            "object": self.object_name,
            "created": ctx.created,
            "model": ctx.model,
            "choices": [self._full_choice(ctx, c) for c in ctx.choices],
            "usage": ctx.usage(),
            **self._response_fields(ctx),
        }

    def _full_choice(self, ctx: RequestContext, c: Choice) -> dict[str, Any]:
        choice = self._render_choice(ctx, c)
        choice["finish_reason"] = self._finish_reason(ctx, c, c.finish_reason)
        choice["stop_reason"] = c.stop_reason
        if ctx.req.return_token_ids:
            choice["prompt_token_ids"] = ctx.prompts[c.prompt_index].token_ids
            choice["token_ids"] = c.token_ids
        return choice

    # -- stream ---------------------------------------------------------------------------

    async def _stream(self, raw: Request, ctx: RequestContext, gens: Generations) -> Response:
        # Wait for the first output so that busy / failed-at-once still get an HTTP status.
        try:
            first = await await_or_disconnect(raw, gens.next())
            first_events = ctx.apply(*first) if first is not None else []
        except ClientDisconnected:
            gens.cancel()
            logger.info("request %s: client disconnected before the first token", ctx.request_id)
            self.metrics.count(m.OUTCOME_CANCELLED)
            return Response(status_code=499)
        except APIError as e:
            gens.cancel()
            self._count_error(e)
            logger.warning("request %s failed: %d %s", ctx.request_id, e.status_code, e.message)
            return self._error_response(e, ctx.headers())
        return SSEResponse(
            self._sse(ctx, gens, first_events, first is None),
            headers={**ctx.headers(), "Cache-Control": "no-cache"}, on_close=gens.cancel,
        )

    async def _sse(
        self,
        ctx: RequestContext,
        gens: Generations,
        first_events: list[tuple[Choice, CompletionDelta]],
        ended: bool,
    ) -> AsyncIterator[str]:
        outcome = m.OUTCOME_CANCELLED
        try:
            for event in self._sse_open(ctx):
                yield event
            events = first_events
            while True:
                for choice, delta in events:
                    for event in self._sse_delta(ctx, choice, delta):
                        yield event
                if ended:
                    break
                try:
                    item = await gens.next()
                    if item is None:
                        break
                    events = ctx.apply(*item)
                except APIError as e:
                    outcome = m.OUTCOME_UNAVAILABLE if e.status_code == 503 else m.OUTCOME_ERROR
                    logger.warning(
                        "request %s failed mid-stream: %d %s", ctx.request_id, e.status_code,
                        e.message,
                    )
                    for event in self._sse_error(ctx, e):
                        yield event
                    return
            for event in await self._sse_close(ctx):
                yield event
            outcome = m.OUTCOME_SUCCESS
            self._observe(ctx)
        finally:
            gens.cancel()
            if outcome == m.OUTCOME_CANCELLED:
                logger.info("request %s: client disconnected mid-stream, cancelled", ctx.request_id)
            if outcome != m.OUTCOME_SUCCESS:
                self.metrics.count(outcome)

    # The stream's events (SSE text); an endpoint with its own event types overrides them.

    def _sse_open(self, ctx: RequestContext) -> list[str]:
        return [sse_event(self._chunk(ctx, [c])) for c in self._stream_preamble(ctx)]

    def _sse_delta(self, ctx: RequestContext, choice: Choice, delta: CompletionDelta) -> list[str]:
        chunk_choice = self._stream_choice(ctx, choice, delta)
        return [] if chunk_choice is None else [sse_event(self._chunk(ctx, [chunk_choice]))]

    def _sse_error(self, ctx: RequestContext, e: APIError) -> list[str]:
        return [sse_event(e.to_dict()), DONE_EVENT]

    async def _sse_close(self, ctx: RequestContext) -> list[str]:
        events = []
        if ctx.req.include_usage():
            events.append(sse_event({
                "id": ctx.request_id,
                "object": self.chunk_object_name,
                "created": ctx.created,
                "model": ctx.model,
                "choices": [],
                "usage": ctx.usage(),
            }))
        return [*events, DONE_EVENT]

    def _chunk(self, ctx: RequestContext, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": ctx.request_id,
            "object": self.chunk_object_name,
            "created": ctx.created,
            "model": ctx.model,
            "choices": choices,
        }
        if ctx.req.continuous_usage():
            chunk["usage"] = ctx.usage()
        elif ctx.req.include_usage():
            chunk["usage"] = None
        return chunk

    def _stream_choice(self, ctx: RequestContext, choice: Choice,
                       delta: CompletionDelta) -> dict[str, Any] | None:
        first = not choice.started
        if not (delta.text or delta.token_ids or delta.finish_reason
                or (first and self._opens_with_prompt(ctx))):
            return None
        choice.started = True
        out = self._render_delta(ctx, choice, delta, first)
        out["finish_reason"] = self._finish_reason(ctx, choice, delta.finish_reason)
        out["stop_reason"] = delta.stop_reason
        if ctx.req.return_token_ids:
            if first:
                out["prompt_token_ids"] = ctx.prompts[choice.prompt_index].token_ids
            out["token_ids"] = list(delta.token_ids)
        return out

    # -- metrics --------------------------------------------------------------------------

    def _observe(self, ctx: RequestContext) -> None:
        self.metrics.count(m.OUTCOME_SUCCESS)
        self.metrics.observe_finished(
            ctx.arrival_time, ctx.first_token_time, time.time(), ctx.max_choice_tokens()
        )

    def _count_error(self, e: APIError) -> None:
        if e.status_code == 503:
            self.metrics.count(m.OUTCOME_UNAVAILABLE)
        elif e.status_code < 500:
            self.metrics.count(m.OUTCOME_INVALID)
        else:
            self.metrics.count(m.OUTCOME_ERROR)


def _random_hex() -> str:
    """32 random hex digits for a response id: uuid4's width without its os.urandom call,
    which cost ~0.2 ms per request under load (Python reseeds `random` in forked children)."""
    return f"{random.getrandbits(128):032x}"


def error_response(e: APIError, headers: dict[str, str] | None = None,
                   body: dict[str, Any] | None = None) -> Response:
    """The JSON error response of `e` (`body`: another API's error shape of it)."""
    return Response(
        dumps(e.to_dict() if body is None else body), status_code=e.status_code,
        media_type="application/json", headers={**(headers or {}), **e.headers()},
    )
