"""Greedy verification: the model's argmax at the last token and at each guess; the
guesses are kept while each equals the model's choice before it, then the model's own
next token is added. Output: exactly the tokens one-token greedy steps would emit (the
verify rows' logits are the decode step's: docs/DESIGN.md, the CPU fast path)."""
from __future__ import annotations

from typing import Sequence


def verify_greedy(seqs: Sequence, spec: list, sampled: dict[str, int]) -> dict[str, list[int]]:
    """Per speculating seq (`spec`: StepLogits.spec, (seq index, its guesses' logits)), the
    guesses the model agrees with and the model's token after them."""
    out = {}
    for i, rows in spec:
        rid = seqs[i].request_id
        out[rid] = accept_greedy(seqs[i].spec_token_ids, greedy_targets(sampled[rid], rows))[1:]
    return out


def greedy_targets(first: int, rows) -> list[int]:
    """The model's tokens: `first` (the sampler's, at the last token) and the argmax of
    each guess's float32 logits row, as the sampler's greedy path takes it (no torch
    imported here: the engine loop imports this module)."""
    if rows.device.type == "cpu" and not rows.requires_grad:
        return [first] + rows.numpy().argmax(axis=-1).tolist()
    return [first] + rows.argmax(dim=-1).tolist()


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens to emit: the longest prefix of `drafts` equal to `targets`, plus the
    target after it (len(targets) == len(drafts) + 1)."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return list(targets[:n + 1])
