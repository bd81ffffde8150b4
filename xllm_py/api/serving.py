"""OpenAI completions and chat completions over a GenerateBackend.

Stages of one HTTP request:
  1. readiness check (503), parse + validate (400), model check (404);
  2. tokenize (chat template for chat), resolve max_tokens against max_model_len (400);
  3. one GenerateRequest per prompt; each backend stream is drained by its own pump task
     into one queue (`_Generations`), so choices of all prompts interleave; choice index =
     prompt_index * n + CompletionDelta.index;
  4. non-stream: aggregate per choice, racing a client-disconnect watcher;
     stream: wait for the first output (errors before it are still HTTP errors), then SSE;
  5. on any exit the pump tasks are cancelled, which closes the backend streams (the
     backend aborts the request).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from xllm_py.api import metrics as m
from xllm_py.api.backend import GenerateBackend, GenerateRequest, TokenizerLike
from xllm_py.api.errors import (
    APIError,
    BackendError,
    InvalidRequestError,
    ModelNotFoundError,
    ServiceUnavailableError,
)
from xllm_py.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _CommonRequest,
    parse_request,
)
from xllm_py.api.sse import DONE_EVENT, SSEResponse, dumps, sse_event
from xllm_py.outputs import CompletionDelta, RequestOutput, TokenLogprob
from xllm_py.request import prompt_token_error

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_MIN_LOGPROB = -9999.0  # JSON has no -inf
_COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI legacy completions default


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


# ---------------------------------------------------------------------------------------
# Backend streams


class _Generations:
    """Drains one backend stream per prompt (each in its own task) into a single queue."""

    _END = object()

    def __init__(self, streams: list[AsyncIterator[RequestOutput]]) -> None:
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._num_open = len(streams)
        self._cancelled = False
        self._tasks = [
            asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)
        ]

    async def _pump(self, prompt_index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((prompt_index, out))
                if out.finished or out.failed or self._cancelled:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as e:  # reported to the consumer, which answers the client
            if not isinstance(e, APIError):
                logger.exception("backend stream of prompt %d failed", prompt_index)
            self._queue.put_nowait((prompt_index, e))
        finally:
            await _aclose(stream)
            self._queue.put_nowait((prompt_index, self._END))

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next (prompt_index, output); None when every stream has ended."""
        while self._num_open > 0:
            prompt_index, item = await self._queue.get()
            if item is self._END:
                self._num_open -= 1
                continue
            if isinstance(item, APIError):
                raise item
            if isinstance(item, Exception):
                raise BackendError(f"backend failure ({type(item).__name__})") from item
            return prompt_index, item
        return None

    def cancel(self) -> None:
        """Cancel every pump; each closes its backend stream (synchronous, safe to call twice).
        A pump whose cancellation is lost stops at its next output all the same."""
        self._cancelled = True
        for t in self._tasks:
            t.cancel()

    async def aclose(self) -> None:
        self.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _aclose(stream: Any) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        logger.warning("closing a backend stream failed", exc_info=True)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _await_or_disconnect(request: Request, aw: Awaitable[_T]) -> _T:
    """Await `aw`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


# ---------------------------------------------------------------------------------------
# Per-request state


class _TokenText:
    """Token id -> string, by decoding the single id (cached per request)."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tokenizer.decode([token_id])
            self._cache[token_id] = s
        return s


@dataclasses.dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None  # for echo only
    num_cached_tokens: int = 0


@dataclasses.dataclass
class _Choice:
    index: int
    prompt_index: int
    text_parts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    started: bool = False  # stream: echo / prompt_token_ids already sent
    text_offset: int = 0  # completions logprobs text_offset of the next token

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
class _Context:
    """Everything about one HTTP request that rendering needs."""

    kind: str  # "completion" | "chat"
    request_id: str
    x_request_id: str | None
    created: int
    model: str
    req: _CommonRequest
    prompts: list[_Prompt]
    choices: list[_Choice]
    token_text: _TokenText
    arrival_time: float
    first_token_time: float | None = None

    @property
    def n(self) -> int:
        return self.req.n

    @property
    def num_logprobs(self) -> int | None:
        return self.req.num_logprobs()

    @property
    def echo(self) -> bool:
        return isinstance(self.req, CompletionRequest) and self.req.echo

    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.x_request_id or self.request_id}

    def apply(self, prompt_index: int, out: RequestOutput) -> list[tuple[_Choice, CompletionDelta]]:
        """Fold one backend output into the choices; returns the (choice, delta) pairs to emit."""
        if out.failed:
            raise BackendError(out.error_message, out.error_code)
        prompt = self.prompts[prompt_index]
        prompt.num_cached_tokens = max(prompt.num_cached_tokens, out.num_cached_tokens)
        if self.first_token_time is None and any(d.token_ids or d.text for d in out.outputs):
            self.first_token_time = time.time()
        emitted: list[tuple[_Choice, CompletionDelta]] = []
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
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {
                "cached_tokens": sum(p.num_cached_tokens for p in self.prompts)
            },
        }

    def max_choice_tokens(self) -> int:
        return max((len(c.token_ids) for c in self.choices), default=0)


# ---------------------------------------------------------------------------------------
# Logprobs in the two OpenAI formats


def _lp(value: float) -> float:
    return max(float(value), _MIN_LOGPROB)


def completion_logprobs(
    entries: list[TokenLogprob | None],
    num_top: int,
    token_text: Callable[[int], str],
    token_ids: list[int],
    text_offset: int,
) -> tuple[dict[str, Any], int]:
    """Completions format; `entries[i] is None` for echoed prompt tokens. Returns (dict, next offset)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries):
        s = token_text(token_id)
        tokens.append(s)
        offsets.append(text_offset)
        text_offset += len(s)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_lp(entry.logprob))
        top: dict[str, float] = {}
        for tid, value in entry.top[:num_top]:
            top.setdefault(token_text(tid), _lp(value))
        top.setdefault(s, _lp(entry.logprob))  # the sampled token is always included
        top_logprobs.append(top)
    return (
        {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
         "text_offset": offsets},
        text_offset,
    )


def chat_logprobs(
    entries: list[TokenLogprob], num_top: int, token_text: Callable[[int], str]
) -> list[dict[str, Any]]:
    content = []
    for entry in entries:
        s = token_text(entry.token_id)
        content.append({
            "token": s,
            "logprob": _lp(entry.logprob),
            "bytes": list(s.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := token_text(tid)), "logprob": _lp(value),
                 "bytes": list(t.encode("utf-8"))}
                for tid, value in entry.top[:num_top]
            ],
        })
    return content


def _entries_for(delta_token_ids: list[int], logprobs: list[TokenLogprob] | None) -> list[TokenLogprob]:
    """Logprob entries aligned with token ids (backends that omit them get zeros)."""
    logprobs = logprobs or []
    if len(logprobs) == len(delta_token_ids):
        return logprobs
    by_pos = list(logprobs) + [
        TokenLogprob(token_id=t, logprob=0.0) for t in delta_token_ids[len(logprobs):]
    ]
    return by_pos[: len(delta_token_ids)]


# ---------------------------------------------------------------------------------------
# The service


class OpenAIServing:
    def __init__(
        self,
        backend: GenerateBackend,
        metrics: m.APIMetrics,
        served_model_name: str | None = None,
    ) -> None:
        self.backend = backend
        self.metrics = metrics
        self.model_name = served_model_name or backend.model_name

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.backend.model_name):
            raise ModelNotFoundError(model)

    def check_ready(self) -> None:
        ok, reason = self.backend.check_ready()
        if not ok:
            raise ServiceUnavailableError(reason or "backend not ready")

    # -- entry points -------------------------------------------------------------------

    async def create_completion(self, raw: Request) -> Response:
        return await self._handle(raw, "completion")

    async def create_chat_completion(self, raw: Request) -> Response:
        return await self._handle(raw, "chat")

    async def _handle(self, raw: Request, kind: str) -> Response:
        arrival_time = time.time()
        try:
            self.check_ready()
            body = await raw.body()
            req: _CommonRequest
            if kind == "chat":
                req = parse_request(ChatCompletionRequest, body)
            else:
                req = parse_request(CompletionRequest, body)
            self.check_model(req.model)
            ctx, gen_reqs = self._prepare(req, kind, raw.headers.get("x-request-id"), arrival_time)
        except APIError as e:
            self._count_error(e)
            return _error_response(e)
        except Exception as e:  # tokenizer / template failures: a 500 with an OpenAI body
            logger.exception("preparing a %s request failed", kind)
            err = APIError(f"internal error ({type(e).__name__})", status_code=500)
            self._count_error(err)
            return _error_response(err)

        logger.debug("request %s: %d prompt(s), n=%d", ctx.request_id, len(gen_reqs), req.n)
        try:
            gens = _Generations(self._start(gen_reqs))
        except APIError as e:
            self._count_error(e)
            return _error_response(e, ctx.headers())

        if req.stream:
            return await self._stream(raw, ctx, gens)
        return await self._complete(raw, ctx, gens)

    def _start(self, gen_reqs: list[GenerateRequest]) -> list[AsyncIterator[RequestOutput]]:
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for r in gen_reqs:
                streams.append(self.backend.generate(r))
        except BaseException:
            for s in streams:  # never started: close without awaiting the loop
                close = getattr(s, "aclose", None)
                if close is not None:
                    asyncio.ensure_future(_aclose(s))
            raise
        return streams

    # -- preparation --------------------------------------------------------------------

    def _prepare(
        self, req: _CommonRequest, kind: str, x_request_id: str | None, arrival_time: float
    ) -> tuple[_Context, list[GenerateRequest]]:
        tokenizer = self.backend.tokenizer()
        max_model_len = self.backend.max_model_len
        prompts: list[_Prompt] = []
        if isinstance(req, ChatCompletionRequest):
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
            prompts.append(_Prompt(token_ids=ids, text=None))
            prefix = "chatcmpl"
        else:
            assert isinstance(req, CompletionRequest)
            for p in req.prompt_list():
                if isinstance(p, str):
                    prompts.append(_Prompt(list(tokenizer.encode(p, add_special_tokens=True)), p))
                else:
                    error = prompt_token_error(p, getattr(tokenizer, "vocab_size", None))
                    if error is not None:
                        raise InvalidRequestError(error, param="prompt")
                    text = tokenizer.decode(p) if req.echo else None
                    prompts.append(_Prompt(list(p), text))
            prefix = "cmpl"

        requested = req.requested_max_tokens()
        max_tokens_per_prompt = []
        for p in prompts:
            num = len(p.token_ids)
            if num == 0:
                raise InvalidRequestError("prompt is empty after tokenization", param="prompt")
            if requested is None:
                if num >= max_model_len:
                    raise InvalidRequestError(
                        f"This model's maximum context length is {max_model_len} tokens. "
                        f"However, your prompt has {num} tokens, leaving no room for completion.",
                        param="messages" if kind == "chat" else "prompt",
                    )
                default = max_model_len - num
                if kind == "completion":
                    default = min(default, _COMPLETION_DEFAULT_MAX_TOKENS)
                max_tokens_per_prompt.append(default)
            else:
                if num + requested > max_model_len:
                    raise InvalidRequestError(
                        f"This model's maximum context length is {max_model_len} tokens. "
                        f"However, you requested {num + requested} tokens ({num} in the prompt, "
                        f"{requested} in the completion). Please reduce the prompt or the "
                        f"completion length.",
                        param="max_tokens",
                    )
                max_tokens_per_prompt.append(requested)

        base_id = f"{prefix}-{_random_hex()}"
        gen_reqs = [
            req.to_generate_request(
                base_id if len(prompts) == 1 else f"{base_id}-{i}",
                p.token_ids,
                prompt_text=p.text,
                max_tokens=max_tokens_per_prompt[i],
                x_request_id=x_request_id,
                arrival_time=arrival_time,
                echo=isinstance(req, CompletionRequest) and req.echo,
            )
            for i, p in enumerate(prompts)
        ]
        choices = [
            _Choice(index=i * req.n + j, prompt_index=i)
            for i in range(len(prompts)) for j in range(req.n)
        ]
        ctx = _Context(
            kind=kind, request_id=base_id, x_request_id=x_request_id,
            created=int(arrival_time), model=self.model_name, req=req, prompts=prompts,
            choices=choices, token_text=_TokenText(tokenizer), arrival_time=arrival_time,
        )
        return ctx, gen_reqs

    # -- non-stream -----------------------------------------------------------------------

    async def _complete(self, raw: Request, ctx: _Context, gens: _Generations) -> Response:
        async def collect() -> None:
            while (item := await gens.next()) is not None:
                ctx.apply(*item)

        try:
            await _await_or_disconnect(raw, collect())
        except ClientDisconnected:
            logger.info("request %s: client disconnected, cancelled", ctx.request_id)
            self.metrics.count(m.OUTCOME_CANCELLED)
            return Response(status_code=499)
        except APIError as e:
            self._count_error(e)
            logger.warning("request %s failed: %d %s", ctx.request_id, e.status_code, e.message)
            return _error_response(e, ctx.headers())
        finally:
            gens.cancel()

        self._observe(ctx)
        body = self._render_full(ctx)
        return Response(dumps(body), media_type="application/json", headers=ctx.headers())

    def _render_full(self, ctx: _Context) -> dict[str, Any]:
        choices = []
        num_top = ctx.num_logprobs
        for c in ctx.choices:
            prompt = ctx.prompts[c.prompt_index]
            text = "".join(c.text_parts)
            entries = _entries_for(c.token_ids, c.logprobs) if num_top is not None else []
            if ctx.kind == "chat":
                choice: dict[str, Any] = {
                    "index": c.index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": (
                        {"content": chat_logprobs(entries, num_top, ctx.token_text)}
                        if num_top is not None else None
                    ),
                }
            else:
                lp = None
                if ctx.echo:
                    text = (prompt.text or "") + text
                if num_top is not None:
                    ids = list(c.token_ids)
                    all_entries: list[TokenLogprob | None] = list(entries)
                    if ctx.echo:
                        ids = prompt.token_ids + ids
                        all_entries = [None] * len(prompt.token_ids) + all_entries
                    lp, _ = completion_logprobs(all_entries, num_top, ctx.token_text, ids, 0)
                choice = {"index": c.index, "text": text, "logprobs": lp}
            choice["finish_reason"] = c.finish_reason
            choice["stop_reason"] = c.stop_reason
            if ctx.req.return_token_ids:
                choice["prompt_token_ids"] = prompt.token_ids
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return {
            "id": ctx.request_id,
            "object": "chat.completion" if ctx.kind == "chat" else "text_completion",
            "created": ctx.created,
            "model": ctx.model,
            "choices": choices,
            "usage": ctx.usage(),
        }

    # -- stream ---------------------------------------------------------------------------

    async def _stream(self, raw: Request, ctx: _Context, gens: _Generations) -> Response:
        # Wait for the first output so that busy / failed-at-once still get an HTTP status.
        try:
            first = await _await_or_disconnect(raw, gens.next())
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
            return _error_response(e, ctx.headers())
        return SSEResponse(
            self._sse(ctx, gens, first_events, first is None),
            headers={**ctx.headers(), "Cache-Control": "no-cache"},
        )

    async def _sse(
        self,
        ctx: _Context,
        gens: _Generations,
        first_events: list[tuple[_Choice, CompletionDelta]],
        ended: bool,
    ) -> AsyncIterator[str]:
        outcome = m.OUTCOME_CANCELLED
        try:
            if ctx.kind == "chat":
                for c in ctx.choices:
                    yield sse_event(self._chunk(ctx, [{
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }]))
            events = first_events
            while True:
                for choice, delta in events:
                    chunk_choice = self._stream_choice(ctx, choice, delta)
                    if chunk_choice is not None:
                        yield sse_event(self._chunk(ctx, [chunk_choice]))
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
                    yield sse_event(e.to_dict())
                    yield DONE_EVENT
                    return
            if ctx.req.include_usage():
                yield sse_event({
                    "id": ctx.request_id,
                    "object": self._chunk_object(ctx),
                    "created": ctx.created,
                    "model": ctx.model,
                    "choices": [],
                    "usage": ctx.usage(),
                })
            yield DONE_EVENT
            outcome = m.OUTCOME_SUCCESS
            self._observe(ctx)
        finally:
            gens.cancel()
            if outcome == m.OUTCOME_CANCELLED:
                logger.info("request %s: client disconnected mid-stream, cancelled", ctx.request_id)
            if outcome != m.OUTCOME_SUCCESS:
                self.metrics.count(outcome)

    @staticmethod
    def _chunk_object(ctx: _Context) -> str:
        return "chat.completion.chunk" if ctx.kind == "chat" else "text_completion"

    def _chunk(self, ctx: _Context, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": ctx.request_id,
            "object": self._chunk_object(ctx),
            "created": ctx.created,
            "model": ctx.model,
            "choices": choices,
        }
        if ctx.req.include_usage():
            chunk["usage"] = None
        return chunk

    def _stream_choice(
        self, ctx: _Context, choice: _Choice, delta: CompletionDelta
    ) -> dict[str, Any] | None:
        first = not choice.started
        prompt = ctx.prompts[choice.prompt_index]
        echo_now = ctx.echo and first
        if not (delta.text or delta.token_ids or delta.finish_reason or echo_now):
            return None
        choice.started = True
        num_top = ctx.num_logprobs
        entries = _entries_for(delta.token_ids, delta.logprobs) if num_top is not None else []
        out: dict[str, Any]
        if ctx.kind == "chat":
            out = {
                "index": choice.index,
                "delta": {"content": delta.text} if delta.text else {},
                "logprobs": (
                    {"content": chat_logprobs(entries, num_top, ctx.token_text)}
                    if num_top is not None and entries else None
                ),
            }
        else:
            text = delta.text
            ids = list(delta.token_ids)
            all_entries: list[TokenLogprob | None] = list(entries)
            if echo_now:
                text = (prompt.text or "") + text
                ids = prompt.token_ids + ids
                all_entries = [None] * len(prompt.token_ids) + all_entries
            lp = None
            if num_top is not None and ids:
                lp, choice.text_offset = completion_logprobs(
                    all_entries, num_top, ctx.token_text, ids, choice.text_offset
                )
            out = {"index": choice.index, "text": text, "logprobs": lp}
        out["finish_reason"] = delta.finish_reason
        out["stop_reason"] = delta.stop_reason
        if ctx.req.return_token_ids:
            if first:
                out["prompt_token_ids"] = prompt.token_ids
            out["token_ids"] = list(delta.token_ids)
        return out

    # -- metrics --------------------------------------------------------------------------

    def _observe(self, ctx: _Context) -> None:
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


def _error_response(e: APIError, headers: dict[str, str] | None = None) -> Response:
    return Response(
        dumps(e.to_dict()), status_code=e.status_code, media_type="application/json",
        headers=headers,
    )
