"""Speculator: which running sequences propose guesses this step, and what their
verification leaves in the KV cache.

Proposers: a request with a `prediction` (OpenAI's Predicted Outputs) guesses from it
(prediction.py), whatever the engine's method, even with none configured; the others by
the configured method (ngram.py, suffix.py: its engine-wide cache takes the outputs of
requests that end here), or not at all.

Per step (`propose`): each sequence's guesses are worth what its running rate of kept
guesses says and cost what the engine's decode steps say a row costs (step_cost.py:
fitted from its own steps; before that the latency profile; with neither, every guess
is verified); `plan_guesses` keeps the rows that raise the step's expected tokens per ms,
so a compute-bound step (a large batch) verifies few guesses or none, a prediction's too
(the client asked for speed: rows that cost more than they emit would slow it).
Per sequence: any decode but a PD prefill's hand-over (each guess row is sampled as a
one-token step would sample that position: verify.py), at most as many guesses as
max_tokens and the context leave room for, under a grammar only those it accepts (cut
at the first it refuses or that completes it), and none while its rate has fallen below
MIN_ACCEPTANCE: it rests, then tries again, each rest twice as long as the last, up to
MAX_REST_STEPS (back to FIRST_REST_STEPS once a verify keeps every guess). A sequence
the step's price leaves out does not rest: the price changes with the batch, so it asks
again the next step, and after PRICED_OUT_STEPS in a row it verifies a short probe (its
rate may be better than the one the price hid).

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
from xllm_py.engine.spec_decode.step_cost import StepCost, plan_guesses
from xllm_py.engine.spec_decode.suffix import SuffixCache, SuffixProposer
from xllm_py.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# A sequence's rate of kept guesses before it has verified any: the method's so far, and
# this before the method has any (optimistic: a new sequence gets its chance).
PRIOR_RATE = 0.8
MIN_ACCEPTANCE = 0.25
_CACHED_ENDS = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
EWMA_WEIGHT = 0.3
FIRST_REST_STEPS = 4
MAX_REST_STEPS = 64
PROBE_TOKENS = 2  # guesses of the step after a rest (at most)
PRICED_OUT_STEPS = FIRST_REST_STEPS
# Guesses a step from a prediction: an edit's prediction is mostly kept, so more pay than
# the lookup methods' default (within SpeculativeConfig.MAX_TOKENS).
PREDICTION_TOKENS = 8
PREDICTION = "prediction"  # the method label of guesses from a prediction


@dataclasses.dataclass
class _SeqState:
    method: str
    proposer: NgramIndex | PredictionLookup | SuffixProposer
    rate: float  # EWMA of the rate a guess is kept at (given those before it were)
    rest_left: int = 0  # steps without proposing
    rest_next: int = FIRST_REST_STEPS
    rested: bool = False  # a rest ended: the next proposal is verified whatever its rate
    priced_out: int = 0  # steps in a row the step's price left it out
    # guessed tokens kept and not kept (a prediction's: the request's usage reports them)
    accepted: int = 0
    rejected: int = 0

    def rest(self, floor: float) -> None:
        """No guesses for the next rest_next steps (each rest twice the last, up to
        MAX_REST_STEPS), then one probe; the rate at least twice `floor` (a fresh
        chance) from then on."""
        self.rest_left, self.rest_next = self.rest_next, min(2 * self.rest_next, MAX_REST_STEPS)
        self.rested = True
        self.rate = max(self.rate, min(2 * floor, 1.0))


@dataclasses.dataclass
class SpecStats:
    """Counters per method (Prometheus: xllm_spec_decode_*_tokens_total)."""

    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0  # sequence-steps that carried guesses
    rejections: int = 0  # verify steps that refused a guess (each ends one)
    # guesses kept in a verify step -> sequence-steps (xllm_spec_decode_acceptance_length)
    acceptance_lengths: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def rate(self) -> float:
        """The rate a guess was kept at, given those before it were (PRIOR_RATE: none yet)."""
        trials = self.accepted + self.rejections
        return self.accepted / trials if trials else PRIOR_RATE


class Speculator:
    def __init__(self, config: SpeculativeConfig | None,
                 profile: Callable[[], object | None] = lambda: None) -> None:
        """`config`: the engine's method (None: only requests with a prediction guess).
        `profile`: the engine's latency profile once it has one (cluster/latency_profile.py
        LatencyProfile: step_ms(prompt tokens, decode seqs, context tokens)), else None.
        `step_cost` is to be told every step (the engine's step observers)."""
        self.config = config
        # per method (the configured one from the start, "prediction" once used)
        self.stats: dict[str, SpecStats] = {config.method: SpecStats()} if config else {}
        self._suffix_cache = (SuffixCache(config.suffix_decoding_max_cached_requests)
                              if config and config.method == "suffix" else None)
        self._profile = profile
        self.step_cost = StepCost()
        self._seqs: weakref.WeakKeyDictionary[Request, _SeqState] = weakref.WeakKeyDictionary()

    def step_price(self, decodes: list[Request]) -> tuple[float, float] | None:
        """(ms of a step of `decodes` without guesses, ms a guess row adds), or None: not
        known yet (step_cost.py), or not asked (cost_aware false: every guess verified)."""
        if self.config is not None and not self.config.cost_aware:
            return None
        fit = self.step_cost.fit()
        if fit is not None:
            base, per_row = fit
            return base + per_row * len(decodes), per_row
        profile = self._profile()
        if profile is None:
            return None
        ctx = sum(r.num_tokens for r in decodes)
        return profile.step_ms(0, len(decodes), ctx), profile.prefill_ms_per_token

    def propose(self, decodes: list[Request], max_model_len: int) -> dict[str, list[int]]:
        """Guesses per request id of the decoding sequences that speculate this step."""
        if not decodes:
            return {}
        price = self.step_price(decodes)
        # a rate at or below this bar: not even a first guess pays (plan_guesses)
        bar = price[1] * len(decodes) / price[0] if price and price[0] > 0 else 0.0
        drafted: dict[str, list[int]] = {}
        candidates: list[tuple[str, int, float]] = []
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
            probe = state.rested
            if price is not None and state.rate <= bar and not probe:
                # (not worth a row at this step's price: no rest, which would outlast
                # the batch that priced it out; skipping costs nothing, as it comes
                # before proposing)
                state.priced_out += 1
                if state.priced_out <= PRICED_OUT_STEPS:
                    continue
                probe = True
            state.priced_out = 0
            state.rested = False
            drafts = state.proposer.propose(
                request.output_token_ids if predicted else request.all_token_ids, k)
            if drafts and request.grammar is not None:
                drafts = drafts[:request.grammar.num_guessable(drafts)]
            if drafts and probe:  # (first and short: it tells a rate the price hid)
                drafts = drafts[:PROBE_TOKENS]
            if drafts:
                drafted[request.request_id] = drafts
                candidates.append((request.request_id, len(drafts),
                                   1.0 if probe else state.rate))
        if price is None or not candidates:
            return drafted
        base_ms, per_row = price
        counts = plan_guesses(candidates, len(decodes), base_ms, per_row)
        for rid, _, _ in candidates:  # (a priced sequence keeps what the plan gives it)
            n = counts.get(rid, 0)
            if n:
                drafted[rid] = drafted[rid][:n]
            else:
                del drafted[rid]
        return drafted

    def settle(self, request: Request, num_drafts: int, num_kept: int, num_emitted: int,
               kv) -> None:
        """After a verify step in which the model kept `num_kept` of `num_drafts` guesses
        and `num_emitted` tokens were appended (fewer than num_kept + 1 where a stop token
        or the length cap came first, which refuses no guess): count them, keep KV up to
        the last token before the newest, roll back the rest (`kv`: the scheduler's
        KVCacheManager), before the request may end."""
        accepted = num_kept
        refused = int(accepted < num_drafts)
        state = self._seqs[request]
        stats = self.stats.setdefault(state.method, SpecStats())
        stats.proposed += num_drafts
        stats.accepted += accepted
        stats.rejections += refused
        stats.verify_steps += 1
        stats.acceptance_lengths[accepted] = stats.acceptance_lengths.get(accepted, 0) + 1
        shown = min(accepted, num_emitted)  # (the guesses in the output, for its usage)
        state.accepted += shown
        state.rejected += num_drafts - shown
        state.rate += EWMA_WEIGHT * (accepted / (accepted + refused) - state.rate)
        if not refused:  # (its guesses are good again: a later rest starts short)
            state.rest_next = FIRST_REST_STEPS
        if state.rate < MIN_ACCEPTANCE:
            state.rest(MIN_ACCEPTANCE)
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
                method, proposer = PREDICTION, PredictionLookup(prediction[:max_model_len])
            elif self._suffix_cache is not None:
                method, proposer = cfg.method, SuffixProposer(
                    self._suffix_cache, cfg.suffix_decoding_max_tree_depth,
                    cfg.suffix_decoding_min_token_prob, cfg.suffix_decoding_max_spec_factor)
            else:
                method, proposer = cfg.method, NgramIndex(cfg.prompt_lookup_min,
                                                          cfg.prompt_lookup_max)
            # (a prediction is the request's own text: other requests' say nothing of it)
            stats = self.stats.get(method) if method != PREDICTION else None
            state = _SeqState(method, proposer, stats.rate if stats else PRIOR_RATE)
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
