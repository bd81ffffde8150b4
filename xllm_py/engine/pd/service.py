"""DisaggPDServicer: the DisaggPDService on every engine. Each RPC: proto -> domain
(xllm_py.rpc) -> the engine or the DisaggPDScheduler -> domain result or StatusError ->
proto / gRPC status.

MIX instances serve `Generate` (a whole request from the service) and MultiGenerations
(a request migrated off a dead MIX instance, its KV recomputed); PREFILL instances serve
`Generate` through the DisaggPDScheduler; DECODE instances serve AddNewRequests,
FirstGeneration, LinkInstance/UnlinkInstance and MultiGenerations, and `Generate` as MIX
does: the service's conditional disaggregation sends a prompt that is short, or mostly
in the decode's prefix cache, to the decode itself, whose scheduler prefills it in
chunks within the step budget alongside the running decodes.
"""
from __future__ import annotations

import logging
import os

from xllm_py.config import (FAULT_EXIT_ON_FIRST_GENERATION, InstanceRole,
                            fault_exit_on_first_generation)
from xllm_py.engine.generations_reporter import GenerationsReporter
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.engine.migration import multi_generations
from xllm_py.engine.pd.scheduler import DisaggPDScheduler
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.rpc import pd as wire
from xllm_py.rpc.convert import spec_from_proto
from xllm_py.status import Status, StatusError

logger = logging.getLogger(__name__)

# Items one AddNewRequests / FirstGeneration / MultiGenerations may carry (a prefill
# batches at most its max_num_seqs; more is a hostile or broken caller).
MAX_BATCH_ITEMS = 1024


class DisaggPDServicer(pb_grpc.DisaggPDServiceServicer):
    def __init__(self, engine: LLMEngine, role: InstanceRole, reporter: GenerationsReporter,
                 pd: DisaggPDScheduler | None) -> None:
        self.engine = engine
        self.role = role
        self.reporter = reporter
        self.pd = pd
        self._fault_exit_on_first_generation = fault_exit_on_first_generation()

    async def _abort(self, context, exc: StatusError) -> None:
        await context.abort(exc.status.grpc_code, exc.message)

    def _decode_pd(self, rpc: str) -> DisaggPDScheduler:
        """The PD scheduler, or StatusError(FAILED_PRECONDITION) unless this is DECODE."""
        if self.role != InstanceRole.DECODE or self.pd is None:
            raise StatusError(Status.FAILED_PRECONDITION, f"{rpc} is served by DECODE "
                                                          f"instances; this one is {self.role.value}")
        return self.pd

    async def Generate(self, request: pb.DisaggRequest, context) -> pb.Status:
        try:
            self._generate_one(request)
        except StatusError as exc:
            await self._abort(context, exc)
        return wire.status_to_proto()

    async def GenerateStream(self, request_iterator, context):
        """Generate over one long-lived stream: one Status per request, in order."""
        async for request in request_iterator:
            try:
                self._generate_one(request)
            except StatusError as exc:
                yield wire.status_to_proto(exc.status, exc.message)
                continue
            yield wire.status_to_proto()

    def _generate_one(self, request: pb.DisaggRequest) -> None:
        """Accept a request from the service; StatusError on refusal (INVALID_ARGUMENT,
        FAILED_PRECONDITION)."""
        try:
            spec = spec_from_proto(request)
        except ValueError as exc:
            raise StatusError(Status.INVALID_ARGUMENT, f"bad request: {exc}") from None
        if not spec.source_xservice_addr:
            raise StatusError(Status.INVALID_ARGUMENT,
                              "source_xservice_addr is required: tokens go back there")
        self._admit_or_refuse()
        if self.role == InstanceRole.PREFILL:
            if self.pd is None:
                raise StatusError(Status.FAILED_PRECONDITION, "prefill instance is starting")
            self.pd.add_request(spec)
            return
        sink = self.reporter.sink(spec.source_xservice_addr, spec.service_request_id,
                                  spec.request_id)
        if not self.engine.try_submit(EngineRequest(spec.request_id, spec.prompt_token_ids,
                                                    spec.params, sink, offline=spec.offline,
                                                    tpot_slo_ms=spec.tpot_slo_ms)):
            raise StatusError(Status.INVALID_ARGUMENT,
                              f"duplicate request id {spec.request_id}: it is running here")

    def _admit_or_refuse(self) -> None:
        """RESOURCE_EXHAUSTED when this instance holds as many requests not started yet as
        it takes (`APILimits.max_pending_requests`): the service tries another one, and
        answers 429 when every one is full."""
        queued = self.engine.num_not_started
        if self.pd is not None and self.pd.prefill is not None:
            queued += self.pd.prefill.num_pending()
        limit = self.engine.config.api.max_pending_requests
        if queued >= limit:
            raise StatusError(Status.RESOURCE_EXHAUSTED,
                              f"{queued} requests are waiting here (limit {limit}); retry later")

    async def Cancel(self, request: pb.CancelRequest, context) -> pb.Status:
        request_id, reason = wire.cancel_from_proto(request)
        logger.info("cancel %s: %s", request_id, reason or "no reason given")
        if self.pd is None or not self.pd.cancel(request_id):
            self.engine.abort(request_id)
        return wire.status_to_proto()

    async def AddNewRequests(self, request: pb.DisaggRequests, context) -> pb.DisaggResponses:
        try:
            pd = self._decode_pd("AddNewRequests")
            _check_batch(len(request.reqs))
        except StatusError as exc:
            await self._abort(context, exc)
        prefill_name, items = wire.add_requests_from_proto(request)
        return wire.placements_to_proto(await pd.add_new_requests(prefill_name, items))

    async def FirstGeneration(self, request: pb.DisaggGenerationsRequests, context) -> pb.Status:
        try:
            pd = self._decode_pd("FirstGeneration")
            _check_batch(len(request.gens))
        except StatusError as exc:
            await self._abort(context, exc)
        if self._fault_exit_on_first_generation:
            logger.error("%s=1: exiting at FirstGeneration", FAULT_EXIT_ON_FIRST_GENERATION)
            os._exit(17)
        problems = await pd.first_generation(wire.handovers_from_proto(request))
        return wire.problems_to_proto(problems)

    async def MultiGenerations(self, request: pb.MultiGenerationsRequests, context) -> pb.Status:
        """Migration: DECODE pulls the KV when the item says where it is, else recomputes;
        MIX always recomputes (it has no KV transfer, so an item with kv is refused)."""
        try:
            _check_batch(len(request.reqs))
        except StatusError as exc:
            await self._abort(context, exc)
        if self.role in (InstanceRole.MIX, InstanceRole.DEFAULT):
            status = await multi_generations(self.engine, self.reporter, wire.migration_items_from_proto(request),
                                             None, self.role.value)
        elif self.role == InstanceRole.PREFILL:
            await context.abort(Status.FAILED_PRECONDITION.grpc_code,
                                "MultiGenerations is served by DECODE and MIX instances; "
                                "this one is PREFILL")
        else:
            try:
                pd = self._decode_pd("MultiGenerations")
            except StatusError as exc:
                await self._abort(context, exc)
            status = await multi_generations(self.engine, self.reporter, wire.migration_items_from_proto(request),
                                             pd.resume_with_kv, self.role.value)
        ok, message = wire.status_from_proto(status)
        if not ok:
            await context.abort(Status.INVALID_ARGUMENT.grpc_code, message)
        return status

    async def SendPullSignal(self, request: pb.PullSignal, context) -> pb.PullReply:
        """A decode with room pulls offline work (PREFILL instances): the reply says how
        many queued offline requests are placed on it."""
        try:
            if self.role != InstanceRole.PREFILL or self.pd is None:
                raise StatusError(Status.FAILED_PRECONDITION, "SendPullSignal is served by "
                                  f"PREFILL instances; this one is {self.role.value}")
            try:
                pull = wire.offline_pull_from_proto(request)
            except ValueError as exc:
                raise StatusError(Status.INVALID_ARGUMENT, f"bad PullSignal: {exc}") from None
        except StatusError as exc:
            await self._abort(context, exc)
        return wire.pull_reply_to_proto(self.pd.on_pull(pull))

    async def LinkInstance(self, request: pb.InstanceClusterInfo, context) -> pb.Status:
        try:
            pd = self._decode_pd("LinkInstance")
            try:
                link = wire.peer_link_from_proto(request)
            except ValueError as exc:
                raise StatusError(Status.INVALID_ARGUMENT, f"bad LinkInstance: {exc}") from None
            await pd.link_instance(link)
        except StatusError as exc:
            await self._abort(context, exc)
        return wire.status_to_proto()

    async def UnlinkInstance(self, request: pb.InstanceClusterInfo, context) -> pb.Status:
        if self.pd is not None:
            self.pd.unlink_instance(wire.unlink_name_from_proto(request))
        return wire.status_to_proto()


def _check_batch(num_items: int) -> None:
    if num_items > MAX_BATCH_ITEMS:
        raise StatusError(Status.INVALID_ARGUMENT,
                          f"{num_items} items in one call; at most {MAX_BATCH_ITEMS}")
