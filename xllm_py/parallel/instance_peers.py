"""InstancePeers: what one instance's PD code calls (engine/pd/peers.PDPeers): the other
engines' DisaggPDService, and its own KV workers, one per rank, for KV moves between PD
instances of any TP and PP sizes.

Stages (decode, PULL): a prefill links (LinkInstance) -> the transfer plan of the pair is
computed from both registrations (``model/kv_layout.transfer_plan``: each decode rank's
layers x KV heads, each from one prefill rank that holds them) and kept with the peer ->
each of our ranks' workers links the prefill ranks the plan has it read -> per hand-over,
every move runs on its decode rank's worker at once: whole blocks where a decode rank
reads one prefill rank's whole pool, else a slice of heads and layers (a pipeline stage
holds some layers: the move takes the overlap of the two ranks' layers, at each pool's
offset). Prefill, PUSH: the plan is made at
LinkInstance and every move runs on its prefill rank's worker, into the decode rank's
heads. A hand-over is done when every move is. Between two TP 1 instances a move or a link
goes as it is to rank 0's worker.

The workers are KVWorkerClients (kv_transfer/kv_worker.py), rank 0 first: the engine's
own worker called in this process (kv_transfer/in_process.py: no gRPC call to ourselves),
ranks > 0 over their WorkerService (rpc/pd_peers.GrpcWorkerClient). The peer of a move is
known by its rank 0's cluster id, the one a KVMove names (recorded when it linked).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging

from xllm_py.cluster.instance_meta import InstanceMeta, pair_layouts
from xllm_py.kv_transfer.kv_worker import KVWorkerClient
from xllm_py.model.kv_groups import KVGroups, kv_groups
from xllm_py.model.kv_layout import TransferPlan, TransferPlanError, transfer_plan, worker_rank
from xllm_py.pd_messages import HandOver, KVMove, OfflinePull, PeerLink, Placement
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.rpc.pd_peers import PDServiceClient
from xllm_py.status import Status, StatusError

logger = logging.getLogger(__name__)

# (src_head, dst_head, heads[, src_layer, dst_layer, layers]) in the two ranks' pools
Heads = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class RankMove:
    src_rank: int  # the prefill's worker that has the KV (registration index)
    dst_rank: int  # the decode's worker that receives it
    heads: Heads | None  # the KV slice (kv_transfer/head_slices.py); None: whole blocks
    # a hybrid model's stages: per KV group (its index, its slice); the move of each
    # takes the hand-over's blocks of that group only (KVMove.group_blocks)
    groups: tuple[tuple[int, Heads], ...] = ()


def rank_moves(plan: TransferPlan) -> list[RankMove]:
    """The transfers of a hand-over under ``plan``: one per (prefill rank, decode rank, head
    slice), covering the layers both hold; whole blocks where that is each rank's whole
    pool, a head slice where it is every layer of both, else a slice of heads and layers
    (pool indices: a stage's pool starts at its first layer). A hybrid model's pools hold
    KV group slots, not layers (model/kv_groups.py): between stages, a slice per group of
    the slots the layers both hold use."""
    windows = plan.src.layer_windows or plan.dst.layer_windows
    groups = kv_groups(windows) if windows else None
    if groups is not None and not groups.hybrid:
        groups = None  # (one group: the slots are the layers)
    spans: dict[tuple[int, int, tuple[int, int, int]], list[tuple[int, int]]] = {}
    for p in plan.pieces:
        spans.setdefault((p.src_rank, p.dst_rank, p.head_move), []).append(p.layers)
    moves = []
    for (s, d, heads), layers in spans.items():
        lo, hi = min(a for a, _ in layers), max(b for _, b in layers)
        if sum(b - a for a, b in layers) != hi - lo:  # (ranks hold contiguous layers)
            raise TransferPlanError(f"prefill rank {s} -> decode rank {d}: layers {layers} "
                                    "are not one range")
        src, dst = plan.src.ranks[s], plan.dst.ranks[d]
        per_group: tuple[tuple[int, Heads], ...] = ()
        # (a hybrid model's stage pools a slot where any of its layers uses it, so a block
        # of a stage carries slots of other stages' layers: moved per group instead)
        if src.layers == dst.layers == (lo, hi) and (groups is None or lo == 0
                                                     and hi == len(windows)):
            whole = src.heads == dst.heads and heads[2] == src.heads[1] - src.heads[0]
            kv = None if whole else heads
        elif groups is not None:
            kv, per_group = None, _group_slices(groups, src.layers, dst.layers, lo, hi, heads)
        else:
            kv = (*heads, lo - src.layers[0], lo - dst.layers[0], hi - lo)
        moves.append(RankMove(worker_rank(plan.src, s), worker_rank(plan.dst, d), kv,
                              per_group))
    return moves


def _group_slices(groups: KVGroups, src_layers: tuple[int, int], dst_layers: tuple[int, int],
                  lo: int, hi: int, heads: tuple[int, int, int]
                  ) -> tuple[tuple[int, Heads], ...]:
    """Per KV group with layers in [lo, hi): the slice of their slots in the two stages'
    pools. A group's layers take its slots in layer order, so those in a range of layers
    hold consecutive slots, at consecutive indices of a pool holding them all."""
    src, dst = groups.stage(*src_layers), groups.stage(*dst_layers)
    out = []
    for j in range(groups.num_groups):
        slots = [groups.layer_slot[i] for i in range(lo, hi) if groups.layer_group[i] == j]
        if slots:
            out.append((j, (*heads, src.slots.index(slots[0]), dst.slots.index(slots[0]),
                            len(slots))))
    return tuple(out)


class InstancePeers:
    def __init__(self, meta: InstanceMeta, engines: PDServiceClient,
                 workers: list[KVWorkerClient], layer_windows: tuple[int, ...] = ()) -> None:
        self.meta = meta
        self.engines = engines
        self.workers = workers  # one per rank, rank 0 first
        # per model layer its window (0 full attention): a hybrid model's stages hold KV
        # group slots; both sides run one model, so ours are the peer's (() = not known)
        self.layer_windows = tuple(layer_windows)
        # rank 0's cluster id -> (linked peer, the moves of a hand-over with it)
        self._peers: dict[int, tuple[InstanceMeta, list[RankMove]]] = {}

    async def close(self) -> None:
        for worker in self.workers:
            await worker.close()
        await self.engines.close()

    # ---- the other engines' DisaggPDService
    async def link_instance(self, decode: InstanceMeta, prefill: InstanceMeta) -> None:
        self._remember(decode, we_send=True)  # a pairing the plan refuses never links
        await self.engines.link_instance(decode, prefill)

    async def add_new_request(self, decode: InstanceMeta, prefill: InstanceMeta,
                              spec: EngineRequestSpec) -> Placement:
        return await self.engines.add_new_request(decode, prefill, spec)

    async def first_generation(self, decode: InstanceMeta, handover: HandOver,
                               timeout_s: float) -> str:
        return await self.engines.first_generation(decode, handover, timeout_s)

    async def send_pull_signal(self, prefill: InstanceMeta, pull: OfflinePull) -> int:
        return await self.engines.send_pull_signal(prefill, pull)

    # ---- our KV workers
    async def push_kv(self, move: KVMove) -> None:
        """Prefill, PUSH: our ranks' KV into the decode's."""
        await asyncio.gather(*(self.workers[rank].push_kv(m, heads)
                               for rank, m, heads in self._plan(move, we_send=True)))

    async def pull_kv(self, move: KVMove) -> None:
        """Decode, PULL: the prefill's KV into our ranks'."""
        await asyncio.gather(*(self.workers[rank].pull_kv(m, heads)
                               for rank, m, heads in self._plan(move, we_send=False)))

    async def link_cluster(self, link: PeerLink) -> None:
        """Decode: each of our ranks' workers links the prefill ranks it reads."""
        prefill = link.meta
        if not self._is_tp(prefill):
            await self.workers[0].link_cluster(link)
            return
        if prefill is None:
            raise StatusError(Status.FAILED_PRECONDITION, "a tensor-parallel decode needs "
                              "the prefill's meta (tp_size, KV heads) to link")
        moves = self._remember(prefill, we_send=False)
        reads: dict[int, set[int]] = {}
        for m in moves:
            reads.setdefault(m.dst_rank, set()).add(m.src_rank)
        # Each worker holds some heads and layers: the instances' were compared already.
        for rank, srcs in sorted(reads.items()):
            ranks = sorted(srcs)
            meta = dataclasses.replace(prefill, num_kv_heads=0, num_layers=0,
                                       transfer_keys=[_key(prefill, s) for s in ranks])
            await self.workers[rank].link_cluster(PeerLink(
                link.instance_name, [prefill.cluster_ids[s] for s in ranks],
                [prefill.addrs[s] for s in ranks], meta))

    def _plan(self, move: KVMove, we_send: bool) -> list[tuple[int, KVMove, Heads | None]]:
        """(our rank, its move, heads) for each transfer of ``move``: between two TP 1
        instances the move itself on rank 0's worker; else one per rank pair, addressed to
        the peer rank's worker."""
        peer, moves = self._peers.get(move.cluster_id, (None, []))
        if peer is None and self.meta.tp_size * self.meta.pp_size > 1:
            raise StatusError(Status.BAD_GATEWAY, f"KV move of {move.request_id}: no linked "
                              f"peer with cluster id {move.cluster_id} (its TP x PP layout "
                              "is needed to split the KV)")
        if not self._is_tp(peer):
            return [(0, move, None)]
        plan = []
        for m in moves:
            ours, theirs = (m.src_rank, m.dst_rank) if we_send else (m.dst_rank, m.src_rank)
            to = dataclasses.replace(move, cluster_id=peer.cluster_ids[theirs],
                                     addr=peer.addrs[theirs], transfer_key=_key(peer, theirs))
            if not m.groups:
                plan.append((ours, to, m.heads))
                continue
            parts = _group_parts(move)
            for j, heads in m.groups:
                lo, hi = parts[j] if j < len(parts) else (0, 0)
                if hi > lo:
                    plan.append((ours, dataclasses.replace(
                        to, src_blocks=move.src_blocks[lo:hi],
                        dst_blocks=move.dst_blocks[lo:hi]), heads))
        return plan

    def _remember(self, peer: InstanceMeta | None, we_send: bool) -> list[RankMove]:
        """Plan the hand-overs with ``peer`` from both registrations and keep the plan;
        FAILED_PRECONDITION when the layouts cannot be planned."""
        if peer is None or not peer.cluster_ids:
            return []
        if not self._is_tp(peer):
            moves = [RankMove(0, 0, None)]
        else:
            src, dst = (self.meta, peer) if we_send else (peer, self.meta)
            try:
                layouts = pair_layouts(src, dst)
                if all(x.num_layers == len(self.layer_windows) for x in layouts):
                    layouts = tuple(dataclasses.replace(x, layer_windows=self.layer_windows)
                                    for x in layouts)
                moves = rank_moves(transfer_plan(*layouts))
            except TransferPlanError as e:
                raise StatusError(Status.FAILED_PRECONDITION,
                                  f"no KV hand-over from {src.name} to {dst.name}: {e}") from e
        self._peers[peer.cluster_ids[0]] = (peer, moves)
        return moves

    def _is_tp(self, peer: InstanceMeta | None) -> bool:
        """More than one rank on either side: moves go through the plan."""
        return (self.meta.tp_size * self.meta.pp_size > 1
                or (peer is not None and peer.tp_size * peer.pp_size > 1))


def _group_parts(move: KVMove) -> list[tuple[int, int]]:
    """Per KV group, the [start, end) of its blocks in ``move``'s lists (groups past
    ``group_blocks`` have none: a push of streamed full-attention blocks)."""
    sizes = move.group_blocks
    if sum(sizes) != len(move.src_blocks) or min(sizes, default=0) < 0:
        raise StatusError(Status.INTERNAL, f"KV move of {move.request_id}: group sizes "
                          f"{list(sizes)} for {len(move.src_blocks)} blocks")
    return [(end - n, end) for n, end in zip(sizes, itertools.accumulate(sizes))]


def _key(peer: InstanceMeta, rank: int) -> str:
    """The transfer key of the peer's rank ``rank`` worker ("" from a peer without keys)."""
    return peer.transfer_keys[rank] if rank < len(peer.transfer_keys) else ""
