"""The step message rank 0 broadcasts (xllm_py/parallel/protocol.py) decodes to the same
inputs, with and without kept rows."""
from __future__ import annotations

import torch

from xllm_py.model.attention import AttentionMetadata
from xllm_py.parallel.protocol import (HEADER_LEN, Command, StepInputs, decode_step,
                                       encode_step, header, payload_len)


def _step(keep: torch.Tensor | None, logits: bool) -> StepInputs:
    meta = AttentionMetadata.build([(0, 5, [3, 7]), (9, 1, [1, 4, 2])], block_size=4)
    ids = torch.arange(6, dtype=torch.int64) + 100
    pos = torch.tensor([0, 1, 2, 3, 4, 9])
    return StepInputs(ids, pos, meta, keep, logits)


def test_step_round_trip():
    for keep, logits in ((None, True), (torch.tensor([4, 5]), False),
                         (torch.zeros(0, dtype=torch.int64), True)):
        step = _step(keep, logits)
        h, payload = encode_step(step)
        assert h.shape == (HEADER_LEN,) and Command(int(h[0])) == Command.STEP
        assert payload.numel() == payload_len(h)
        got = decode_step(h.clone(), payload.clone(), torch.device("cpu"))
        assert torch.equal(got.input_ids, step.input_ids)
        assert torch.equal(got.positions, step.positions)
        for f in ("slot_mapping", "query_start_loc", "seq_lens", "context_lens",
                  "block_tables"):
            assert torch.equal(getattr(got.meta, f), getattr(step.meta, f)), f
        assert (got.meta.max_query_len, got.meta.max_seq_len) == (5, 10)
        assert got.logits is logits
        if keep is None:
            assert got.keep_rows is None
        else:
            assert torch.equal(got.keep_rows, keep)


def test_command_header():
    h = header(Command.INIT_KV, 96)
    assert h.tolist() == [int(Command.INIT_KV), 96] + [0] * (HEADER_LEN - 2)


def test_step_round_trip_with_kv_group_tables():
    """A hybrid model's step (model/kv_groups.py): the slots and tables of KV groups 1..
    travel too, and each group's metadata is its own."""
    groups = [[[0, 8], [0, 9]], [[0, 0, 6], [5, 0, 11]]]  # per seq: groups 1 and 2
    meta = AttentionMetadata.build([(4, 2, [3, 7]), (9, 1, [1, 4, 2])], block_size=4,
                                   group_tables=groups)
    step = StepInputs(torch.arange(3) + 100, torch.tensor([4, 5, 9]), meta, None, True)
    h, payload = encode_step(step)
    assert payload.numel() == payload_len(h)
    got = decode_step(h, payload, torch.device("cpu")).meta
    assert got.group_slots.tolist() == [[8 * 4, 8 * 4 + 1, 6 * 4 + 1], [9 * 4, 9 * 4 + 1, 11 * 4 + 1]]
    g2 = got.for_group(2)
    assert g2.block_tables.tolist() == [[0, 9, 0], [5, 0, 11]]
    assert g2.slot_mapping.tolist() == got.group_slots[1].tolist()
    assert got.for_group(0) is got and got.for_group(0).slot_mapping.tolist() == [28, 29, 9]
