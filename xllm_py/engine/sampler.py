"""Sampler: logits [N, V] -> one token id (and optionally logprobs) per row.

Stages, each skipped when no row of the batch needs it:
  1. penalties     repetition (HF: prompt + output), frequency and presence (OpenAI: output)
  2. greedy rows   temperature 0 or top_k 1: argmax of the penalised logits
  3. random rows   temperature, top_k, top_p, min_p -> probs; draw = argmax(probs / Exp(1) noise)
                   seeded rows draw their own noise from (seed, step) only, so a request's
                   tokens do not depend on which other requests share the batch
  4. logprobs      log_softmax of the raw model logits (before penalties and temperature)

The all-greedy batch without penalties or logprobs is a single argmax.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from xllm_py.outputs import TokenLogprob

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5
_MASK64 = (1 << 64) - 1


@dataclasses.dataclass
class SamplingRow:
    """Sampling settings of one row of the logits batch (plain values, no SamplingParams)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # reproducible per request
    # With a seed: the step index, so that the draw is a function of (seed, step) only.
    num_output_tokens_so_far: int = 0
    output_token_ids: Sequence[int] = ()  # frequency / presence penalties
    prompt_token_ids: Sequence[int] = ()  # repetition penalty covers prompt + output
    num_logprobs: int | None = None  # None: no logprobs; k: chosen token's logprob + top-k

    def __post_init__(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.num_logprobs is not None and self.num_logprobs < 0:
            raise ValueError(f"num_logprobs must be None or >= 0, got {self.num_logprobs}")
        if self.num_output_tokens_so_far < 0:
            raise ValueError(
                f"num_output_tokens_so_far must be >= 0, got {self.num_output_tokens_so_far}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


@dataclasses.dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Samples one token per row. `seed` seeds the generator shared by unseeded rows."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows, vocab] with num_rows={len(rows)}, "
                f"got shape {tuple(logits.shape)}")
        # Hot path: greedy, no penalties, no logprobs.
        for row in rows:
            if not row.is_greedy or row.has_penalties or row.num_logprobs is not None:
                break
        else:
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(rows))
        return self._sample_general(logits, rows)

    def _sample_general(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        raw_logits = logits
        logits = logits.float()
        if any(row.has_penalties for row in rows):
            logits = apply_penalties(logits, rows)
        device = logits.device
        num_rows = len(rows)
        random_idx = [i for i, row in enumerate(rows) if not row.is_greedy]
        if len(random_idx) == num_rows:
            token_ids = self._sample_random(logits, rows)
        else:
            token_ids = logits.argmax(dim=-1)
            if random_idx:
                idx = torch.tensor(random_idx, device=device)
                token_ids[idx] = self._sample_random(logits[idx], [rows[i] for i in random_idx])

        logprobs: list[TokenLogprob | None] = [None] * num_rows
        logprob_idx = [i for i, row in enumerate(rows) if row.num_logprobs is not None]
        if logprob_idx:
            for i, entry in zip(logprob_idx, _compute_logprobs(raw_logits, token_ids, rows, logprob_idx)):
                logprobs[i] = entry
        return SamplerOutput(token_ids.tolist(), logprobs)

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Draw from the filtered distribution of each row: argmax(probs / Exp(1))."""
        probs = compute_probs(logits, rows)
        noise = torch.empty_like(probs)
        unseeded = [i for i, row in enumerate(rows) if row.seed is None]
        if len(unseeded) == len(rows):
            noise.exponential_(generator=self._shared_generator(probs.device))
        else:
            if unseeded:
                idx = torch.tensor(unseeded, device=probs.device)
                noise[idx] = torch.empty(
                    (len(unseeded), probs.shape[1]), device=probs.device
                ).exponential_(generator=self._shared_generator(probs.device))
            gen = self._seeded_generator(probs.device)
            for i, row in enumerate(rows):
                if row.seed is not None:
                    gen.manual_seed(_mix_seed(row.seed, row.num_output_tokens_so_far))
                    noise[i].exponential_(generator=gen)
        # exponential_ may return exactly 0; keep the ratio finite.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed & _MASK64)
            self._shared_generators[device] = gen
        return gen

    def _seeded_generator(self, device: torch.device) -> torch.Generator:
        # One generator, re-seeded per row: manual_seed resets its whole state.
        gen = self._seeded_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            self._seeded_generators[device] = gen
        return gen


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Returns a penalised copy of `logits` [N, V] (float32); `logits` is not modified.

    repetition (HF): for tokens in prompt + output, logit / p if logit > 0 else logit * p.
    frequency / presence (OpenAI): logit -= frequency * count_in_output + presence * (count > 0).
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(
            f"logits must be [num_rows, vocab] with num_rows={len(rows)}, "
            f"got shape {tuple(logits.shape)}")
    out = logits.float().clone()
    vocab_size = out.shape[1]
    device = out.device

    rep_idx = [i for i, row in enumerate(rows) if row.repetition_penalty != 1.0]
    if rep_idx:
        seqs = [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in rep_idx]
        present = _token_counts(seqs, vocab_size, device) > 0
        penalty = torch.tensor([rows[i].repetition_penalty for i in rep_idx],
                               dtype=out.dtype, device=device).unsqueeze(1)
        idx = torch.tensor(rep_idx, device=device)
        sub = out[idx]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        out[idx] = torch.where(present, penalised, sub)

    freq_idx = [i for i, row in enumerate(rows)
                if row.frequency_penalty != 0.0 or row.presence_penalty != 0.0]
    if freq_idx:
        counts = _token_counts([list(rows[i].output_token_ids) for i in freq_idx],
                               vocab_size, device)
        frequency = torch.tensor([rows[i].frequency_penalty for i in freq_idx],
                                 dtype=out.dtype, device=device).unsqueeze(1)
        presence = torch.tensor([rows[i].presence_penalty for i in freq_idx],
                                dtype=out.dtype, device=device).unsqueeze(1)
        idx = torch.tensor(freq_idx, device=device)
        out[idx] = out[idx] - frequency * counts - presence * (counts > 0).to(out.dtype)
    return out


def compute_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, then top_k, top_p, min_p filtering; returns probabilities [N, V].

    Filtered-out tokens get probability exactly 0; the rest are renormalised. Rows with
    temperature 0 are treated as temperature 1 here (the sampler takes their argmax instead).
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(
            f"logits must be [num_rows, vocab] with num_rows={len(rows)}, "
            f"got shape {tuple(logits.shape)}")
    device = logits.device
    vocab_size = logits.shape[1]
    temps = [row.temperature if row.temperature >= _SAMPLING_EPS else 1.0 for row in rows]
    logits = logits.float()
    if any(t != 1.0 for t in temps):
        logits = logits / torch.tensor(temps, dtype=logits.dtype, device=device).unsqueeze(1)

    need_top_k = any(0 < row.top_k < vocab_size for row in rows)
    need_top_p = any(row.top_p < 1.0 for row in rows)
    if need_top_k or need_top_p:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
        if need_top_k:
            top_k = torch.tensor([row.top_k if 0 < row.top_k < vocab_size else vocab_size
                                  for row in rows], device=device)
            positions = torch.arange(vocab_size, device=device)
            # Ascending order: the k best are the last k positions.
            sorted_logits = sorted_logits.masked_fill(
                positions.unsqueeze(0) < (vocab_size - top_k).unsqueeze(1), float("-inf"))
        if need_top_p:
            top_p = torch.tensor([row.top_p for row in rows], dtype=logits.dtype, device=device)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # Drop the least likely tokens whose total mass stays within 1 - top_p.
            drop = cumulative <= (1.0 - top_p).unsqueeze(1)
            drop[:, -1] = False  # always keep the most likely token
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)

    probs = logits.softmax(dim=-1)
    if any(row.min_p > 0.0 for row in rows):
        min_p = torch.tensor([row.min_p for row in rows], dtype=probs.dtype, device=device)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        filtered = probs.masked_fill(probs < threshold, 0.0)
        # Renormalise only the rows that use min_p, so other rows stay bit-identical
        # whatever the batch they share.
        probs = torch.where(min_p.unsqueeze(1) > 0.0,
                            filtered / filtered.sum(dim=-1, keepdim=True), probs)
    return probs


def _compute_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                      rows: Sequence[SamplingRow], idx: list[int]) -> list[TokenLogprob]:
    """Chosen token's logprob and the top-k, from log_softmax of the raw model logits."""
    index = torch.tensor(idx, device=raw_logits.device)
    logprobs = torch.log_softmax(raw_logits[index].float(), dim=-1)
    chosen_ids = token_ids[index]
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    max_k = min(max(rows[i].num_logprobs or 0 for i in idx), logprobs.shape[1])
    if max_k > 0:
        top_values, top_ids = logprobs.topk(max_k, dim=-1)  # sorted, best first
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    chosen_ids_list = chosen_ids.tolist()
    result = []
    for j, i in enumerate(idx):
        k = min(rows[i].num_logprobs or 0, max_k)
        top = list(zip(top_ids_list[j][:k], top_values_list[j][:k])) if k else []
        result.append(TokenLogprob(token_id=chosen_ids_list[j], logprob=chosen[j], top=top))
    return result


def _token_counts(seqs: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Per-row occurrence counts [len(seqs), vocab_size] (float32) of the given token ids."""
    max_len = max((len(seq) for seq in seqs), default=0)
    counts = torch.zeros((len(seqs), vocab_size + 1), dtype=torch.float32, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    for seq in seqs:
        if seq and (min(seq) < 0 or max(seq) >= vocab_size):
            raise ValueError(f"token id out of range [0, {vocab_size}) in penalty history")
    # Pad with vocab_size: an extra column that is dropped afterwards.
    padded = torch.tensor([seq + [vocab_size] * (max_len - len(seq)) for seq in seqs],
                          dtype=torch.long, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _mix_seed(seed: int, step: int) -> int:
    """A 64-bit generator seed from (request seed, step): splitmix64 of the pair."""
    x = (seed * 0x9E3779B97F4A7C15 + step) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
