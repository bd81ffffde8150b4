"""Defaults derived from latency profiles: what a cluster started without tuning
flags aims at, and how its engines schedule to get there. One place, read by the engines
(xllm_py/engine/self_profile.py `apply_derived`) and the service (pd_decision.py).

The profiles are the cost of a step on a core of its own (xllm_py/engine/self_profile.py),
so the targets say what the cluster can do, not how loaded the machine is now. The
decode's pace: one step of PACE_SEQS streams of PACE_CTX tokens of context each (a decode
at moderate load; tiny-25m: ~18 ms).
  TPOT target       TPOT_OVER_PACE x the pace of the slowest decode (~23 ms on tiny-25m;
                    the mixed-workload runs routed at 25 ms).
  TTFT target       TTFT_OVER_ALONE x a TTFT_REF_TOKENS-token prompt (or the longest the
                    instance takes) computed alone on the slowest prefill (no prefill: the
                    decodes): the longest prompt meets it behind half of another (~2.7 s
                    on tiny-25m).
  guard target      the decode's TPOT guard keeps its streams within GUARD_SHARE of the
                    TPOT target (~16 ms on tiny-25m, as measured best in the mixed-workload runs: the rest
                    is the slack for the prompts it lets through at the hold limit and for
                    bursts of streams, which no holding prevents; ~15 ms).
  hold limit        a prompt the guard holds goes anyway after HOLD_SHARE of the TTFT
                    target (it then still meets the target; ~1.6 s).
  decode holding    the service steps around a decode whose prompt has waited a third of
                    that decode's hold limit (the prompts held there go together later).
  decode chunk cap  prompt tokens per step beside streams: the power of two nearest the
                    tokens three steps at the guard's target pay for (64 on tiny-25m,
                    as the mixed-workload runs ran).
  prefill budget    a prefill's step token budget: the largest power of two whose step
                    takes at most PREFILL_STEP_SHARE of the TTFT target (512 on tiny-25m:
                    a short prompt behind a long one waits one such step for its turn in
                    the deadline order, not the long prompt's whole prefill).
Torch-free: the service imports it.
"""
from __future__ import annotations

import math
from typing import Iterable

from xllm_py.cluster.latency_profile import LatencyProfile, attn_pairs

PACE_SEQS = 8
PACE_CTX = 1024
TPOT_OVER_PACE = 1.25
TTFT_REF_TOKENS = 2048
TTFT_OVER_ALONE = 1.5
GUARD_SHARE = 0.65
HOLD_SHARE = 0.6
HOLDING_SHARE = 1.0 / 3.0
PREFILL_STEP_SHARE = 0.2
CHUNK_STEPS = 3.0
MIN_BUDGET, MAX_BUDGET = 64, 2048
MIN_CHUNK, MAX_CHUNK = 16, 512


def decode_pace_ms(p: LatencyProfile) -> float:
    return p.decode_step_ms(PACE_SEQS, PACE_SEQS * PACE_CTX)


def tpot_target_ms(decodes: Iterable[LatencyProfile]) -> float:
    """The TPOT target the profiles of these decode instances support (0: none given)."""
    return max((TPOT_OVER_PACE * decode_pace_ms(p) for p in decodes), default=0.0)


def ttft_target_ms(prefills: Iterable[LatencyProfile]) -> float:
    """The TTFT target the profiles of the instances computing prompts support."""
    def alone(p: LatencyProfile) -> float:
        n = min(TTFT_REF_TOKENS, p.max_model_len or TTFT_REF_TOKENS)
        return p.prefill_ms(n)

    return max((TTFT_OVER_ALONE * alone(p) for p in prefills), default=0.0)


def guard_target_ms(p: LatencyProfile) -> float:
    """The TPOT guard's target on a decode of profile `p`."""
    return GUARD_SHARE * tpot_target_ms([p])


def hold_limit_ms(p: LatencyProfile) -> float:
    """How long the TPOT guard of an instance of profile `p` holds a prompt at most."""
    return HOLD_SHARE * ttft_target_ms([p])


def decode_holding_ms(p: LatencyProfile) -> float:
    """When the service counts a decode as holding prompts (0: it does not hold them)."""
    return HOLDING_SHARE * p.prompt_hold_max_ms


def decode_chunk_cap(p: LatencyProfile) -> int:
    """Prompt tokens a decode computes per step beside its streams."""
    if p.prefill_ms_per_token <= 0:
        return MAX_CHUNK
    tokens = CHUNK_STEPS * guard_target_ms(p) / p.prefill_ms_per_token
    return min(MAX_CHUNK, max(MIN_CHUNK, 2 ** round(math.log2(max(1.0, tokens)))))


def prefill_step_budget(p: LatencyProfile, least: int = MIN_BUDGET) -> int:
    """A prefill instance's step token budget (at least `least`: its max_num_seqs)."""
    limit = PREFILL_STEP_SHARE * ttft_target_ms([p])
    n = MAX_BUDGET
    while n > MIN_BUDGET and p.step_ms(n, 0, 0) + p.prefill_ms_per_kpair * attn_pairs(0, n) / 1000 > limit:
        n //= 2
    return max(n, least)
