"""DisaggPDServicer: the DisaggPDService on every engine. Each RPC: proto -> domain
(xllm_py.rpc) -> the handler of this instance's role (handlers.py: chosen once, no role
branch per RPC) -> domain result or StatusError -> proto / gRPC status.

A MIX instance serves through an EngineHandler from the start; a PREFILL or DECODE
through `Starting` until ClusterNode attaches its PDRole (`attach`), then through the
role's PrefillHandler or DecodeHandler.
"""
from __future__ import annotations

import logging

from xllm_py.config import InstanceRole
from xllm_py.engine.generations_reporter import GenerationsReporter
from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.engine.pd.handlers import EngineHandler, Starting
from xllm_py.engine.pd.role import PDRole
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
    def __init__(self, engine: LLMEngine, role: InstanceRole,
                 reporter: GenerationsReporter, starting: bool | None = None) -> None:
        """`starting`: serve nothing until `attach` (default: a PREFILL or DECODE; an
        elastic MIX too)."""
        self.engine = engine
        if starting is None:
            starting = role in (InstanceRole.PREFILL, InstanceRole.DECODE)
        self.handler: EngineHandler = (Starting if starting else EngineHandler)(
            engine, reporter, role)

    def attach(self, pd: PDRole) -> None:
        """The PD role is up: its handler serves from now on."""
        self.handler = pd.handler()

    async def _abort(self, context, exc: StatusError) -> None:
        await context.abort(exc.status.grpc_code, exc.message)

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
        FAILED_PRECONDITION, RESOURCE_EXHAUSTED)."""
        try:
            spec = spec_from_proto(request)
        except ValueError as exc:
            raise StatusError(Status.INVALID_ARGUMENT, f"bad request: {exc}") from None
        if not spec.source_xservice_addr:
            raise StatusError(Status.INVALID_ARGUMENT,
                              "source_xservice_addr is required: tokens go back there")
        self._admit_or_refuse()
        self.handler.generate(spec)

    def _admit_or_refuse(self) -> None:
        """RESOURCE_EXHAUSTED when this instance holds as many requests not started yet as
        it takes (`APILimits.max_pending_requests`): the service tries another one, and
        answers 429 when every one is full."""
        queued = self.engine.num_not_started + self.handler.num_pending()
        limit = self.engine.config.api.max_pending_requests
        if queued >= limit:
            raise StatusError(Status.RESOURCE_EXHAUSTED,
                              f"{queued} requests are waiting here (limit {limit}); retry later")

    async def Cancel(self, request: pb.CancelRequest, context) -> pb.Status:
        request_id, reason = wire.cancel_from_proto(request)
        logger.info("cancel %s: %s", request_id, reason or "no reason given")
        self.handler.cancel(request_id)
        return wire.status_to_proto()

    async def AddNewRequests(self, request: pb.DisaggRequests, context) -> pb.DisaggResponses:
        try:
            self.handler.check("AddNewRequests")
            _check_batch(len(request.reqs))
            prefill_name, items = wire.add_requests_from_proto(request)
            placements = await self.handler.add_new_requests(prefill_name, items)
        except StatusError as exc:
            await self._abort(context, exc)
        return wire.placements_to_proto(placements)

    async def FirstGeneration(self, request: pb.DisaggGenerationsRequests, context) -> pb.Status:
        try:
            self.handler.check("FirstGeneration")
            _check_batch(len(request.gens))
            problems = await self.handler.first_generation(wire.handovers_from_proto(request))
        except StatusError as exc:
            await self._abort(context, exc)
        return wire.problems_to_proto(problems)

    async def MultiGenerations(self, request: pb.MultiGenerationsRequests, context) -> pb.Status:
        """Migration: DECODE pulls the KV when the item says where it is, else recomputes;
        MIX always recomputes (it has no KV transfer, so an item with kv is refused)."""
        try:
            _check_batch(len(request.reqs))
            self.handler.check("MultiGenerations")
            status = await self.handler.multi_generations(
                wire.migration_items_from_proto(request))
        except StatusError as exc:
            await self._abort(context, exc)
        ok, message = wire.status_from_proto(status)
        if not ok:
            await context.abort(Status.INVALID_ARGUMENT.grpc_code, message)
        return status

    async def SendPullSignal(self, request: pb.PullSignal, context) -> pb.PullReply:
        """A decode with room pulls offline work (PREFILL instances): the reply says how
        many queued offline requests are placed on it."""
        try:
            self.handler.check("SendPullSignal")
            try:
                pull = wire.offline_pull_from_proto(request)
            except ValueError as exc:
                raise StatusError(Status.INVALID_ARGUMENT, f"bad PullSignal: {exc}") from None
            granted = self.handler.on_pull(pull)
        except StatusError as exc:
            await self._abort(context, exc)
        return wire.pull_reply_to_proto(granted)

    async def LinkInstance(self, request: pb.InstanceClusterInfo, context) -> pb.Status:
        try:
            self.handler.check("LinkInstance")
            try:
                link = wire.peer_link_from_proto(request)
            except ValueError as exc:
                raise StatusError(Status.INVALID_ARGUMENT, f"bad LinkInstance: {exc}") from None
            await self.handler.link_instance(link)
        except StatusError as exc:
            await self._abort(context, exc)
        return wire.status_to_proto()

    async def UnlinkInstance(self, request: pb.InstanceClusterInfo, context) -> pb.Status:
        self.handler.unlink_instance(wire.unlink_name_from_proto(request))
        return wire.status_to_proto()


def _check_batch(num_items: int) -> None:
    if num_items > MAX_BATCH_ITEMS:
        raise StatusError(Status.INVALID_ARGUMENT,
                          f"{num_items} items in one call; at most {MAX_BATCH_ITEMS}")
