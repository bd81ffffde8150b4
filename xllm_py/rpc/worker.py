"""WorkerService wire forms on the worker's side: the requests its servicer reads
(PullKVCache, PushKVCache, LinkCluster, UnlinkCluster) and the replies it sends (Status,
CacheInfo, TransferMetrics). The engine's side builds the requests in rpc/pd.py
(pull_to_proto, push_to_proto, cluster_link_to_proto) and reads TransferMetrics with
``transfer_metrics_from_proto``.
"""
from __future__ import annotations

import dataclasses

from xllm_py.kv_transfer.kv_worker import CacheInfoData, PeerMeta
from xllm_py.kv_transfer.metrics import TransferSnapshot
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.status import Status


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
    # different TP, + (src_layer_start, dst_layer_start, num_layers) between pipeline
    # stages (kv_transfer/head_slices.py); None: whole blocks
    heads: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class WorkerLink:
    """LinkCluster / UnlinkCluster: the peer's workers, what its KV looks like (None: the
    sender did not say) and each worker's transfer key."""
    cluster_ids: list[int]
    addrs: list[str]
    peer_meta: PeerMeta | None = None
    keys: list[str] = dataclasses.field(default_factory=list, repr=False)


def transfer_from_proto(msg: pb.PullKVCacheRequest | pb.PushKVCacheRequest) -> WorkerTransfer:
    return WorkerTransfer(addr=msg.addr, src_blocks=list(msg.src_blocks),
                          dst_blocks=list(msg.dst_blocks), req_id=msg.req_id,
                          transfer_key=msg.transfer_key,
                          heads=_slice_from_proto(msg))


def _slice_from_proto(msg: pb.PullKVCacheRequest | pb.PushKVCacheRequest
                      ) -> tuple[int, ...] | None:
    """The move's heads (and layers) slice; None: whole blocks. ValueError for a layer
    range without heads: moved as whole blocks it could pass every size check between
    pools of one shape and copy the wrong layers."""
    if not msg.num_heads:
        if msg.num_layers or msg.src_layer_start or msg.dst_layer_start:
            raise ValueError("a layer range (num_layers, src/dst_layer_start) needs num_heads > 0")
        return None
    heads = (msg.src_head_start, msg.dst_head_start, msg.num_heads)
    if msg.num_layers:
        return (*heads, msg.src_layer_start, msg.dst_layer_start, msg.num_layers)
    return heads


def peer_meta_from_proto(m: pb.InstanceMetaInfo) -> PeerMeta:
    """The compatibility-relevant part of a peer's InstanceMetaInfo."""
    return PeerMeta.of(m)


def link_from_proto(msg: pb.ClusterLink) -> WorkerLink:
    if not msg.HasField("meta"):
        return WorkerLink(list(msg.cluster_ids), list(msg.addrs))
    return WorkerLink(list(msg.cluster_ids), list(msg.addrs), peer_meta_from_proto(msg.meta),
                      list(msg.meta.transfer_keys))


def ok_to_proto() -> pb.Status:
    return pb.Status(ok=True, code=Status.OK.http_status)


def cache_info_to_proto(info: CacheInfoData) -> pb.CacheInfo:
    return pb.CacheInfo(**dataclasses.asdict(info))


def transfer_metrics_request() -> pb.Empty:
    """GetTransferMetrics' request (it asks nothing)."""
    return pb.Empty()


def transfer_metrics_to_proto(snap: TransferSnapshot) -> pb.TransferMetrics:
    msg = pb.TransferMetrics(buckets=list(snap.buckets))
    for op in sorted(set(snap.bytes_total) | set(snap.blocks_total) | set(snap.hist_counts)):
        msg.ops.add(op=op, bytes=snap.bytes_total.get(op, 0),
                    blocks=snap.blocks_total.get(op, 0),
                    bucket_counts=snap.hist_counts.get(op, []),
                    seconds_sum=snap.hist_sum.get(op, 0.0))
    for (op, reason), n in sorted(snap.failures_total.items()):
        msg.failures.add(op=op, reason=reason, count=n)
    return msg


def transfer_metrics_from_proto(msg: pb.TransferMetrics) -> TransferSnapshot:
    """ValueError when a histogram does not match the bucket list (a peer's bug: the
    series would be wrong)."""
    buckets = tuple(msg.buckets)
    hist_counts, hist_sum = {}, {}
    for o in msg.ops:
        if not o.bucket_counts:
            continue
        if len(o.bucket_counts) != len(buckets) + 1:
            raise ValueError(f"op {o.op!r}: {len(o.bucket_counts)} bucket counts for "
                             f"{len(buckets)} buckets (+Inf)")
        hist_counts[o.op], hist_sum[o.op] = list(o.bucket_counts), o.seconds_sum
    return TransferSnapshot(
        buckets=buckets, bytes_total={o.op: o.bytes for o in msg.ops},
        blocks_total={o.op: o.blocks for o in msg.ops},
        failures_total={(f.op, f.reason): f.count for f in msg.failures},
        hist_counts=hist_counts, hist_sum=hist_sum)
