"""SamplingParams: how one request samples and when it stops (pure Python, validated).

The one form of a request's sampling parameters between its two ways in, the HTTP models
(api/protocol.py) and the proto (rpc/convert.py), and the sampler, which reads them in
place (engine/sampler.py `SamplingRow.params`).

Invalid input raises `SamplingParamsError` (a `ValueError`) that names the offending
parameter, so the HTTP layer can answer 400 with `param` set.
"""
from __future__ import annotations

import dataclasses
import math

from xllm_py.structured.spec import GrammarSpec

# Below this temperature sampling is greedy (argmax).
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
# repetition_penalty divides or multiplies float32 logits: outside this range a logit
# overflows to inf (1e-300 is 0 in float32: logit / 0) and sampling fails the whole step
# (found by tests/integration/test_fuzz.py). Useful values are 1.0-2.0.
REPETITION_PENALTY_RANGE = (1e-4, 1e4)


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names it (OpenAI error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # None: up to the model's context length. 0: score the prompt, generate nothing (only
    # with prompt_logprobs or echo); the request ends after its prefill with "length".
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; k in 0..20: the chosen token's logprob plus the top k.
    logprobs: int | None = None
    # None: none; k in 0..20: each prompt token's logprob (after the first) plus the top k.
    prompt_logprobs: int | None = None
    echo: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> bias in [-100, 100] added to that token's logit before sampling (the
    # returned logprobs stay those of the raw logits). Decimal-string keys (JSON) are
    # accepted and made ints; the engine checks the ids against its vocabulary.
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    # Structured output: the grammar every sampled token must keep to (None: free text).
    # The HTTP layer builds it (response_format, structured_outputs, guided_*, tools)
    # and checks it; the engine compiles it against its vocabulary.
    structured: GrammarSpec | None = None
    # vLLM's allowed_token_ids: only these tokens may be sampled (empty: any token).
    allowed_token_ids: list[int] = dataclasses.field(default_factory=list)
    # vLLM's bad_words as token sequences (the HTTP layer tokenizes the words): a
    # sequence's last token is never sampled where the output ends with the rest of it.
    bad_words_token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    # OpenAI's Predicted Outputs, tokenized by the HTTP layer: text the output is expected
    # to repeat, a source of speculative guesses for this request (engine/spec_decode/);
    # the output is what it would be without it.
    prediction_token_ids: list[int] = dataclasses.field(default_factory=list)
    # Filled by the engine from the model's generation config, not by clients.
    eos_token_ids: list[int] = dataclasses.field(
        default_factory=list, metadata={"engine_only": True})

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.eos_token_ids = list(self.eos_token_ids)
        self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words_token_ids = [list(seq) for seq in self.bad_words_token_ids]
        self.prediction_token_ids = list(self.prediction_token_ids)
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the request's token history (repetition, frequency or
        presence penalty)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def edits_logits(self) -> bool:
        """Whether sampling changes the logits before it picks (bias, allowed tokens, bad
        words): the sampler's general path."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the request's token history (penalties, bad words)."""
        return self.has_penalties or bool(self.bad_words_token_ids)

    def validate(self) -> None:
        """Raise SamplingParamsError naming the first invalid parameter."""
        if not _is_int(self.n) or self.n < 1:
            raise SamplingParamsError("n", f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise SamplingParamsError(
                "best_of", f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}"
            )
        self._check_float("temperature", self.temperature, low=0.0)
        self._check_float("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p <= 0.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamsError(
                "top_k", f"top_k must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}"
            )
        self._check_float("min_p", self.min_p, low=0.0, high=1.0)
        self._check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        self._check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        self._check_float("repetition_penalty", self.repetition_penalty,
                          low=REPETITION_PENALTY_RANGE[0], high=REPETITION_PENALTY_RANGE[1])
        if self.seed is not None and not _is_int(self.seed):
            raise SamplingParamsError("seed", f"seed must be an integer or null, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise SamplingParamsError(
                "max_tokens", f"max_tokens must be an integer >= 0, got {self.max_tokens!r}"
            )
        if self.max_tokens == 0 and self.prompt_logprobs is None and not self.echo:
            raise SamplingParamsError(
                "max_tokens", "max_tokens 0 (generate nothing) needs echo or prompt_logprobs"
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise SamplingParamsError(
                "min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingParamsError("stop", "stop must be a list of non-empty strings")
        if not all(isinstance(seq, list) and seq and all(_is_int(t) and t >= 0 for t in seq)
                   for seq in self.bad_words_token_ids):
            raise SamplingParamsError("bad_words", "bad_words must be non-empty token sequences")
        for name in ("stop_token_ids", "eos_token_ids", "allowed_token_ids",
                     "prediction_token_ids"):
            ids = getattr(self, name)
            if not all(_is_int(t) and t >= 0 for t in ids):
                raise SamplingParamsError(name, f"{name} must be a list of token ids >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise SamplingParamsError(
                    name, f"{name} must be null or an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        self._check_logit_bias()
        if self.structured is not None and not isinstance(self.structured, GrammarSpec):
            raise SamplingParamsError(
                "structured", f"structured must be a GrammarSpec or None, got {self.structured!r}")

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamsError(
                "logit_bias", f"logit_bias must be a map of token id to bias, got {self.logit_bias!r}")
        for token_id, bias in self.logit_bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise SamplingParamsError(
                    "logit_bias", f"logit_bias keys must be token ids >= 0, got {token_id!r}")
            if (not _is_number(bias) or math.isnan(bias)
                    or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise SamplingParamsError(
                    "logit_bias", f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {bias!r} for token {token_id}")

    @staticmethod
    def _check_float(
        name: str, value: object, low: float | None = None, high: float | None = None
    ) -> None:
        if not _is_number(value) or math.isnan(value) or math.isinf(value):
            raise SamplingParamsError(name, f"{name} must be a finite number, got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
            raise SamplingParamsError(name, f"{name} must be in {bounds}, got {value!r}")


def _normalize_logit_bias(value: object) -> object:
    """Keys given as decimal strings (JSON objects have string keys) become ints; anything
    else is left for validate() to reject."""
    if not isinstance(value, dict):
        return value
    out: dict = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        out[key] = bias
    return out


# The fields a client sets: every field but the ones the engine fills itself. The HTTP
# models take their values by these names (api/protocol.py `sampling_fields`).
REQUEST_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(SamplingParams) if not f.metadata.get("engine_only"))
