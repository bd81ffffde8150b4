"""Head and column ranges of tensor-parallel ranks (xllm_py/model/sharding.py)."""
from __future__ import annotations

import pytest

from xllm_py.model.config import ModelConfig
from xllm_py.model.sharding import kv_head_range, shard_config, shard_for, tp_error


def _config(heads: int = 8, kv: int = 4, inter: int = 64) -> ModelConfig:
    return ModelConfig(architecture="Qwen3ForCausalLM", num_layers=2, hidden_size=64,
                       num_heads=heads, num_kv_heads=kv, head_dim=8, vocab_size=32,
                       intermediate_size=inter)


def test_split_heads_and_columns():
    cfg = _config()
    shards = [shard_for(cfg, r, 2) for r in range(2)]
    assert [s.q_heads for s in shards] == [(0, 4), (4, 8)]
    assert [s.kv_heads for s in shards] == [(0, 2), (2, 4)]
    assert [s.intermediate for s in shards] == [(0, 32), (32, 64)]
    local = shard_config(cfg, shards[1])
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (4, 2, 32)
    assert local.head_dim == cfg.head_dim and local.hidden_size == cfg.hidden_size


def test_each_rank_reads_the_kv_heads_of_its_query_heads():
    for heads, kv, tp in ((8, 4, 2), (8, 4, 4), (8, 2, 4), (8, 2, 8), (4, 1, 4), (8, 8, 1)):
        cfg = _config(heads, kv)
        group = heads // kv
        for r in range(tp):
            s = shard_for(cfg, r, tp)
            needed = {q // group for q in range(*s.q_heads)}
            assert needed == set(range(*s.kv_heads)), (heads, kv, tp, r)


def test_kv_heads_replicated_past_their_count():
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(1, 2, r) for r in range(2)] == [(0, 1), (0, 1)]


@pytest.mark.parametrize("heads,kv,inter,tp,word", [
    (8, 4, 64, 3, "attention heads"),
    (8, 4, 60, 8, "intermediate size"),
    (12, 6, 48, 4, "KV heads"),
    (8, 4, 64, 0, ">= 1"),
])
def test_unsplittable_models_are_refused(heads, kv, inter, tp, word):
    error = tp_error(heads, kv, inter, tp)
    assert error is not None and word in error
    if tp >= 1:
        with pytest.raises(ValueError, match=word):
            shard_for(_config(heads, kv, inter), 0, tp)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="rank 2"):
        shard_for(_config(), 2, 2)


def test_rank_moves_of_each_pd_pair():
    from xllm_py.model.kv_layout import kv_layout, transfer_plan
    from xllm_py.parallel.instance_peers import RankMove, rank_moves

    def moves(heads, src_tp, dst_tp):
        return rank_moves(transfer_plan(kv_layout(2, heads, src_tp), kv_layout(2, heads, dst_tp)))

    assert moves(4, 2, 2) == [RankMove(0, 0, None), RankMove(1, 1, None)]
    assert moves(4, 2, 1) == [RankMove(0, 0, (0, 0, 2)), RankMove(1, 0, (0, 2, 2))]
    assert moves(4, 1, 2) == [RankMove(0, 0, (0, 0, 2)), RankMove(0, 1, (2, 0, 2))]
    assert moves(2, 1, 1) == [RankMove(0, 0, None)]
    assert moves(1, 2, 1) == [RankMove(0, 0, None)]  # a replicated head: one rank's whole pool


def test_rank_moves_between_pipeline_stages_take_the_layers_both_hold():
    """Moves between workers in process order (rank 0 runs the last stage), each a slice
    (src_head, dst_head, heads, src_layer, dst_layer, layers) in the two pools' indices."""
    from xllm_py.model.kv_layout import kv_layout, transfer_plan
    from xllm_py.parallel.instance_peers import RankMove, rank_moves

    def moves(src, dst):
        return rank_moves(transfer_plan(kv_layout(4, 2, *src), kv_layout(4, 2, *dst)))

    # P PP 2 -> D TP 1: stage 0 (worker 1) fills layers 0-1, stage 1 (worker 0) layers 2-3
    assert moves((1, 2), (1, 1)) == [RankMove(1, 0, (0, 0, 2, 0, 0, 2)),
                                     RankMove(0, 0, (0, 0, 2, 0, 2, 2))]
    assert moves((1, 2), (2, 1)) == [  # D TP 2: each decode rank its head of every stage
        RankMove(1, 0, (0, 0, 1, 0, 0, 2)), RankMove(0, 0, (0, 0, 1, 0, 2, 2)),
        RankMove(1, 1, (1, 0, 1, 0, 0, 2)), RankMove(0, 1, (1, 0, 1, 0, 2, 2))]
    assert moves((1, 1), (1, 2, (3, 1))) == [  # D PP 2 uneven: each stage its layers
        RankMove(0, 1, (0, 0, 2, 0, 0, 3)), RankMove(0, 0, (0, 0, 2, 3, 0, 1))]
    assert moves((1, 2), (1, 2)) == [RankMove(1, 1, None), RankMove(0, 0, None)]
    assert moves((1, 2, (1, 3)), (1, 2, (3, 1))) == [
        RankMove(1, 1, (0, 0, 2, 0, 0, 1)), RankMove(0, 1, (0, 0, 2, 0, 1, 2)),
        RankMove(0, 0, (0, 0, 2, 2, 0, 1))]


def test_rank_moves_of_a_hybrid_model_slice_each_kv_groups_slots():
    """Gemma 3 style, 6 layers: sliding 0, 1 (group 1), full 2, 5 (group 0), sliding 3, 4
    (group 2); two slots a group. Between stages a move is a slice per group, in the slot
    indices of each stage's pool (the slots its layers use)."""
    from xllm_py.model.kv_layout import kv_layout, transfer_plan
    from xllm_py.parallel.instance_peers import RankMove, rank_moves

    windows = (6, 6, 0, 6, 6, 0)

    def moves(src, dst):
        return rank_moves(transfer_plan(kv_layout(6, 1, *src, layer_windows=windows),
                                        kv_layout(6, 1, *dst, layer_windows=windows)))

    # P PP 3 (3, 2, 1) -> D TP 1: stage 0 (worker 1) its full layer 2 (slot 0) and group
    # 1; stage 1 (worker 2) group 2; stage 2 (worker 0) layer 5: slot 1, its pool's only
    assert moves((1, 3, (3, 2, 1)), (1, 1)) == [
        RankMove(1, 0, None, ((0, (0, 0, 1, 0, 0, 1)), (1, (0, 0, 1, 0, 0, 2)))),
        RankMove(2, 0, None, ((2, (0, 0, 1, 0, 0, 2)),)),
        RankMove(0, 0, None, ((0, (0, 0, 1, 0, 1, 1)),))]
    # P TP 1 -> D PP 2 (1, 5): stage 0 holds slot 0 of group 1 only
    assert moves((1, 1), (1, 2, (1, 5))) == [
        RankMove(0, 1, None, ((1, (0, 0, 1, 0, 0, 1)),)),
        RankMove(0, 0, None, ((0, (0, 0, 1, 0, 0, 2)), (1, (0, 0, 1, 1, 1, 1)),
                              (2, (0, 0, 1, 0, 0, 2))))]
    # PP 2 -> PP 2, the same bounds: a stage pools slot 1 of group 0 for the other
    # stage's layer 5 (group 1 uses both slots): each group's own slots, not whole blocks
    assert moves((1, 2), (1, 2)) == [
        RankMove(1, 1, None, ((0, (0, 0, 1, 0, 0, 1)), (1, (0, 0, 1, 0, 0, 2)))),
        RankMove(0, 0, None, ((0, (0, 0, 1, 1, 1, 1)), (2, (0, 0, 1, 0, 0, 2))))]
    assert moves((1, 1), (1, 1)) == [RankMove(0, 0, None)]  # every layer: whole blocks


def test_executor_refuses_an_unsplittable_model_before_starting_ranks():
    from xllm_py.config import EngineConfig
    from xllm_py.model.tiny import ensure_tiny_model
    from xllm_py.parallel.executor import TPExecutor

    with pytest.raises(ValueError, match="4 attention heads cannot be split over 3 ranks"):
        TPExecutor.start(EngineConfig(model="tiny", tensor_parallel_size=3),
                         str(ensure_tiny_model("tiny")))
