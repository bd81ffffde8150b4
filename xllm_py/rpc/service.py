"""The service's (master's) messages to and from the engines: proto <-> domain for
Generate, MultiGenerations (migration), Cancel and the Generations stream (both of its
ends: the engine's GenerationsReporter builds it here too). The service builds and reads
no pb message anywhere else.
"""
from __future__ import annotations

import dataclasses

from xllm_py.outputs import RequestOutput
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.rpc.convert import EngineRequestSpec, output_from_proto, output_to_proto, spec_to_proto


@dataclasses.dataclass(frozen=True)
class SubmitStatus:
    """An engine's answer to Generate or MultiGenerations. `code` 400: the request is
    invalid (the client gets a 400); anything else not ok: refused (503)."""
    ok: bool
    code: int = 200
    message: str = ""


@dataclasses.dataclass(frozen=True)
class Generation:
    """One engine output for a service request."""
    service_request_id: str
    output: RequestOutput
    on_prefill: bool  # PD: the prefill instance's output (the first token)


@dataclasses.dataclass(frozen=True)
class Generations:
    """One Generations message: the outputs an engine (`instance_name`, may be "") sends."""
    instance_name: str
    gens: list[Generation]


def generate_request(spec: EngineRequestSpec) -> pb.DisaggRequest:
    return spec_to_proto(spec)


def submit_status(status: pb.Status) -> SubmitStatus:
    return SubmitStatus(ok=status.ok, code=status.code, message=status.message)


def invalid_argument(message: str) -> SubmitStatus:
    """An engine that rejected the request with INVALID_ARGUMENT."""
    return SubmitStatus(ok=False, code=400, message=message or "invalid request")


def migration_request(spec: EngineRequestSpec, generated_token_ids: list[int],
                      num_unread_tokens: int) -> pb.MultiGenerationsRequests:
    """MultiGenerations of one request that resumes after `generated_token_ids` (no KV:
    the engine recomputes); the text of the last `num_unread_tokens` of them is still
    owed to the client."""
    item = pb.MultiGenerationsRequest(
        request=spec_to_proto(spec), generated_token_ids=list(generated_token_ids),
        num_unread_tokens=num_unread_tokens, has_num_unread_tokens=True)
    return pb.MultiGenerationsRequests(reqs=[item])


def cancel_request(engine_request_id: str, service_request_id: str = "",
                   reason: str = "") -> pb.CancelRequest:
    return pb.CancelRequest(req_id=engine_request_id, service_req_id=service_request_id,
                            reason=reason)


def generations_from_proto(msg: pb.DisaggStreamGenerations) -> Generations:
    return Generations(instance_name=msg.instance_name, gens=[
        Generation(service_request_id=g.service_req_id, output=output_from_proto(g),
                   on_prefill=g.finished_on_prefill_instance) for g in msg.gens])


def generation_to_proto(output: RequestOutput, service_request_id: str,
                        engine_request_id: str,
                        finished_on_prefill: bool = False) -> pb.DisaggStreamGeneration:
    """One engine output for the service's Generations stream (engine side)."""
    gen = output_to_proto(output, service_request_id, finished_on_prefill=finished_on_prefill)
    gen.req_id = engine_request_id
    return gen


def dropped_generation(gen: pb.DisaggStreamGeneration, instance_name: str,
                       why: str) -> pb.DisaggStreamGeneration:
    """The last word on the request of `gen` from the instance that gave it up (it could
    not reach the service): a failed final output naming that instance, which the service
    takes as a reason to move the request elsewhere."""
    out = RequestOutput(request_id=gen.req_id, finished=True, error_code=503,
                        error_message=why, unreachable_instance=instance_name)
    return generation_to_proto(out, gen.service_req_id, gen.req_id)


def generations_to_proto(gens: list[pb.DisaggStreamGeneration],
                         instance_name: str) -> pb.DisaggStreamGenerations:
    return pb.DisaggStreamGenerations(gens=gens, instance_name=instance_name)


def statuses_from_proto(reply: pb.StatusSet) -> list[tuple[bool, str]]:
    """The service's answer to a Generations message: (ok, why not) per generation."""
    return [(status.ok, status.message) for status in reply.all_status]


def num_generations(msg: pb.DisaggStreamGenerations) -> int:
    return len(msg.gens)


def reply_fits(msg: pb.DisaggStreamGenerations, reply: pb.StatusSet) -> bool:
    """The reply has one status per generation of `msg`."""
    return len(reply.all_status) == len(msg.gens)


_UNKNOWN = "unknown or cancelled request"


def generations_reply(accepted: list[bool]) -> pb.StatusSet:
    """One status per generation: ok, or ok=false for an id the service does not know
    (the engine then aborts that request)."""
    reply = pb.StatusSet()
    for ok in accepted:
        if ok:
            reply.all_status.add(ok=True)
        else:
            reply.all_status.add(ok=False, message=_UNKNOWN)
    return reply


# ---------------------------------------------------------------- XllmRpcService (engines -> service)
@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """An engine's heartbeat: who, its load, and its prefix-cache changes."""
    name: str
    incarnation_id: str
    waiting: int
    running: int
    kv_usage: float
    recent_max_ttft_ms: int
    recent_max_tbt_ms: int
    stored_cache: list[bytes]
    removed_cache: list[bytes]
    full_cache: bool  # stored_cache is a full snapshot


def heartbeat_from_proto(req: pb.HeartbeatRequest) -> Heartbeat:
    return Heartbeat(
        name=req.name, incarnation_id=req.incarnation_id,
        waiting=req.load_metrics.waiting_requests_num,
        running=req.load_metrics.running_requests_num,
        kv_usage=req.load_metrics.gpu_cache_usage_perc,
        recent_max_ttft_ms=req.latency_metrics.recent_max_ttft,
        recent_max_tbt_ms=req.latency_metrics.recent_max_tbt,
        stored_cache=list(req.cache_event.stored_cache),
        removed_cache=list(req.cache_event.removed_cache),
        full_cache=req.cache_event.full_snapshot)


MAX_CACHE_EVENTS = 1 << 16  # block hashes one heartbeat may add or remove


def heartbeat_problem(hb: Heartbeat) -> str:
    """Why a heartbeat cannot be taken (a value no engine sends), or ""."""
    if not hb.name or not hb.incarnation_id:
        return "heartbeat needs name and incarnation_id"
    if min(hb.waiting, hb.running, hb.recent_max_ttft_ms, hb.recent_max_tbt_ms) < 0:
        return "heartbeat load and latency figures must be >= 0"
    if not 0.0 <= hb.kv_usage <= 1.0:  # (NaN fails too)
        return f"gpu_cache_usage_perc must be in [0, 1], got {hb.kv_usage!r}"
    if len(hb.stored_cache) + len(hb.removed_cache) > MAX_CACHE_EVENTS:
        return f"more than {MAX_CACHE_EVENTS} cache events in one heartbeat"
    return ""


def heartbeat_reply(ok: bool, message: str) -> pb.Status:
    """409: refused (unknown instance or stale incarnation: register again)."""
    return pb.Status(ok=ok, message=message, code=200 if ok else 409)


def registered_reply(incarnation_id: str) -> pb.StatusCode:
    return pb.StatusCode(status_code=200, message=f"incarnation_id={incarnation_id}")


def instance_ids(names: list[str]) -> pb.InstanceIDs:
    return pb.InstanceIDs(names=names)


def unknown_generations_reply(num: int) -> pb.StatusSet:
    """Every one of `num` generations is unknown (no router attached): engines cancel."""
    return pb.StatusSet(all_status=[pb.Status(ok=False, code=404, message="unknown request")
                                    for _ in range(num)])
