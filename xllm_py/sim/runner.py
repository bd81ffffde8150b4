"""SimulatedRunner and SimulatedSampler: the ModelRunner / Sampler seams of the engine
step (LLMEngine.step) with the forward replaced by a time model.

execute_step(seqs): write each computed token's payload into the KV pool -> check that a
decoding sequence's previous position is in the pool (a lost KV transfer shows here) ->
the next token of each sampled sequence, a function of (last token, position) only, so
PD and MIX give the same tokens and reruns the same -> sleep for the rest of the
modelled step time (or, with `burn_cpu`, spend it on the CPU: the modelled time is the
real step's CPU time, so a burning simulator waits for a shared core as the real engine
does; validate.py compares them that way). The sampler passes those tokens through (no logprobs, no prompt
logprobs: a request that asks for them gets none).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from typing import Sequence

from xllm_py.sim.storage import SimKVStorage
from xllm_py.sim.time_model import StepShape, TimeModel

logger = logging.getLogger(__name__)

_BURN = bytes(16 * 1024)  # ~10 us of CPU per hash


def next_token(last_token: int, position: int, vocab: Sequence[int]) -> int:
    """The simulated model: a deterministic token from the last one and its position."""
    h = (last_token * 1_000_003 + position * 7_919 + 12_345) * 2_654_435_761 % (1 << 32)
    return vocab[h % len(vocab)]


class SimulatedRunner:
    def __init__(self, time_model: TimeModel, storage: SimKVStorage,
                 vocab: Sequence[int], burn_cpu: bool = False) -> None:
        if not vocab:
            raise ValueError("the simulated model needs at least one token to emit")
        self.time_model = time_model
        self.storage = storage
        self.vocab = list(vocab)
        self.num_kv_misses = 0  # decode steps that found their previous position missing
        self.busy_s = 0.0  # modelled forward time, summed
        self.burn_cpu = burn_cpu  # spend the modelled time on the CPU instead of sleeping

    def execute_step(self, seqs: Sequence) -> SimulatedStepLogits:
        """ModelRunner.execute_step: `sample` holds the sampled seqs' next tokens."""
        return SimulatedStepLogits(self.execute(seqs))

    def execute(self, seqs: Sequence) -> list[int] | None:
        if not seqs:
            return None
        t0, c0 = time.monotonic(), time.thread_time()
        step_s = self.time_model.step_ms(StepShape.of(seqs)) / 1000
        sampled: list[int] = []
        for s in seqs:
            if s.start_pos > 0 and not self.storage.holds_position(s.block_table,
                                                                   s.start_pos - 1):
                self.num_kv_misses += 1
                logger.error("simulated KV missing: request %s has no KV for position %d "
                             "(a transfer or the prefix cache lost a block)", s.request_id,
                             s.start_pos - 1)
            self.storage.write_tokens(s.block_table, s.start_pos, s.token_ids)
            if s.sample:
                sampled.append(next_token(s.token_ids[-1],
                                          s.start_pos + len(s.token_ids) - 1, self.vocab))
        self.busy_s += step_s
        if self.burn_cpu:  # (hashing a buffer releases the GIL, as a torch forward does)
            while time.thread_time() - c0 < step_s:
                hashlib.sha256(_BURN)
        else:
            left = step_s - (time.monotonic() - t0)
            if left > 0:
                time.sleep(left)
        return sampled or None


@dataclasses.dataclass
class SimulatedStepLogits:  # (model_runner.StepLogits: tokens instead of logits)
    sample: list[int] | None
    prompt: list = dataclasses.field(default_factory=list)
    spec: list = dataclasses.field(default_factory=list)  # (no speculation simulated)


@dataclasses.dataclass
class SimulatedSamplerOutput:
    token_ids: list[int]
    logprobs: list[None]


class SimulatedSampler:
    """The runner chose the tokens already: hand them on (one per sampled row)."""

    def __call__(self, tokens: list[int], rows: Sequence, mask: object = None
                 ) -> SimulatedSamplerOutput:
        if len(tokens) != len(rows):
            raise ValueError(f"{len(tokens)} simulated tokens for {len(rows)} rows")
        return SimulatedSamplerOutput(list(tokens), [None] * len(tokens))
