"""Domain output of a request: what the engine produces per step, transport-free.

Mirrors xLLM's `DisaggStreamGeneration`/`SequenceOutput`; xllm_py/rpc/convert.py maps it
to and from protobuf, xllm_py/api turns a stream of it into OpenAI responses.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # (token_id, logprob) of the most likely tokens at this position, best first.
    top: list[tuple[int, float]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CompletionDelta:
    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionDelta] = dataclasses.field(default_factory=list)
    finished: bool = False
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    # Predicted Outputs (SamplingParams.prediction_token_ids), so far: guessed tokens of
    # the prediction that the model kept, and that it did not.
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    prompt_token_ids: list[int] | None = None
    # With SamplingParams.prompt_logprobs, on the first output only: one entry per prompt
    # token, None for the first (nothing precedes it); each the token's logprob under the
    # raw logits of the position before it, with the top-k alternatives.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Set when the request failed: (HTTP-like status code, message for the client).
    error_code: int = 0
    error_message: str = ""
    # With a failure: the peer instance that could not be reached (see the proto field).
    unreachable_instance: str = ""

    @property
    def failed(self) -> bool:
        return self.error_code != 0
