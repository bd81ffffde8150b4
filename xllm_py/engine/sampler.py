"""Sampler: logits [N, V] -> one token id (and optionally logprobs) per row.

Stages, each skipped when no row of the batch needs it:
  1. logit bias    the request's token id -> bias added to the logits (vLLM v1 order:
                   before the penalties)
  2. penalties     repetition (HF: prompt + output), frequency and presence (OpenAI: output)
  2b. grammar      rows with a structured-output constraint: disallowed tokens -inf
                   (structured/token_mask.py; a batch without one has no mask at all)
  3. greedy rows   temperature 0 or top_k 1: argmax of the biased, penalised logits
  4. random rows   temperature, top_k, top_p, min_p -> probs; inverse-CDF draw of one uniform
                   seeded rows draw their uniform from (seed, step) only, so a request's
                   tokens do not depend on which other requests share the batch
  5. logprobs      log_softmax of the raw model logits (before bias, penalties and
                   temperature: vLLM v1's default logprobs_mode "raw_logprobs")

The all-greedy batch without bias, penalties or logprobs is a single argmax. Given the
step's rows before the LM head (model/lm_head.py HeadRows, what the engine's ModelRunner
returns), such a batch takes the argmax inside the head, without its logits; any other
batch has its logits computed and goes through the stages above. Random rows draw natively where the
kernels are loaded (csrc/sample.c: the same distribution and draw, by selection instead of
a sort of the whole row), else through `compute_probs`.
`prompt_logprobs` scores prompt tokens from the raw logits of the positions before them.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from xllm_py.model.lm_head import HeadRows, sample_rows
from xllm_py.outputs import TokenLogprob
from xllm_py.sampling_params import GREEDY_EPS, SamplingParams
from xllm_py.structured.token_mask import TokenMask, apply_token_mask, masked_greedy

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


@dataclasses.dataclass
class SamplingRow:
    """One row of the logits batch: the request's SamplingParams as the request carries
    them (the sampler reads them in place), and the token history of the request that its
    penalties and seeded draws need."""

    params: SamplingParams
    # With a seed: the step index, so that the draw is a function of (seed, step) only.
    num_output_tokens_so_far: int = 0
    output_token_ids: Sequence[int] = ()  # frequency / presence penalties
    prompt_token_ids: Sequence[int] = ()  # repetition penalty covers prompt + output

    @property
    def is_greedy(self) -> bool:
        return self.params.is_greedy or self.params.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.params.has_penalties

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing else to compute: the token is the raw logits' argmax."""
        return (self.is_greedy and not self.has_penalties and self.params.logprobs is None
                and not self.params.edits_logits)


@dataclasses.dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Samples one token per row. `seed` seeds the generator shared by unseeded rows."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._shared_gen: torch.Generator | None = None
        # One CPU generator for seeded rows, re-seeded per row (manual_seed resets its state).
        self._seeded_generator = torch.Generator()

    def __call__(self, logits: torch.Tensor | HeadRows, rows: list[SamplingRow],
                 mask: TokenMask | None = None) -> SamplerOutput:
        """`logits` [N, V], or the rows before the LM head (HeadRows). `mask`: the grammar
        masks of the rows with a structured-output constraint. On the greedy hot path only
        rows whose argmax the grammar refuses are masked (copies of them); elsewhere the
        mask is applied to a copy, so logprobs stay those of the raw logits."""
        if isinstance(logits, HeadRows):
            return self._sample_head(logits, rows, mask)
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows, vocab] with num_rows={len(rows)}, "
                f"got shape {tuple(logits.shape)}")
        # Hot path: greedy, no bias, no penalties, no logprobs (a mask: masked_greedy).
        for row in rows:
            if not row.argmax_only:
                break
        else:
            if (logits.device.type == "cpu" and logits.dtype == torch.float32
                    and not logits.requires_grad):  # numpy: no thread-pool hand-off
                ids = logits.numpy().argmax(axis=-1).tolist()
            else:
                ids = logits.argmax(dim=-1).tolist()
            if mask is not None:
                ids = masked_greedy(logits, ids, mask)
            return SamplerOutput(ids, [None] * len(rows))
        return self._sample_general(logits, rows, mask)

    def _sample_head(self, head: HeadRows, rows: list[SamplingRow],
                     mask: TokenMask | None) -> SamplerOutput:
        """A batch of argmax-only rows: their tokens from inside the LM head. Any other
        batch: every row's logits, in one pass over the head's weights (two passes, one
        for the argmax rows and one for the others, would stream the weights twice)."""
        if len(head) != len(rows):
            raise ValueError(f"logits must be [num_rows, vocab] with num_rows={len(rows)}, "
                             f"got shape {head.shape}")
        if mask is None and all(row.argmax_only for row in rows):
            return SamplerOutput(head.argmax(), [None] * len(rows))
        return self(head.logits(), rows, mask)

    def _sample_general(self, logits: torch.Tensor, rows: list[SamplingRow],
                        mask: TokenMask | None = None) -> SamplerOutput:
        raw_logits = logits
        logits = logits.float()
        if any(row.params.logit_bias for row in rows):
            logits = apply_logit_bias(logits, rows)
        if any(row.params.allowed_token_ids or row.params.bad_words_token_ids for row in rows):
            logits = apply_token_limits(logits.clone() if logits is raw_logits else logits, rows)
        if any(row.has_penalties for row in rows):
            logits = apply_penalties(logits, rows)
        if mask is not None:  # on a copy: logprobs are of the raw logits
            logits = apply_token_mask(logits.clone() if logits is raw_logits else logits, mask)
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
        logprob_idx = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if logprob_idx:
            entries = _compute_logprobs(raw_logits, token_ids, rows, logprob_idx)
            for i, entry in zip(logprob_idx, entries):
                logprobs[i] = entry
        return SamplerOutput(token_ids.tolist(), logprobs)

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Inverse-CDF draw, in vocabulary order, from the filtered distribution of each row.

        One uniform per row, drawn on the CPU: from the shared generator for unseeded rows,
        from a generator seeded with (seed, step) for seeded rows.
        """
        unseeded = [i for i, row in enumerate(rows) if row.params.seed is None]
        uniforms = [0.0] * len(rows)
        if unseeded:
            for i, u in zip(unseeded, torch.rand(len(unseeded), dtype=torch.float64,
                                                 generator=self._shared_generator).tolist()):
                uniforms[i] = u
        if len(unseeded) < len(rows):
            gen = self._seeded_generator
            for i, row in enumerate(rows):
                if row.params.seed is not None:
                    gen.manual_seed(_mix_seed(row.params.seed, row.num_output_tokens_so_far))
                    uniforms[i] = torch.rand(1, dtype=torch.float64, generator=gen).item()
        vocab_size = logits.shape[1]
        ids = sample_rows(
            logits, [p.temperature if p.temperature >= GREEDY_EPS else 1.0
                     for p in (row.params for row in rows)],
            [row.params.top_k if 0 < row.params.top_k < vocab_size else 0 for row in rows],
            [row.params.top_p for row in rows], [row.params.min_p for row in rows], uniforms)
        if ids is not None:
            return torch.tensor(ids, dtype=torch.long)
        probs = compute_probs(logits, rows)
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        target = torch.tensor(uniforms, dtype=cdf.dtype, device=cdf.device).unsqueeze(1) * total
        # Rounding may lift u * total to total: keep it strictly below.
        target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
        # First index whose cdf exceeds the target: zero-probability tokens are never chosen.
        return torch.searchsorted(cdf, target, right=True).squeeze(1)

    @property
    def _shared_generator(self) -> torch.Generator:
        if self._shared_gen is None:
            self._shared_gen = torch.Generator()
            if self._seed is None:
                self._shared_gen.seed()
            else:
                self._shared_gen.manual_seed(self._seed & _MASK64)
        return self._shared_gen


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Returns a copy of `logits` [N, V] (float32) with each row's logit_bias added."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(
            f"logits must be [num_rows, vocab] with num_rows={len(rows)}, "
            f"got shape {tuple(logits.shape)}")
    vocab_size = logits.shape[1]
    row_idx: list[int] = []
    token_idx: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary "
                                 f"of {vocab_size} tokens")
            row_idx.append(i)
            token_idx.append(token_id)
            biases.append(float(bias))
    out = logits.float().clone()
    device = out.device
    out[torch.tensor(row_idx, device=device), torch.tensor(token_idx, device=device)] += (
        torch.tensor(biases, dtype=out.dtype, device=device))
    return out


def apply_token_limits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """`logits` [N, V] (modified in place) with -inf at the tokens a row may not sample:
    those outside its allowed_token_ids, and the last token of each bad word whose other
    tokens end the row's output so far."""
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        allowed = row.params.allowed_token_ids
        if allowed:
            keep = torch.zeros(vocab_size, dtype=torch.bool, device=logits.device)
            keep[torch.tensor([t for t in allowed if t < vocab_size], dtype=torch.long,
                              device=logits.device)] = True
            logits[i].masked_fill_(~keep, float("-inf"))
        output = row.output_token_ids
        banned = [seq[-1] for seq in row.params.bad_words_token_ids
                  if seq[-1] < vocab_size and (len(seq) == 1 or (
                      len(output) >= len(seq) - 1
                      and list(output[len(output) - len(seq) + 1:]) == seq[:-1]))]
        if banned:
            logits[i, torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


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

    rep_idx = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if rep_idx:
        seqs = [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in rep_idx]
        present = _token_counts(seqs, vocab_size, device) > 0
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in rep_idx],
                               dtype=out.dtype, device=device).unsqueeze(1)
        idx = torch.tensor(rep_idx, device=device)
        sub = out[idx]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        out[idx] = torch.where(present, penalised, sub)

    freq_idx = [i for i, row in enumerate(rows)
                if row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0]
    if freq_idx:
        counts = _token_counts([list(rows[i].output_token_ids) for i in freq_idx],
                               vocab_size, device)
        frequency = torch.tensor([rows[i].params.frequency_penalty for i in freq_idx],
                                 dtype=out.dtype, device=device).unsqueeze(1)
        presence = torch.tensor([rows[i].params.presence_penalty for i in freq_idx],
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
    temps = [row.params.temperature if row.params.temperature >= GREEDY_EPS else 1.0 for row in rows]
    logits = logits.float()
    if any(t != 1.0 for t in temps):
        logits = logits / torch.tensor(temps, dtype=logits.dtype, device=device).unsqueeze(1)

    top_k = [row.params.top_k if 0 < row.params.top_k < vocab_size else vocab_size for row in rows]
    need_top_k = any(k < vocab_size for k in top_k)
    need_top_p = any(row.params.top_p < 1.0 for row in rows)
    if need_top_k or need_top_p:
        max_k = max(top_k)
        if max_k < vocab_size:  # every row has a top_k: no full sort
            values, indices = logits.topk(max_k, dim=-1)  # best first
        else:
            values, indices = logits.sort(dim=-1, descending=True)
        if need_top_k:
            positions = torch.arange(values.shape[1], device=device)
            k = torch.tensor(top_k, device=device)
            values = values.masked_fill(positions.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))
        if need_top_p:
            top_p = torch.tensor([row.params.top_p for row in rows], dtype=values.dtype, device=device)
            # Keep a token while the mass of the better tokens is below top_p * total: a
            # sequential prefix sum, so a row's result does not depend on the batch's width.
            weights = (values - values[:, :1]).exp()
            cumulative = weights.cumsum(dim=-1)
            before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)
            drop = before >= top_p.unsqueeze(1) * cumulative[:, -1:]
            drop &= (top_p < 1.0).unsqueeze(1)
            drop[:, 0] = False  # the best token always stays (top_p 1e-300 is 0 in float32)
            values = values.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, indices, values)

    probs = logits.softmax(dim=-1)
    if any(row.params.min_p > 0.0 for row in rows):
        min_p = torch.tensor([row.params.min_p for row in rows], dtype=probs.dtype, device=device)
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
    max_k = min(max(rows[i].params.logprobs or 0 for i in idx), logprobs.shape[1])
    top_values_list: list[list[float]] = []
    top_ids_list: list[list[int]] = []
    if max_k > 0:
        top_values, top_ids = logprobs.topk(max_k, dim=-1)  # sorted, best first
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    chosen_ids_list = chosen_ids.tolist()
    result = []
    for j, i in enumerate(idx):
        k = min(rows[i].params.logprobs or 0, max_k)
        top = list(zip(top_ids_list[j][:k], top_values_list[j][:k])) if k else []
        result.append(TokenLogprob(token_id=chosen_ids_list[j], logprob=chosen[j], top=top))
    return result


# Prompt rows scored per log_softmax: bounds the float32 copy of a long prompt's logits.
_PROMPT_ROWS_PER_PASS = 512


def prompt_logprobs(logits: torch.Tensor, target_ids: Sequence[int],
                    num_top: int) -> list[TokenLogprob]:
    """Row i of `logits` [R, V] (raw model logits at one position) scores `target_ids[i]`,
    the prompt token after that position: its float32 log_softmax value and the `num_top`
    most likely tokens, best first."""
    if logits.dim() != 2 or logits.shape[0] != len(target_ids):
        raise ValueError(
            f"logits must be [num_targets, vocab] with num_targets={len(target_ids)}, "
            f"got shape {tuple(logits.shape)}")
    num_top = min(num_top, logits.shape[1])
    result: list[TokenLogprob] = []
    for lo in range(0, len(target_ids), _PROMPT_ROWS_PER_PASS):
        hi = min(lo + _PROMPT_ROWS_PER_PASS, len(target_ids))
        logprobs = torch.log_softmax(logits[lo:hi].float(), dim=-1)
        targets = torch.tensor(target_ids[lo:hi], dtype=torch.long, device=logprobs.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        if num_top > 0:
            top_values, top_ids = logprobs.topk(num_top, dim=-1)  # sorted, best first
            tops = [list(zip(ids, values))
                    for ids, values in zip(top_ids.tolist(), top_values.tolist())]
        else:
            tops = [[] for _ in range(hi - lo)]
        result.extend(TokenLogprob(token_id=t, logprob=lp, top=top)
                      for t, lp, top in zip(target_ids[lo:hi], chosen, tops))
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


def request_row(request) -> SamplingRow:
    """A request's row (its SamplingParams as they are), made once and kept on the request;
    its output count kept current. The penalties read the request's own token lists, which
    grow in place."""
    row = request.sampling_row
    if row is None:
        p = request.sampling_params
        history = p.reads_history
        row = SamplingRow(p, output_token_ids=request.output_token_ids if history else (),
                          prompt_token_ids=request.prompt_token_ids if history else ())
        request.sampling_row = row
    row.num_output_tokens_so_far = len(request.output_token_ids)
    return row
