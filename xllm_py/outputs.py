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
    prompt_token_ids: list[int] | None = None
    # Set when the request failed: (HTTP-like status code, message for the client).
    error_code: int = 0
    error_message: str = ""

    @property
    def failed(self) -> bool:
        return self.error_code != 0


def extend_delta(prev: CompletionDelta, d: CompletionDelta) -> None:
    """Append ``d``'s tokens and logprobs to ``prev`` (same choice); its finish reason wins.
    (The text is the caller's: appended, or joined once for many deltas.)"""
    prev.token_ids.extend(d.token_ids)
    if d.logprobs is not None:
        if prev.logprobs is None:
            prev.logprobs = []
        prev.logprobs.extend(d.logprobs)
    if d.finish_reason is not None:
        prev.finish_reason, prev.stop_reason = d.finish_reason, d.stop_reason


def merge_output(into: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Fold ``later`` (the next output of the same request) into ``into``, in place: each
    choice's text, token ids and logprobs are appended, the end state and counters are
    the later ones. ``into`` must be owned by the caller (its delta lists are extended)."""
    by_index = {d.index: d for d in into.outputs}
    for d in later.outputs:
        prev = by_index.get(d.index)
        if prev is None:
            prev = by_index[d.index] = CompletionDelta(
                index=d.index, token_ids=[], logprobs=None)
            into.outputs.append(prev)
        prev.text += d.text
        extend_delta(prev, d)
    into.finished = later.finished
    into.num_generated_tokens = later.num_generated_tokens
    into.num_cached_tokens = max(into.num_cached_tokens, later.num_cached_tokens)
    into.num_prompt_tokens = later.num_prompt_tokens or into.num_prompt_tokens
    if into.prompt_token_ids is None:
        into.prompt_token_ids = later.prompt_token_ids
    into.error_code, into.error_message = later.error_code, later.error_message
    return into


def copy_output(out: RequestOutput) -> RequestOutput:
    """A copy whose delta lists can be extended by ``merge_output``."""
    return dataclasses.replace(out, outputs=[
        dataclasses.replace(d, token_ids=list(d.token_ids),
                            logprobs=None if d.logprobs is None else list(d.logprobs))
        for d in out.outputs])
