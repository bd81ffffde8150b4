"""GenerationsReporter: streams each engine step's outputs to the services that own them.

Stages: engine thread emits RequestOutput into a per-service pending batch ->
end of step (step listener) -> hand the batch to the event loop -> one sender task per
service sends the batches in order on a long-lived `GenerationsStream` (unary
`Generations` if the stream breaks), merging batches that piled up while one was in
flight -> a reply with ok=false (client gone) or a dead service aborts the request.

A request aborted because its service could not be reached (deadline, broken stream) is
not forgotten: the service still waits on it. Until the service answers (or
DROPPED_NOTICE_S), a failed final output naming this instance is resent every
RESEND_S; the service then moves the request to another instance (or fails it cleanly)
instead of leaving its client waiting for its idle timeout.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable, NamedTuple

import grpc

from xllm_py.outputs import RequestOutput
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.rpc import service as wire
from xllm_py.utils.grpc_channels import ChannelPool, PipelinedStream, StreamBroken

logger = logging.getLogger(__name__)

RESEND_S = 1.0            # how often a dropped request's notice is resent
DROPPED_NOTICE_S = 120.0  # and for how long (the service's request idle timeout)


class Outgoing(NamedTuple):
    """One output on its way to a service: `message` is its wire form."""
    engine_request_id: str
    finished: bool
    message: object


class ReporterSink:
    """OutputSink of one request: its outputs go to the service at `service_addr`."""

    def __init__(self, reporter: "GenerationsReporter", service_addr: str,
                 service_request_id: str, engine_request_id: str,
                 on_output: Callable[[RequestOutput], bool] | None = None) -> None:
        self.reporter = reporter
        self.service_addr = service_addr
        self.service_request_id = service_request_id
        self.engine_request_id = engine_request_id
        # PD hook: may rewrite/suppress the output (returns False to suppress).
        self.on_output = on_output
        self.finished_on_prefill = False

    def emit(self, output: RequestOutput) -> None:
        if self.on_output is not None and not self.on_output(output):
            return
        message = wire.generation_to_proto(output, self.service_request_id,
                                           self.engine_request_id, self.finished_on_prefill)
        self.reporter.add(self.service_addr,
                          Outgoing(self.engine_request_id, output.finished, message))


class GenerationsReporter:
    def __init__(self, loop: asyncio.AbstractEventLoop, instance_name: str,
                 abort: Callable[[str], None], timeout_s: float = 5.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.loop = loop
        self.instance_name = instance_name
        self.abort = abort  # abort(engine_request_id), thread-safe
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pending: dict[str, list[Outgoing]] = {}
        self._queues: dict[str, list[Outgoing]] = {}
        self._senders: dict[str, asyncio.Task] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        self._channels = ChannelPool(credentials)
        self._streams: dict[str, PipelinedStream] = {}
        self._sending = 0  # outputs in a call not answered yet
        self.num_calls = 0
        # service addr -> engine request id -> the notice of its drop (not yet answered)
        self._dropped: dict[str, dict[str, object]] = {}
        self._resenders: dict[str, asyncio.Task] = {}

    def sink(self, service_addr: str, service_request_id: str, engine_request_id: str,
             on_output=None) -> ReporterSink:
        return ReporterSink(self, service_addr, service_request_id, engine_request_id, on_output)

    def add(self, service_addr: str, gen: Outgoing) -> None:
        """Any thread. Buffered until flush()."""
        with self._lock:
            self._pending.setdefault(service_addr, []).append(gen)

    def num_unsent(self) -> int:
        """Event loop: outputs no service has answered yet (buffered, queued or in a call):
        a drain waits for them, or a service would see the request's instance leave
        before its last tokens."""
        with self._lock:
            buffered = sum(len(v) for v in self._pending.values())
        return buffered + sum(len(v) for v in self._queues.values()) + self._sending

    def flush(self) -> None:
        """Engine thread, end of step: hand the step's outputs to the event loop."""
        with self._lock:
            if not self._pending:
                return
            pending, self._pending = self._pending, {}
        self.loop.call_soon_threadsafe(self._enqueue, pending)

    def _enqueue(self, pending: dict[str, list[Outgoing]]) -> None:
        for addr, gens in pending.items():
            self._queues.setdefault(addr, []).extend(gens)
            if addr not in self._senders or self._senders[addr].done():
                self._wakeups[addr] = asyncio.Event()
                self._senders[addr] = asyncio.create_task(self._send_loop(addr))
            self._wakeups[addr].set()

    def _stub(self, addr: str) -> pb_grpc.XllmRpcServiceStub:
        return pb_grpc.XllmRpcServiceStub(self._channels.get(addr))

    async def _send_loop(self, addr: str) -> None:
        wake = self._wakeups[addr]
        while True:
            await wake.wait()
            wake.clear()
            gens = self._queues.pop(addr, [])
            if not gens:
                continue
            await self._send(addr, gens)

    def _stream(self, addr: str) -> PipelinedStream:
        stream = self._streams.get(addr)
        if stream is None:
            stub = pb_grpc.XllmRpcServiceStub(self._channels.get(addr))
            stream = PipelinedStream(lambda: stub.GenerationsStream())
            self._streams[addr] = stream
        return stream

    async def _send(self, addr: str, gens: list[Outgoing]) -> None:
        request = wire.generations_to_proto([g.message for g in gens], self.instance_name)
        reply = None
        self._sending += len(gens)
        try:
            reply = await self._stream(addr).request(request, self.timeout_s)
            self.num_calls += 1
        except StreamBroken as exc:
            if exc.maybe_delivered:  # a resend could deliver tokens twice
                logger.warning("Generations stream to %s broke: %s", addr, exc)
            else:
                reply = await self._send_unary(addr, request)
        except asyncio.TimeoutError:
            logger.warning("Generations to %s timed out after %.1fs", addr, self.timeout_s)
        finally:
            self._sending -= len(gens)
        if reply is None:
            logger.warning("aborting %d requests of service %s", len(gens), addr)
            why = f"instance {self.instance_name} could not reach the service and dropped it"
            notices = self._dropped.setdefault(addr, {})
            for gen in gens:
                if not gen.finished:
                    self.abort(gen.engine_request_id)
                    notices[gen.engine_request_id] = wire.dropped_generation(
                        gen.message, self.instance_name, why)
            if notices and (addr not in self._resenders or self._resenders[addr].done()):
                self._resenders[addr] = asyncio.create_task(self._resend_dropped(addr))
            return
        for gen, (ok, why) in zip(gens, wire.statuses_from_proto(reply)):
            if not ok and not gen.finished:
                logger.info("service %s dropped request %s: %s", addr, gen.engine_request_id, why)
                self.abort(gen.engine_request_id)

    async def _resend_dropped(self, addr: str) -> None:
        """Tell the service of the requests dropped while it could not be reached, until
        it answers (whatever it answers: it knows now)."""
        t0 = asyncio.get_running_loop().time()
        while self._dropped.get(addr):
            await asyncio.sleep(RESEND_S)
            notices = self._dropped.get(addr, {})
            if asyncio.get_running_loop().time() - t0 > DROPPED_NOTICE_S:
                logger.warning("service %s unreachable for %.0fs: %d dropped requests not "
                               "reported", addr, DROPPED_NOTICE_S, len(notices))
                self._dropped.pop(addr, None)
                return
            sent = dict(notices)
            reply = await self._send_unary(
                addr, wire.generations_to_proto(list(sent.values()), self.instance_name))
            if reply is not None:
                logger.info("told service %s of %d requests dropped while it was unreachable",
                            addr, len(sent))
                for rid in sent:
                    notices.pop(rid, None)

    async def _send_unary(self, addr: str, request: object) -> object | None:
        try:
            reply = await self._stub(addr).Generations(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.warning("Generations to %s failed: %s", addr, exc.code().name)
            return None
        self.num_calls += 1
        return reply

    async def close(self) -> None:
        for task in (*self._senders.values(), *self._resenders.values()):
            task.cancel()
        for stream in self._streams.values():
            await stream.close()
        await self._channels.close()
