"""DisaggPDService servicer on every engine (thin: proto -> domain -> proto).

MIX instances serve `Generate` (a whole request from the service) and MultiGenerations
(a request migrated off a dead MIX instance, its KV recomputed); PREFILL instances serve
`Generate` through the DisaggPDScheduler; DECODE instances serve AddNewRequests,
FirstGeneration, LinkInstance/UnlinkInstance and MultiGenerations.
"""
from __future__ import annotations

import logging
import os

import grpc

from xllm_py.config import (FAULT_EXIT_ON_FIRST_GENERATION, InstanceRole,
                             fault_exit_on_first_generation)
from xllm_py.engine.disagg_scheduler import DisaggPDScheduler, PDError
from xllm_py.engine.generations_reporter import GenerationsReporter
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.engine.migration import multi_generations
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.rpc.convert import spec_from_proto

logger = logging.getLogger(__name__)

_PD_CODES = {412: grpc.StatusCode.FAILED_PRECONDITION, 400: grpc.StatusCode.INVALID_ARGUMENT,
             500: grpc.StatusCode.INVALID_ARGUMENT}


class DisaggPDServicer(pb_grpc.DisaggPDServiceServicer):
    def __init__(self, engine: LLMEngine, role: InstanceRole, reporter: GenerationsReporter,
                 pd: DisaggPDScheduler | None) -> None:
        self.engine = engine
        self.role = role
        self.reporter = reporter
        self.pd = pd
        self._fault_exit_on_first_generation = fault_exit_on_first_generation()

    async def _require_decode(self, rpc: str, context) -> None:
        """Abort with FAILED_PRECONDITION unless this is a DECODE instance."""
        if self.role != InstanceRole.DECODE or self.pd is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{rpc} is served by DECODE instances; this one is {self.role.value}")

    async def Generate(self, request: pb.DisaggRequest, context) -> pb.Status:
        status = await self._generate_one(request)
        if not status.ok:
            code = (grpc.StatusCode.INVALID_ARGUMENT if status.code == 400
                    else grpc.StatusCode.FAILED_PRECONDITION)
            await context.abort(code, status.message)
        return status

    async def GenerateStream(self, request_iterator, context):
        """Generate over one long-lived stream: one Status per request, in order."""
        async for request in request_iterator:
            yield await self._generate_one(request)

    async def _generate_one(self, request: pb.DisaggRequest) -> pb.Status:
        """Accept a request from the service; Status code 400/412 on refusal."""
        try:
            spec = spec_from_proto(request)
        except ValueError as exc:
            return pb.Status(ok=False, code=400, message=f"bad request: {exc}")
        if not spec.source_xservice_addr:
            return pb.Status(ok=False, code=400,
                             message="source_xservice_addr is required: tokens go back there")
        if self.role == InstanceRole.PREFILL:
            if self.pd is None:
                return pb.Status(ok=False, code=412, message="prefill instance is starting")
            await self.pd.add_request(spec)
            return pb.Status(ok=True, code=200)
        if self.role == InstanceRole.DECODE:
            return pb.Status(ok=False, code=412, message=(
                "a DECODE instance takes requests from a prefill instance only"))
        sink = self.reporter.sink(spec.source_xservice_addr, spec.service_request_id,
                                  spec.request_id)
        self.engine.submit(EngineRequest(spec.request_id, spec.prompt_token_ids, spec.params, sink))
        return pb.Status(ok=True, code=200)

    async def Cancel(self, request: pb.PullSignal, context) -> pb.Status:
        if self.pd is None or not self.pd.cancel(request.req_id):
            self.engine.abort(request.req_id)
        return pb.Status(ok=True, code=200)

    async def AddNewRequests(self, request: pb.DisaggRequests, context) -> pb.DisaggResponses:
        await self._require_decode("AddNewRequests", context)
        return await self.pd.add_new_requests(request)

    async def FirstGeneration(self, request: pb.DisaggGenerationsRequests, context) -> pb.Status:
        await self._require_decode("FirstGeneration", context)
        if self._fault_exit_on_first_generation:
            logger.error("%s=1: exiting at FirstGeneration", FAULT_EXIT_ON_FIRST_GENERATION)
            os._exit(17)
        return await self.pd.first_generation(request)

    async def MultiGenerations(self, request: pb.MultiGenerationsRequests, context) -> pb.Status:
        """Migration: DECODE pulls the KV when the item says where it is, else recomputes;
        MIX always recomputes (it has no KV transfer, so an item with kv is refused)."""
        if self.role in (InstanceRole.MIX, InstanceRole.DEFAULT):
            status = await multi_generations(self.engine, self.reporter, request.reqs,
                                             None, self.role.value)
        elif self.role == InstanceRole.PREFILL:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "MultiGenerations is served by DECODE and MIX instances; "
                                "this one is PREFILL")
        else:
            await self._require_decode("MultiGenerations", context)
            status = await self.pd.multi_generations(request)
        if not status.ok:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status.message)
        return status

    async def SendPullSignal(self, request: pb.PullSignal, context) -> pb.Status:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "SendPullSignal needs online/offline co-location, not implemented")

    async def LinkInstance(self, request: pb.InstanceClusterInfo, context) -> pb.Status:
        await self._require_decode("LinkInstance", context)
        try:
            await self.pd.link_instance(request)
        except PDError as exc:
            await context.abort(_PD_CODES.get(exc.code, grpc.StatusCode.UNAVAILABLE), exc.message)
        return pb.Status(ok=True, code=200)

    async def UnlinkInstance(self, request: pb.InstanceClusterInfo, context) -> pb.Status:
        if self.pd is not None:
            self.pd._linked.pop(request.instance_name, None)
        return pb.Status(ok=True, code=200)

