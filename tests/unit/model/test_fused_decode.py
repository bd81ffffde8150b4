"""Fused decode layers (xllm_py/model/fused_decode.py): a decode batch gives bit-identical
logits to the per-op path, for each model family, and every batch or model the fused
path does not take falls back to the per-op path."""
from __future__ import annotations

import contextlib
import random

import pytest
import torch

from xllm_py.engine.model_runner import ModelRunner
from xllm_py.engine.scheduler import ScheduledSeq
from xllm_py.model import cpu_kernels, fused_decode
from xllm_py.model.attention import allocate_kv_caches
from xllm_py.model.loader import load_model
from xllm_py.model.packed import pack_linears
from xllm_py.model.tiny import build_model_dir

pytestmark = pytest.mark.integration  # the real model (ModelRunner)

needs_kernels = pytest.mark.skipif(not fused_decode.supported(),
                                   reason="no fused decode layer in the CPU kernels "
                                          f"({cpu_kernels.unavailable_reason() or 'no AVX2/FMA'})")

BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def packed_model(request, tmp_path_factory):
    """qwen3: per-head q/k norm; llama: none; qwen2: q/k/v biases."""
    path = build_model_dir(tmp_path_factory.mktemp(request.param), family=request.param,
                           hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                           intermediate_size=96, seed=3)
    model, cfg = load_model(str(path))
    assert pack_linears(model) > 0
    return model, cfg


def _prefilled(model, cfg, lengths: list[int]):
    """A runner whose caches hold prompts of these lengths; returns (runner, seqs) with
    each sequence's next decode step (tables cover a few more blocks)."""
    caches = allocate_kv_caches(cfg.num_layers, 64, BLOCK_SIZE, cfg.num_kv_heads,
                                cfg.head_dim)
    runner = ModelRunner(model, caches, BLOCK_SIZE)
    rng = random.Random(len(lengths))
    free = list(range(1, 64))
    rng.shuffle(free)
    prefill, seqs = [], []
    for i, n in enumerate(lengths):
        table = [free.pop() for _ in range((n + 8) // BLOCK_SIZE + 1)]
        prompt = [rng.randrange(3, cfg.vocab_size) for _ in range(n)]
        prefill.append(ScheduledSeq(f"r{i}", prompt, 0, table, True))
        seqs.append(ScheduledSeq(f"r{i}", [rng.randrange(3, cfg.vocab_size)], n, table, True))
    with torch.inference_mode():
        runner.execute(prefill)
    return runner, seqs


@contextlib.contextmanager
def _recording_runs(model):
    """Yields a list that gets, per forward, whether the fused path took it ("head": the
    layers, final norm and LM head in one call; "layers": the layers only; False: per-op)."""
    fused = model._fused_decoder()
    assert fused is not None
    taken: list = []
    real_run = fused._run

    def recording(*args):
        out = real_run(*args)
        taken.append(out is not None and ("head" if args[-1] is not None else "layers"))
        return out

    fused._run = recording
    try:
        yield taken
    finally:
        del fused._run


def _both_paths(model, runner, seqs):
    with torch.inference_mode():
        model.fused_decode = False
        per_op = runner.execute(seqs)
        model.fused_decode = True
        fused = runner.execute(seqs)  # rewrites the same K/V into the same slots
    return per_op, fused


@needs_kernels
def test_decode_steps_equal_the_per_op_path(packed_model):
    model, cfg = packed_model
    lengths = [1, 3, 4, 5, 8, 13]  # on and across block boundaries
    runner, seqs = _prefilled(model, cfg, lengths)
    with _recording_runs(model) as taken:
        for step in range(4):
            per_op, fused = _both_paths(model, runner, seqs)
            assert torch.equal(per_op, fused), f"step {step}"
            next_ids = fused.argmax(-1).tolist()
            seqs = [ScheduledSeq(s.request_id, [t], s.start_pos + 1, s.block_table, True)
                    for s, t in zip(seqs, next_ids)]
    assert taken == ["head"] * 4


@needs_kernels
def test_batches_it_does_not_take_fall_back(packed_model):
    model, cfg = packed_model
    runner, seqs = _prefilled(model, cfg, [5, 6])
    with _recording_runs(model) as taken, torch.inference_mode():
        runner.execute(seqs)  # decode only: fused
        mixed = [seqs[0], ScheduledSeq("p", [5, 6, 7], 0, [60], True)]
        runner.execute(mixed)  # a prefill in the batch: per-op
        with cpu_kernels.disabled():
            runner.execute(seqs)  # kernels off: per-op
        wide = [ScheduledSeq(f"w{i}", [5], 0, [1 + i % 60], True)
                for i in range(cpu_kernels.PANEL_MAX_ROWS + 1)]
        runner.execute(wide)  # more rows than the panel kernel takes: per-op
    assert taken == ["head", False, False, False]


@needs_kernels
def test_unpacked_model_has_no_fused_decoder(tmp_path):
    path = build_model_dir(tmp_path, hidden_size=32, num_layers=1, num_heads=2,
                           num_kv_heads=1, intermediate_size=48)
    model, _ = load_model(str(path))
    assert model._fused_decoder() is None  # nn.Linear weights: nothing to fuse
    pack_linears(model)
    assert model._fused_decoder() is not None  # rebuilt once the linears are packed
    model.fused_decode = False
    assert model._fused_decoder() is None


@needs_kernels
def test_a_decode_row_that_does_not_sample_is_left_out(packed_model):
    model, cfg = packed_model
    runner, seqs = _prefilled(model, cfg, [3, 7, 9])
    seqs[1] = ScheduledSeq(seqs[1].request_id, seqs[1].token_ids, seqs[1].start_pos,
                           seqs[1].block_table, False)
    with _recording_runs(model) as taken:
        per_op, fused = _both_paths(model, runner, seqs)
    assert taken == ["layers"] and fused.shape[0] == 2  # the head only for the kept row
    assert torch.equal(per_op, fused)


@needs_kernels
def test_a_head_without_panels_runs_after_the_fused_layers(packed_model):
    model, cfg = packed_model
    runner, seqs = _prefilled(model, cfg, [2, 6, 11])
    packed_head = model.lm_head
    model.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    try:
        with torch.no_grad():
            model.lm_head.weight.copy_(packed_head.forward(torch.eye(cfg.hidden_size)).T)
        model._fused = (0, None)  # rebuilt: no native head now
        with _recording_runs(model) as taken:
            per_op, fused = _both_paths(model, runner, seqs)
        assert taken == ["layers"]
        assert torch.equal(per_op, fused)
    finally:
        model.lm_head = packed_head
        model._fused = (0, None)


@needs_kernels
def test_an_out_of_vocabulary_id_is_declined_and_raises(packed_model):
    model, cfg = packed_model
    runner, seqs = _prefilled(model, cfg, [3, 4])
    seqs[1] = ScheduledSeq(seqs[1].request_id, [cfg.vocab_size], seqs[1].start_pos,
                           seqs[1].block_table, True)
    with _recording_runs(model) as taken, torch.inference_mode():
        with pytest.raises(IndexError):  # the per-op path's embedding lookup
            runner.execute(seqs)
    assert taken == [False]  # the native step checked the ids and did nothing
