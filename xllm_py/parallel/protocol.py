"""What rank 0 broadcasts to the other ranks: one command per message.

A message is a fixed header ``int64[HEADER_LEN]`` (command + sizes) and, for a step, one
int64 payload holding every index tensor of the step back to back::

    ids[T] positions[T] slot_mapping[T] query_start_loc[B+1] seq_lens[B]
    context_lens[B] block_tables[B*W] keep_rows[K] group_slots[(G-1)*T]
    group_tables[(G-1)*B*W]

(the last two: KV groups 1.. of a hybrid model, header[8] = G - 1; model/kv_groups.py).

Two broadcasts per step whatever its size; the receivers rebuild the same
``AttentionMetadata`` views from the payload.
"""
from __future__ import annotations

import dataclasses
import enum

import torch

from xllm_py.model.attention import AttentionMetadata

HEADER_LEN = 9


class Command(enum.IntEnum):
    STOP = 0
    STEP = 1
    INIT_KV = 2  # header[1]: num_blocks; every rank allocates its KV pool
    NOOP = 3  # keep-alive of an idle instance
    START_KV_WORKER = 4  # every rank > 0 starts its KV worker (parallel/kv_workers.py)


@dataclasses.dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    keep_rows: torch.Tensor | None
    logits: bool


def header(cmd: Command, *args: int) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0] = int(cmd)
    for i, a in enumerate(args):
        h[i + 1] = int(a)
    return h


def encode_step(step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (header, payload), CPU int64."""
    m = step.meta
    t = int(step.input_ids.shape[0])
    b = int(m.seq_lens.shape[0])
    w = int(m.block_tables.shape[1])
    keep = step.keep_rows
    parts = [step.input_ids, step.positions, m.slot_mapping, m.query_start_loc, m.seq_lens,
             m.context_lens, m.block_tables.reshape(-1)]
    if keep is not None:
        parts.append(keep)
    groups = 0
    if m.group_slots is not None:
        groups = int(m.group_slots.shape[0])
        parts += [m.group_slots.reshape(-1), m.group_tables.reshape(-1)]
    payload = torch.cat([p.to("cpu", torch.int64) for p in parts])
    h = header(Command.STEP, t, b, w, -1 if keep is None else int(keep.shape[0]),
               m.max_query_len, m.max_seq_len, int(step.logits), groups)
    return h, payload


def payload_len(h: torch.Tensor) -> int:
    t, b, w, k = (int(x) for x in h[1:5])
    g = int(h[8])
    return 3 * t + (b + 1) + 2 * b + b * w + max(k, 0) + g * (t + b * w)


def decode_step(h: torch.Tensor, payload: torch.Tensor,
                device: torch.device) -> StepInputs:
    t, b, w, k, max_q, max_s, logits, g = (int(x) for x in h[1:9])
    flat = payload.to(device)
    sizes = [t, t, t, b + 1, b, b, b * w, max(k, 0), g * t, g * b * w]
    ids, pos, slots, qsl, lens, ctx, tables, keep, g_slots, g_tables = flat.split(sizes)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=lens,
                             context_lens=ctx, block_tables=tables.view(b, w),
                             max_query_len=max_q, max_seq_len=max_s)
    if g:
        meta.group_slots, meta.group_tables = g_slots.view(g, t), g_tables.view(g, b, w)
    return StepInputs(ids, pos, meta, keep if k >= 0 else None, bool(logits))
