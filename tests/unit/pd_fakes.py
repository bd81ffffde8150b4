"""Fakes for the PD scheduler's unit tests: a fake PDPeers (the other processes), a
reporter that keeps what would go to the service, and helpers on a real engine."""
from __future__ import annotations

import asyncio
import time

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.pd_messages import HandOver, KVMove, PeerLink, Placement
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.status import Status, StatusError


class Sink:
    def __init__(self, request_id: str, on_output=None) -> None:
        self.request_id = request_id
        self.outputs = []
        self.finished_on_prefill = False
        self.on_output = on_output  # as ReporterSink: False suppresses the output

    def emit(self, output) -> None:
        if self.on_output is None or self.on_output(output):
            self.outputs.append(output)


class Reporter:
    """Collects what the PD scheduler would send to the service."""

    def __init__(self) -> None:
        self.sinks: list[Sink] = []

    def sink(self, service_addr: str, service_request_id: str, request_id: str,
             on_output=None) -> Sink:
        self.sinks.append(Sink(request_id, on_output))
        return self.sinks[-1]

    def flush(self) -> None:
        pass

    def outputs(self, request_id: str) -> list:
        return [o for s in self.sinks if s.request_id == request_id for o in s.outputs]

    def errors(self) -> list[tuple[str, int, str]]:
        return [(s.request_id, o.error_code, o.error_message)
                for s in self.sinks for o in s.outputs if o.error_code]


class FakePeers:
    """PDPeers in the test's process. Decodes answer from `full` (no KV space) and
    `refuse` (name -> Status), place every request on `block_ids`; KV transfers are
    recorded and run until `transfer_gate` is set (when one is given)."""

    def __init__(self, block_ids: list[int] | None = None) -> None:
        self.block_ids = block_ids if block_ids is not None else [0, 1, 2]
        self.full: set[str] = set()
        self.refuse: dict[str, Status] = {}
        self.lost_answers: set[str] = set()  # decodes that place, but whose answer is lost
        self.unreachable_first_generations = 0  # the next N FirstGenerations cannot connect
        self.links: list[tuple[str, str]] = []  # (decode, prefill)
        self.placements: list[tuple[str, str]] = []  # (request, decode)
        self.handovers: list[tuple[str, HandOver]] = []  # (decode, hand-over)
        self.moves: list[tuple[str, KVMove]] = []  # ("pull" | "push", move)
        self.cluster_links: list[PeerLink] = []
        self.transfer_started = asyncio.Event()
        self.transfer_gate: asyncio.Event | None = None
        self.transfer_error: StatusError | None = None
        self.asked: list[str] = []  # request ids, in the order AddNewRequests came
        self.place_started = asyncio.Event()
        self.place_gate: asyncio.Event | None = None
        self.closed = False
        self.dead_addresses: set[str] = set()  # rpc addresses nobody listens on
        self.refused_on: list[tuple[str, str]] = []  # (request, decode) refusals
        self.pulls: list[tuple[str, object]] = []  # (prefill, OfflinePull)
        self.pull_answer = 0  # requests a prefill hands over on each pull
        self.pull_error: StatusError | None = None

    async def link_instance(self, decode: InstanceMeta, prefill: InstanceMeta) -> None:
        if decode.rpc_address in self.dead_addresses:
            raise StatusError(Status.UNAVAILABLE, f"cannot link decode {decode.name}: "
                                                  f"UNAVAILABLE")
        self.links.append((decode.name, prefill.name))

    async def add_new_request(self, decode: InstanceMeta, prefill: InstanceMeta,
                              spec: EngineRequestSpec) -> Placement:
        self.asked.append(spec.request_id)
        self.place_started.set()
        if self.place_gate is not None:
            await self.place_gate.wait()
        if decode.name in self.full:
            return Placement(spec.request_id, Status.RESOURCE_EXHAUSTED, message="full")
        if decode.name in self.refuse:
            self.refused_on.append((spec.request_id, decode.name))
            return Placement(spec.request_id, self.refuse[decode.name],
                             message=f"{decode.name} refuses it")
        self.placements.append((spec.request_id, decode.name))
        if decode.name in self.lost_answers:
            raise StatusError(Status.DEADLINE_EXCEEDED, "AddNewRequests: Deadline Exceeded")
        return Placement(spec.request_id, Status.OK, list(self.block_ids), 0)

    async def first_generation(self, decode: InstanceMeta, handover: HandOver,
                               timeout_s: float) -> str:
        assert timeout_s > 0
        if self.unreachable_first_generations > 0:
            self.unreachable_first_generations -= 1
            raise StatusError(Status.UNAVAILABLE, "FirstGeneration: cannot connect")
        self.handovers.append((decode.name, handover))
        return ""

    async def send_pull_signal(self, prefill: InstanceMeta, pull) -> int:
        self.pulls.append((prefill.name, pull))
        if self.pull_error is not None:
            raise self.pull_error
        return self.pull_answer

    async def _transfer(self, op: str, move: KVMove) -> None:
        self.moves.append((op, move))
        self.transfer_started.set()
        if self.transfer_gate is not None:
            await self.transfer_gate.wait()
        if self.transfer_error is not None:
            raise self.transfer_error

    async def push_kv(self, move: KVMove) -> None:
        await self._transfer("push", move)

    async def pull_kv(self, move: KVMove) -> None:
        await self._transfer("pull", move)

    async def link_cluster(self, link: PeerLink) -> None:
        self.cluster_links.append(link)

    async def close(self) -> None:
        self.closed = True


async def on_engine(engine: LLMEngine, fn):
    return await asyncio.wrap_future(engine.call(fn))


async def blocks_used(engine: LLMEngine) -> int:
    return await on_engine(engine, lambda: engine.scheduler.kv.block_pool.num_used_blocks)


async def until(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll `predicate` (sync or async) until true, failing after timeout_s."""
    t0 = time.monotonic()
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        assert time.monotonic() - t0 < timeout_s, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def until_free(engine: LLMEngine, timeout_s: float = 20.0) -> None:
    async def free() -> bool:
        return (not await blocks_used(engine)
                and not await on_engine(engine, lambda: engine.scheduler.requests))
    await until(free, timeout_s, "every block and request freed")
