"""PD wire forms (xllm_py/rpc/pd.py): every domain message survives its proto, and
statuses keep their meaning on the wire."""
from __future__ import annotations

import pytest

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole
from xllm_py.pd_messages import HandOver, KVMove, Placement
from xllm_py.outputs import TokenLogprob
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.rpc import pd as wire
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.status import Status
from xllm_py.sampling_params import SamplingParams

PREFILL = InstanceMeta(name="prefill:1", type=InstanceRole.PREFILL, cluster_ids=[3],
                       addrs=["10.0.0.1:5"], ports=[5], worker_rpc_addrs=["10.0.0.1:6"],
                       block_size=16, incarnation_id="abc")


def test_handover_round_trip_with_logprobs():
    h = HandOver("r1", prefill_name="prefill:1", mode="PUSH", token_ids=[11, 12],
                 logprobs=[TokenLogprob(11, -0.5, [(11, -0.5), (3, -2.0)]), None],
                 cluster_ids=[3], addrs=["10.0.0.1:5"], worker_rpc_addrs=["10.0.0.1:6"],
                 block_ids=[4, 5], dp_size=1, num_computed_tokens=40)
    [back] = wire.handovers_from_proto(pb.DisaggGenerationsRequests.FromString(
        wire.handovers_to_proto([h]).SerializeToString()))
    assert back == h


def test_failed_handover_round_trip():
    h = HandOver("r1", prefill_name="prefill:1", failed=True, status_msg="cancelled")
    assert wire.handover_from_proto(wire.handover_to_proto(h)) == h


@pytest.mark.parametrize("status, code", [(Status.OK, 200), (Status.RESOURCE_EXHAUSTED, 404),
                                          (Status.INVALID_ARGUMENT, 400),
                                          (Status.INTERNAL, 500)])
def test_placement_status_on_the_wire(status, code):
    p = Placement("r1", status, [1, 2] if status.ok else [], 16 if status.ok else 0, "why")
    reply = wire.placements_to_proto([p])
    assert reply.reqs[0].status_code == code  # 404: xLLM's "no KV space now"
    assert wire.placement_from_reply(reply, "r1") == p


def test_an_empty_placement_reply_is_internal():
    p = wire.placement_from_reply(pb.DisaggResponses(), "r1")
    assert p.status is Status.INTERNAL and p.request_id == "r1"


def test_add_requests_round_trip_and_an_unreadable_request():
    spec = EngineRequestSpec("r1", "s1", [1, 2, 3], SamplingParams(max_tokens=4),
                             source_xservice_addr="10.0.0.9:1")
    msg = wire.add_requests_to_proto(PREFILL, [spec])
    msg.reqs.add(req_id="r2")  # no prompt
    name, items = wire.add_requests_from_proto(msg)
    assert name == "prefill:1" and msg.cluster_infos.addrs == ["10.0.0.1:5"]
    assert items[0] == spec
    assert items[1].status is Status.INVALID_ARGUMENT and "prompt_tokens" in items[1].message


def test_link_round_trip():
    link = wire.peer_link_from_proto(wire.link_info_to_proto(PREFILL))
    assert (link.instance_name, link.cluster_ids, link.addrs) == ("prefill:1", [3],
                                                                 ["10.0.0.1:5"])
    assert link.meta.name == "prefill:1" and link.meta.incarnation_id == "abc"
    cluster = wire.cluster_link_to_proto(link)
    assert list(cluster.addrs) == ["10.0.0.1:5"] and cluster.meta.block_size == 16


def test_kv_moves():
    move = KVMove("r1", 3, "10.0.0.1:5", [1, 2], [7, 8])
    for msg in (wire.pull_to_proto(move), wire.push_to_proto(move)):
        assert (msg.req_id, msg.cluster_id, msg.addr, list(msg.src_blocks),
                list(msg.dst_blocks)) == ("r1", 3, "10.0.0.1:5", [1, 2], [7, 8])


def test_batch_status():
    assert wire.problems_to_proto(["", ""]).ok
    bad = wire.problems_to_proto(["", "unknown request r2"])
    assert not bad.ok and bad.message == "unknown request r2"


def test_cancel_has_its_own_message_wire_compatible_with_the_old_pull_signal():
    from xllm_py.rpc import service as service_wire

    msg = service_wire.cancel_request("e1", "client-1", "the client went away")
    assert wire.cancel_from_proto(msg) == ("e1", "the client went away")
    # an engine of the previous version read Cancel as PullSignal: same req_id
    assert pb.PullSignal.FromString(msg.SerializeToString()).req_id == "e1"
    assert wire.cancel_from_proto(pb.CancelRequest.FromString(
        pb.PullSignal(req_id="e2").SerializeToString())) == ("e2", "")


def test_migration_items_read_what_the_service_sends_and_an_unreadable_request():
    from xllm_py.rpc import service

    spec = EngineRequestSpec("r1", "s1", [1, 2, 3], SamplingParams(max_tokens=4),
                             source_xservice_addr="10.0.0.9:1")
    msg = service.migration_request(spec, [7, 8], num_unread_tokens=1)
    msg.reqs.add().request.req_id = "r2"  # no prompt
    first, bad = wire.migration_items_from_proto(msg)
    assert (first.request_id, first.spec, first.problem) == ("r1", spec, "")
    assert (first.generated, first.num_unread, first.has_kv) == ([7, 8], 1, False)
    assert bad.spec is None and "prompt_tokens" in bad.problem and bad.num_unread is None
    msg.reqs[0].kv.block_ids.extend([4, 5])
    first = wire.migration_items_from_proto(msg)[0]
    assert first.has_kv and first.num_kv_blocks == 2 and first.message is msg.reqs[0]
