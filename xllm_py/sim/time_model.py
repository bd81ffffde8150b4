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
non-negative least squares (xllm_py/cluster/step_cost_fit.py) on the steps of a real
engine serving workloads (profile.py), mixed steps included, and stored as JSON with what
they were measured on.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

from xllm_py.cluster.latency_profile import attn_pairs  # noqa: F401 - re-exported
from xllm_py.cluster.step_cost_fit import StepShape, fit_step_costs


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


def fit(samples: Sequence[tuple[StepShape, float]], source: dict | None = None) -> TimeModel:
    """Fit the coefficients to (shape, measured ms) pairs, all steps at once (a mixed
    step's time is the sum of its prompt and decode terms; xllm_py/cluster/step_cost_fit.py)."""
    return TimeModel(**fit_step_costs(samples), source=dict(source or {}))
