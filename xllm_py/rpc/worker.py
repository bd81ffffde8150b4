"""WorkerService wire forms on the worker's side: the requests its servicer reads
(PullKVCache, PushKVCache, LinkCluster, UnlinkCluster) and the replies it sends (Status,
CacheInfo). The engine's side builds them in rpc/pd.py (pull_to_proto, push_to_proto,
cluster_link_to_proto).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from xllm_py.proto import xllm_pb2 as pb
from xllm_py.rpc.status import Status

if TYPE_CHECKING:
    from xllm_py.kv_transfer.worker_service import CacheInfoData, PeerMeta


@dataclasses.dataclass(frozen=True)
class WorkerTransfer:
    """PullKVCache / PushKVCache: `src_blocks` of the side that has the KV into
    `dst_blocks` of the other; `addr` is the peer's worker, `transfer_key` its key."""
    addr: str
    src_blocks: list[int]
    dst_blocks: list[int]
    req_id: str
    transfer_key: str = dataclasses.field(default="", repr=False)
    # a KV head slice (src_head_start, dst_head_start, num_heads) between instances of
    # different TP; None: whole blocks
    heads: tuple[int, int, int] | None = None


@dataclasses.dataclass(frozen=True)
class WorkerLink:
    """LinkCluster / UnlinkCluster: the peer's workers, what its KV looks like (None: the
    sender did not say) and each worker's transfer key."""
    cluster_ids: list[int]
    addrs: list[str]
    peer_meta: "PeerMeta | None" = None
    keys: list[str] = dataclasses.field(default_factory=list, repr=False)


def transfer_from_proto(msg: pb.PullKVCacheRequest | pb.PushKVCacheRequest) -> WorkerTransfer:
    return WorkerTransfer(addr=msg.addr, src_blocks=list(msg.src_blocks),
                          dst_blocks=list(msg.dst_blocks), req_id=msg.req_id,
                          transfer_key=msg.transfer_key,
                          heads=((msg.src_head_start, msg.dst_head_start, msg.num_heads)
                                 if msg.num_heads else None))


def peer_meta_from_proto(m: pb.InstanceMetaInfo) -> "PeerMeta":
    """The compatibility-relevant part of a peer's InstanceMetaInfo."""
    from xllm_py.kv_transfer.worker_service import PeerMeta  # (it imports this module)

    return PeerMeta(model=m.model, block_size=m.block_size, kv_dtype=m.kv_dtype,
                    kv_layout=m.kv_layout, num_layers=m.num_layers,
                    num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)


def link_from_proto(msg: pb.ClusterLink) -> WorkerLink:
    if not msg.HasField("meta"):
        return WorkerLink(list(msg.cluster_ids), list(msg.addrs))
    return WorkerLink(list(msg.cluster_ids), list(msg.addrs), peer_meta_from_proto(msg.meta),
                      list(msg.meta.transfer_keys))


def ok_to_proto() -> pb.Status:
    return pb.Status(ok=True, code=Status.OK.http_status)


def cache_info_to_proto(info: "CacheInfoData") -> pb.CacheInfo:
    return pb.CacheInfo(**dataclasses.asdict(info))
