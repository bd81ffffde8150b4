"""TpotGuard: how many prompt tokens a step may carry beside running streams.

An engine that computes prompts while it decodes (a DECODE that prefills short prompts
itself, conditional disaggregation; a MIX) puts the prompt's cost on the step
every running stream waits for. A cap on the prompt tokens per step bounds the stall of
one step, not what a stream's mean time per output token (TPOT, what an SLO counts)
ends at: a burst of short prompts computed back to back adds one chunk after another to
the same streams, and their mean TPOT climbs with every chunk.

With a target T, a step carries prompt tokens only while every decoding stream is
predicted to end within T a token on average:

    elapsed_i + n * c_tok + rem_i * c_step <= T * (done_i + rem_i)

where elapsed_i is the time since the stream's first step here, done_i the tokens it
produced since, rem_i the tokens it has left (its max_tokens, at most `horizon` of them:
a stream may stop early), c_step a decode step's cost and c_tok a prompt token's, both
moving averages of this engine's own steps. A stream's slack is what it saved against T
so far plus what it will save; a prompt chunk spends it on every stream at once. Prompts
held so wait for streams to end or save up; one held `max_hold_s` goes anyway (a TTFT
target is worth more than a stream's margin under its TPOT target). Below `min_chunk`
tokens a chunk is not worth its step: none is taken. Before the costs are measured
(the first steps) nothing is held.

Pure Python, no torch. The scheduler tells it what happens, on its clock: a prompt
queued (`queued`), a step begun (`begin_step`, with its size once chosen: `size_step`) and
ended (`end_step`), a request gone (`forget`); and asks `prompt_tokens_allowed`.
"""
from __future__ import annotations

import dataclasses
import math

# Weight of a new measurement in the moving averages of the step costs.
COST_ALPHA = 0.2


@dataclasses.dataclass
class _Stream:
    start_s: float  # its first step here ended (its first token here)
    tokens: int = 0  # tokens produced since start_s


@dataclasses.dataclass
class Stream:
    """What the guard needs of one decoding stream at schedule time."""
    request_id: str
    tokens_left: int | None  # max_tokens - produced; None: no max_tokens


class TpotGuard:
    def __init__(self, target_ms: float, horizon_tokens: int = 64,
                 max_hold_ms: float = 1000.0, min_chunk: int = 16) -> None:
        if target_ms <= 0:
            raise ValueError(f"target_ms must be positive, got {target_ms}")
        if horizon_tokens <= 0 or min_chunk <= 0 or max_hold_ms < 0:
            raise ValueError("horizon_tokens and min_chunk must be positive, max_hold_ms >= 0")
        self.target_s = target_ms / 1000.0
        self.horizon = horizon_tokens
        self.max_hold_s = max_hold_ms / 1000.0
        self.min_chunk = min_chunk
        self.step_s: float | None = None  # a decode-only step
        self.token_s: float | None = None  # one prompt token beside the streams
        self._streams: dict[str, _Stream] = {}
        self._queued_s: dict[str, float] = {}  # prompts: when queued here
        self._step_began_s = 0.0
        self._step_size = (0, 0)  # decode tokens, prompt tokens of the step under way
        self.num_held = 0  # steps that held a prompt back (metric, tests)
        # why the last prompt_tokens_allowed answered so (the engine's --step-trace):
        # "unmeasured", "hold limit", "held", "too small" or "slack"
        self.last_decision = ""
        self.step_estimates: tuple[float | None, float | None] = (None, None)

    def retarget(self, target_ms: float, max_hold_ms: float) -> None:
        """New target and hold limit (derived from a latency profile corrected since)."""
        if target_ms <= 0 or max_hold_ms < 0:
            raise ValueError("target_ms must be positive, max_hold_ms >= 0")
        self.target_s, self.max_hold_s = target_ms / 1000.0, max_hold_ms / 1000.0

    # -- what the scheduler tells it -------------------------------------------------
    def queued(self, request_id: str, now_s: float) -> None:
        self._queued_s[request_id] = now_s

    def begin_step(self, now_s: float) -> None:
        self._step_began_s = now_s
        self.last_decision = ""  # (not asked this step unless prompt_tokens_allowed runs)
        self.step_estimates = (self.step_s, self.token_s)  # what this step is decided on

    def size_step(self, decode_tokens: int, prompt_tokens: int) -> None:
        self._step_size = (decode_tokens, prompt_tokens)

    def end_step(self, now_s: float, sampled_ids) -> None:
        """The step begun last ended at `now_s`; `sampled_ids`: the requests it gave a token."""
        decode_tokens, prompt_tokens = self._step_size
        self.observe_step(now_s - self._step_began_s, prompt_tokens, decode_tokens)
        for request_id in sampled_ids:
            self.stream_token(request_id, now_s)

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._queued_s.pop(request_id, None)

    def oldest_wait_s(self, now_s: float, request_ids) -> float:
        """How long the longest-waiting of these prompts has waited (inf: one not queued
        here, e.g. preempted and back: it is not held)."""
        return now_s - min((self._queued_s.get(r, -math.inf) for r in request_ids),
                           default=now_s)

    # -- what the steps measure ------------------------------------------------------
    def observe_step(self, duration_s: float, prompt_tokens: int, decode_seqs: int) -> None:
        """A step of `decode_seqs` decode tokens and `prompt_tokens` prompt tokens took
        `duration_s`. Steps without streams teach nothing (their cost is no stall)."""
        if decode_seqs == 0 or duration_s <= 0:
            return
        if prompt_tokens == 0:
            self.step_s = _ema(self.step_s, duration_s)
        elif self.step_s is not None:
            per_token = max(0.0, duration_s - self.step_s) / prompt_tokens
            self.token_s = _ema(self.token_s, per_token)

    def stream_token(self, request_id: str, now_s: float) -> None:
        """A decoding stream produced a token at `now_s` (its first one here starts it)."""
        s = self._streams.get(request_id)
        if s is None:
            self._streams[request_id] = _Stream(now_s)
        else:
            s.tokens += 1

    # -- the decision ----------------------------------------------------------------
    def prompt_tokens_allowed(self, now_s: float, streams: list[Stream],
                              oldest_prompt_wait_s: float) -> int | None:
        """Prompt tokens this step may carry beside `streams` (None: no limit from the
        guard; 0: hold the prompts). `oldest_prompt_wait_s`: how long the longest-waiting
        prompt has waited here."""
        if not streams or self.step_s is None or self.token_s is None:
            self.last_decision = "unmeasured"
            return None
        if oldest_prompt_wait_s >= self.max_hold_s:
            self.last_decision = "hold limit"
            return None
        slack = math.inf
        for st in streams:
            s = self._streams.get(st.request_id)
            rem = (self.horizon if st.tokens_left is None
                   else max(1, min(st.tokens_left, self.horizon)))
            if s is None:  # not stepped here yet: nothing saved or spent
                elapsed, done = 0.0, 0
            else:
                elapsed, done = max(0.0, now_s - s.start_s), s.tokens
            slack = min(slack, self.target_s * (done + rem) - elapsed - rem * self.step_s)
        if slack <= 0:
            self.num_held += 1
            self.last_decision = "held"
            return 0
        n = int(slack / self.token_s) if self.token_s > 0 else 1 << 30
        if n < self.min_chunk:
            self.num_held += 1
            self.last_decision = "too small"
            return 0
        self.last_decision = "slack"
        return n


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + COST_ALPHA * (new - old)
