"""ModelRunner: SchedulerOutput -> input tensors -> model forward -> logits of the sampled rows.

The only module of the engine that touches the model and torch tensors for the forward pass.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from xllm_py.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: str = "cpu") -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)

    @torch.inference_mode()
    def execute(self, seqs: Sequence) -> torch.Tensor | None:
        """Run one step over `seqs` (ScheduledSeq-like: token_ids, start_pos, block_table,
        sample). Returns float32 logits [num_sampled, vocab] in the order of the sampled
        seqs, or None when nothing is sampled this step."""
        if not seqs:
            return None
        input_ids: list[int] = []
        positions: list[int] = []
        sample_idx: list[int] = []
        for seq in seqs:
            n = len(seq.token_ids)
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + n))
            if seq.sample:
                sample_idx.append(len(input_ids) - 1)
        meta = AttentionMetadata.build(
            [(s.start_pos, len(s.token_ids), s.block_table) for s in seqs],
            self.block_size, self.device)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids_t, pos_t, meta, self.kv_caches)
        if not sample_idx:
            return None
        if len(sample_idx) == hidden.shape[0]:
            last = hidden
        else:
            last = hidden[torch.tensor(sample_idx, dtype=torch.long, device=self.device)]
        return self.model.compute_logits(last).float()
