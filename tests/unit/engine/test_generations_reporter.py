"""GenerationsReporter.num_unsent over a real gRPC server on loopback: an output counts
from the moment the engine emits it until its service has answered it (what a drain
waits for before the instance leaves the cluster)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from xllm_py.engine.generations_reporter import GenerationsReporter
from xllm_py.outputs import CompletionDelta, RequestOutput
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration  # a gRPC server


class SlowService(pb_grpc.XllmRpcServiceServicer):
    """Answers each Generations message only once `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.received = 0

    async def GenerationsStream(self, request_iterator, context):
        async for msg in request_iterator:
            self.received += len(msg.gens)
            await self.release.wait()
            yield pb.StatusSet(all_status=[pb.Status(ok=True) for _ in msg.gens])


async def wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_an_output_counts_until_its_service_answers():
    service = SlowService()
    server = grpc.aio.server()
    pb_grpc.add_XllmRpcServiceServicer_to_server(service, server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    reporter = GenerationsReporter(asyncio.get_running_loop(), "engine-a", lambda rid: None)
    try:
        sink = reporter.sink(addr, "svc-1", "eng-1")
        sink.emit(RequestOutput("eng-1", [CompletionDelta(0, "a", [5], finish_reason="length")],
                                finished=True))
        assert reporter.num_unsent() == 1  # buffered until the end of the step
        reporter.flush()
        await wait_for(lambda: service.received == 1)
        assert reporter.num_unsent() == 1  # in a call the service has not answered
        service.release.set()
        await wait_for(lambda: reporter.num_unsent() == 0)
    finally:
        await reporter.close()
        await server.stop(None)
