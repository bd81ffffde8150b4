"""LatencyProfile: what one engine step costs on an instance, as the instance registers it
(the `latency_profile` of its InstanceMeta) for the service's SLO_AWARE routing.

    step_ms = base + prefill_ms_per_token * prompt tokens computed
              + prefill_ms_per_kpair * (prompt token, key) pairs they attend to / 1000
              + decode_ms_per_seq * decoding sequences
              + decode_ms_per_ctx_token * context tokens those sequences attend to

(base: `prefill_base_ms` for a step without decodes, else `decode_base_ms`.) The JSON is
the simulator's time model (`xllm_py.sim.time_model.TimeModel`, written by
`python -m xllm_py.sim.profile --out PROFILE.json`): the same keys (the pairs term
optional: 0 in older files) and an optional `source`, so one profile file serves both; an engine loads it with `--latency-profile`.
From it, TTFT as a function of uncached prompt tokens (`prefill_ms`: the prompt's chunks,
each riding a step with the running decodes) and TPOT as a function of the running
batch and its context (`decode_step_ms`).

Torch-free and numpy-free: the service (xllm_service) reads it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

def attn_pairs(start: int, n: int) -> int:
    """(query, key) pairs of `n` prompt tokens computed after `start` others (causal)."""
    return n * start + n * (n + 1) // 2 if n > 0 else 0


KEYS = ("prefill_base_ms", "prefill_ms_per_token", "decode_base_ms", "decode_ms_per_seq",
        "decode_ms_per_ctx_token")


@dataclasses.dataclass(frozen=True)
class LatencyProfile:
    prefill_base_ms: float
    prefill_ms_per_token: float
    decode_base_ms: float
    decode_ms_per_seq: float
    decode_ms_per_ctx_token: float
    # Prompt attention (quadratic in a prompt's length); 0 in profiles made before it.
    prefill_ms_per_kpair: float = 0.0
    # Step token budget of the instance (its --max-num-batched-tokens): prompt chunk size.
    max_num_batched_tokens: int = 2048
    # Prompt tokens per step while sequences decode (--max-prefill-tokens-while-decoding;
    # 0: the whole budget): the chunk size beside running streams.
    max_prefill_tokens_while_decoding: int = 0
    # The longest context the instance takes (its --max-model-len; 0: unknown), and how
    # long its TPOT guard holds a prompt back at most (0: no guard): what the service
    # derives its defaults from (xllm_py/cluster/slo_defaults.py).
    max_model_len: int = 0
    prompt_hold_max_ms: float = 0.0
    # The mean time a token its TPOT guard keeps its streams within while it computes
    # prompts beside them (0: no guard): how the service predicts a prompt it sends there.
    prompt_tpot_target_ms: float = 0.0

    def step_ms(self, prefill_tokens: int, decode_seqs: int, decode_ctx_tokens: int) -> float:
        if prefill_tokens <= 0 and decode_seqs <= 0:
            return 0.0
        base = self.decode_base_ms if decode_seqs > 0 else self.prefill_base_ms
        return (base + self.prefill_ms_per_token * max(0, prefill_tokens)
                + self.decode_ms_per_seq * max(0, decode_seqs)
                + self.decode_ms_per_ctx_token * max(0, decode_ctx_tokens))

    def prefill_ms(self, tokens: int, decode_seqs: int = 0, decode_ctx_tokens: int = 0,
                   pairs: int | None = None) -> float:
        """Time to compute `tokens` prompt tokens in chunks of the step budget (less the
        running decodes' tokens), each chunk in a step with the running decodes; `pairs`:
        the (token, key) pairs they attend to (default: one prompt from position 0)."""
        if tokens <= 0:
            return 0.0
        if pairs is None:
            pairs = attn_pairs(0, tokens)
        chunk = self.prompt_chunk(decode_seqs)
        full, last = divmod(tokens, chunk)
        ms = full * self.step_ms(chunk, decode_seqs, decode_ctx_tokens)
        if last:
            ms += self.step_ms(last, decode_seqs, decode_ctx_tokens)
        return ms + self.prefill_ms_per_kpair * pairs / 1000

    def prompt_chunk(self, decode_seqs: int) -> int:
        """Prompt tokens in one step beside `decode_seqs` decoding sequences."""
        chunk = max(1, self.max_num_batched_tokens - decode_seqs)
        if decode_seqs > 0 and self.max_prefill_tokens_while_decoding > 0:
            chunk = min(chunk, self.max_prefill_tokens_while_decoding)
        return chunk

    def decode_step_ms(self, decode_seqs: int, decode_ctx_tokens: int) -> float:
        """One decode step of `decode_seqs` sequences attending to `decode_ctx_tokens`."""
        return self.step_ms(0, max(1, decode_seqs), decode_ctx_tokens)

    # ------------------------------------------------------------------ wire
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LatencyProfile":
        """From the JSON of a profile (a TimeModel's keys; `source` and unknown keys are
        ignored); ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"latency profile must be a JSON object, got {type(data).__name__}")
        missing = [k for k in KEYS if k not in data]
        if missing:
            raise ValueError(f"latency profile lacks {missing}")
        values: dict[str, Any] = {}
        for key in (*KEYS, "prefill_ms_per_kpair", "prompt_hold_max_ms",
                    "prompt_tpot_target_ms"):  # (0 in older ones)
            v = data.get(key, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 \
                    or math.isinf(v):
                raise ValueError(f"latency profile {key} must be a number >= 0, got {v!r}")
            values[key] = float(v)
        budgets: dict[str, int] = {}
        for key, default, least in (("max_num_batched_tokens", 2048, 1),
                                    ("max_prefill_tokens_while_decoding", 0, 0),
                                    ("max_model_len", 0, 0)):
            v = data.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"latency profile {key} must be an integer >= {least}, "
                                 f"got {v!r}")
            budgets[key] = v
        return cls(**values, **budgets)

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "LatencyProfile":
        try:
            return cls.from_dict(json.loads(pathlib.Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read latency profile {str(path)!r}: {exc}") from None
