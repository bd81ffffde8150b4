"""What an instance's DisaggPDService does, by role: one handler per role, in domain
values (service.py turns protos into them and StatusError into gRPC statuses).

  EngineHandler    MIX (and DEFAULT): `Generate` runs the whole request on the engine;
                   MultiGenerations recomputes a migrated request's KV. What a role does
                   not serve is refused here (FAILED_PRECONDITION). A PREFILL or DECODE
                   refuses requests (Starting) until its PDRole is up.
  PrefillHandler   PREFILL: `Generate` queues the request on the PrefillSide; a decode
                   with room pulls offline work (SendPullSignal).
  DecodeHandler    DECODE: AddNewRequests, FirstGeneration, LinkInstance and
                   MultiGenerations (pulling the KV when the item says where it is) on
                   the DecodeSide; `Generate` as MIX: the service's conditional
                   disaggregation sends a prompt that is short, or mostly in the decode's
                   prefix cache, to the decode itself, whose scheduler prefills it in
                   chunks within the step budget beside the running decodes.
  ElasticHandler   an elastic instance (MIX in a cluster, duty.py): both sides; the
                   route decides `Generate` (the prompt of a PD pair to the prefill side,
                   anything else whole), the duty whether new placements are taken.
"""
from __future__ import annotations

from xllm_py.config import InstanceRole
from xllm_py.engine.generations_reporter import GenerationsReporter
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.engine.migration import multi_generations
from xllm_py.engine.pd.decode import DecodeSide
from xllm_py.engine.pd.duty import Duty
from xllm_py.engine.pd.links import Links
from xllm_py.engine.pd.prefill import PrefillSide
from xllm_py.pd_messages import HandOver, OfflinePull, PeerLink, Placement
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.rpc.pd import MigrationItem
from xllm_py.status import Status, StatusError


# The RPCs not every role serves, and the roles that do.
SERVED_BY = {"AddNewRequests": "DECODE", "FirstGeneration": "DECODE", "LinkInstance": "DECODE",
             "MultiGenerations": "DECODE and MIX", "SendPullSignal": "PREFILL"}


class EngineHandler:
    serves = frozenset({"MultiGenerations"})  # of SERVED_BY

    def __init__(self, engine: LLMEngine, reporter: GenerationsReporter,
                 role: InstanceRole) -> None:
        self.engine = engine
        self.reporter = reporter
        self.role = role

    def check(self, rpc: str) -> None:
        """StatusError(FAILED_PRECONDITION) unless this role serves `rpc` (before its
        message is read: a caller at the wrong instance learns that first)."""
        if rpc not in self.serves:
            raise self._not_served(rpc)

    def _not_served(self, rpc: str) -> StatusError:
        return StatusError(Status.FAILED_PRECONDITION, f"{rpc} is served by "
                           f"{SERVED_BY[rpc]} instances; this one is {self.role.value}")

    def num_pending(self) -> int:
        """Requests accepted here that the engine does not hold yet."""
        return 0

    def generate(self, spec: EngineRequestSpec) -> None:
        sink = self.reporter.sink(spec.source_xservice_addr, spec.service_request_id,
                                  spec.request_id)
        if not self.engine.try_submit(EngineRequest(spec.request_id, spec.prompt_token_ids,
                                                    spec.params, sink, offline=spec.offline,
                                                    tpot_slo_ms=spec.tpot_slo_ms)):
            raise StatusError(Status.INVALID_ARGUMENT,
                              f"duplicate request id {spec.request_id}: it is running here")

    def cancel(self, request_id: str) -> None:
        """The service cancelled the request: the engine aborts it."""
        self.engine.abort(request_id)

    async def multi_generations(self, items: list[MigrationItem]) -> object:
        """Migrated requests resumed by recompute (no KV transfer here): their Status."""
        return await multi_generations(self.engine, self.reporter, items, None,
                                       self.role.value)

    async def add_new_requests(self, prefill_name: str,
                               items: list[EngineRequestSpec | Placement]) -> list[Placement]:
        raise self._not_served("AddNewRequests")

    async def first_generation(self, handovers: list[HandOver]) -> list[str]:
        raise self._not_served("FirstGeneration")

    async def link_instance(self, link: PeerLink) -> None:
        raise self._not_served("LinkInstance")

    def unlink_instance(self, name: str) -> None:
        """Nothing is linked here."""

    def on_pull(self, pull: OfflinePull) -> int:
        raise self._not_served("SendPullSignal")


class Starting(EngineHandler):
    """A PREFILL or DECODE before its PDRole is up: no request is taken yet (nobody
    routes here before the instance registers, after that)."""

    serves = frozenset()

    def _not_served(self, rpc: str) -> StatusError:
        return StatusError(Status.FAILED_PRECONDITION,
                           f"{self.role.value.lower()} instance is starting")

    def generate(self, spec: EngineRequestSpec) -> None:
        raise self._not_served("Generate")


class PrefillHandler(EngineHandler):
    serves = frozenset({"SendPullSignal"})

    def __init__(self, engine: LLMEngine, reporter: GenerationsReporter, prefill: PrefillSide,
                 links: Links) -> None:
        super().__init__(engine, reporter, InstanceRole.PREFILL)
        self.prefill = prefill
        self.links = links

    def num_pending(self) -> int:
        return self.prefill.num_pending()

    def generate(self, spec: EngineRequestSpec) -> None:
        self.prefill.add_request(spec)

    def cancel(self, request_id: str) -> None:
        """The prefill side stops its PD work for the request, and the engine aborts it
        (what it holds for a hand-over under way is freed by the hand-over)."""
        self.prefill.cancel(request_id)
        self.engine.abort(request_id)

    async def multi_generations(self, items: list[MigrationItem]) -> object:
        raise self._not_served("MultiGenerations")

    def on_pull(self, pull: OfflinePull) -> int:
        return self.prefill.on_pull(pull)

    def unlink_instance(self, name: str) -> None:
        self.links.forget(name)


class DecodeHandler(EngineHandler):
    serves = frozenset({"AddNewRequests", "FirstGeneration", "LinkInstance", "MultiGenerations"})

    def __init__(self, engine: LLMEngine, reporter: GenerationsReporter, decode: DecodeSide,
                 links: Links) -> None:
        super().__init__(engine, reporter, InstanceRole.DECODE)
        self.decode = decode
        self.links = links

    def cancel(self, request_id: str) -> None:
        """A request the decode side holds blocks for is freed by it once no transfer can
        touch them; one it has handed to the engine (decoding) the engine aborts."""
        if not self.decode.cancel(request_id):
            self.engine.abort(request_id)

    async def multi_generations(self, items: list[MigrationItem]) -> object:
        """Migrated requests: their KV pulled when the item says where it is, else
        recomputed."""
        return await multi_generations(self.engine, self.reporter, items,
                                       self.decode.resume_with_kv, self.role.value)

    async def add_new_requests(self, prefill_name: str,
                               items: list[EngineRequestSpec | Placement]) -> list[Placement]:
        return await self.decode.add_new_requests(prefill_name, items)

    async def first_generation(self, handovers: list[HandOver]) -> list[str]:
        return await self.decode.first_generation(handovers)

    async def link_instance(self, link: PeerLink) -> None:
        await self.links.link_instance(link)

    def unlink_instance(self, name: str) -> None:
        self.links.forget(name)


class ElasticHandler(DecodeHandler):
    """Serves what a DECODE serves (placements only while its duty takes them) and what
    a PREFILL serves; `Generate` goes where the service routed it (duty.py)."""

    serves = DecodeHandler.serves | PrefillHandler.serves

    def __init__(self, engine: LLMEngine, reporter: GenerationsReporter, prefill: PrefillSide,
                 decode: DecodeSide, links: Links, duty: Duty) -> None:
        super().__init__(engine, reporter, decode, links)
        self.role = InstanceRole.MIX
        self.prefill = prefill
        self.duty = duty

    def num_pending(self) -> int:
        return self.prefill.num_pending()

    def generate(self, spec: EngineRequestSpec) -> None:
        if spec.decode_name:  # routed as the prompt of a PD pair
            self.prefill.add_request(spec)
        else:
            super().generate(spec)

    def cancel(self, request_id: str) -> None:
        if self.prefill.phase(request_id) is not None:
            self.prefill.cancel(request_id)
            self.engine.abort(request_id)
        else:
            super().cancel(request_id)

    async def add_new_requests(self, prefill_name: str,
                               items: list[EngineRequestSpec | Placement]) -> list[Placement]:
        if not self.duty.takes_placements:
            raise StatusError(Status.FAILED_PRECONDITION,
                              f"this instance serves as {self.duty.serves.value} now; "
                              "it takes no new decode placements")
        return await super().add_new_requests(prefill_name, items)

    def on_pull(self, pull: OfflinePull) -> int:
        return self.prefill.on_pull(pull)
