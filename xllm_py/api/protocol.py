"""OpenAI request models (pydantic v2) for /v1/completions and /v1/chat/completions.

Parsing is two steps: `parse_request(cls, body)` checks JSON and types (strict: a string
where a number belongs is a 400), then `req.check_values()` checks value ranges. Both raise
`InvalidRequestError` with the offending `param`. Unknown fields are ignored, except
the OpenAI / vLLM parameters this server knows it does not implement (unsupported.py:
response_format other than text, tools, functions, guided decoding, ...), which are a 400
naming the parameter rather than silently ignored. vLLM's extensions (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, prompt_logprobs, ...) are accepted.

Everything accepted here can be held by the engine and by the wire: every
integer fits its proto field and every number is finite and fits a proto float
(validation.py), and the request's work is bounded by the limits
below (fan-out, stop lists); the sampling values become the request's one
`SamplingParams` here (`to_generate_request`), whose own checks are a 400 too, so a
request the HTTP layer takes is never refused later as a 500.
"""
from __future__ import annotations

from typing import Any, TypeVar, Union


from pydantic import BaseModel, ConfigDict, PrivateAttr

from xllm_py.api.backend import GenerateRequest
from xllm_py.api.chat_messages import ChatMessage
from xllm_py.api.errors import InvalidRequestError
from xllm_py.api.structured_request import StructuredFields
from xllm_py.api.tool_choice import ToolRequest, tool_request
from xllm_py.api.unsupported import UnsupportedFields
from xllm_py.api.validation import check, check_wire_values, parse_model
from xllm_py.api.vllm_extras import VLLMExtraFields
from xllm_py.sampling_params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, REQUEST_FIELDS, SamplingParams,
                                     SamplingParamsError)

MAX_N = 128
MAX_BEST_OF = 128
# Sequences one HTTP request may start: prompts x max(n, best_of). Each is a sequence in
# the scheduler with its own KV blocks; 256 is two full batches of the default max_num_seqs.
MAX_FANOUT = 256
MAX_STOP = 16  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 1024  # length of one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPT_TOKEN_IDS = 1 << 20  # prompt given as token ids, before the context check

# Re-exported for callers that import everything request-shaped from here.
__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "GenerateRequest",
    "StreamOptions",
    "parse_request",
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _CommonRequest(UnsupportedFields, StructuredFields, VLLMExtraFields):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # token id (a JSON object key: a string) -> bias added to its logit, in [-100, 100]
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # vLLM: top-k logprobs of every prompt token
    # Extension: latency targets for xllm_service's SLO_AWARE routing (ms).
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    # Extension (xLLM's `offline`): batch work, served in the room online requests leave.
    offline: bool = False

    # -- value checks -------------------------------------------------------------------

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        raise NotImplementedError

    def scores_prompt(self) -> bool:
        """True if the request asks for something of the prompt itself (echo, prompt
        logprobs), so that max_tokens 0 (generate nothing) makes sense."""
        return self.prompt_logprobs is not None

    def check_values(self) -> None:
        """Raise InvalidRequestError for out-of-range values (types are already checked)."""
        check_wire_values(self)
        self.check_unsupported()
        check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        check(self.n <= MAX_N, "n", f"n must be at most {MAX_N}, got {self.n}")
        if self.best_of is not None:
            check(self.best_of <= MAX_BEST_OF, "best_of",
                   f"best_of must be at most {MAX_BEST_OF}, got {self.best_of}")
            check(
                self.best_of >= self.n, "best_of",
                f"best_of must be greater than or equal to n, got best_of={self.best_of} n={self.n}",
            )
            check(
                not (self.stream and self.best_of > self.n), "best_of",
                "best_of must equal n when streaming",
            )
        if self.temperature is not None:
            check(self.temperature >= 0, "temperature",
                   f"temperature must be non-negative, got {self.temperature}")
        if self.top_p is not None:
            check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None:
            check(self.top_k >= -1, "top_k",
                   f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        if self.min_p is not None:
            check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if value is not None:
                check(-2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty is not None:
            check(self.repetition_penalty > 0, "repetition_penalty",
                   f"repetition_penalty must be positive, got {self.repetition_penalty}")
        max_tokens = self.requested_max_tokens()
        if max_tokens is not None and not self.scores_prompt():
            check(max_tokens >= 1, self._max_tokens_param(),
                   f"max_tokens must be at least 1, got {max_tokens}")
        elif max_tokens is not None:
            check(max_tokens >= 0, self._max_tokens_param(),
                   f"max_tokens must be non-negative, got {max_tokens}")
        check(self.min_tokens >= 0, "min_tokens",
               f"min_tokens must be non-negative, got {self.min_tokens}")
        if max_tokens is not None:
            check(self.min_tokens <= max_tokens, "min_tokens",
                   f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        check(len(stops) <= MAX_STOP, "stop", f"stop has at most {MAX_STOP} strings")
        check(all(len(s) <= MAX_STOP_CHARS for s in stops), "stop",
               f"a stop string has at most {MAX_STOP_CHARS} characters")
        check(len(self.stop_token_ids or []) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"stop_token_ids has at most {MAX_STOP_TOKEN_IDS} ids")
        for token_id in self.stop_token_ids or []:
            check(token_id >= 0, "stop_token_ids", "stop_token_ids must be non-negative")
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, name)
            if value is not None:
                check(value > 0, name, f"{name} must be positive, got {value}")
        check(self.stream or self.stream_options is None, "stream_options",
               "stream_options is only allowed when stream is true")
        check(not (self.stream and self.prompt_logprobs is not None), "prompt_logprobs",
               "prompt_logprobs is not supported with stream (as in vLLM)")
        if self.prompt_logprobs is not None:
            check(0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
                   f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        self.logit_bias_ids()
        self.output_spec()
        self.check_extras()

    def logit_bias_ids(self) -> dict[int, float]:
        """logit_bias with integer token ids; 400 (param logit_bias) for a key that is not
        a non-negative integer or a bias outside [-100, 100]."""
        out: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            check(key.strip().isdigit(), "logit_bias",
                   f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
            check(-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, "logit_bias",
                   f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
            out[int(key)] = float(bias)
        return out

    def _max_tokens_param(self) -> str:
        return "max_tokens"

    def num_sequences(self, num_prompts: int) -> int:
        """Sequences this request starts in the engine: one per prompt and best_of."""
        return num_prompts * max(self.n, self.best_of or 0)

    def check_fanout(self, num_prompts: int) -> None:
        num = self.num_sequences(num_prompts)
        check(num <= MAX_FANOUT, "best_of" if (self.best_of or 0) > self.n else "n",
               f"this request would run {num} sequences ({num_prompts} prompt(s) x "
               f"{max(self.n, self.best_of or 0)}); at most {MAX_FANOUT} per request")

    # -- conversion -------------------------------------------------------------------

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: usage on every chunk."""
        return bool(self.stream and self.stream_options
                    and self.stream_options.continuous_usage_stats)

    def num_prompt_logprobs(self) -> int | None:
        """Top-k of the prompt logprobs the engine must compute (None: none)."""
        return self.prompt_logprobs

    def sampling_fields(self) -> dict[str, Any]:
        """The client's sampling values under SamplingParams' names (REQUEST_FIELDS), less
        max_tokens (the endpoint resolves it against the prompt). A field the client left
        unset is left out, so its default is SamplingParams' own. Fields with the OpenAI
        name of a sampling field are taken by that name; the others are converted here."""
        fields: dict[str, Any] = {
            name: getattr(self, name) for name in REQUEST_FIELDS if name in type(self).model_fields
        }
        fields.update(
            max_tokens=None,
            best_of=self.best_of if (self.best_of or 0) > self.n else None,  # <= n: none
            top_k=self.top_k or None,  # 0: off, as the default -1
            stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []),
            logprobs=self.num_logprobs(),
            prompt_logprobs=self.num_prompt_logprobs(),
            logit_bias=self.logit_bias_ids() or None,
            structured=self.output_spec(),
            **self.extra_sampling_fields(),
        )
        return {name: value for name, value in fields.items() if value is not None}

    def to_generate_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        prompt_text: str | None,
        max_tokens: int,
        x_request_id: str | None,
        arrival_time: float,
    ) -> GenerateRequest:
        """One prompt's GenerateRequest, its SamplingParams made here: the one place the
        HTTP values become them (SamplingParams' own refusal is a 400 naming the
        parameter)."""
        try:
            sampling = SamplingParams(**self.sampling_fields(), max_tokens=max_tokens)
        except SamplingParamsError as e:
            raise InvalidRequestError(e.message, param=e.param) from None
        return GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            prompt_text=prompt_text,
            x_request_id=x_request_id,
            stream=self.stream,
            arrival_time=arrival_time,
            ttft_slo_ms=self.ttft_slo_ms,
            tpot_slo_ms=self.tpot_slo_ms,
            offline=self.offline,
        )


PromptType = Union[str, list[int], list[str], list[list[int]]]


class CompletionRequest(_CommonRequest):
    SUPPORTED = ("use_beam_search",)
    prompt: PromptType
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    use_beam_search: bool = False  # (beam_search.py: n beams)
    length_penalty: float = 1.0

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def scores_prompt(self) -> bool:
        return self.echo or super().scores_prompt()

    def num_prompt_logprobs(self) -> int | None:
        """echo + logprobs needs the prompt tokens' logprobs (with logprobs alternatives)."""
        wanted = [k for k in (self.prompt_logprobs,
                              self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def check_values(self) -> None:
        super().check_values()
        if self.logprobs is not None:
            check(0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
                   f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        check(self.suffix is None, "suffix", "suffix is not supported")
        check(-10 <= self.length_penalty <= 10, "length_penalty",  # (length ** it: a float)
              f"length_penalty must be in [-10, 10], got {self.length_penalty}")
        if self.use_beam_search:
            for name, ok in (("stream", not self.stream), ("best_of", self.best_of is None),
                             ("logprobs", self.logprobs is None), ("echo", not self.echo),
                             ("prompt_logprobs", self.prompt_logprobs is None),
                             ("response_format", self.output_spec() is None)):
                check(ok, name, f"{name} is not supported with use_beam_search")
        prompts = self.prompt_list()
        check(len(prompts) > 0, "prompt", "prompt must not be empty")
        self.check_fanout(len(prompts))
        for p in prompts:
            check(len(p) > 0, "prompt", "prompt must not be empty")
            if isinstance(p, list):
                check(len(p) <= MAX_PROMPT_TOKEN_IDS, "prompt",
                       f"a prompt has at most {MAX_PROMPT_TOKEN_IDS} token ids")
                check(all(t >= 0 for t in p), "prompt", "prompt token ids must be non-negative")

    def prompt_list(self) -> list[str | list[int]]:
        """Each element is its own prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatCompletionRequest(_CommonRequest):
    SUPPORTED = ("tools", "tool_choice", "parallel_tool_calls", "chat_template")
    # The tool-call format its choices are read in (serving_chat; None: no tools).
    _tool_format: str | None = PrivateAttr(default=None)
    # The request of another API this chat request serves (Responses, Messages), if any.
    _origin: Any = PrivateAttr(default=None)
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM chat extensions not implemented: a 400 unless left at their default
    chat_template: str | None = None  # (vllm_extras.py)
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = None
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def _max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def check_values(self) -> None:
        super().check_values()
        check(len(self.messages) > 0, "messages", "messages must not be empty")
        self.check_fanout(1)
        for name, default in (("echo", False), ("continue_final_message", False),
                              ("add_generation_prompt", True)):
            value = getattr(self, name)
            check(value is None or value == default, name,
                   f"{name}={value} is not supported on chat completions")
        reserved = sorted(set(self.chat_template_kwargs or {}) & _TEMPLATE_ARGS)
        check(not reserved, "chat_template_kwargs", f"chat_template_kwargs cannot set "
              f"{', '.join(reserved)} (the request's own fields)")
        if self.top_logprobs is not None:
            check(0 <= self.top_logprobs <= MAX_LOGPROBS, "top_logprobs",
                   f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
            check(self.logprobs or self.top_logprobs == 0, "top_logprobs",
                   "top_logprobs requires logprobs to be true")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]

    def tool_request(self) -> ToolRequest | None:
        """The request's tool use (400 on malformed tools or an unknown tool name)."""
        return tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)

    def _constraints(self) -> list[tuple[str, Any]]:
        found = super()._constraints()
        tools = self.tool_request()
        spec = tools.grammar() if tools is not None else None
        if spec is not None:
            if found:
                raise InvalidRequestError(
                    f"tool_choice {tools.mode} is a constraint of its own; it cannot be "
                    f"combined with {found[0][0]}", param="tool_choice")
            found.append(("tool_choice", spec))
        return found


# What a chat template is given from the request itself, not from chat_template_kwargs.
_TEMPLATE_ARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                            "chat_template"})

_R = TypeVar("_R", bound=_CommonRequest)


def parse_request(cls: type[_R], body: bytes) -> _R:
    """JSON body -> request model; malformed JSON and wrong types -> InvalidRequestError."""
    req = parse_model(cls, body)
    req.check_values()
    return req
