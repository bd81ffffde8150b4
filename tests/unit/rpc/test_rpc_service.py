"""rpc/service.py, the Generations stream end to end: what the engine's reporter builds
is what the service reads, and the service's reply reads back per generation."""
from __future__ import annotations

from xllm_py.outputs import CompletionDelta, RequestOutput
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.rpc import service as wire


def test_generations_built_by_the_engine_read_by_the_service():
    out = RequestOutput("s1", [CompletionDelta(0, "hi", [5], finish_reason="stop")],
                        finished=True, num_prompt_tokens=3, num_generated_tokens=1)
    gen = wire.generation_to_proto(out, "s1", "engine-r1", finished_on_prefill=True)
    msg = wire.generations_to_proto([gen], "inst:1")
    back = wire.generations_from_proto(pb.DisaggStreamGenerations.FromString(msg.SerializeToString()))
    assert back.instance_name == "inst:1" and wire.num_generations(msg) == 1
    [g] = back.gens
    assert g.service_request_id == "s1" and g.on_prefill
    assert g.output.outputs[0].token_ids == [5] and g.output.finished
    assert msg.gens[0].req_id == "engine-r1"  # the engine's id, for the reply's aborts


def test_generations_reply_reads_back_per_generation():
    reply = wire.generations_reply([True, False])
    assert wire.statuses_from_proto(reply) == [(True, ""), (False, "unknown or cancelled request")]
    two = wire.generations_to_proto([pb.DisaggStreamGeneration(), pb.DisaggStreamGeneration()], "")
    assert wire.reply_fits(two, reply)
    assert not wire.reply_fits(two, wire.unknown_generations_reply(1))
