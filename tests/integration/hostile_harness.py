"""A small cluster for hostile-input tests: a service with a MIX engine on one
etcd namespace, a DECODE engine on another (reached directly over its DisaggPDService),
and a stand-in service that collects what the decode streams back."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time

import grpc
import httpx

from tests.integration.cluster_harness import Harness, labelled, metric
from xllm_py.cluster.etcd_client import EtcdClient
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.utils.procs import ChildProcess


class CollectingService(pb_grpc.XllmRpcServiceServicer):
    """Stands in for xllm_service: records the Generations an engine streams back."""

    def __init__(self) -> None:
        self.gens: dict[str, list[pb.DisaggStreamGeneration]] = {}
        self.done: dict[str, asyncio.Event] = {}

    async def Generations(self, request, context):
        for gen in request.gens:
            self.gens.setdefault(gen.service_req_id, []).append(gen)
            if gen.finished:
                self.done.setdefault(gen.service_req_id, asyncio.Event()).set()
        return pb.StatusSet(all_status=[pb.Status(ok=True) for _ in request.gens])

    async def wait_done(self, request_id: str, timeout_s: float = 60) -> pb.DisaggStreamGeneration:
        await asyncio.wait_for(self.done.setdefault(request_id, asyncio.Event()).wait(), timeout_s)
        return self.gens[request_id][-1]


@dataclasses.dataclass
class Cluster:
    service: ChildProcess
    mix: ChildProcess
    decode: ChildProcess
    mix_meta: dict
    decode_meta: dict


def start_cluster(h: Harness, decode_namespace: str) -> Cluster:
    svc = h.service()
    mix = h.engine("MIX", "mix", extra=["--block-size", "8", "--num-blocks", "256"])
    decode = h.engine("DECODE", "decode", extra=["--etcd-namespace", decode_namespace,
                                                "--block-size", "8", "--num-blocks", "256"])
    for p in (mix, decode):
        p.wait_ready(180)
    svc.wait_ready(60, path="/readiness")
    mix_meta = asyncio.run(instance_meta(h.etcd, h.namespace, "MIX"))
    decode_meta = asyncio.run(instance_meta(h.etcd, decode_namespace, "DECODE"))
    deadline = time.monotonic() + 30
    while labelled(svc.http_url, "xllm_service_instances", 'state="ACTIVE"') != 1:
        assert time.monotonic() < deadline, "the service does not see the MIX engine ACTIVE"
        time.sleep(0.1)
    return Cluster(svc, mix, decode, mix_meta, decode_meta)


async def instance_meta(endpoint: str, namespace: str, role: str) -> dict:
    async with EtcdClient(endpoint, namespace=namespace) as etcd:
        for _ in range(100):
            kvs, _ = await etcd.get_prefix(f"XLLM:{role}:")
            if kvs:
                return json.loads(kvs[0].value)
            await asyncio.sleep(0.1)
    raise AssertionError(f"no {role} instance registered")


def blocks_used(proc: ChildProcess) -> int:
    return int(metric(proc.http_url, "xllm_kv_cache_blocks_used"))


def step_failures(proc: ChildProcess) -> int:
    """Failed engine steps (xllm_engine_step_failures_total; its log line where the
    metric is missing: older engines)."""
    try:
        return int(metric(proc.http_url, "xllm_engine_step_failures_total"))
    except AssertionError:
        return log_count(proc, "engine step failed")


async def wait_blocks_free(proc: ChildProcess, timeout_s: float = 30) -> None:
    for _ in range(int(timeout_s / 0.1)):
        if blocks_used(proc) == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{proc.name} still holds {blocks_used(proc)} KV blocks")


async def start_collector() -> tuple[grpc.aio.Server, CollectingService, str]:
    collector = CollectingService()
    server = grpc.aio.server()
    pb_grpc.add_XllmRpcServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, collector, f"127.0.0.1:{port}"


def disagg_request(req_id: str, prompt: list[int], source: str, max_tokens: int = 8,
                   **fields) -> pb.DisaggRequest:
    req = pb.DisaggRequest(req_id=req_id, service_req_id=req_id, max_tokens=max_tokens,
                           ignore_eos=True, has_temperature=True,
                           temperature=0.0, source_xservice_addr=source, n=1, **fields)
    req.prompt_tokens.extend(prompt)
    return req


def handover(req_id: str, tokens: list[int]) -> pb.DisaggGenerationsRequest:
    """A PUSH hand-over (the KV is said to be in decode's blocks already: no pull)."""
    gen = pb.DisaggGenerationsRequest(req_id=req_id, kv_cache_transfer_mode="PUSH",
                                      prefill_name="prefill-x")
    for t in tokens:
        gen.tokens.add(token_id=t)
    return gen


def log_count(proc: ChildProcess, pattern: str) -> int:
    return len(re.findall(pattern, proc.log_path.read_text(errors="replace")))


def post(url: str, path: str, body, timeout: float = 30.0) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, timeout=timeout, trust_env=False,
                      headers={"Content-Type": "application/json"})


def tiny_vocab_size() -> int:
    from xllm_py.model.tiny import ensure_tiny_model

    return json.loads((ensure_tiny_model("tiny") / "config.json").read_text())["vocab_size"]
