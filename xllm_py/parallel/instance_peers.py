"""InstancePeers: what one instance's PD code calls (engine/pd/peers.PDPeers): the other
engines' DisaggPDService, and its own KV workers, one per rank, for KV moves between PD
instances of any TP sizes.

Stages (decode, PULL): a prefill links (LinkInstance) -> each of our ranks' workers links
the prefill ranks it reads (``rank_moves``) -> per hand-over, every move runs on its
decode rank's worker at once: whole blocks rank to rank when the TP sizes are equal, else
the rank's own KV heads from each prefill rank that holds them (``mapping.kv_head_plan``).
Prefill, PUSH: every move runs on its prefill rank's worker, into the decode rank's heads.
A hand-over is done when every move is. Between two TP 1 instances a move or a link goes
as it is to rank 0's worker.

The workers are KVWorkerClients (kv_transfer/kv_worker.py), rank 0 first: the engine's
own worker called in this process (kv_transfer/in_process.py: no gRPC call to ourselves),
ranks > 0 over their WorkerService (rpc/pd_peers.GrpcWorkerClient). The peer of a move is
known by its rank 0's cluster id, the one a KVMove names (recorded when it linked).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.kv_transfer.kv_worker import KVWorkerClient
from xllm_py.kv_transfer.mapping import kv_head_plan
from xllm_py.pd_messages import HandOver, KVMove, OfflinePull, PeerLink, Placement
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.rpc.pd_peers import PDServiceClient
from xllm_py.status import Status, StatusError

logger = logging.getLogger(__name__)

Heads = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class RankMove:
    src_rank: int  # the rank that has the KV (prefill)
    dst_rank: int  # the rank that receives it (decode)
    heads: Heads | None  # (src_start, dst_start, count) local head indices; None: whole blocks


def rank_moves(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[RankMove]:
    """Every transfer a hand-over needs: equal TP, rank to rank whole blocks; else each
    decode rank's heads from the prefill ranks that hold them."""
    if src_tp == dst_tp:
        return [RankMove(r, r, None) for r in range(dst_tp)]
    return [RankMove(sl.src_rank, d, (sl.src_start, sl.dst_start, sl.count))
            for d in range(dst_tp) for sl in kv_head_plan(num_kv_heads, src_tp, dst_tp, d)]


class InstancePeers:
    def __init__(self, meta: InstanceMeta, engines: PDServiceClient,
                 workers: list[KVWorkerClient]) -> None:
        self.meta = meta
        self.engines = engines
        self.workers = workers  # one per rank, rank 0 first
        self._peers: dict[int, InstanceMeta] = {}  # rank 0's cluster id -> linked peer

    async def close(self) -> None:
        for worker in self.workers:
            await worker.close()
        await self.engines.close()

    # ---- the other engines' DisaggPDService
    async def link_instance(self, decode: InstanceMeta, prefill: InstanceMeta) -> None:
        await self.engines.link_instance(decode, prefill)
        self._remember(decode)

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
        self._remember(prefill)
        reads: dict[int, set[int]] = {}
        for m in rank_moves(self.meta.num_kv_heads, prefill.tp_size, self.meta.tp_size):
            reads.setdefault(m.dst_rank, set()).add(m.src_rank)
        # Each worker holds some heads: the instances' head counts were compared already.
        for rank, srcs in sorted(reads.items()):
            ranks = sorted(srcs)
            meta = dataclasses.replace(prefill, num_kv_heads=0,
                                       transfer_keys=[_key(prefill, s) for s in ranks])
            await self.workers[rank].link_cluster(PeerLink(
                link.instance_name, [prefill.cluster_ids[s] for s in ranks],
                [prefill.addrs[s] for s in ranks], meta))

    def _plan(self, move: KVMove, we_send: bool) -> list[tuple[int, KVMove, Heads | None]]:
        """(our rank, its move, heads) for each transfer of ``move``: between two TP 1
        instances the move itself on rank 0's worker; else one per rank pair, addressed to
        the peer rank's worker."""
        peer = self._peers.get(move.cluster_id)
        if peer is None and self.meta.tp_size > 1:
            raise StatusError(Status.BAD_GATEWAY, f"KV move of {move.request_id}: no linked "
                              f"peer with cluster id {move.cluster_id} (its TP layout is "
                              "needed to split the KV heads)")
        if not self._is_tp(peer):
            return [(0, move, None)]
        src_tp, dst_tp = ((self.meta.tp_size, peer.tp_size) if we_send
                          else (peer.tp_size, self.meta.tp_size))
        plan = []
        for m in rank_moves(self.meta.num_kv_heads, src_tp, dst_tp):
            ours, theirs = (m.src_rank, m.dst_rank) if we_send else (m.dst_rank, m.src_rank)
            plan.append((ours, dataclasses.replace(
                move, cluster_id=peer.cluster_ids[theirs], addr=peer.addrs[theirs],
                transfer_key=_key(peer, theirs)), m.heads))
        return plan

    def _remember(self, peer: InstanceMeta | None) -> None:
        if peer is not None and peer.cluster_ids:
            self._peers[peer.cluster_ids[0]] = peer

    def _is_tp(self, peer: InstanceMeta | None) -> bool:
        return self.meta.tp_size > 1 or (peer is not None and peer.tp_size > 1)


def _key(peer: InstanceMeta, rank: int) -> str:
    """The transfer key of the peer's rank ``rank`` worker ("" from a peer without keys)."""
    return peer.transfer_keys[rank] if rank < len(peer.transfer_keys) else ""
