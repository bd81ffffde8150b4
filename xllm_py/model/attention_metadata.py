"""AttentionMetadata: what one step's ragged batch looks like to the paged attention.

Hybrid models (model/kv_groups.py) have a block table per KV group: ``block_tables`` and
``slot_mapping`` are group 0's, ``group_tables`` / ``group_slots`` those of groups 1..
(``for_group`` gives the metadata a layer of group j attends with). Without them every
layer uses group 0's (one group; or a warm-up step of made-up tables).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    query_start_loc: torch.Tensor  # [B+1] int64, token offsets of each sequence
    seq_lens: torch.Tensor  # [B] int64, context incl. the new tokens
    context_lens: torch.Tensor  # [B] int64, tokens already cached before this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    max_query_len: int
    max_seq_len: int
    group_slots: torch.Tensor | None = None  # [G-1, T]: KV groups 1..
    group_tables: torch.Tensor | None = None  # [G-1, B, max_blocks]

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata of KV group ``group`` (its slots and tables)."""
        if group == 0 or self.group_slots is None:
            return self
        return dataclasses.replace(self, slot_mapping=self.group_slots[group - 1],
                                   block_tables=self.group_tables[group - 1],
                                   group_slots=None, group_tables=None)

    @classmethod
    def build(cls, seqs: Sequence[tuple[int, int, Sequence[int]]], block_size: int,
              device: torch.device | str = "cpu",
              group_tables: Sequence[Sequence[Sequence[int]]] | None = None
              ) -> "AttentionMetadata":
        """Build from ``(start_pos, num_new_tokens, block_table)`` per sequence.

        Token ``i`` of a sequence sits at position ``start_pos + i``; its slot is taken from
        ``block_table[pos // block_size]``. ``group_tables``: per sequence, the tables of
        KV groups 1.. (each as long as its block_table).
        """
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not seqs:
            raise ValueError("AttentionMetadata.build needs at least one sequence")
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        ctx_lens: list[int] = []
        tables: list[list[int]] = []
        for i, (start, n, table) in enumerate(seqs):
            if start < 0 or n <= 0:
                raise ValueError(
                    f"sequence {i}: start_pos must be >= 0 and num_new_tokens > 0, "
                    f"got ({start}, {n})")
            end = start + n
            if len(table) * block_size < end:
                raise ValueError(
                    f"sequence {i}: block table of {len(table)} blocks holds "
                    f"{len(table) * block_size} tokens, needs {end}")
            for pos in range(start, end):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            ctx_lens.append(start)
            tables.append(list(table))
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        g_slots = g_tables = None
        if group_tables is not None:
            num_groups = len(group_tables[0])
            gs: list[list[int]] = [[] for _ in range(num_groups)]
            gt: list[list[list[int]]] = [[] for _ in range(num_groups)]
            for (start, n, _), seq_groups in zip(seqs, group_tables):
                for j, table in enumerate(seq_groups):
                    gs[j].extend(table[p // block_size] * block_size + p % block_size
                                 for p in range(start, start + n))
                    gt[j].append(list(table) + [0] * (width - len(table)))
            g_slots, g_tables = as_t(gs), as_t(gt)
        return cls(
            slot_mapping=as_t(slots),
            query_start_loc=as_t(qsl),
            seq_lens=as_t(seq_lens),
            context_lens=as_t(ctx_lens),
            block_tables=as_t(padded),
            max_query_len=max(n for _, n, _ in seqs),
            max_seq_len=max(seq_lens),
            group_slots=g_slots,
            group_tables=g_tables,
        )

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def build_positions(seqs: Sequence[tuple[int, int, Sequence[int]]],
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions [T] for the same ``(start_pos, num_new_tokens, block_table)`` list."""
    pos: list[int] = []
    for start, n, _ in seqs:
        pos.extend(range(start, start + n))
    return torch.tensor(pos, dtype=torch.int64, device=device)
