"""MultiGenerations: a DECODE instance takes over a request that already generated tokens
(the basis of migration) and continues exactly where a single engine would."""
from __future__ import annotations

import asyncio

import grpc
import openai
import pytest

from tests.integration.cluster_harness import Harness
from tests.integration.hostile_harness import CollectingService
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.utils.procs import engine_args, free_port, spawn

pytestmark = pytest.mark.integration


async def test_multi_generations_continues_like_mix(etcd_server, tmp_path):
    h = Harness(etcd_server.endpoint, "multigen/", tmp_path)
    mix_port = free_port()
    mix = spawn("mix", "xllm_py.engine", engine_args("MIX", mix_port), tmp_path,
                http_url=f"http://127.0.0.1:{mix_port}")
    h.procs.append(mix)
    collector = CollectingService()
    server = grpc.aio.server()
    pb_grpc.add_XllmRpcServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        decode = h.engine("DECODE", "decode", extra=["--advertise-host", "localhost"])
        decode.wait_ready(180)
        mix.wait_ready(180)
        ref = openai.OpenAI(base_url=mix.http_url + "/v1", api_key="x").completions.create(
            model="tiny", prompt="Once upon a time there was", max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
        prompt_ids = ref.model_extra["prompt_token_ids"]
        ref_ids = ref.model_extra["token_ids"]
        meta = (await _decode_meta(etcd_server.endpoint, h.namespace))
        # Peers get the advertised address, not the bind address.
        assert meta["name"].startswith("localhost:") and meta["rpc_address"].startswith("localhost:")
        assert all(a.startswith("localhost:") for a in meta["addrs"] + meta["worker_rpc_addrs"])
        async with grpc.aio.insecure_channel(meta["rpc_address"]) as ch:
            stub = pb_grpc.DisaggPDServiceStub(ch)
            req = pb.DisaggRequest(req_id="mig-1", service_req_id="mig-1", max_tokens=24,
                                   ignore_eos=True, has_temperature=True, temperature=0.0,
                                   source_xservice_addr=f"127.0.0.1:{port}", n=1)
            req.prompt_tokens.extend(prompt_ids)

            async def migrate(request: pb.DisaggRequest, generated: list[int]) -> list:
                """MultiGenerations; the Generations it then streams, to the last."""
                item = pb.MultiGenerationsRequest(request=request, generated_token_ids=generated)
                status = await stub.MultiGenerations(pb.MultiGenerationsRequests(reqs=[item]),
                                                     timeout=10)
                assert status.ok
                await asyncio.wait_for(
                    collector.done.setdefault(request.req_id, asyncio.Event()).wait(), 30)
                return collector.gens[request.req_id]

            gens = await migrate(req, ref_ids[:8])
            continued = [t for g in gens for o in g.outputs for t in o.token_ids]
            assert continued == ref_ids[8:]
            assert gens[-1].usage.num_prompt_tokens == len(prompt_ids)
            assert gens[-1].usage.num_generated_tokens == 24
            # min_tokens counts the tokens generated elsewhere, also without max_tokens:
            # 12 in all, then the first stop token (all of the first 12 greedy ones).
            req2 = pb.DisaggRequest()
            req2.CopyFrom(req)
            req2.req_id = req2.service_req_id = "mig-2"
            req2.max_tokens, req2.min_tokens = 0, 12
            req2.stop_token_ids.extend(ref_ids[:12])
            gens = await migrate(req2, ref_ids[:8])
            assert [t for g in gens for o in g.outputs for t in o.token_ids] == ref_ids[8:12]
            # Bad input: a clear INVALID_ARGUMENT.
            bad = pb.MultiGenerationsRequest(request=req)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.MultiGenerations(pb.MultiGenerationsRequests(reqs=[bad]), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "generated_token_ids is empty" in e.value.details()
            # Bad RPCs get a status with a message, and the instance keeps serving.
            replies = await stub.AddNewRequests(pb.DisaggRequests(
                prefill_name="p", reqs=[pb.DisaggRequest(req_id="bad")]), timeout=10)
            assert replies.reqs[0].status_code == 400  # INVALID_ARGUMENT: a bad request
            assert "prompt_tokens is empty" in replies.reqs[0].status_msg
            # A DECODE serves a whole request as MIX does (the service's conditional
            # disaggregation prefills short prompts there): the MIX tokens.
            req3 = pb.DisaggRequest()
            req3.CopyFrom(req)
            req3.req_id = req3.service_req_id = "whole-1"
            assert (await stub.Generate(req3, timeout=10)).ok
            await asyncio.wait_for(
                collector.done.setdefault("whole-1", asyncio.Event()).wait(), 30)
            gens = collector.gens["whole-1"]
            assert [t for g in gens for o in g.outputs for t in o.token_ids] == ref_ids
            status = await stub.FirstGeneration(pb.DisaggGenerationsRequests(
                gens=[pb.DisaggGenerationsRequest(req_id="nope")]), timeout=10)
            assert not status.ok and "unknown request nope" in status.message
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.SendPullSignal(pb.PullSignal(req_id="x"), timeout=10)
            # answered since offline co-location: a pull needs a DECODE peer
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await server.stop(0)
        h.stop()


async def _decode_meta(endpoint: str, namespace: str) -> dict:
    import json

    from xllm_py.cluster.etcd_client import EtcdClient

    async with EtcdClient(endpoint, namespace=namespace) as etcd:
        for _ in range(50):
            kvs, _ = await etcd.get_prefix("XLLM:DECODE:")
            if kvs:
                return json.loads(kvs[0].value)
            await asyncio.sleep(0.1)
    raise AssertionError("decode not registered")
