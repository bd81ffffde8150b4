"""PDRole: the PD role of an engine, assembled. For a PREFILL or DECODE instance it builds
the role's side with what the side works with, and runs the side's loops; for an
elastic instance (MIX in a cluster: duty.py) both sides, and its Duty:
  links.py    Links: peers linked for KV transfer (prelink on prefill, LinkInstance on decode)
  prefill.py  PrefillSide: queue, dispatch to a decode, prefill, hand-over (PREFILL role)
  decode.py   DecodeSide: allocate, take over, pull, reap orphans (DECODE role)
  offline_pull.py  OfflinePuller: a decode with room pulls offline work (SendPullSignal)
  peers.py    PDPeers: every RPC made to another process (parallel/instance_peers.InstancePeers in a cluster)
  metrics.py  PDMetrics (prometheus_client)
Lifecycle: constructed in ClusterNode once our meta is known -> start() (prefill: the
dispatch and prelink loops; decode: the orphan reaper and the offline puller) -> the
DisaggPDService servicer (service.py) calls the side itself, with domain values ->
stop() cancels the loops and the tasks in flight and closes the peers' channels.
The sides reach the engine through one PDConnector (connector.py), which the engine
polls in its step: no PD module touches the engine's scheduler or output processor.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Coroutine

from prometheus_client import CollectorRegistry

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.config import EngineConfig, InstanceRole, PDSchedulerConfig
from xllm_py.engine.generations_reporter import GenerationsReporter
from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.engine.pd.connector import PDConnector
from xllm_py.engine.pd.decode import DecodeSide
from xllm_py.engine.pd.duty import Duty, DutyState
from xllm_py.engine.pd.handlers import (DecodeHandler, ElasticHandler, EngineHandler,
                                        PrefillHandler)
from xllm_py.engine.pd.links import DecodeLister, Links, MetaResolver
from xllm_py.engine.pd.metrics import PDMetrics
from xllm_py.engine.pd.offline_pull import OfflinePuller, PrefillLister
from xllm_py.engine.pd.peers import PDPeers
from xllm_py.engine.pd.prefill import PrefillSide


class PDRole:
    def __init__(self, engine: LLMEngine, config: EngineConfig, meta: InstanceMeta,
                 reporter: GenerationsReporter, peers: PDPeers,
                 resolve_meta: MetaResolver | None = None,
                 list_decodes: DecodeLister | None = None,
                 pd_config: PDSchedulerConfig = PDSchedulerConfig(),
                 registry: CollectorRegistry | None = None,
                 forget_meta: Callable[[str], None] | None = None,
                 list_prefills: PrefillLister | None = None, *,
                 latency_profile: LatencyProfile | None) -> None:
        """`latency_profile`: this instance's as registered at start-up (a prefill's
        deadline order predicts from it; None: FCFS)."""
        if config.role not in (InstanceRole.PREFILL, InstanceRole.DECODE, InstanceRole.MIX):
            raise ValueError(f"a PDRole is PREFILL, DECODE or MIX (elastic), not {config.role}")
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
        # Elastic: the engine hands over only what the prefill side submits.
        self.connector = PDConnector(asyncio.get_running_loop(), engine.wake,
                                     hands_over=self.role != InstanceRole.DECODE)
        engine.set_connector(self.connector)
        self.duty = Duty(self._pending) if self.role == InstanceRole.MIX else None
        if self.role != InstanceRole.DECODE:
            self.prefill = PrefillSide(engine, self.connector, config, pd_config, meta,
                                       reporter, self.links, peers, self.metrics, self._spawn,
                                       latency_profile)
            if self.prefill.streams:  # each chunk's blocks go to the decode as computed
                engine.step_observers.append(self.connector)
        if self.role != InstanceRole.PREFILL:
            self.decode = DecodeSide(engine, self.connector, config, pd_config, reporter,
                                     peers, self.metrics, self._spawn)
            if list_prefills is not None and resolve_meta is not None:
                decode = self.decode
                self.puller = OfflinePuller(self._offline_room, meta.name, peers,
                                            list_prefills,
                                            resolve_meta, self.metrics,
                                            lambda: decode.num_offline_placed)
        self.metrics.watch_sides(
            self._pending, (lambda: self.duty.state.value) if self.duty is not None else None,
            tuple(s.value for s in DutyState))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.prefill is not None:
            self._loops += [asyncio.create_task(self.prefill.dispatch_loop()),
                            asyncio.create_task(
                                self.links.prelink_loop(self.pd_config.prelink_interval_s))]
        if self.decode is not None:
            self._loops.append(asyncio.create_task(self.decode.reap_loop()))
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

    async def _offline_room(self) -> tuple[int, int] | None:
        """Room for offline work: an elastic instance pulls it only in DECODE duty."""
        if self.duty is not None and self.duty.serves is not InstanceRole.DECODE:
            return None
        return await self.connector.offline_room()

    def _pending(self) -> tuple[int, int]:
        """(prefill side's requests not handed over, decode side's open placements)."""
        return (self.prefill.num_pending() if self.prefill is not None else 0,
                self.decode.num_open() if self.decode is not None else 0)

    def handler(self) -> EngineHandler:
        """What this instance's DisaggPDService serves (service.py), for its role."""
        if self.duty is not None:
            return ElasticHandler(self.engine, self.reporter, self.prefill, self.decode,
                                  self.links, self.duty)
        if self.prefill is not None:
            return PrefillHandler(self.engine, self.reporter, self.prefill, self.links)
        return DecodeHandler(self.engine, self.reporter, self.decode, self.links)

    def num_pending(self) -> int:
        """Prefill: requests not handed over yet (queued, finding a decode, prefilling)."""
        return self.prefill.num_pending() if self.prefill is not None else 0

    def metrics_text(self) -> str:
        return self.metrics.render()
