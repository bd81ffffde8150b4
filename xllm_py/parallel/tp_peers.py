"""KV moves between PD instances of any TP sizes, rank by rank.

Stages (decode, PULL): a prefill links (LinkInstance) -> each of our ranks' workers links
the prefill ranks it reads (``pull_moves``) -> per hand-over, every move runs on its
decode rank's worker at once: whole blocks rank to rank when the TP sizes are equal, else
the rank's own KV heads from each prefill rank that holds them (``mapping.kv_head_plan``).
Prefill, PUSH: every move runs on its prefill rank's worker, into the decode rank's heads.
A hand-over is done when every move is.

``TPGrpcPeers`` is ``GrpcPeers`` (rpc/pd_peers.py) with those fan-outs; both TP 1:
GrpcPeers. The moves and links of rank 0's worker, which lives in this process, go
straight to it (``local``, kv_transfer/in_process.py): no gRPC call to ourselves; ranks
> 0 are other processes, reached through their WorkerService. The peer of a move is known by its rank 0's cluster id, the one a
KVMove names (recorded when it linked).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.rpc.pd_peers import GrpcPeers
from xllm_py.pd_messages import KVMove, PeerLink
from xllm_py.kv_transfer.in_process import InProcessWorker
from xllm_py.kv_transfer.mapping import kv_head_plan
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.rpc import pd as wire
from xllm_py.rpc.status import Status, StatusError

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


class TPGrpcPeers(GrpcPeers):
    def __init__(self, meta: InstanceMeta, rpc_timeout_s: float, transfer_timeout_s: float,
                 credentials: grpc.ChannelCredentials | None = None,
                 local: InProcessWorker | None = None) -> None:
        super().__init__(meta.worker_rpc_addrs[0] if meta.worker_rpc_addrs else "",
                         rpc_timeout_s, transfer_timeout_s, credentials)
        self.meta = meta
        self.local = local  # rank 0's worker, in this process (called directly)
        self._peers: dict[int, InstanceMeta] = {}  # rank 0's cluster id -> linked peer
        # One GrpcPeers per rank's worker (rank 0's is this one).
        self._ranks = [self] + [GrpcPeers(a, rpc_timeout_s, transfer_timeout_s, credentials)
                                for a in meta.worker_rpc_addrs[1:]]

    def _rank_worker(self, rank: int) -> pb_grpc.WorkerServiceStub:
        return self._ranks[rank]._worker()

    async def close(self) -> None:
        for peers in self._ranks[1:]:
            await peers.close()
        await super().close()

    def _remember(self, peer: InstanceMeta | None) -> None:
        if peer is not None and peer.cluster_ids:
            self._peers[peer.cluster_ids[0]] = peer

    def _is_tp(self, peer: InstanceMeta | None) -> bool:
        return self.meta.tp_size > 1 or (peer is not None and peer.tp_size > 1)

    def _peer(self, move: KVMove) -> InstanceMeta | None:
        peer = self._peers.get(move.cluster_id)
        if peer is None and self.meta.tp_size > 1:
            raise StatusError(Status.BAD_GATEWAY, f"KV move of {move.request_id}: no linked "
                              f"peer with cluster id {move.cluster_id} (its TP layout is "
                              "needed to split the KV heads)")
        return peer

    # ---- prefill: a decode links; PUSH
    async def link_instance(self, decode: InstanceMeta, prefill: InstanceMeta) -> None:
        await super().link_instance(decode, prefill)
        self._remember(decode)

    async def push_kv(self, move: KVMove) -> None:
        decode = self._peer(move)
        if not self._is_tp(decode):
            await (self.local.push_kv(move) if self.local else super().push_kv(move))
            return
        moves = rank_moves(self.meta.num_kv_heads, self.meta.tp_size, decode.tp_size)
        await asyncio.gather(*(self._move(
            "push", m.src_rank, dataclasses.replace(
                move, cluster_id=decode.cluster_ids[m.dst_rank], addr=decode.addrs[m.dst_rank],
                transfer_key=_key(decode, m.dst_rank)), m.heads)
            for m in moves))

    async def _move(self, op: str, rank: int, move: KVMove, heads) -> None:
        """One move on our rank ``rank``'s worker: rank 0's in this process directly."""
        if rank == 0 and self.local is not None:
            await (self.local.pull_kv if op == "pull" else self.local.push_kv)(move, heads)
            return
        worker = self._rank_worker(rank)
        if op == "pull":
            await self._transfer(op, worker.PullKVCache, wire.pull_to_proto(move, heads))
        else:
            await self._transfer(op, worker.PushKVCache, wire.push_to_proto(move, heads))

    # ---- decode: a prefill links; PULL
    async def link_cluster(self, link: PeerLink) -> None:
        prefill = link.meta
        if not self._is_tp(prefill):
            await (self.local.link_cluster(link) if self.local else super().link_cluster(link))
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
            sub = PeerLink(link.instance_name, [prefill.cluster_ids[s] for s in ranks],
                           [prefill.addrs[s] for s in ranks], meta)
            if rank == 0 and self.local is not None:  # our own worker, in this process
                await self.local.link_cluster(sub)
            elif rank == 0:  # (this object is rank 0's GrpcPeers)
                await super().link_cluster(sub)
            else:
                await self._ranks[rank].link_cluster(sub)

    async def pull_kv(self, move: KVMove) -> None:
        prefill = self._peer(move)
        if not self._is_tp(prefill):
            await (self.local.pull_kv(move) if self.local else super().pull_kv(move))
            return
        moves = rank_moves(self.meta.num_kv_heads, prefill.tp_size, self.meta.tp_size)
        await asyncio.gather(*(self._move(
            "pull", m.dst_rank, dataclasses.replace(
                move, cluster_id=prefill.cluster_ids[m.src_rank], addr=prefill.addrs[m.src_rank],
                transfer_key=_key(prefill, m.src_rank)), m.heads)
            for m in moves))


def _key(peer: InstanceMeta, rank: int) -> str:
    """The transfer key of the peer's rank ``rank`` worker ("" from a peer without keys)."""
    return peer.transfer_keys[rank] if rank < len(peer.transfer_keys) else ""
