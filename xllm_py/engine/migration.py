"""MultiGenerations: take over requests that already generated tokens on an instance
that died (the service migrates them here).

DECODE (DecodeSide.resume_with_kv) and MIX (pd/handlers.py) both serve it through
`multi_generations`; only what happens to the KV differs. Stages of one item:
  parse (`parse_resumption`: the spec, the generated ids, how many of them the client
  has no text for; the token budgets with the generated tokens spent) ->
  with `kv` (DECODE only: where the KV of prompt + generated[:-1] lives) the caller's
  `pull_kv` pulls it like a FirstGeneration; without it `resume_by_recompute`: the engine
  recomputes the KV of prompt + generated (its prefix cache may hold part of it) and
  samples the token after the last generated one ->
  decoding resumes; usage counts the generated tokens, and text continues with prompt +
  generated as detokenizer context, starting with the unread ones' text.
A MIX instance has no KV transfer, so an item with `kv` is refused there.
"""
from __future__ import annotations

import dataclasses
from typing import Awaitable, Callable, Sequence

from xllm_py.engine.generations_reporter import GenerationsReporter
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.rpc import pd as wire
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.rpc.pd import MigrationItem
from xllm_py.sampling_params import SamplingParams


@dataclasses.dataclass
class Resumption:
    """One MultiGenerations item, checked."""
    spec: EngineRequestSpec
    generated: list[int]  # never empty
    num_unread: int | None  # of `generated`, those the client has no text for (None: infer)
    # spec.params with k - 1 of each budget spent: generated[-1] counts as the first
    # output token here (min_tokens too when max_tokens is unset)
    params: SamplingParams

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.spec.prompt_token_ids)


# Pulls an item's KV and starts decoding it; returns a problem ("" when it was taken).
# Its first argument: the item's wire form (MigrationItem.message).
KVPuller = Callable[[object, Resumption], Awaitable[str]]


def parse_resumption(item: MigrationItem) -> Resumption | str:
    """The item as a Resumption, or why it cannot be resumed."""
    spec = item.spec
    if spec is None:
        return f"{item.request_id}: {item.problem}"
    generated = list(item.generated)
    if not generated:
        return f"{spec.request_id}: generated_token_ids is empty"
    if not spec.source_xservice_addr:
        return f"{spec.request_id}: source_xservice_addr is required: tokens go back there"
    params = spec.params
    if params.n > 1 or (params.best_of or 1) > 1:
        return (f"{spec.request_id}: n/best_of > 1 cannot be resumed: generated_token_ids "
                "are one sequence's")
    k = len(generated)
    if params.max_tokens is not None and params.max_tokens <= k:
        return f"{spec.request_id}: already generated max_tokens"
    params = dataclasses.replace(
        params, max_tokens=None if params.max_tokens is None else params.max_tokens - (k - 1),
        min_tokens=max(0, params.min_tokens - (k - 1)))
    unread = item.num_unread
    if unread is not None and not 0 <= unread <= k:
        return f"{spec.request_id}: num_unread_tokens must be in [0, {k}], got {unread}"
    return Resumption(spec, generated, unread, params)


def resume_by_recompute(engine: LLMEngine, reporter: GenerationsReporter,
                        r: Resumption) -> bool:
    """Submit prompt + generated as the prompt: the next sampled token is the one after
    generated[-1], so the last of the budgets' k tokens is spent too. False: a request
    of that id is already here (nothing submitted)."""
    spec, params = r.spec, r.params
    params = dataclasses.replace(
        params, max_tokens=None if params.max_tokens is None else params.max_tokens - 1,
        min_tokens=max(0, params.min_tokens - 1))
    sink = reporter.sink(spec.source_xservice_addr, spec.service_request_id, spec.request_id)
    return engine.try_submit(EngineRequest(
        spec.request_id, spec.prompt_token_ids + r.generated, params, sink,
        usage_prompt_tokens=r.num_prompt_tokens, generated_offset=len(r.generated),
        num_unread=r.num_unread, offline=spec.offline, tpot_slo_ms=spec.tpot_slo_ms))


async def multi_generations(engine: LLMEngine, reporter: GenerationsReporter,
                            items: Sequence[MigrationItem],
                            pull_kv: KVPuller | None, role: str) -> object:
    """Resume every item that can be; the Status lists those that cannot (not ok when
    any). `pull_kv` is None where there is no KV transfer (MIX): items with `kv` are
    refused there rather than silently recomputed, so a sender relying on it learns."""
    problems = []
    for item in items:
        if pull_kv is None and item.has_kv:
            problems.append(f"{item.request_id}: kv is set, but a {role} instance has no "
                            "KV transfer: send the request without kv to recompute it here")
            continue
        r = parse_resumption(item)
        if isinstance(r, str):
            problems.append(r)
        elif pull_kv is not None and item.has_kv and item.num_kv_blocks:
            problem = await pull_kv(item.message, r)
            if problem:
                problems.append(problem)
        elif not resume_by_recompute(engine, reporter, r):
            problems.append(f"{r.spec.request_id}: duplicate request id: it is running here")
    return wire.problems_to_proto(problems)
