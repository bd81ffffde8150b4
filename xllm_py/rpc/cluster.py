"""Cluster wire forms: InstanceMeta <-> InstanceMetaInfo (RegisterInstance,
GetInstanceInfo, LinkInstance, ClusterLink) and the engines' heartbeats. No module
outside xllm_py/rpc/ builds or reads these messages.
"""
from __future__ import annotations

from xllm_py.cluster.instance_meta import SCHEMA_VERSION, InstanceMeta, InstanceMetaError
from xllm_py.config import InstanceRole
from xllm_py.proto import xllm_pb2 as pb


# ---------------------------------------------------------------- InstanceMetaInfo
def instance_meta_to_proto(meta: InstanceMeta) -> pb.InstanceMetaInfo:
    return pb.InstanceMetaInfo(
        name=meta.name,
        rpc_address=meta.rpc_address,
        type=pb.InstanceType.Value(meta.type.value),
        cluster_ids=meta.cluster_ids,
        addrs=meta.addrs,
        ports=meta.ports,
        dp_size=meta.dp_size,
        incarnation_id=meta.incarnation_id,
        register_ts_ms=meta.register_ts_ms,
        kv_split_size=meta.kv_split_size,
        schema_version=meta.schema_version,
        model=meta.model,
        block_size=meta.block_size,
        kv_layout=meta.kv_layout,
        kv_dtype=meta.kv_dtype,
        tp_size=meta.tp_size,
        num_layers=meta.num_layers,
        num_kv_heads=meta.num_kv_heads,
        head_dim=meta.head_dim,
        num_blocks=meta.num_blocks,
        http_address=meta.http_address,
        worker_rpc_addrs=meta.worker_rpc_addrs,
        draining=meta.draining,
        transfer_keys=meta.transfer_keys,
        pp_size=meta.pp_size,
        rank_kv=[v for span in meta.rank_kv for v in span],
    )


def instance_meta_from_proto(msg: pb.InstanceMetaInfo) -> InstanceMeta:
    """Raises InstanceMetaError (a ValueError) on a meta without a name."""
    if not msg.name:
        raise InstanceMetaError("InstanceMetaInfo.name must not be empty")
    return InstanceMeta(
        name=msg.name,
        type=role_from_proto(msg.type),
        rpc_address=msg.rpc_address,
        cluster_ids=list(msg.cluster_ids),
        addrs=list(msg.addrs),
        ports=list(msg.ports),
        dp_size=msg.dp_size or 1,
        incarnation_id=msg.incarnation_id,
        register_ts_ms=msg.register_ts_ms,
        kv_split_size=msg.kv_split_size or 1,
        # proto3 has no presence: 0 means an old writer that predates versioning.
        schema_version=msg.schema_version or SCHEMA_VERSION,
        model=msg.model,
        block_size=msg.block_size,
        kv_layout=msg.kv_layout,
        kv_dtype=msg.kv_dtype,
        tp_size=msg.tp_size or 1,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        num_blocks=msg.num_blocks,
        http_address=msg.http_address,
        worker_rpc_addrs=list(msg.worker_rpc_addrs),
        draining=msg.draining,
        transfer_keys=list(msg.transfer_keys),
        pp_size=msg.pp_size or 1,
        rank_kv=[list(msg.rank_kv[i:i + 4]) for i in range(0, len(msg.rank_kv) // 4 * 4, 4)],
    )


def role_from_proto(number: int) -> InstanceRole:
    """The role of an InstanceType enum number (ValueError on an unknown one)."""
    return InstanceRole(pb.InstanceType.Name(number))


def instance_id_to_proto(name: str) -> pb.InstanceID:
    return pb.InstanceID(name=name)


def instance_id_from_proto(msg: pb.InstanceID) -> str:
    return msg.name


def instance_ids_from_proto(msg: pb.InstanceIDs) -> list[str]:
    return list(msg.names)


# ---------------------------------------------------------------- heartbeats (engine side)
def heartbeat_to_proto(name: str, incarnation_id: str, waiting: int, running: int,
                       kv_usage: float, recent_max_ttft_ms: int, recent_max_tbt_ms: int,
                       stored_cache: list[bytes], removed_cache: list[bytes],
                       full_cache: bool = False) -> pb.HeartbeatRequest:
    """The service reads it with rpc.service.heartbeat_from_proto."""
    return pb.HeartbeatRequest(
        name=name,
        incarnation_id=incarnation_id,
        load_metrics=pb.LoadMetrics(waiting_requests_num=waiting, gpu_cache_usage_perc=kv_usage,
                                    running_requests_num=running),
        latency_metrics=pb.LatencyMetrics(recent_max_ttft=recent_max_ttft_ms,
                                          recent_max_tbt=recent_max_tbt_ms),
        cache_event=pb.KvCacheEvent(stored_cache=stored_cache, removed_cache=removed_cache,
                                    full_snapshot=full_cache),
    )


def heartbeat_reply_from_proto(reply: pb.Status) -> tuple[bool, str]:
    """(ok, why not)."""
    return reply.ok, reply.message
