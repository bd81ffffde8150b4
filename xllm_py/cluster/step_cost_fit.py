"""The step-cost fit: what a step computes (`StepShape`) and the least-squares fit of the
latency profile's coefficients to measured steps (`fit_step_costs`).

Used by the engine's start-up self-profile (xllm_py/engine/self_profile.py) and by the
simulator's `python -m xllm_py.sim.profile` (xllm_py/sim/time_model.py). Pure Python (no
numpy, no torch): a few dozen samples of six terms, solved by Householder QR on columns
scaled to unit norm, with non-negative coefficients (the most negative one is dropped and
the rest refitted, until none is negative).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from xllm_py.cluster.latency_profile import attn_pairs

# The fitted coefficients, in the order of `_row`'s columns.
TERMS = ("prefill_base_ms", "decode_base_ms", "prefill_ms_per_token", "decode_ms_per_seq",
         "decode_ms_per_ctx_token", "prefill_ms_per_kpair")


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What a step computes: prompt tokens (and the keys they attend to), decoding
    sequences, their summed context."""

    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_decode_ctx_tokens: int = 0
    num_prefill_pairs: int = 0

    @classmethod
    def of(cls, seqs: Sequence) -> "StepShape":
        """From ScheduledSeq-like items (token_ids, start_pos, spec_token_ids): a
        one-token step past position 0 is a decode, its speculative guesses rows that
        cost as prompt tokens do (so a step verifying guesses is a mixed one), anything
        else computes prompt tokens."""
        prefill = decodes = ctx = pairs = 0
        for s in seqs:
            n = len(s.token_ids)
            guesses = len(getattr(s, "spec_token_ids", ()))
            if n - guesses == 1 and s.start_pos > 0:
                decodes += 1
                ctx += s.start_pos + 1
                if guesses:
                    prefill += guesses
                    pairs += attn_pairs(s.start_pos + 1, guesses)
            else:
                prefill += n
                pairs += attn_pairs(s.start_pos, n)
        return cls(prefill, decodes, ctx, pairs)


def _row(s: StepShape) -> list[float]:
    return [0.0 if s.num_decode_seqs else 1.0, 1.0 if s.num_decode_seqs else 0.0,
            float(s.num_prefill_tokens), float(s.num_decode_seqs),
            float(s.num_decode_ctx_tokens), s.num_prefill_pairs / 1000]


def _lstsq(rows: list[list[float]], y: list[float], cols: list[int]) -> list[float]:
    """Least squares over columns `cols` (Householder QR); a column that carries nothing
    (all zero, or dependent on the others) gets 0."""
    norms = [math.sqrt(sum(r[c] ** 2 for r in rows)) for c in cols]
    a = [[r[c] / n if n else 0.0 for c, n in zip(cols, norms)] for r in rows]
    b = list(y)
    m, k = len(a), len(cols)
    diag: list[float] = []
    for j in range(min(m, k)):
        alpha = math.sqrt(sum(a[i][j] ** 2 for i in range(j, m)))
        if alpha < 1e-12:
            diag.append(0.0)
            continue
        if a[j][j] > 0:
            alpha = -alpha
        v = [0.0] * j + [a[i][j] for i in range(j, m)]
        v[j] -= alpha
        vv = sum(x * x for x in v[j:])
        for col in range(j, k):
            d = sum(v[i] * a[i][col] for i in range(j, m)) * 2 / vv
            for i in range(j, m):
                a[i][col] -= d * v[i]
        d = sum(v[i] * b[i] for i in range(j, m)) * 2 / vv
        for i in range(j, m):
            b[i] -= d * v[i]
        diag.append(a[j][j])
    x = [0.0] * k
    for j in reversed(range(min(m, k))):
        if abs(diag[j]) < 1e-9:
            continue
        x[j] = (b[j] - sum(a[j][c] * x[c] for c in range(j + 1, k))) / a[j][j]
    return [xj / n if n else 0.0 for xj, n in zip(x, norms)]


def fit_step_costs(samples: Sequence[tuple[StepShape, float]]) -> dict[str, float]:
    """The profile's coefficients (TERMS) fitted to (shape, measured ms) pairs, all steps at
    once (a mixed step's time is the sum of its prompt and decode terms), each >= 0.
    ValueError without prompt-only and decode-only steps among >= 6."""
    kinds = {(bool(s.num_prefill_tokens), bool(s.num_decode_seqs)) for s, _ in samples}
    if not {(True, False), (False, True)} <= kinds or len(samples) < 6:
        raise ValueError("need >= 6 step samples, prefill-only and decode-only among them")
    rows = [_row(s) for s, _ in samples]
    y = [float(ms) for _, ms in samples]
    keep = list(range(len(TERMS)))
    while True:
        coef = _lstsq(rows, y, keep)
        if all(c >= 0 for c in coef) or len(keep) == 1:
            out = [0.0] * len(TERMS)
            for c, v in zip(keep, coef):
                out[c] = max(0.0, v)
            return dict(zip(TERMS, out))
        keep.pop(min(range(len(coef)), key=coef.__getitem__))
