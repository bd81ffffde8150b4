"""What a guess costs and what it is worth: the Speculator's per-step choice of how many
guesses each sequence verifies.

`StepCost`, a step observer (engine/step_observers.py), fits the engine's own decode steps
(no prompt chunk in them) as `ms = base + per_row * rows`, rows the tokens the step
computed (one per sequence plus its guesses: a guess row costs what a sequence's row
does, its layers and its LM head row). Older steps weigh less (DECAY a step), so the fit
follows the machine's speed as its load changes. It has no answer while the steps it has
seen do not tell the slope (all of one size): the Speculator then uses the latency
profile, or, with none, verifies every guess, which gives the fit steps of other sizes.

`plan_guesses` picks the rows: the j-th guess of a sequence whose guesses are each kept
with probability a (its running rate) is worth a^j tokens (kept only if those before it
are) and costs per_row ms. A step of `tokens` expected tokens in `ms` gains by a row
worth g while g / per_row > tokens / ms; the rows are taken best first, so the step's
expected tokens per ms is the largest the guesses allow. On a memory-bound step (one
sequence: the weights' read dominates) nearly every guess pays; where the step is
compute-bound (a large batch, a large LM head) only the likeliest do, or none.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from xllm_py.engine.step_observers import StepRecord

DECAY = 0.98  # weight of a step 50 steps ago: 0.36
# The fit answers once it holds this much weight and its rows vary by this much (variance)
MIN_WEIGHT = 4.0
MIN_ROWS_VARIANCE = 0.25


class StepCost:
    def __init__(self, decay: float = DECAY) -> None:
        self._decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def on_step(self, step: StepRecord) -> None:
        out = step.out
        if out.seqs and out.num_decode_seqs == len(out.seqs):
            self.add(out.num_batched_tokens, step.ms)

    def add(self, rows: int, ms: float) -> None:
        d = self._decay
        self._w = self._w * d + 1
        self._x = self._x * d + rows
        self._y = self._y * d + ms
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * ms

    def fit(self) -> tuple[float, float] | None:
        """(base ms, ms per row) of a decode step, or None (module docstring)."""
        w = self._w
        if w < MIN_WEIGHT:
            return None
        mx, my = self._x / w, self._y / w
        var = self._xx / w - mx * mx
        if var < MIN_ROWS_VARIANCE:
            return None
        per_row = max(0.0, (self._xy / w - mx * my) / var)
        return max(0.0, my - per_row * mx), per_row


def plan_guesses(candidates: Sequence[tuple[str, int, float]], tokens: float, ms: float,
                 per_row: float) -> dict[str, int]:
    """How many guesses each candidate (request id, guesses it has, the rate its guesses
    are kept at) verifies, for a step that without them emits `tokens` in `ms`, each
    guess row costing `per_row` ms (module docstring). Candidates left out verify none."""
    heap = [(-rate, rid, 1, rate, n) for rid, n, rate in candidates if n > 0 and rate > 0]
    heapq.heapify(heap)
    taken: dict[str, int] = {}
    while heap:
        neg_gain, rid, j, rate, n = heapq.heappop(heap)
        gain = -neg_gain
        if gain * ms <= per_row * tokens:
            break  # (the rest are worth less, and the bar only rose)
        tokens, ms, taken[rid] = tokens + gain, ms + per_row, j
        if j < n:
            heapq.heappush(heap, (-gain * rate, rid, j + 1, rate, n))
    return taken
