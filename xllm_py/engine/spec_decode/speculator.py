"""Speculator: which running sequences propose guesses this step, and what their
verification leaves in the KV cache.

Proposers: a request with a `prediction` (OpenAI's Predicted Outputs) guesses from it
(prediction.py), whatever the engine's method, even with none configured; the others by
the configured method (ngram.py, suffix.py: its engine-wide cache takes the outputs of
requests that end here), or not at all.

Per step (`propose`): none above `max_batch` decoding sequences (the step is compute
bound there: each guess costs about what a token of prompt costs, and pays only while
the step's fixed cost dominates; derived from the engine's latency profile where it has
one, else DEFAULT_MAX_BATCH). Per sequence: any decode but a PD prefill's hand-over
(each guess row is sampled as a one-token step would sample that position: verify.py),
at most as many guesses as max_tokens and the context leave room for, under a grammar
only those it accepts (cut at the first it refuses or that completes it), and none
while its acceptance has fallen (an EWMA of accepted / proposed below MIN_ACCEPTANCE: it rests, then tries again, each rest twice
as long as the last, up to MAX_REST_STEPS).

After the verify step (`settle`): the accepted tokens were appended; KV is valid up to
the last of them, the rejected guesses' slots are rolled back (num_computed_tokens, the
blocks past the sequence freed) before any full block is hashed into the prefix cache.

Pure Python: no torch.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Callable

from xllm_py.speculative_config import SpeculativeConfig
from xllm_py.engine.spec_decode.ngram import NgramIndex
from xllm_py.engine.spec_decode.prediction import PredictionLookup
from xllm_py.engine.spec_decode.suffix import SuffixCache, SuffixProposer
from xllm_py.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# Decoding sequences above which no one speculates without a latency profile: from
# benchmarks/bench_spec.py on gemma-3-270m (2-core VM): at 4 sequences the verify rows
# still paid on repetitive text (1.60x tok/s), not on open text (0.92x).
DEFAULT_MAX_BATCH = 8
# Acceptance assumed when the cut-off is derived from a latency profile (a guess is kept
# with this probability): conservative for the repetitive text speculation is for.
PROFILE_ACCEPTANCE = 0.5
MIN_ACCEPTANCE = 0.25
_CACHED_ENDS = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
EWMA_WEIGHT = 0.3
FIRST_REST_STEPS = 4
MAX_REST_STEPS = 64
# Guesses a step from a prediction: an edit's prediction is mostly kept, so more pay than
# the lookup methods' default (within SpeculativeConfig.MAX_TOKENS).
PREDICTION_TOKENS = 8
PREDICTION = "prediction"  # the method label of guesses from a prediction


@dataclasses.dataclass
class _SeqState:
    method: str
    proposer: NgramIndex | PredictionLookup | SuffixProposer
    acceptance: float = 1.0  # EWMA of accepted / proposed
    rest_left: int = 0  # steps without proposing
    rest_next: int = FIRST_REST_STEPS
    # guessed tokens kept and not kept (a prediction's: the request's usage reports them)
    accepted: int = 0
    rejected: int = 0


@dataclasses.dataclass
class SpecStats:
    """Counters per method (Prometheus: xllm_spec_decode_*_tokens_total)."""

    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0  # sequence-steps that carried guesses
    # guesses kept in a verify step -> sequence-steps (xllm_spec_decode_acceptance_length)
    acceptance_lengths: dict[int, int] = dataclasses.field(default_factory=dict)


class Speculator:
    def __init__(self, config: SpeculativeConfig | None,
                 profile: Callable[[], object | None] = lambda: None,
                 max_num_seqs: int = 64) -> None:
        """`config`: the engine's method (None: only requests with a prediction guess).
        `profile`: the engine's latency profile once it has one (cluster/latency_profile.py
        LatencyProfile: step_ms(prompt tokens, decode seqs, context tokens)), else None."""
        self.config = config
        # per method (the configured one from the start, "prediction" once used)
        self.stats: dict[str, SpecStats] = {config.method: SpecStats()} if config else {}
        self._suffix_cache = (SuffixCache(config.suffix_decoding_max_cached_requests)
                              if config and config.method == "suffix" else None)
        self._profile = profile
        self._max_num_seqs = max_num_seqs
        self._cut: tuple[object, int] | None = None  # (profile, max batch derived from it)
        self._seqs: weakref.WeakKeyDictionary[Request, _SeqState] = weakref.WeakKeyDictionary()

    @property
    def max_batch(self) -> int:
        profile = self._profile()
        if profile is None:
            return DEFAULT_MAX_BATCH
        if self._cut is None or self._cut[0] is not profile:
            self._cut = (profile, max_batch_from_profile(
                profile, self.config.num_speculative_tokens if self.config else PREDICTION_TOKENS,
                self._max_num_seqs))
        return self._cut[1]

    def propose(self, decodes: list[Request], max_model_len: int) -> dict[str, list[int]]:
        """Guesses per request id of the decoding sequences that speculate this step."""
        if not decodes or len(decodes) > self.max_batch:
            return {}
        out: dict[str, list[int]] = {}
        for request in decodes:
            predicted = bool(request.sampling_params.prediction_token_ids)
            if not (predicted or self.config) or not speculates(request):
                continue
            k = PREDICTION_TOKENS if predicted else self.config.num_speculative_tokens
            k = min(k, max_model_len - request.num_tokens - 1)
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                k = min(k, max_tokens - request.num_output_tokens - 1)
            if k <= 0:
                continue
            state = self._state(request, max_model_len)
            if state.rest_left > 0:
                state.rest_left -= 1
                continue
            drafts = state.proposer.propose(
                request.output_token_ids if predicted else request.all_token_ids, k)
            if drafts and request.grammar is not None:
                drafts = drafts[:request.grammar.num_guessable(drafts)]
            if drafts:
                out[request.request_id] = drafts
        return out

    def settle(self, request: Request, num_drafts: int, num_emitted: int, kv) -> None:
        """After a verify step that appended `num_emitted` tokens for `num_drafts` guesses:
        count them, keep KV up to the last token before the newest, roll back the rest
        (`kv`: the scheduler's KVCacheManager), before the request may end."""
        accepted = num_emitted - 1
        state = self._seqs[request]
        stats = self.stats.setdefault(state.method, SpecStats())
        stats.proposed += num_drafts
        stats.accepted += accepted
        stats.verify_steps += 1
        stats.acceptance_lengths[accepted] = stats.acceptance_lengths.get(accepted, 0) + 1
        state.accepted += accepted
        state.rejected += num_drafts - accepted
        state.acceptance += EWMA_WEIGHT * (accepted / num_drafts - state.acceptance)
        if state.acceptance < MIN_ACCEPTANCE:
            state.rest_left, state.rest_next = state.rest_next, min(2 * state.rest_next,
                                                                    MAX_REST_STEPS)
            state.acceptance = MIN_ACCEPTANCE * 2  # a fresh chance after the rest
        request.num_computed_tokens = request.num_tokens - 1
        kv.truncate(request, -(-request.num_tokens // kv.block_size))
        kv.cache_full_blocks(request)

    def prediction_usage(self, request: Request) -> tuple[int, int] | None:
        """A request with a prediction: its guessed tokens kept and not kept so far."""
        state = self._seqs.get(request)
        if state is None or state.method != PREDICTION:
            return None
        return state.accepted, state.rejected

    def _state(self, request: Request, max_model_len: int) -> _SeqState:
        state = self._seqs.get(request)
        if state is None:
            prediction, cfg = request.sampling_params.prediction_token_ids, self.config
            if prediction:  # (no longer than any output can be)
                state = _SeqState(PREDICTION, PredictionLookup(prediction[:max_model_len]))
            elif self._suffix_cache is not None:
                state = _SeqState(cfg.method, SuffixProposer(
                    self._suffix_cache, cfg.suffix_decoding_max_tree_depth,
                    cfg.suffix_decoding_min_token_prob, cfg.suffix_decoding_max_spec_factor))
            else:
                state = _SeqState(cfg.method,
                                  NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max))
            self._seqs[request] = state
        return state

    def finished(self, request: Request) -> None:
        """A request ended here: suffix decoding caches its output (not a failed or
        aborted one's, nor a PD prefill's single token)."""
        if (self._suffix_cache is not None and request.status in _CACHED_ENDS
                and not request.remote_decode):
            self._suffix_cache.add(request.request_id, request.output_token_ids)


def speculates(request: Request) -> bool:
    """Whether a decoding request may verify guesses: each guess row is sampled as a
    one-token step samples that position (its history, bias, grammar state, logprobs:
    verify.py), each of n sequences is its own request, and a decode has its prompt
    logprobs already; so any but a PD prefill's hand-over (one token, then the decode
    peer goes on)."""
    return not request.remote_decode


def max_batch_from_profile(profile, k: int, max_num_seqs: int, ctx: int = 512) -> int:
    """The largest batch whose step with k guesses per sequence, divided by the tokens it
    is expected to emit (1 + PROFILE_ACCEPTANCE * k each), costs less than a plain step."""
    best = 0
    for batch in range(1, max_num_seqs + 1):
        plain = profile.step_ms(0, batch, batch * ctx)
        spec = profile.step_ms(k * batch, batch, batch * ctx) / (1 + PROFILE_ACCEPTANCE * k)
        if spec < plain:
            best = batch
    return best
