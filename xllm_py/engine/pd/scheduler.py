"""DisaggPDScheduler (xLLM's name): the PD role of an engine, one facade over
  links.py    Links: peers linked for KV transfer (prelink on prefill, LinkInstance on decode)
  prefill.py  PrefillSide: queue, dispatch to a decode, prefill, hand-over (PREFILL role)
  decode.py   DecodeSide: allocate, take over, pull, reap orphans (DECODE role)
  offline_pull.py  OfflinePuller: a decode with room pulls offline work (SendPullSignal)
  peers.py    PDPeers: every RPC made to another process (parallel/instance_peers.InstancePeers in a cluster)
  metrics.py  PDMetrics (prometheus_client)
Lifecycle: constructed in ClusterNode once our meta is known -> start() (prefill: the
dispatch and prelink loops; decode: the orphan reaper and the offline puller) -> the DisaggPDService servicer
(service.py) calls in with domain values -> stop() cancels the loops and the tasks in
flight and closes the peers' channels.
The sides reach the engine through one PDConnector (connector.py), which the engine
polls in its step: no PD module touches the engine's scheduler or output processor.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Coroutine

from prometheus_client import CollectorRegistry

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import EngineConfig, InstanceRole
from xllm_py.engine.generations_reporter import GenerationsReporter
from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.engine.migration import Resumption
from xllm_py.engine.pd.config import PDSchedulerConfig
from xllm_py.engine.pd.connector import PDConnector
from xllm_py.engine.pd.decode import DecodeSide
from xllm_py.engine.pd.links import DecodeLister, Links, MetaResolver
from xllm_py.pd_messages import HandOver, OfflinePull, PeerLink, Placement
from xllm_py.engine.pd.metrics import PDMetrics
from xllm_py.engine.pd.offline_pull import OfflinePuller, PrefillLister
from xllm_py.engine.pd.peers import PDPeers
from xllm_py.engine.pd.prefill import PrefillSide
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.status import Status, StatusError


class DisaggPDScheduler:
    def __init__(self, engine: LLMEngine, config: EngineConfig, meta: InstanceMeta,
                 reporter: GenerationsReporter, peers: PDPeers,
                 resolve_meta: MetaResolver | None = None,
                 list_decodes: DecodeLister | None = None,
                 pd_config: PDSchedulerConfig = PDSchedulerConfig(),
                 registry: CollectorRegistry | None = None,
                 forget_meta: Callable[[str], None] | None = None,
                 list_prefills: PrefillLister | None = None) -> None:
        if config.role not in (InstanceRole.PREFILL, InstanceRole.DECODE):
            raise ValueError(f"a DisaggPDScheduler serves PREFILL or DECODE, not {config.role}")
        self.engine = engine
        self.reporter = reporter
        self.role = config.role
        self.pd_config = pd_config
        self.peers = peers
        self.links = Links(meta, peers, resolve_meta, list_decodes, forget_meta)
        self.metrics = PDMetrics(lambda: len(self.links), registry)
        self._tasks: set[asyncio.Task] = set()
        self._loops: list[asyncio.Task] = []
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self.puller: OfflinePuller | None = None
        self.connector = PDConnector(asyncio.get_running_loop(), engine.wake,
                                     hands_over=self.role == InstanceRole.PREFILL)
        engine.set_connector(self.connector)
        if self.role == InstanceRole.PREFILL:
            self.prefill = PrefillSide(engine, self.connector, config, pd_config, meta,
                                       reporter, self.links, peers, self.metrics, self._spawn)
        else:
            self.decode = DecodeSide(engine, self.connector, config, pd_config, reporter,
                                     peers, self.metrics, self._spawn)
            if list_prefills is not None and resolve_meta is not None:
                decode = self.decode
                self.puller = OfflinePuller(self.connector.offline_room, meta.name, peers,
                                            list_prefills,
                                            resolve_meta, self.metrics,
                                            lambda: decode.num_offline_placed)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.prefill is not None:
            self._loops = [asyncio.create_task(self.prefill.dispatch_loop()),
                           asyncio.create_task(
                               self.links.prelink_loop(self.pd_config.prelink_interval_s))]
        if self.decode is not None:
            self._loops = [asyncio.create_task(self.decode.reap_loop())]
            if self.puller is not None:
                self._loops.append(asyncio.create_task(self.puller.loop()))

    async def stop(self) -> None:
        for task in [*self._loops, *self._tasks]:
            task.cancel()
        await self.peers.close()

    def _spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _require(self, side, rpc: str):
        if side is None:
            raise StatusError(Status.FAILED_PRECONDITION,
                              f"{rpc} is not served by a {self.role.value} instance")
        return side

    # ------------------------------------------------------------------ prefill
    def add_request(self, spec: EngineRequestSpec) -> None:
        self._require(self.prefill, "Generate").add_request(spec)

    def on_pull(self, pull: OfflinePull) -> int:
        return self._require(self.prefill, "SendPullSignal").on_pull(pull)

    async def prelink_once(self) -> list[str]:
        return await self.links.prelink_once()

    # ------------------------------------------------------------------ decode
    async def add_new_requests(self, prefill_name: str,
                               items: list[EngineRequestSpec | Placement]) -> list[Placement]:
        return await self._require(self.decode, "AddNewRequests").add_new_requests(
            prefill_name, items)

    async def first_generation(self, handovers: list[HandOver]) -> list[str]:
        return await self._require(self.decode, "FirstGeneration").first_generation(handovers)

    async def resume_with_kv(self, item, r: Resumption) -> str:
        return await self._require(self.decode, "MultiGenerations").resume_with_kv(item, r)

    async def link_instance(self, link: PeerLink) -> None:
        self._require(self.decode, "LinkInstance")
        await self.links.link_instance(link)

    def unlink_instance(self, name: str) -> None:
        self.links.forget(name)

    def reap_orphans(self, now: float) -> list[str]:
        return self._require(self.decode, "reap_orphans").reap_orphans(now)

    # ------------------------------------------------------------------ both
    def cancel(self, request_id: str) -> bool:
        """The service cancelled the request. True: its blocks are freed here once no
        transfer can touch them; False: the engine may abort it now."""
        if self.prefill is not None:
            return self.prefill.cancel(request_id)
        return self.decode.cancel(request_id)

    def num_pending(self) -> int:
        """Prefill: requests not handed over yet (queued, finding a decode, prefilling)."""
        return self.prefill.num_pending() if self.prefill is not None else 0

    def metrics_text(self) -> str:
        return self.metrics.render()
