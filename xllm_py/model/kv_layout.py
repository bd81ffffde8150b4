"""Which KV each rank of an instance holds, and the plan that hands a prompt's KV from one
instance's layout to another's (pure Python: the registry, the link check and the KV
workers all use it).

A rank holds the KV of a rectangle: a contiguous range of the model's layers (its
pipeline stage) times a range of its KV heads (its tensor-parallel shard,
``sharding.kv_head_range``: one head replicated on ``tp / num_kv_heads`` ranks when the TP
size exceeds the KV heads). Ranks are numbered ``pp_rank * tp + tp_rank`` (their workers,
as registered, in process order: ``worker_rank``).

``transfer_plan`` gives every decode rank its rectangle exactly once: the rectangle is cut
along every prefill rank's boundaries and along the changes of layer kind of a hybrid
model (a sliding layer hands over only the blocks its window reads, a full one all), each
cell is taken from one prefill rank that holds it (a replicated head from replica
``dst_rank % replicas``: one sender per decode copy, the readers spread over the
replicas), and neighbouring cells of one sender are merged into pieces. So a prompt's KV
crosses the wire once per decode copy of it, never once per prefill replica (TensorRT-LLM
``get_peer_overlap`` / ``duplicate_head_factor``). A pairing that cannot be planned (other
model, other layer or head count, a side whose ranks do not tile the model) raises
``TransferPlanError`` with the reason, so the link is refused instead of a hand-over that
never completes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from xllm_py.model.sharding import kv_head_range

Span = tuple[int, int]  # [start, end)


class TransferPlanError(ValueError):
    """Two layouts whose KV cannot be handed over, or a layout that does not tile its model."""


@dataclasses.dataclass(frozen=True)
class RankKV:
    """What one rank holds: model layers ``layers`` x model KV heads ``heads``."""

    layers: Span
    heads: Span


@dataclasses.dataclass(frozen=True)
class KVLayout:
    num_layers: int  # the model's layers (not the pool's slots: kv_groups.py)
    num_kv_heads: int  # the model's KV heads
    tp_size: int
    pp_size: int
    ranks: tuple[RankKV, ...]  # pp_rank * tp + tp_rank
    model: str = ""  # "" = not known, not compared
    layer_windows: tuple[int, ...] = ()  # per model layer: 0 full, W sliding; () = not known

    def error(self) -> str | None:
        """Why the ranks do not tile the model (every (layer, head) held by a rank of
        every stage), or None."""
        if self.num_layers <= 0 or self.num_kv_heads <= 0:
            return f"{self.num_layers} layers and {self.num_kv_heads} KV heads: both must be positive"
        if self.tp_size <= 0 or self.pp_size <= 0:
            return f"TP {self.tp_size} x PP {self.pp_size}: both must be positive"
        if len(self.ranks) != self.tp_size * self.pp_size:
            return (f"{len(self.ranks)} ranks registered for TP {self.tp_size} x PP "
                    f"{self.pp_size}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            return f"{len(self.layer_windows)} layer kinds for {self.num_layers} layers"
        next_layer = 0
        for stage in range(self.pp_size):
            ranks = self.ranks[stage * self.tp_size:(stage + 1) * self.tp_size]
            layers = ranks[0].layers
            if any(r.layers != layers for r in ranks):
                return f"the TP ranks of stage {stage} hold different layers"
            if layers[0] != next_layer or layers[1] <= layers[0]:
                return (f"stage {stage} holds layers [{layers[0]}, {layers[1]}): stages must "
                        f"hold consecutive non-empty ranges from layer 0")
            next_layer = layers[1]
            held = set()
            for r in ranks:
                if not 0 <= r.heads[0] < r.heads[1] <= self.num_kv_heads:
                    return (f"KV heads [{r.heads[0]}, {r.heads[1]}) outside the model's "
                            f"{self.num_kv_heads}")
                held.update(range(*r.heads))
            if len(held) != self.num_kv_heads:
                return f"the TP ranks of stage {stage} do not hold every KV head"
        if next_layer != self.num_layers:
            return f"the stages hold {next_layer} of the model's {self.num_layers} layers"
        return None


def rank_of(stage: int, pp: int, tp: int = 1, tp_rank: int = 0) -> int:
    """The process rank of TP index ``tp_rank`` of pipeline stage ``stage``: rank 0, the
    engine, runs the last stage (it samples) and the next ranks the stages from the first,
    each stage's TP ranks in order. The one mapping both the stages' processes
    (parallel/pipeline.py) and the KV moves addressed to their workers use."""
    return (stage + 1) % pp * tp + tp_rank


def stage_of(rank: int, pp: int, tp: int = 1) -> int:
    """The stage process rank ``rank`` runs (the inverse of rank_of)."""
    return (rank // tp - 1) % pp


def worker_rank(layout: KVLayout, index: int) -> int:
    """The registered worker (its index in cluster_ids / addrs: the process rank) that
    holds ``layout.ranks[index]`` (``rank_of``)."""
    stage, tp_rank = divmod(index, layout.tp_size)
    return rank_of(stage, layout.pp_size, layout.tp_size, tp_rank)


def pp_layer_ranges(num_layers: int, pp: int,
                    partition: Sequence[int] | None = None) -> list[Span]:
    """Each stage's layers: ``partition`` (layer counts, summing to ``num_layers``) or an
    even split whose remainder goes to the first stages (the last one also computes the
    logits). ``TransferPlanError`` when it does not divide."""
    if pp <= 0 or pp > num_layers:
        raise TransferPlanError(f"{num_layers} layers cannot be split into {pp} stages")
    if partition is None:
        per, extra = divmod(num_layers, pp)
        partition = [per + (s < extra) for s in range(pp)]
    if len(partition) != pp or sum(partition) != num_layers or min(partition) <= 0:
        raise TransferPlanError(f"layer partition {list(partition)} does not split "
                                f"{num_layers} layers into {pp} non-empty stages")
    out, start = [], 0
    for count in partition:
        out.append((start, start + count))
        start += count
    return out


def kv_layout(num_layers: int, num_kv_heads: int, tp: int = 1, pp: int = 1,
              partition: Sequence[int] | None = None, model: str = "",
              layer_windows: Sequence[int] = ()) -> KVLayout:
    """The layout of a TP x PP instance as the engine shards it (sharding.py, the split
    of ``pp_layer_ranges``)."""
    if tp <= 0 or (num_kv_heads % tp and tp % num_kv_heads):
        raise TransferPlanError(f"{num_kv_heads} KV heads cannot be split over {tp} ranks "
                                f"(nor replicated)")
    ranks = tuple(RankKV(layers, kv_head_range(num_kv_heads, tp, t))
                  for layers in pp_layer_ranges(num_layers, pp, partition) for t in range(tp))
    return KVLayout(num_layers, num_kv_heads, tp, pp, ranks, model, tuple(layer_windows))


@dataclasses.dataclass(frozen=True)
class KVPiece:
    """Layers ``layers`` x KV heads ``heads`` (model indices) of prefill rank ``src_rank``
    go to decode rank ``dst_rank``; ``window`` is the layers' kind (0 full attention, W a
    sliding window: only its window's blocks move)."""

    src_rank: int
    dst_rank: int
    layers: Span
    heads: Span
    window: int
    src_head: int  # heads[0] in the prefill rank's pool (its local index)
    dst_head: int  # heads[0] in the decode rank's pool

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def head_move(self) -> tuple[int, int, int]:
        """(src_start, dst_start, count) in the ranks' pools: a KV move's head slice."""
        return self.src_head, self.dst_head, self.num_heads


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    src: KVLayout  # the prefill's
    dst: KVLayout  # the decode's
    pieces: tuple[KVPiece, ...]  # by decode rank, then layer, then head

    def to_rank(self, dst_rank: int) -> list[KVPiece]:
        return [p for p in self.pieces if p.dst_rank == dst_rank]

    def from_rank(self, src_rank: int) -> list[KVPiece]:
        return [p for p in self.pieces if p.src_rank == src_rank]

    def reads(self) -> dict[int, list[int]]:
        """Per decode rank, the prefill ranks it exchanges KV with (the ones to link)."""
        out: dict[int, set[int]] = {}
        for p in self.pieces:
            out.setdefault(p.dst_rank, set()).add(p.src_rank)
        return {d: sorted(s) for d, s in sorted(out.items())}


def pairing_error(src: KVLayout, dst: KVLayout) -> str | None:
    """Why the prefill layout ``src`` cannot hand KV to the decode layout ``dst``, or None."""
    for side, layout in (("prefill", src), ("decode", dst)):
        error = layout.error()
        if error is not None:
            return f"the {side}'s layout (TP {layout.tp_size} x PP {layout.pp_size}): {error}"
    if src.model and dst.model and src.model != dst.model:
        return f"different models: prefill {src.model!r}, decode {dst.model!r}"
    if src.num_layers != dst.num_layers:
        return f"different layer counts: prefill {src.num_layers}, decode {dst.num_layers}"
    if src.num_kv_heads != dst.num_kv_heads:
        return f"different KV head counts: prefill {src.num_kv_heads}, decode {dst.num_kv_heads}"
    if src.layer_windows and dst.layer_windows and src.layer_windows != dst.layer_windows:
        return "different layer kinds (sliding / full attention) on the two sides"
    return None


def _cuts(span: Span, bounds: set[int]) -> list[Span]:
    points = [span[0]] + sorted(b for b in bounds if span[0] < b < span[1]) + [span[1]]
    return list(zip(points, points[1:]))


def transfer_plan(src: KVLayout, dst: KVLayout) -> TransferPlan:
    """The pieces that give every rank of ``dst`` its KV from ``src`` (module doc);
    ``TransferPlanError`` when the pairing cannot be planned."""
    error = pairing_error(src, dst)
    if error is not None:
        raise TransferPlanError(error)
    windows = src.layer_windows or dst.layer_windows or (0,) * src.num_layers
    layer_bounds = {i for i in range(1, src.num_layers) if windows[i] != windows[i - 1]}
    head_bounds: set[int] = set()
    for r in src.ranks:
        layer_bounds.update(r.layers)
        head_bounds.update(r.heads)
    pieces: list[KVPiece] = []
    for d, mine in enumerate(dst.ranks):
        open_at: dict[tuple[int, Span], int] = {}  # (src, heads) -> index of a piece ending here
        for layers in _cuts(mine.layers, layer_bounds):
            row: list[tuple[int, Span]] = []  # this layer cut's (src, heads), heads merged
            for heads in _cuts(mine.heads, head_bounds):
                holders = [s for s, r in enumerate(src.ranks)
                           if r.layers[0] <= layers[0] and layers[1] <= r.layers[1]
                           and r.heads[0] <= heads[0] and heads[1] <= r.heads[1]]
                s = holders[d % len(holders)]  # error() checked that every cell is held
                if row and row[-1][0] == s and row[-1][1][1] == heads[0]:
                    row[-1] = (s, (row[-1][1][0], heads[1]))
                else:
                    row.append((s, heads))
            for s, heads in row:
                i = open_at.get((s, heads))
                prev = pieces[i] if i is not None else None
                if (prev is not None and prev.layers[1] == layers[0]
                        and prev.window == windows[layers[0]]):
                    pieces[i] = dataclasses.replace(prev, layers=(prev.layers[0], layers[1]))
                    continue
                open_at[(s, heads)] = len(pieces)
                pieces.append(KVPiece(s, d, layers, heads, windows[layers[0]],
                                      heads[0] - src.ranks[s].heads[0],
                                      heads[0] - mine.heads[0]))
    pieces.sort(key=lambda p: (p.dst_rank, p.layers[0], p.heads[0]))
    return TransferPlan(src, dst, tuple(pieces))
