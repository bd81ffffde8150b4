"""ModelRunner: SchedulerOutput -> input tensors -> model forward -> logits of the sampled rows.

The only module of the engine that touches the model and torch tensors for the forward pass.
Logits rows: the last token of each sequence that samples, plus, for a prefill chunk that
scores its prompt (ScheduledSeq.num_prompt_logprob_rows > 0), its leading tokens whose
next token is a prompt token; a speculating seq (spec_token_ids) samples at its last known
token and returns its guesses' rows as well (StepLogits.spec): a step of decodes and such
verify chunks runs as decode rows (`_decode_rows`). The model computes the last layer and
the LM head for those rows only, so a step without prompt logprobs does exactly what it did before. A step whose
only logits rows are the sampled ones and guesses leaves the LM head to the sampler
(StepLogits.sample is then the rows before the head, model/lm_head.py HeadRows: greedy rows
take their argmax inside the head, without their 262,144-float rows on Gemma 3).
"""
from __future__ import annotations

import array
import dataclasses
import itertools
import logging
from typing import Sequence

import torch

from xllm_py.model.attention import AttentionMetadata
from xllm_py.model.lm_head import HeadRows

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepLogits:
    """Float32 logits of one step."""

    # [num_sampled, vocab], in the order of the sampled seqs; HeadRows (the same rows before
    # the LM head: the sampler takes them) when the step has no other logits rows
    sample: torch.Tensor | HeadRows | None
    # (index of the seq in the step, [num_prompt_logprob_rows, vocab]): row i is the
    # logits at position start_pos + i of that seq, in the order of the seqs
    prompt: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)
    # (index of the seq in the step, [len(spec_token_ids), vocab]): the logits at each guess
    # (HeadRows where `sample` is: a step without prompt logprob rows)
    spec: list[tuple[int, torch.Tensor | HeadRows]] = dataclasses.field(default_factory=list)
    # With guesses: `sample` then every `spec` block, one tensor (they are views of it)
    sample_and_spec: torch.Tensor | HeadRows | None = None

    def sample_logits(self) -> torch.Tensor | None:
        """``sample`` as a float32 logits tensor."""
        return self.sample.logits() if isinstance(self.sample, HeadRows) else self.sample


def _rows(logits: torch.Tensor | HeadRows, lo: int, hi: int) -> torch.Tensor | HeadRows:
    return logits.rows(lo, hi) if isinstance(logits, HeadRows) else logits[lo:hi]


def _num_prompt_rows(seq) -> int:
    return getattr(seq, "num_prompt_logprob_rows", 0)


def _num_spec(seq) -> int:
    return len(getattr(seq, "spec_token_ids", ()))


@dataclasses.dataclass(frozen=True)
class _DecodeRow:
    """One token of a verify chunk as a decode of its own (the fields _prepare_decode reads)."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    group_tables: list[list[int]] | None


def _decode_rows(seqs: Sequence) -> list:
    """A step of decodes and verify chunks as decode rows: a chunk's token j a decode at its
    position, its context the tokens before it. Each layer stores every row's K/V before
    any row attends (the kernels' order), so row j reads the chunk's tokens before it from
    the cache, as the one-token step at that position does; the step keeps the decode
    path (model/fused_decode.py, gemma3_decode.py) and its floats."""
    rows: list = []
    for s in seqs:
        if not _num_spec(s):
            rows.append(s)
            continue
        tables = _group_tables(s)
        rows.extend(_DecodeRow([t], s.start_pos + j, s.block_table, s.sample and j == 0, tables)
                    for j, t in enumerate(s.token_ids))
    return rows


def _group_tables(seq) -> list | None:
    """Hybrid models: the seq's tables of KV groups 1.. (ScheduledSeq.group_tables)."""
    return getattr(seq, "group_tables", None)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: str = "cpu") -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self._arange: dict[int, torch.Tensor] = {}  # query_start_loc of n one-token seqs

    def execute(self, seqs: Sequence) -> torch.Tensor | None:
        """Run one step over `seqs` (ScheduledSeq-like: token_ids, start_pos, block_table,
        sample). Returns float32 logits [num_sampled, vocab] in the order of the sampled
        seqs, or None when nothing is sampled this step."""
        return self.execute_step(seqs).sample_logits()

    @torch.inference_mode()
    def execute_step(self, seqs: Sequence) -> StepLogits:
        """`execute`, plus the logits of the prompt-scoring rows of seqs that ask for them
        (optional attribute `num_prompt_logprob_rows`)."""
        if not seqs:
            return StepLogits(None)
        if all(len(s.token_ids) == 1 for s in seqs):
            ids_t, pos_t, meta, sample_idx = self._prepare_decode(seqs)
        elif all(len(s.token_ids) == 1 + _num_spec(s) and not _num_prompt_rows(s) for s in seqs):
            ids_t, pos_t, meta, sample_idx = self._prepare_decode(_decode_rows(seqs))
        else:
            ids_t, pos_t, meta, sample_idx = self._prepare_mixed(seqs)
        # (seq index, number of rows) of the seqs that score their prompt
        prompt_seqs = [(i, n) for i, s in enumerate(seqs) if (n := _num_prompt_rows(s))]
        spec_seqs = [(i, n) for i, s in enumerate(seqs) if (n := _num_spec(s))]
        prompt_rows: list[int] = []
        if prompt_seqs or spec_seqs:
            starts = list(itertools.accumulate((len(s.token_ids) for s in seqs), initial=0))
            for i, n in spec_seqs:  # (the guesses: the seq's last rows)
                prompt_rows.extend(range(starts[i + 1] - n, starts[i + 1]))
            for i, n in prompt_seqs:
                prompt_rows.extend(range(starts[i], starts[i] + n))
        rows = sample_idx + prompt_rows
        keep = None
        if prompt_rows or len(sample_idx) < ids_t.shape[0]:  # only these rows reach the logits
            keep = torch.tensor(rows, dtype=torch.long, device=self.device)
        if not rows:
            self.model(ids_t, pos_t, meta, self.kv_caches, keep_rows=keep)
            return StepLogits(None)
        num_sampled = len(sample_idx)
        if not prompt_seqs and hasattr(self.model, "forward_head"):
            head = self.model.forward_head(ids_t, pos_t, meta, self.kv_caches, keep_rows=keep)
            if not spec_seqs:
                return StepLogits(head)
            # (guess rows too: a greedy verify step takes every row's argmax in the head)
            logits = head
        else:
            logits = self.model.forward_logits(ids_t, pos_t, meta, self.kv_caches,
                                               keep_rows=keep).float()
        out = StepLogits(_rows(logits, 0, num_sampled) if num_sampled else None)
        offset = num_sampled
        for i, n in spec_seqs:
            out.spec.append((i, _rows(logits, offset, offset + n)))
            offset += n
        if spec_seqs:
            out.sample_and_spec = _rows(logits, 0, offset)
        for i, n in prompt_seqs:
            out.prompt.append((i, logits[offset:offset + n]))
            offset += n
        return out

    def _prepare_decode(self, seqs: Sequence) -> tuple[torch.Tensor, torch.Tensor,
                                                       AttentionMetadata, list[int]]:
        """All seqs decode one token: the metadata without per-token loops, every int64
        array of the step in one buffer (one tensor made, the rest are views of it)."""
        bs = self.block_size
        n = len(seqs)
        width = max(len(s.block_table) for s in seqs)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        tables: list[int] = []
        sample_idx: list[int] = []
        for i, s in enumerate(seqs):
            p = s.start_pos
            table = s.block_table
            if p < 0 or len(table) * bs <= p:
                raise ValueError(f"sequence {i}: position {p} outside its block table of "
                                 f"{len(table)} blocks")
            ids.append(s.token_ids[0])
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            tables.extend(table)
            if len(table) < width:
                tables.extend([0] * (width - len(table)))
            if s.sample:
                sample_idx.append(i)
        lens = [p + 1 for p in pos]
        flat = torch.frombuffer(array.array("q", ids + pos + lens + slots + tables),
                                dtype=torch.int64)
        if flat.device != self.device:
            flat = flat.to(self.device)
        ids_t, pos_t, lens_t, slots_t = (flat[k * n:(k + 1) * n] for k in range(4))
        qsl = self._arange.get(n)
        if qsl is None:
            qsl = self._arange[n] = torch.arange(n + 1, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=slots_t, query_start_loc=qsl, seq_lens=lens_t, context_lens=pos_t,
            block_tables=flat[4 * n:].view(n, width), max_query_len=1,
            max_seq_len=max(pos) + 1)
        if _group_tables(seqs[0]) is not None:
            meta.group_slots, meta.group_tables = self._group_arrays(seqs, width)
        return ids_t, pos_t, meta, sample_idx

    def _group_arrays(self, seqs: Sequence, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's slots [G-1, n] and tables [G-1, n, width] of KV groups 1..
        (hybrid models)."""
        bs = self.block_size
        slots: list[int] = []
        tables: list[int] = []
        for j in range(len(seqs[0].group_tables)):
            for s in seqs:
                table = s.group_tables[j]
                slots.append(table[s.start_pos // bs] * bs + s.start_pos % bs)
                tables.extend(table)
                tables.extend([0] * (width - len(table)))
        n, g = len(seqs), len(seqs[0].group_tables)
        flat = torch.frombuffer(array.array("q", slots + tables), dtype=torch.int64)
        if flat.device != self.device:
            flat = flat.to(self.device)
        return flat[:g * n].view(g, n), flat[g * n:].view(g, n, width)

    def _prepare_mixed(self, seqs: Sequence) -> tuple[torch.Tensor, torch.Tensor,
                                                      AttentionMetadata, list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        sample_idx: list[int] = []
        for seq in seqs:
            n = len(seq.token_ids)
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + n))
            if seq.sample:  # (a speculating seq: at its last known token)
                sample_idx.append(len(input_ids) - 1 - _num_spec(seq))
        meta = AttentionMetadata.build(
            [(s.start_pos, len(s.token_ids), s.block_table) for s in seqs],
            self.block_size, self.device,
            [s.group_tables for s in seqs] if _group_tables(seqs[0]) is not None else None)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids_t, pos_t, meta, sample_idx
