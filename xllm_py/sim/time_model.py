"""TimeModel: how long one engine step takes, from what the step computes.

    step_ms = base_ms(kind) + prefill_ms_per_token * prompt tokens computed
              + prefill_ms_per_kpair * (prompt token, key) pairs they attend to / 1000
              + decode_ms_per_seq * decoding sequences
              + decode_ms_per_ctx_token * context tokens the decoding sequences attend to

(base: `prefill_base_ms` for a step without decodes, else `decode_base_ms`.) The pairs
term is prompt attention, quadratic in a prompt's length: a chunk of n tokens after s
computed ones attends to n*s + n*(n+1)/2 keys (`attn_pairs`); it is fitted from prompts
of up to 1536 tokens (tiny-25m on one core: 128 tokens 110 ms, 1500 tokens 1.3 s, not
the 0.83 s a linear fit up to 512 tokens predicts). The coefficients are fitted by
non-negative least squares on the steps of a real engine serving workloads (profile.py),
mixed steps included, and stored as JSON with what they were measured on.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

import numpy as np

from xllm_py.cluster.latency_profile import attn_pairs


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
        """From ScheduledSeq-like items (token_ids, start_pos): a one-token step past
        position 0 is a decode, anything else computes prompt tokens."""
        prefill = decodes = ctx = pairs = 0
        for s in seqs:
            n = len(s.token_ids)
            if n == 1 and s.start_pos > 0:
                decodes += 1
                ctx += s.start_pos + 1
            else:
                prefill += n
                pairs += attn_pairs(s.start_pos, n)
        return cls(prefill, decodes, ctx, pairs)


@dataclasses.dataclass(frozen=True)
class TimeModel:
    prefill_base_ms: float
    prefill_ms_per_token: float
    decode_base_ms: float
    decode_ms_per_seq: float
    decode_ms_per_ctx_token: float
    prefill_ms_per_kpair: float = 0.0  # (absent from profiles made before it: 0)
    # What it was measured on (printed by the benchmarks, not used by the model).
    source: dict = dataclasses.field(default_factory=dict)

    def step_ms(self, shape: StepShape) -> float:
        if not shape.num_prefill_tokens and not shape.num_decode_seqs:
            return 0.0
        base = self.decode_base_ms if shape.num_decode_seqs else self.prefill_base_ms
        return (base + self.prefill_ms_per_token * shape.num_prefill_tokens
                + self.prefill_ms_per_kpair * shape.num_prefill_pairs / 1000
                + self.decode_ms_per_seq * shape.num_decode_seqs
                + self.decode_ms_per_ctx_token * shape.num_decode_ctx_tokens)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "TimeModel":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - {"source", "prefill_ms_per_kpair"} - set(d)
        if missing:
            raise ValueError(f"time model profile lacks {sorted(missing)}")
        model = cls(**{k: v for k, v in d.items() if k in names})
        for f in dataclasses.fields(cls):
            v = getattr(model, f.name)
            if f.name != "source" and (not isinstance(v, (int, float)) or v < 0):
                raise ValueError(f"time model {f.name} must be a number >= 0, got {v!r}")
        return model

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "TimeModel":
        try:
            return cls.from_dict(json.loads(pathlib.Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read time model profile {str(path)!r}: {exc}") from None

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(self.to_json() + "\n")


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: drop the most negative one and refit."""
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = np.zeros(x.shape[1])
            out[keep] = np.maximum(coef, 0)
            return out
        keep.pop(int(np.argmin(coef)))


def fit(samples: Sequence[tuple[StepShape, float]], source: dict | None = None) -> TimeModel:
    """Fit the coefficients to (shape, measured ms) pairs, all steps at once (a mixed
    step's time is the sum of its prompt and decode terms)."""
    kinds = {(bool(s.num_prefill_tokens), bool(s.num_decode_seqs)) for s, _ in samples}
    if not {(True, False), (False, True)} <= kinds or len(samples) < 6:
        raise ValueError("need >= 6 step samples, prefill-only and decode-only among them")
    x = np.array([[0.0 if s.num_decode_seqs else 1.0, 1.0 if s.num_decode_seqs else 0.0,
                   s.num_prefill_tokens, s.num_decode_seqs, s.num_decode_ctx_tokens,
                   s.num_prefill_pairs / 1000] for s, _ in samples])
    c = _nonneg_lstsq(x, np.array([ms for _, ms in samples]))
    return TimeModel(prefill_base_ms=float(c[0]), decode_base_ms=float(c[1]),
                     prefill_ms_per_token=float(c[2]), decode_ms_per_seq=float(c[3]),
                     decode_ms_per_ctx_token=float(c[4]), prefill_ms_per_kpair=float(c[5]),
                     source=dict(source or {}))
