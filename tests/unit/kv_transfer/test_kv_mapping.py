"""xLLM's TP/DP worker mapping."""
from __future__ import annotations

import itertools

import pytest

from xllm_py.kv_transfer.mapping import link_cluster_map, src_worker_for, worker_rank


@pytest.mark.parametrize("src_dp,src_tp,dst_dp,dst_tp",
                         list(itertools.product([1, 2, 3], [1, 2, 4], [1, 2], [1, 2, 4, 8])))
def test_grid_every_destination_maps_to_valid_source(src_dp, src_tp, dst_dp, dst_tp) -> None:
    m = link_cluster_map(src_dp, src_tp, dst_dp, dst_tp)
    assert sorted(m) == list(range(dst_dp * dst_tp))
    for dst_rank, srcs in m.items():
        assert len(srcs) == src_dp
        for src_dp_rank, s in enumerate(srcs):
            # the source worker lies in the right DP group and is a valid worker
            assert src_dp_rank * src_tp <= s < (src_dp_rank + 1) * src_tp
            assert s == src_dp_rank * src_tp + dst_rank % src_tp
    if src_tp == dst_tp:  # equal TP: tp_rank i reads tp_rank i
        for dst_rank, srcs in m.items():
            assert [s % src_tp for s in srcs] == [dst_rank % dst_tp] * src_dp


def test_hand_computed_cases() -> None:
    # P: dp=2, tp=2 (workers 0..3); D: dp=1, tp=2: D worker 1 pulls from P worker 1 (group 0) or 3 (group 1).
    assert link_cluster_map(2, 2, 1, 2) == {0: [0, 2], 1: [1, 3]}
    # D tp=4 > P tp=2: D workers 2 and 3 reuse P tp ranks 0 and 1 (head slicing out of scope).
    assert link_cluster_map(1, 2, 1, 4) == {0: [0], 1: [1], 2: [0], 3: [1]}
    # D dp=2, tp=2 -> worker rank 3 = dp 1, tp 1; P tp=4, src dp rank 1 -> 1*4 + 3 % 4 = 7.
    assert src_worker_for(1, 2, 1, src_dp_rank=1, src_tp=4) == 7
    # P tp=1: everything reads that group's only worker.
    assert link_cluster_map(3, 1, 2, 2) == {r: [0, 1, 2] for r in range(4)}
    assert worker_rank(2, 4, 3) == 11


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        worker_rank(0, 2, 2)
    with pytest.raises(ValueError):
        link_cluster_map(0, 1, 1, 1)
    with pytest.raises(ValueError):
        src_worker_for(0, 1, 0, src_dp_rank=2, src_tp=1, src_dp=2)


# ---------------------------------------------------------------- KV head slices (TP pairs)

from xllm_py.kv_transfer.mapping import HeadSlice, head_mapping_error, kv_head_plan  # noqa: E402
from xllm_py.model.sharding import kv_head_range  # noqa: E402


def test_head_plan_equal_tp_is_rank_to_rank_whole_pool() -> None:
    assert [kv_head_plan(4, 2, 2, d) for d in range(2)] == [[HeadSlice(0, 0, 0, 2)],
                                                            [HeadSlice(1, 0, 0, 2)]]


def test_head_plan_prefill_tp2_decode_tp1_reads_both_ranks() -> None:
    assert kv_head_plan(4, 2, 1, 0) == [HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 2, 2)]


def test_head_plan_prefill_tp1_decode_tp2_reads_its_half() -> None:
    assert kv_head_plan(4, 1, 2, 0) == [HeadSlice(0, 0, 0, 2)]
    assert kv_head_plan(4, 1, 2, 1) == [HeadSlice(0, 2, 0, 2)]


def test_head_plan_replicated_heads_spread_over_replicas() -> None:
    # 2 KV heads, P TP 4 (each head on 2 ranks) -> D TP 2: decode 0 reads head 0 from rank 0
    assert kv_head_plan(2, 4, 2, 0) == [HeadSlice(0, 0, 0, 1)]
    assert kv_head_plan(2, 4, 2, 1) == [HeadSlice(3, 0, 0, 1)]
    # D TP 4 from P TP 1: every decode rank reads its one (replicated) head
    assert [kv_head_plan(2, 1, 4, d) for d in range(4)] == [
        [HeadSlice(0, 0, 0, 1)], [HeadSlice(0, 0, 0, 1)], [HeadSlice(0, 1, 0, 1)],
        [HeadSlice(0, 1, 0, 1)]]


@pytest.mark.parametrize("heads,src_tp,dst_tp", [
    (h, s, d) for h in (1, 2, 4, 8) for s in (1, 2, 4, 8) for d in (1, 2, 4, 8)
    if head_mapping_error(h, s, d) is None])
def test_head_plan_covers_exactly_the_owned_heads(heads, src_tp, dst_tp) -> None:
    for d in range(dst_tp):
        d0, d1 = kv_head_range(heads, dst_tp, d)
        got = []
        for sl in kv_head_plan(heads, src_tp, dst_tp, d):
            s0, s1 = kv_head_range(heads, src_tp, sl.src_rank)
            assert 0 <= sl.src_start and sl.src_start + sl.count <= s1 - s0
            got += [(s0 + sl.src_start + i, d0 + sl.dst_start + i) for i in range(sl.count)]
        assert got == [(h, h) for h in range(d0, d1)]  # each owned head once, same head


def test_unmappable_pairs_say_why() -> None:
    assert "6 KV heads cannot be split over the decode's 4 ranks" in head_mapping_error(6, 2, 4)
    assert "prefill" in head_mapping_error(6, 4, 2)
    with pytest.raises(ValueError, match="cannot be split"):
        kv_head_plan(6, 4, 1, 0)
    with pytest.raises(ValueError, match="out of range"):
        kv_head_plan(4, 2, 2, 2)
