"""EngineClient: the RPCs the service makes to an engine's DisaggPDService (Generate,
MultiGenerations, Cancel), one channel per address. The backend talks to engines only
through this interface, so its unit tests pass a fake one.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import grpc

from xllm_service.config import RelayConfig
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.rpc import service as wire
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.utils.grpc_channels import ChannelPool, PipelinedStream, StreamBroken

logger = logging.getLogger(__name__)

# What Generate raises when the request may not have reached the engine (retry elsewhere).
SEND_ERRORS = (grpc.aio.AioRpcError, StreamBroken, asyncio.TimeoutError)


class Engines(Protocol):
    async def generate(self, addr: str, spec: EngineRequestSpec) -> wire.SubmitStatus:
        """Start `spec` on the engine at `addr`; raises one of SEND_ERRORS when the RPC
        itself failed."""

    async def migrate(self, addr: str, spec: EngineRequestSpec, generated_token_ids: list[int],
                      num_unread_tokens: int) -> wire.SubmitStatus:
        """MultiGenerations: resume `spec` after `generated_token_ids`; raises
        grpc.aio.AioRpcError when the RPC failed."""

    async def cancel(self, addr: str, engine_request_id: str, service_request_id: str = "",
                     reason: str = "") -> None:
        """Best effort: the engine aborts the request and frees its blocks."""

    async def close(self) -> None: ...


class EngineClient:
    def __init__(self, config: RelayConfig,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.config = config
        self._channels = ChannelPool(credentials)
        self._gen_streams: dict[str, PipelinedStream] = {}

    def _stub(self, addr: str) -> pb_grpc.DisaggPDServiceStub:
        return pb_grpc.DisaggPDServiceStub(self._channels.get(addr))

    async def generate(self, addr: str, spec: EngineRequestSpec) -> wire.SubmitStatus:
        """Generate over the engine's long-lived GenerateStream (unary if it broke before
        the message went out)."""
        msg, timeout = wire.generate_request(spec), self.config.rpc_timeout_s
        stream = self._gen_streams.get(addr)
        if stream is None:
            stub = self._stub(addr)
            stream = PipelinedStream(lambda: stub.GenerateStream())
            self._gen_streams[addr] = stream
        try:
            return wire.submit_status(await stream.request(msg, timeout))
        except StreamBroken as exc:
            if exc.maybe_delivered:
                raise
        try:
            return wire.submit_status(await self._stub(addr).Generate(msg, timeout=timeout))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                return wire.invalid_argument(exc.details() or "")
            raise

    async def migrate(self, addr: str, spec: EngineRequestSpec, generated_token_ids: list[int],
                      num_unread_tokens: int) -> wire.SubmitStatus:
        msg = wire.migration_request(spec, generated_token_ids, num_unread_tokens)
        status = await self._stub(addr).MultiGenerations(msg, timeout=self.config.rpc_timeout_s)
        return wire.submit_status(status)

    async def cancel(self, addr: str, engine_request_id: str, service_request_id: str = "",
                     reason: str = "") -> None:
        try:
            await self._stub(addr).Cancel(wire.cancel_request(engine_request_id, service_request_id,
                                                              reason),
                                          timeout=self.config.cancel_timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.debug("Cancel of %s on %s failed: %s", engine_request_id, addr, exc.code())

    async def close(self) -> None:
        for stream in self._gen_streams.values():
            await stream.close()
        await self._channels.close()
