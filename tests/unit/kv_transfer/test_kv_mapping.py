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
