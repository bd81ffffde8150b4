"""PipelinedStream over a real in-process gRPC server: ordered replies for pipelined
requests, UNIMPLEMENTED detected (fallback to unary), a dead stream fails pending calls,
a stream that misses a reply deadline is replaced."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.utils.grpc_channels import PipelinedStream, StreamBroken

pytestmark = pytest.mark.integration  # gRPC servers


class Echo(pb_grpc.XllmRpcServiceServicer):
    async def GenerationsStream(self, request_iterator, context):
        async for msg in request_iterator:
            await asyncio.sleep(0.001 * (len(msg.instance_name) % 3))  # uneven work
            yield pb.StatusSet(all_status=[pb.Status(ok=True, message=msg.instance_name)])


async def start(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_XllmRpcServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_pipelined_requests_get_their_own_replies():
    server, addr = await start(Echo())
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pb_grpc.XllmRpcServiceStub(ch)
        stream = PipelinedStream(lambda: stub.GenerationsStream())
        replies = await asyncio.gather(*(
            stream.request(pb.DisaggStreamGenerations(instance_name=f"m{i}"), timeout=5)
            for i in range(40)))
        assert [r.all_status[0].message for r in replies] == [f"m{i}" for i in range(40)]
        await stream.close()
    await server.stop(0)


async def test_unimplemented_stream_is_reported_for_fallback():
    server, addr = await start(pb_grpc.XllmRpcServiceServicer())
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pb_grpc.XllmRpcServiceStub(ch)
        stream = PipelinedStream(lambda: stub.GenerationsStream())
        with pytest.raises(StreamBroken) as e:
            await stream.request(pb.DisaggStreamGenerations(), timeout=5)
        assert e.value.unsupported and not e.value.maybe_delivered
        with pytest.raises(StreamBroken):  # remembered: no second stream attempt
            await stream.request(pb.DisaggStreamGenerations(), timeout=5)
        assert stream.unsupported
    await server.stop(0)


async def test_dead_peer_fails_pending_requests():
    received = asyncio.Event()

    class Stuck(pb_grpc.XllmRpcServiceServicer):
        async def GenerationsStream(self, request_iterator, context):
            async for _ in request_iterator:
                received.set()
                await asyncio.sleep(30)  # (a peer that never answers)
                yield pb.StatusSet()

    server, addr = await start(Stuck())
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pb_grpc.XllmRpcServiceStub(ch)
        stream = PipelinedStream(lambda: stub.GenerationsStream())
        pending = asyncio.ensure_future(
            stream.request(pb.DisaggStreamGenerations(), timeout=10))
        await asyncio.wait_for(received.wait(), 5)  # the peer has it, then dies
        await server.stop(0)
        with pytest.raises(StreamBroken) as e:
            await asyncio.wait_for(pending, 5)
        assert e.value.maybe_delivered
    with pytest.raises(asyncio.TimeoutError):
        server2, addr2 = await start(Stuck())
        async with grpc.aio.insecure_channel(addr2) as ch:
            stub = pb_grpc.XllmRpcServiceStub(ch)
            stream = PipelinedStream(lambda: stub.GenerationsStream())
            try:
                await stream.request(pb.DisaggStreamGenerations(), timeout=0.2)
            finally:
                await stream.close()
                await server2.stop(0)


async def test_a_stream_that_missed_a_deadline_is_replaced():
    class FirstStreamHangs(pb_grpc.XllmRpcServiceServicer):
        streams = 0

        async def GenerationsStream(self, request_iterator, context):
            FirstStreamHangs.streams += 1
            hang = FirstStreamHangs.streams == 1
            async for msg in request_iterator:
                if hang:
                    await asyncio.sleep(30)  # (a stream that hangs)
                yield pb.StatusSet(all_status=[pb.Status(ok=True, message=msg.instance_name)])

    server, addr = await start(FirstStreamHangs())
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pb_grpc.XllmRpcServiceStub(ch)
        stream = PipelinedStream(lambda: stub.GenerationsStream())
        behind = asyncio.ensure_future(
            stream.request(pb.DisaggStreamGenerations(instance_name="b"), timeout=10))
        with pytest.raises(asyncio.TimeoutError):
            await stream.request(pb.DisaggStreamGenerations(instance_name="a"), timeout=0.3)
        with pytest.raises(StreamBroken) as e:  # queued behind it on the dead stream
            await asyncio.wait_for(behind, 5)
        assert e.value.maybe_delivered
        reply = await stream.request(pb.DisaggStreamGenerations(instance_name="c"), timeout=5)
        assert reply.all_status[0].message == "c" and FirstStreamHangs.streams == 2
        await stream.close()
    await server.stop(0)


class SlowToDieCall:
    """A stand-in for one bidi call whose cancellation reaches its reader only when the
    test says (`die`), as a call over a cut link can: replies come from `replies`."""

    def __init__(self) -> None:
        self.replies: asyncio.Queue = asyncio.Queue()
        self.written: list = []

    async def write(self, message) -> None:
        self.written.append(message)

    def cancel(self) -> None:
        pass  # noticed by the reader only on die()

    def die(self) -> None:
        self.replies.put_nowait(None)

    def __aiter__(self):
        return self

    async def __anext__(self):
        reply = await self.replies.get()
        if reply is None:
            raise asyncio.CancelledError
        return reply


async def test_a_dying_call_never_takes_the_next_calls_replies():
    """A request times out (its call is reset), the next one goes on a new call, and only
    then does the old call's reader end: the new request still gets its own reply (with
    one queue for every call, the old reader failed it and its reply went to the request
    after it)."""
    calls: list[SlowToDieCall] = []

    def open_call() -> SlowToDieCall:
        calls.append(SlowToDieCall())
        return calls[-1]

    stream = PipelinedStream(open_call)
    with pytest.raises(asyncio.TimeoutError):
        await stream.request("m1", timeout=0.05)
    second = asyncio.ensure_future(stream.request("m2", timeout=5))
    third = asyncio.ensure_future(stream.request("m3", timeout=5))
    await asyncio.sleep(0.01)
    assert len(calls) == 2 and calls[1].written == ["m2", "m3"]
    calls[0].die()
    await asyncio.sleep(0.01)
    calls[1].replies.put_nowait("reply to m2")
    calls[1].replies.put_nowait("reply to m3")
    assert await second == "reply to m2" and await third == "reply to m3"
    await stream.close()
