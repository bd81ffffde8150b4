"""Verification: the model's token at the last known token and at each guess; the guesses
are kept while each equals the model's token before it, then the model's own next token
is added.

One sampler call per step (`sample_step`) picks them all: the row of every sampling seq
at its last known token, then the rows of every speculating seq's guesses. Guess row j
of a request is the row the one-token step at output position n + 1 + j would sample
(`guess_rows`; n: the request's output length): its draw position, its token history
with the guesses up to it (penalties, bad words), its bias, its grammar's mask after
those guesses (EngineGrammars.mask), logprobs of its raw logits. Those logits are the
one-token step's bit for bit (docs/DESIGN.md, the CPU fast path; the verify rows test),
so each emitted token and its logprobs are what a step without speculation gives.

Greedy rows: the model's tokens are the argmax of each (processed) row: exactly the
tokens one-token greedy steps emit.

Sampled rows (temperature > 0): speculative sampling with a one-hot proposal (the
proposers here guess one token, with certainty). Its rule, accept guess d with
probability p(d), else emit a token from p with d removed and renormalised, and after
the last accepted guess a bonus token from p, is the same as drawing x ~ p at each row
and keeping d where x == d: P(keep) = p(d), and given x != d, x is distributed as p(y) /
(1 - p(d)) for y != d; so each emitted token is distributed as the model's. A seeded
request draws from (seed, output position) alone, so its tokens are the ones it emits
without speculation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence


@dataclasses.dataclass
class StepTokens:
    """What one step's sampling picked, per request id."""

    sampled: dict[str, int] = dataclasses.field(default_factory=dict)  # at the last token
    # a speculating seq's guesses kept, then the model's token after them
    accepted: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # requests that ask: a TokenLogprob per token, the sampled one, then the accepted ones
    logprobs: dict[str, list] = dataclasses.field(default_factory=dict)


def sample_step(seqs: Sequence, step_logits: Any, requests: Mapping, sampler: Callable,
                grammars: Any, row_of: Callable) -> StepTokens:
    """The tokens of a step (`step_logits`: model_runner.StepLogits of `seqs`): `requests`
    the scheduler's by id, `sampler` the engine's Sampler, `grammars` its EngineGrammars,
    `row_of(request)` a request's SamplingRow (sampler.request_row)."""
    out = StepTokens()
    logits = step_logits.sample
    if logits is None:
        return out
    sample_seqs = [s for s in seqs if s.sample]
    batch = [requests[s.request_id] for s in sample_seqs]
    rows = [row_of(r) for r in batch]
    guessing = [(requests[seqs[i].request_id], seqs[i].spec_token_ids)
                for i, _ in step_logits.spec]
    if guessing:
        own = {r.request_id: row for r, row in zip(batch, rows)}
        for request, drafts in guessing:
            rows.extend(guess_rows(own[request.request_id], drafts))
        logits = step_logits.sample_and_spec
    picked = sampler(logits, rows, grammars.mask(batch, guessing))
    ids, lps = picked.token_ids, picked.logprobs
    for s, token_id, lp in zip(sample_seqs, ids, lps):
        out.sampled[s.request_id] = token_id
        if lp is not None:
            out.logprobs[s.request_id] = [lp]
    first = len(sample_seqs)
    for request, drafts in guessing:
        rid = request.request_id
        kept = accept_greedy(drafts, [out.sampled[rid], *ids[first:first + len(drafts)]])
        out.accepted[rid] = kept[1:]
        if rid in out.logprobs:
            out.logprobs[rid] += lps[first:first + len(kept) - 1]
        first += len(drafts)
    return out


def guess_rows(row: Any, drafts: Sequence[int]) -> list:
    """The SamplingRows of a request's guess rows, from its own `row` (at output position
    n): row j draws as position n + 1 + j does, its history the output and drafts[:j + 1]
    (the tokens before that position once the guesses up to it are kept)."""
    n = row.num_output_tokens_so_far
    history = row.params.reads_history
    return [dataclasses.replace(
        row, num_output_tokens_so_far=n + 1 + j,
        output_token_ids=[*row.output_token_ids, *drafts[:j + 1]] if history else ())
        for j in range(len(drafts))]


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens to emit: the longest prefix of `drafts` equal to `targets`, plus the
    target after it (len(targets) == len(drafts) + 1)."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return list(targets[:n + 1])
