"""transfer_plan: every decode rank gets each (layer, head) it holds exactly once, from a
prefill rank that holds it, over a matrix of (TP, PP) layouts with uneven stages,
replicated KV heads and hybrid layer kinds; impossible pairings are refused with a reason."""
from __future__ import annotations

import itertools

import pytest

from xllm_py.model.kv_layout import (KVLayout, KVPiece, RankKV, TransferPlanError, kv_layout,
                                     pp_layer_ranges, transfer_plan)

GEMMA_WINDOWS = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))  # 5 sliding, 1 full
# (layers, KV heads, layer kinds): Llama-like, GQA with few heads, one KV head (replicated
# from TP 2 on), gemma-3-270m's hybrid pattern with its one KV head.
MODELS = [(4, 4, ()), (5, 2, ()), (6, 1, ()), (18, 1, GEMMA_WINDOWS)]
LAYOUTS = [(1, 1, None), (2, 1, None), (4, 1, None), (1, 2, None), (1, 3, None),
           (1, 3, (1, 1, 2)), (2, 2, None), (2, 2, (3, 1)), (4, 3, None)]


def layouts(layers, heads, windows):
    out = []
    for tp, pp, partition in LAYOUTS:
        if pp > layers or (heads % tp and tp % heads):
            continue
        if partition is not None and sum(partition) != layers:
            partition = tuple(p + (layers - sum(partition) if i == 0 else 0)
                              for i, p in enumerate(partition))
        out.append(kv_layout(layers, heads, tp, pp, partition, "m", windows))
    return out


CASES = [(src, dst) for layers, heads, windows in MODELS
         for src, dst in itertools.product(layouts(layers, heads, windows), repeat=2)]


def cells(piece: KVPiece):
    return {(layer, head) for layer in range(*piece.layers) for head in range(*piece.heads)}


@pytest.mark.parametrize("src,dst", CASES, ids=lambda l: f"tp{l.tp_size}pp{l.pp_size}-"
                         f"{'-'.join(str(r.layers[1] - r.layers[0]) for r in l.ranks[::l.tp_size])}"
                         f"-h{l.num_kv_heads}L{l.num_layers}")
def test_every_decode_rank_gets_each_layer_and_head_exactly_once(src, dst) -> None:
    plan = transfer_plan(src, dst)
    windows = src.layer_windows or (0,) * src.num_layers
    for d, mine in enumerate(dst.ranks):
        got: list[tuple[int, int]] = []
        for p in plan.to_rank(d):
            theirs = src.ranks[p.src_rank]
            # the sender holds the piece, and the local head offsets address it on both sides
            assert theirs.layers[0] <= p.layers[0] < p.layers[1] <= theirs.layers[1]
            assert theirs.heads[0] <= p.heads[0] < p.heads[1] <= theirs.heads[1]
            assert p.src_head == p.heads[0] - theirs.heads[0]
            assert p.dst_head == p.heads[0] - mine.heads[0]
            assert {windows[i] for i in range(*p.layers)} == {p.window}  # one kind a piece
            got += sorted(cells(p))
        want = [(layer, head) for layer in range(*mine.layers) for head in range(*mine.heads)]
        assert sorted(got) == want  # covered, and nothing twice (no replica sent twice)
    # Bytes: the plan moves exactly what the decode holds, whatever the prefill's replicas.
    assert sum(len(cells(p)) for p in plan.pieces) == sum(
        (r.layers[1] - r.layers[0]) * (r.heads[1] - r.heads[0]) for r in dst.ranks)


@pytest.mark.parametrize("layers,heads,windows", MODELS)
def test_equal_layouts_go_rank_to_rank(layers, heads, windows) -> None:
    for layout in layouts(layers, heads, windows):
        plan = transfer_plan(layout, layout)
        assert all(p.src_rank == p.dst_rank for p in plan.pieces)
        assert plan.reads() == {r: [r] for r in range(len(layout.ranks))}
        if not windows:  # one piece a rank: its whole rectangle
            assert [(p.layers, p.heads) for p in plan.pieces] == [
                (r.layers, r.heads) for r in layout.ranks]


def test_tp2_prefill_to_tp1_decode_reads_half_the_heads_from_each_rank() -> None:
    plan = transfer_plan(kv_layout(4, 4, tp=2), kv_layout(4, 4))
    assert plan.pieces == (KVPiece(0, 0, (0, 4), (0, 2), 0, 0, 0),
                           KVPiece(1, 0, (0, 4), (2, 4), 0, 0, 2))


def test_tp_prefill_to_pp_decode_cuts_layers_and_heads() -> None:
    # the design notes' example: context TP 2, generation PP 2
    plan = transfer_plan(kv_layout(4, 2, tp=2), kv_layout(4, 2, pp=2))
    assert [(p.src_rank, p.dst_rank, p.layers, p.heads) for p in plan.pieces] == [
        (0, 0, (0, 2), (0, 1)), (1, 0, (0, 2), (1, 2)),
        (0, 1, (2, 4), (0, 1)), (1, 1, (2, 4), (1, 2))]


def test_uneven_pp_prefill_to_pp_decode_splits_at_both_sides_stage_bounds() -> None:
    plan = transfer_plan(kv_layout(5, 2, pp=3, partition=(1, 1, 3)), kv_layout(5, 2, pp=2))
    assert [(p.src_rank, p.dst_rank, p.layers) for p in plan.pieces] == [
        (0, 0, (0, 1)), (1, 0, (1, 2)), (2, 0, (2, 3)), (2, 1, (3, 5))]


def test_a_replicated_head_is_sent_once_per_decode_copy_and_spread_over_replicas() -> None:
    # gemma-3-270m's one KV head: TP 2 holds it twice; a TP 1 decode reads it from rank 0 only
    plan = transfer_plan(kv_layout(6, 1, tp=2), kv_layout(6, 1))
    assert [(p.src_rank, p.layers) for p in plan.pieces] == [(0, (0, 6))]
    # TP 4 prefill (2 heads, each on 2 ranks) -> TP 2 decode: each decode rank one replica
    plan = transfer_plan(kv_layout(4, 2, tp=4), kv_layout(4, 2, tp=2))
    assert [(p.src_rank, p.dst_rank, p.heads) for p in plan.pieces] == [
        (0, 0, (0, 1)), (3, 1, (1, 2))]


def test_hybrid_layers_are_cut_where_the_kind_changes() -> None:
    plan = transfer_plan(kv_layout(18, 1, model="g", layer_windows=GEMMA_WINDOWS),
                         kv_layout(18, 1, pp=2, model="g", layer_windows=GEMMA_WINDOWS))
    assert [(p.dst_rank, p.layers, p.window) for p in plan.pieces] == [
        (0, (0, 5), 512), (0, (5, 6), 0), (0, (6, 9), 512),
        (1, (9, 11), 512), (1, (11, 12), 0), (1, (12, 17), 512), (1, (17, 18), 0)]


@pytest.mark.parametrize("src,dst,reason", [
    (kv_layout(4, 2, model="a"), kv_layout(4, 2, model="b"), "different models"),
    (kv_layout(4, 2), kv_layout(6, 2), "different layer counts"),
    (kv_layout(4, 2), kv_layout(4, 4), "different KV head counts"),
    (kv_layout(6, 1, layer_windows=(0,) * 6), kv_layout(6, 1, layer_windows=(9,) + (0,) * 5),
     "different layer kinds"),
    (KVLayout(4, 2, 1, 2, (RankKV((0, 2), (0, 2)), RankKV((3, 4), (0, 2)))), kv_layout(4, 2),
     "consecutive"),
    (kv_layout(4, 2), KVLayout(4, 2, 2, 1, (RankKV((0, 4), (0, 1)), RankKV((0, 4), (0, 1)))),
     "do not hold every KV head"),
    (kv_layout(4, 2), KVLayout(4, 2, 2, 1, (RankKV((0, 4), (0, 2)),)), "1 ranks registered"),
    (KVLayout(4, 2, 1, 1, (RankKV((0, 3), (0, 2)),)), kv_layout(4, 2), "hold 3 of the model's 4"),
])
def test_an_impossible_pairing_is_refused_with_the_reason(src, dst, reason) -> None:
    with pytest.raises(TransferPlanError, match=reason):
        transfer_plan(src, dst)


def test_a_layout_that_does_not_divide_is_refused() -> None:
    with pytest.raises(TransferPlanError, match="cannot be split over 4 ranks"):
        kv_layout(4, 6, tp=4)
    with pytest.raises(TransferPlanError, match="into 5 stages"):
        kv_layout(4, 2, pp=5)
    with pytest.raises(TransferPlanError, match="does not split 4 layers"):
        pp_layer_ranges(4, 2, (1, 2))
    assert pp_layer_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]  # the remainder goes first
