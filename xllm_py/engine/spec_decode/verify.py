"""Verification: the model's token at the last known token and at each guess; the guesses
are kept while each equals the model's token before it, then the model's own next token
is added.

Greedy rows: the model's tokens are the argmax of each row. Output: exactly the tokens
one-token greedy steps would emit (the verify rows' logits are the decode step's:
docs/DESIGN.md, the CPU fast path).

Sampled rows (temperature > 0): speculative sampling with a one-hot proposal (the
proposers here guess one token, with certainty). Its rule, accept guess d with
probability p(d), else emit a token from p with d removed and renormalised, and after
the last accepted guess a bonus token from p, is the same as drawing x ~ p at each row
and keeping d where x == d: P(keep) = p(d), and given x != d, x is distributed as p(y) /
(1 - p(d)) for y != d; so each emitted token is distributed as the model's. Each row is
drawn by the sampler as a one-token step would draw that output position: a seeded
request draws from (seed, output position) alone, so its tokens are the ones it emits
without speculation.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence


def verify(seqs: Sequence, spec: list, sampled: dict[str, int],
           sample: Callable | None = None, requests: Mapping | None = None
           ) -> dict[str, list[int]]:
    """Per speculating seq (`spec`: StepLogits.spec, (seq index, its guesses' logits)), the
    guesses the model agrees with and the model's token after them. `sample`: the engine's
    Sampler and `requests` its scheduler's, for sampled rows."""
    out = {}
    for i, rows in spec:
        rid = seqs[i].request_id
        request = requests.get(rid) if requests is not None else None
        if request is None or request.sampling_params.is_greedy:
            targets = greedy_targets(sampled[rid], rows)
        else:
            targets = [sampled[rid]] + sampled_targets(sample, request, rows)
        out[rid] = accept_greedy(seqs[i].spec_token_ids, targets)[1:]
    return out


def greedy_targets(first: int, rows) -> list[int]:
    """The model's tokens: `first` (the sampler's, at the last token) and the argmax of
    each guess's float32 logits row, as the sampler's greedy path takes it (no torch
    imported here: the engine loop imports this module)."""
    if rows.device.type == "cpu" and not rows.requires_grad:
        return [first] + rows.numpy().argmax(axis=-1).tolist()
    return [first] + rows.argmax(dim=-1).tolist()


def sampled_targets(sample: Callable, request, rows) -> list[int]:
    """The sampler's draw at each guess row: row j is output position n + 1 + j, where n
    is the request's output length (the sampler drew position n at its last token)."""
    from xllm_py.engine.sampler import request_row  # (torch: only once a row samples)

    row = request_row(request)
    n = row.num_output_tokens_so_far
    shifted = [dataclasses.replace(row, num_output_tokens_so_far=n + 1 + j)
               for j in range(rows.shape[0])]
    return sample(rows, shifted).token_ids


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens to emit: the longest prefix of `drafts` equal to `targets`, plus the
    target after it (len(targets) == len(drafts) + 1)."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return list(targets[:n + 1])
