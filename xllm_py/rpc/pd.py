"""PD wire forms: the DisaggPDService / WorkerService messages the PD code sends and
receives, built from and read into xllm_py.pd_messages (no pb2 object leaves
xllm_py/rpc/ and the servicers).

Status codes on the wire: `Status.http_status` in the integer fields
(DisaggResponse.status_code, Status.code), except that xLLM's DisaggResponse says
"no KV space now" with 404 (RESOURCE_EXHAUSTED here), kept for engines of the previous
version.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.pd_messages import HandOver, KVMove, OfflinePull, PeerLink, Placement
from xllm_py.outputs import TokenLogprob
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.rpc.cluster import instance_meta_from_proto, instance_meta_to_proto
from xllm_py.rpc.convert import EngineRequestSpec, spec_from_proto, spec_to_proto
from xllm_py.status import Status

_NO_KV_SPACE = 404  # xLLM's DisaggResponse.status_code for "decode has no KV space now"


# ---------------------------------------------------------------- Status replies
def status_to_proto(status: Status = Status.OK, message: str = "") -> pb.Status:
    return pb.Status(ok=status.ok, code=status.http_status, message=message)


def problems_to_proto(problems: Sequence[str]) -> pb.Status:
    """One Status for a batch: ok when no item had a problem, else their messages."""
    bad = [p for p in problems if p]
    return pb.Status(ok=not bad, code=200 if not bad else Status.INVALID_ARGUMENT.http_status,
                     message="; ".join(bad))


def status_from_proto(reply: pb.Status) -> tuple[bool, str]:
    return reply.ok, reply.message


def cancel_from_proto(msg: pb.CancelRequest) -> tuple[str, str]:
    """Cancel: (the engine's request id, why; "" from a peer that does not say)."""
    return msg.req_id, msg.reason


# ---------------------------------------------------------------- linking
def link_info_to_proto(prefill: InstanceMeta) -> pb.InstanceClusterInfo:
    return pb.InstanceClusterInfo(instance_name=prefill.name, cluster_ids=prefill.cluster_ids,
                                  addrs=prefill.addrs, ports=prefill.ports,
                                  dp_size=prefill.dp_size,
                                  worker_rpc_addrs=prefill.worker_rpc_addrs,
                                  meta=instance_meta_to_proto(prefill))


def peer_link_from_proto(info: pb.InstanceClusterInfo) -> PeerLink:
    """Raises ValueError (InstanceMetaError) on a meta that cannot be read."""
    meta = instance_meta_from_proto(info.meta) if info.HasField("meta") else None
    return PeerLink(instance_name=info.instance_name, cluster_ids=list(info.cluster_ids),
                    addrs=list(info.addrs), meta=meta)


def unlink_name_from_proto(info: pb.InstanceClusterInfo) -> str:
    return info.instance_name


def cluster_link_to_proto(link: PeerLink) -> pb.ClusterLink:
    return pb.ClusterLink(cluster_ids=link.cluster_ids, addrs=link.addrs,
                          meta=instance_meta_to_proto(link.meta) if link.meta is not None else None)


# ---------------------------------------------------------------- AddNewRequests
def add_requests_to_proto(prefill: InstanceMeta,
                          specs: Sequence[EngineRequestSpec]) -> pb.DisaggRequests:
    msg = pb.DisaggRequests(prefill_name=prefill.name, cluster_infos=pb.ClusterInfo(
        cluster_ids=prefill.cluster_ids, addrs=prefill.addrs, ports=prefill.ports,
        dp_size=prefill.dp_size, worker_rpc_addrs=prefill.worker_rpc_addrs))
    msg.reqs.extend(spec_to_proto(s) for s in specs)
    return msg


def add_requests_from_proto(
        msg: pb.DisaggRequests) -> tuple[str, list[EngineRequestSpec | Placement]]:
    """(prefill name, one spec per request, or an INVALID_ARGUMENT Placement for a
    request that cannot be read)."""
    items: list[EngineRequestSpec | Placement] = []
    for req in msg.reqs:
        try:
            items.append(spec_from_proto(req))
        except ValueError as exc:
            items.append(Placement(req.req_id, Status.INVALID_ARGUMENT, message=str(exc)))
    return msg.prefill_name, items


def placements_to_proto(placements: Sequence[Placement]) -> pb.DisaggResponses:
    replies = pb.DisaggResponses()
    for p in placements:
        code = _NO_KV_SPACE if p.status is Status.RESOURCE_EXHAUSTED else p.status.http_status
        replies.reqs.add(req_id=p.request_id, status_code=code, status_msg=p.message,
                         blocks_ids=p.block_ids, dp_rank=0,
                         num_cached_tokens=p.num_cached_tokens)
    return replies


def placement_from_reply(reply: pb.DisaggResponses, request_id: str) -> Placement:
    if not reply.reqs:
        return Placement(request_id, Status.INTERNAL, message="decode answered no placement")
    r = reply.reqs[0]
    status = (Status.RESOURCE_EXHAUSTED if r.status_code == _NO_KV_SPACE
              else Status.from_http(r.status_code))
    return Placement(r.req_id or request_id, status, list(r.blocks_ids), r.num_cached_tokens,
                     r.status_msg)


# ---------------------------------------------------------------- FirstGeneration
def handover_to_proto(h: HandOver) -> pb.DisaggGenerationsRequest:
    gen = pb.DisaggGenerationsRequest(
        req_id=h.request_id, kv_cache_transfer_mode=h.mode, dp_size=h.dp_size,
        prefill_name=h.prefill_name, num_computed_tokens=h.num_computed_tokens,
        cluster_ids=h.cluster_ids, addrs=h.addrs, worker_rpc_addrs=h.worker_rpc_addrs,
        block_ids=h.block_ids, failed=h.failed, status_msg=h.status_msg)
    lps = h.logprobs or [None] * len(h.token_ids)
    for token_id, lp in zip(h.token_ids, lps):
        tok = gen.tokens.add(token_id=token_id)
        if lp is not None:
            tok.has_logprob = True
            tok.logprob = lp.logprob
            tok.top_tokens.extend(t for t, _ in lp.top)
            tok.top_logprobs.extend(v for _, v in lp.top)
    return gen


def handovers_to_proto(handovers: Sequence[HandOver]) -> pb.DisaggGenerationsRequests:
    return pb.DisaggGenerationsRequests(gens=[handover_to_proto(h) for h in handovers])


def handover_from_proto(gen: pb.DisaggGenerationsRequest) -> HandOver:
    return HandOver(
        request_id=gen.req_id, prefill_name=gen.prefill_name,
        mode=gen.kv_cache_transfer_mode, token_ids=[t.token_id for t in gen.tokens],
        logprobs=[TokenLogprob(t.token_id, t.logprob,
                               list(zip(t.top_tokens, t.top_logprobs)))
                  if t.has_logprob else None for t in gen.tokens],
        cluster_ids=list(gen.cluster_ids), addrs=list(gen.addrs),
        worker_rpc_addrs=list(gen.worker_rpc_addrs), block_ids=list(gen.block_ids),
        dp_size=gen.dp_size or 1, num_computed_tokens=gen.num_computed_tokens,
        failed=gen.failed, status_msg=gen.status_msg)


def handovers_from_proto(msg: pb.DisaggGenerationsRequests) -> list[HandOver]:
    return [handover_from_proto(g) for g in msg.gens]


@dataclasses.dataclass(frozen=True)
class MigrationItem:
    """One MultiGenerations item as read (engine side); engine/migration.py checks it."""
    request_id: str
    spec: EngineRequestSpec | None  # None: unreadable, see `problem`
    problem: str
    generated: list[int]
    num_unread: int | None  # None: the sender did not say
    has_kv: bool  # the item says where its KV lives (DECODE pulls it)
    num_kv_blocks: int
    message: object  # the item's wire form (rpc.pd.migration_kv_from_proto reads it)


def migration_items_from_proto(msg: pb.MultiGenerationsRequests) -> list[MigrationItem]:
    return [migration_item_from_proto(item) for item in msg.reqs]


def migration_item_from_proto(item: pb.MultiGenerationsRequest) -> MigrationItem:
    try:
        spec, problem = spec_from_proto(item.request), ""
    except ValueError as exc:
        spec, problem = None, str(exc)
    has_kv = item.HasField("kv")
    return MigrationItem(
        request_id=item.request.req_id, spec=spec, problem=problem,
        generated=list(item.generated_token_ids),
        num_unread=item.num_unread_tokens if item.has_num_unread_tokens else None,
        has_kv=has_kv, num_kv_blocks=len(item.kv.block_ids) if has_kv else 0, message=item)


def migration_kv_from_proto(item: pb.MultiGenerationsRequest) -> HandOver:
    """MultiGenerations with kv: where the KV of prompt + generated[:-1] lives."""
    return handover_from_proto(item.kv)


# ---------------------------------------------------------------- the KV worker
def pull_to_proto(move: KVMove, heads: tuple[int, ...] | None = None
                  ) -> pb.PullKVCacheRequest:
    """``heads`` (src_start, dst_start, count[, src_layer, dst_layer, layers]): only those
    KV heads (TP pairs) and layers (pipeline stages)."""
    return pb.PullKVCacheRequest(cluster_id=move.cluster_id, addr=move.addr,
                                 src_blocks=move.src_blocks, dst_blocks=move.dst_blocks,
                                 req_id=move.request_id, transfer_key=move.transfer_key,
                                 **_head_fields(heads))


def push_to_proto(move: KVMove, heads: tuple[int, ...] | None = None
                  ) -> pb.PushKVCacheRequest:
    return pb.PushKVCacheRequest(cluster_id=move.cluster_id, addr=move.addr,
                                 src_blocks=move.src_blocks, dst_blocks=move.dst_blocks,
                                 req_id=move.request_id, transfer_key=move.transfer_key,
                                 **_head_fields(heads))


def _head_fields(heads: tuple[int, ...] | None) -> dict[str, int]:
    if heads is None:
        return {}
    fields = {"src_head_start": heads[0], "dst_head_start": heads[1], "num_heads": heads[2]}
    if len(heads) == 6:
        fields.update(src_layer_start=heads[3], dst_layer_start=heads[4], num_layers=heads[5])
    return fields


# ---------------------------------------------------------------- SendPullSignal
def offline_pull_to_proto(pull: OfflinePull) -> pb.PullSignal:
    return pb.PullSignal(source_instance_name=pull.source_instance_name,
                         preferred_req_len=pull.preferred_req_len,
                         max_total_len=pull.max_total_len)


def offline_pull_from_proto(msg: pb.PullSignal) -> OfflinePull:
    """Raises ValueError for a pull no decode would send."""
    if not msg.source_instance_name:
        raise ValueError("source_instance_name is empty")
    if msg.preferred_req_len < 0 or msg.max_total_len < 0:
        raise ValueError(f"preferred_req_len and max_total_len must be >= 0, got "
                         f"{msg.preferred_req_len} and {msg.max_total_len}")
    return OfflinePull(msg.source_instance_name, msg.preferred_req_len, msg.max_total_len)


def pull_reply_to_proto(num_handed: int) -> pb.PullReply:
    return pb.PullReply(status=status_to_proto(), num_handed=num_handed)


def pull_reply_from_proto(reply: pb.PullReply) -> tuple[bool, str, int]:
    return reply.status.ok, reply.status.message, reply.num_handed
