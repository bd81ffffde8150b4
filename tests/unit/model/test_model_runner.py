"""ModelRunner: a ragged batch (prefill chunks, cached prefixes and decode steps mixed)
gives the same logits as running each sequence alone."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from xllm_py.engine.model_runner import ModelRunner
from xllm_py.model.attention import allocate_kv_caches
from xllm_py.model.loader import load_model
from xllm_py.model.tiny import ensure_tiny_model

pytestmark = pytest.mark.integration  # the real model (ModelRunner)

BLOCK_SIZE = 4
NUM_BLOCKS = 96
TOL = 1e-4  # float32 logits


@dataclasses.dataclass
class Seq:  # ScheduledSeq-like
    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m, cfg = load_model(str(ensure_tiny_model("tiny")))
    return m, cfg


def _runner(model, cfg) -> ModelRunner:
    caches = allocate_kv_caches(cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads,
                                cfg.head_dim)
    return ModelRunner(model, caches, BLOCK_SIZE)


def _prompts(vocab: int) -> dict[str, list[int]]:
    rng = random.Random(0)
    lengths = {"a": 11, "b": 1, "c": 6, "d": 17}
    return {k: [rng.randrange(3, vocab) for _ in range(n + 6)] for k, n in lengths.items()}


def _tables() -> dict[str, list[int]]:
    """Disjoint, shuffled block tables (block 0 left unused) of 8 blocks each."""
    ids = list(range(1, NUM_BLOCKS))
    random.Random(1).shuffle(ids)
    return {k: ids[i * 8:(i + 1) * 8] for i, k in enumerate("abcd")}


# Per step, per sequence: (number of new tokens, sample?). A sequence's tokens are taken
# in order from its token list; chunked prefills sample only on their last chunk.
SCHEDULE = [
    {"a": (5, False), "b": (1, True), "c": (6, True)},
    {"a": (6, True), "b": (1, True), "c": (1, True), "d": (9, False)},
    {"a": (1, True), "b": (1, True), "c": (1, True), "d": (8, True)},
    {"a": (1, True), "c": (1, True), "d": (1, True)},
    {"b": (1, True), "d": (1, True)},
    {"a": (1, True), "b": (1, True), "c": (1, True), "d": (1, True)},
]


def _run(runner: ModelRunner, steps: list[dict[str, tuple[int, bool]]],
         tokens: dict[str, list[int]], tables: dict[str, list[int]]) -> dict[tuple[int, str], torch.Tensor]:
    """Runs the steps; returns the logits row of every sampled (step, sequence)."""
    pos = {k: 0 for k in tokens}
    out: dict[tuple[int, str], torch.Tensor] = {}
    for i, step in enumerate(steps):
        seqs = []
        for k, (n, sample) in step.items():
            seqs.append(Seq(k, tokens[k][pos[k]:pos[k] + n], pos[k], tables[k], sample))
            pos[k] += n
        logits = runner.execute(seqs)
        sampled = [s.request_id for s in seqs if s.sample]
        if not sampled:
            assert logits is None
            continue
        assert logits is not None and logits.dtype == torch.float32
        assert logits.shape[0] == len(sampled)
        for k, row in zip(sampled, logits):
            out[(i, k)] = row.clone()
    return out


def test_ragged_batch_equals_one_by_one(model):
    m, cfg = model
    tokens = _prompts(cfg.vocab_size)
    tables = _tables()
    batched = _run(_runner(m, cfg), SCHEDULE, tokens, tables)
    alone: dict[tuple[int, str], torch.Tensor] = {}
    for k in tokens:  # each sequence alone on a fresh cache, same chunks
        alone.update(_run_single(_runner(m, cfg), k, SCHEDULE, tokens, tables))
    assert batched.keys() == alone.keys()
    for key in batched:
        err = (batched[key] - alone[key]).abs().max().item()
        assert err < TOL, f"{key}: max abs logit error {err}"
    # greedy tokens agree as well
    assert all(batched[k].argmax() == alone[k].argmax() for k in batched)


def _run_single(runner: ModelRunner, k: str, steps: list[dict[str, tuple[int, bool]]],
                tokens: dict[str, list[int]],
                tables: dict[str, list[int]]) -> dict[tuple[int, str], torch.Tensor]:
    pos = 0
    out: dict[tuple[int, str], torch.Tensor] = {}
    for i, step in enumerate(steps):
        if k not in step:
            continue
        n, sample = step[k]
        logits = runner.execute([Seq(k, tokens[k][pos:pos + n], pos, tables[k], sample)])
        pos += n
        if sample:
            assert logits is not None and logits.shape[0] == 1
            out[(i, k)] = logits[0].clone()
        else:
            assert logits is None
    return out


def test_full_forward_matches_chunked(model):
    """The whole prompt in one step equals the same prompt in chunks plus decode steps."""
    m, cfg = model
    tokens = _prompts(cfg.vocab_size)["d"]
    table = _tables()["d"]
    one = _runner(m, cfg).execute([Seq("d", tokens, 0, table, True)])
    runner = _runner(m, cfg)
    assert runner.execute([Seq("d", tokens[:7], 0, table, False)]) is None
    runner.execute([Seq("d", tokens[7:20], 7, table, False)])
    last = runner.execute([Seq("d", tokens[20:], 20, table, True)])
    assert one is not None and last is not None
    assert (one - last).abs().max().item() < TOL


def test_empty_batch_returns_none(model):
    m, cfg = model
    assert _runner(m, cfg).execute([]) is None


def test_decode_metadata_equals_generic_build(model):
    """The decode-only fast path builds the same metadata as AttentionMetadata.build."""
    from xllm_py.model.attention import AttentionMetadata

    m, cfg = model
    runner = _runner(m, cfg)
    tables = _tables()
    seqs = [Seq("a", [5], 9, tables["a"][:3], True), Seq("b", [6], 0, tables["b"][:1], False),
            Seq("c", [7], 31, tables["c"], True)]
    ids, pos, meta, sample_idx = runner._prepare_decode(seqs)
    ref = AttentionMetadata.build([(s.start_pos, 1, s.block_table) for s in seqs], BLOCK_SIZE)
    assert ids.tolist() == [5, 6, 7] and pos.tolist() == [9, 0, 31] and sample_idx == [0, 2]
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "context_lens", "block_tables"):
        assert torch.equal(getattr(meta, name), getattr(ref, name)), name
    assert (meta.max_query_len, meta.max_seq_len) == (ref.max_query_len, ref.max_seq_len)
    with pytest.raises(ValueError):
        runner._prepare_decode([Seq("a", [5], 12, tables["a"][:3], True)])


@pytest.mark.parametrize("keep", [[4, 11, 12], [12, 4], []])
def test_kept_rows_equal_the_full_forward_and_store_every_kv(model, keep):
    """keep_rows (what the runner passes for the sampled rows): the last layer finishes
    only those rows; the rows equal the full forward's, and every token's K/V is stored
    exactly as by the full forward. Batch: two prefill chunks and a decode token."""
    from xllm_py.model.attention import AttentionMetadata, build_positions

    m, cfg = model
    tokens, tables = _prompts(cfg.vocab_size), _tables()
    spec = [(0, 5, tables["a"]), (3, 7, tables["d"]), (0, 1, tables["b"])]
    ids = torch.tensor(tokens["a"][:5] + tokens["d"][3:10] + tokens["b"][:1])
    runs = []
    for rows in (None, torch.tensor(keep, dtype=torch.long)):
        runner = _runner(m, cfg)
        with torch.inference_mode():
            out = m(ids, build_positions(spec), AttentionMetadata.build(spec, BLOCK_SIZE),
                    runner.kv_caches, keep_rows=rows)
        runs.append((out, runner.kv_caches))
    (full, full_kv), (kept, kept_kv) = runs
    assert kept.shape == (len(keep), cfg.hidden_size)
    if keep:
        assert (kept - full[keep]).abs().max().item() < 1e-5
    for (k0, v0), (k1, v1) in zip(full_kv, kept_kv):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


@dataclasses.dataclass
class ScoringSeq(Seq):
    num_prompt_logprob_rows: int = 0


def _logits_per_position(m, cfg, tokens: list[int], table: list[int]) -> torch.Tensor:
    """Reference: one token a step, every step sampled -> logits [len(tokens), vocab]."""
    runner = _runner(m, cfg)
    return torch.cat([runner.execute([Seq("r", [t], p, table, True)])
                      for p, t in enumerate(tokens)])


def test_prompt_rows_come_back_per_seq_in_order(model):
    """Prompt-scoring rows of prefill chunks (next to a sampled chunk and a decode step),
    and of one-token chunks in a decode-only step, equal the logits of those positions."""
    m, cfg = model
    tokens = _prompts(cfg.vocab_size)
    tables = _tables()
    ref_a = _logits_per_position(m, cfg, tokens["a"][:12], tables["a"])
    ref_b = _logits_per_position(m, cfg, tokens["b"][:3], tables["b"])
    ref_d = _logits_per_position(m, cfg, tokens["d"][:10], tables["d"])
    runner = _runner(m, cfg)
    a, b, d = tokens["a"], tokens["b"], tokens["d"]
    out = runner.execute_step([
        ScoringSeq("b", b[:2], 0, tables["b"], True),
        ScoringSeq("a", a[:5], 0, tables["a"], False, 5),
        ScoringSeq("d", d[:8], 0, tables["d"], True, 7)])
    assert [(i, rows.shape[0]) for i, rows in out.prompt] == [(1, 5), (2, 7)]
    assert (out.sample - torch.stack([ref_b[1], ref_d[7]])).abs().max().item() < TOL
    assert (out.prompt[0][1] - ref_a[:5]).abs().max().item() < TOL
    assert (out.prompt[1][1] - ref_d[:7]).abs().max().item() < TOL
    # decode-only step: a one-token scoring chunk of "a" next to decode steps of b and d
    out = runner.execute_step([
        ScoringSeq("d", d[8:9], 8, tables["d"], True),
        ScoringSeq("a", a[5:6], 5, tables["a"], False, 1),
        ScoringSeq("b", b[2:3], 2, tables["b"], True)])
    assert [(i, rows.shape[0]) for i, rows in out.prompt] == [(1, 1)]
    assert (out.sample - torch.stack([ref_d[8], ref_b[2]])).abs().max().item() < TOL
    assert (out.prompt[0][1][0] - ref_a[5]).abs().max().item() < TOL
    # only scoring rows, nothing sampled: the last chunk of "a" but its final token
    out = runner.execute_step([ScoringSeq("a", a[6:11], 6, tables["a"], False, 5)])
    assert out.sample is None
    assert (out.prompt[0][1] - ref_a[6:11]).abs().max().item() < TOL
