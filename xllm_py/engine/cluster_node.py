"""ClusterNode: what an engine runs when it joins a cluster (`--etcd`).

Stages: KV worker (PD roles: transfer listener + WorkerService gRPC) -> DisaggPDService
gRPC -> Generations reporter hooked to the engine loop -> registration in etcd with a
kept-alive lease + heartbeats to the master -> (PD) PDRole.
A MIX engine in a cluster is elastic (engine/pd/duty.py): it runs the PD stages as well,
both PD sides, and a RoleFollower that takes the duty the master assigns it in etcd.
Stop: deregister, stop the PD role, the gRPC servers, the worker, the reporter.
"""
from __future__ import annotations

import asyncio
import logging
import random

import grpc

from xllm_py.cluster.etcd_client import instance_key
from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.cluster.role_assignment import RoleAssignment, role_key
from xllm_py.cluster.meta_cache import MetaCache
from xllm_py.config import EngineConfig, InstanceRole, advertised_host, etcd_credentials_from_env
from xllm_py.engine.cache_events import CacheEvents
from xllm_py.engine.generations_reporter import GenerationsReporter
from xllm_py.engine.instance_agent import InstanceAgent, LoadReport
from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.engine.pd.duty import RoleFollower
from xllm_py.engine.pd.role import PDRole
from xllm_py.engine.pd.service import DisaggPDServicer
from xllm_py.engine.self_profile import GUARD_SETTINGS, apply_derived, moved
from xllm_py.kv_transfer.kv_storage import KV_LAYOUT
from xllm_py.kv_transfer.in_process import InProcessWorker
from xllm_py.model.kv_layout import kv_layout
from xllm_py.parallel.instance_peers import InstancePeers
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.rpc import cluster as wire
from xllm_py.rpc.pd_peers import GrpcWorkerClient, PDServiceClient
from xllm_py.tls import channel_credentials, server_credentials
from xllm_py.utils.aio import wait_for
from xllm_py.utils.grpc_channels import ChannelPool
from xllm_py.utils.grpc_server import start_grpc_server

logger = logging.getLogger(__name__)

PROFILE_CHECK_S = 2.0  # how often a corrected latency profile is looked at

class ClusterNode:
    def __init__(self, config: EngineConfig, engine: LLMEngine, backend) -> None:
        self.config = config
        self.engine = engine
        self.backend = backend
        self.role = config.role
        self.elastic = config.role == InstanceRole.MIX
        # PD stages: a KV worker, a PDRole (elastic: both sides)
        self.runs_pd = self.elastic or self.role in (InstanceRole.PREFILL, InstanceRole.DECODE)
        self.follower: RoleFollower | None = None
        self.addr_host = advertised_host(config.host, config.advertise_host)
        self.name = config.instance_name or f"{self.addr_host}:{config.port}"
        self.agent: InstanceAgent | None = None
        self.pd: PDRole | None = None
        self.reporter: GenerationsReporter | None = None
        self.worker = None
        self._server: grpc.aio.Server | None = None
        tls = config.security.tls
        self._client_credentials = channel_credentials(tls) if tls is not None else None
        self._server_credentials = server_credentials(tls) if tls is not None else None
        self._channels = ChannelPool(self._client_credentials)
        self.metas = MetaCache(self._fetch_meta)
        self.cache_events = CacheEvents()  # for the service's cache-aware routing
        self._profile_task: asyncio.Task | None = None
        self._follow_task: asyncio.Task | None = None

    async def start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        cluster_id = random.getrandbits(63)
        transfer_addr, worker_addr = "", ""
        if self.runs_pd:
            from xllm_py.parallel.kv_workers import start_kv_worker

            self.worker = await start_kv_worker(self.engine.storage, cfg.transfer, cfg.host,
                                                cfg.worker_port, cluster_id,
                                                self._kv_meta(cluster_id),
                                                self._server_credentials)
            # Publish reachable addresses (the backends report their bind host).
            transfer_addr = f"{self.addr_host}:{self.worker.transfer_addr.rsplit(':', 1)[1]}"
            worker_addr = f"{self.addr_host}:{self.worker.rpc_addr.rsplit(':', 1)[1]}"
        # TP > 1: every rank its own KV worker, registered in rank order (xLLM's worker list).
        cluster_ids, transfer_addrs, worker_addrs, keys = (
            ([cluster_id], [transfer_addr], [worker_addr], [self.worker.transfer_key])
            if transfer_addr else ([], [], [], []))
        if transfer_addr and self.engine.tp is not None:
            from xllm_py.parallel.kv_workers import start_rank_kv_workers

            for w in await start_rank_kv_workers(self.engine.tp, cfg, cluster_id,
                                                 self._kv_meta(cluster_id)):
                cluster_ids.append(w.cluster_id)
                transfer_addrs.append(f"{self.addr_host}:{w.transfer_addr.rsplit(':', 1)[1]}")
                worker_addrs.append(f"{self.addr_host}:{w.rpc_addr.rsplit(':', 1)[1]}")
                keys.append(w.transfer_key)
        if transfer_addr:
            self._register_transfer_metrics(worker_addrs[1:])
            self.backend.health_checks.append(self.worker.worker.backend.broken)
        self.reporter = GenerationsReporter(loop, self.name, self.engine.abort,
                                            timeout_s=cfg.rpc_timeout_s,
                                            credentials=self._client_credentials)
        self.engine.step_listeners.append(self.reporter.flush)
        pool = self.engine.scheduler.kv.block_pool
        self.engine.step_listeners.append(lambda: self.cache_events.collect(pool))
        # The servicer gets its PD role once the bound port (part of our meta) is
        # known; nobody routes here before the agent registers us, at the end.
        servicer = DisaggPDServicer(self.engine, self.role, self.reporter, starting=self.runs_pd)
        self._server, port = await start_grpc_server(
            pb_grpc.add_DisaggPDServiceServicer_to_server, servicer, cfg.host,
            cfg.disagg_pd_port, "DisaggPDService", credentials=self._server_credentials)
        mc = self.engine.model_config
        self.meta = InstanceMeta(
            name=self.name, type=self.role, rpc_address=f"{self.addr_host}:{port}",
            cluster_ids=cluster_ids, addrs=transfer_addrs,
            ports=[int(a.rsplit(":", 1)[1]) for a in transfer_addrs],
            dp_size=1, model=self.backend.model_name, block_size=cfg.cache.block_size,
            kv_layout=KV_LAYOUT, kv_dtype=cfg.dtype, tp_size=cfg.tensor_parallel_size,
            # the model's KV pool tensors (kv_groups.py), whatever a pipeline stage's pool
            # holds of them (rank_kv: the stages' layers)
            num_layers=(self.engine.kv_groups.num_slots if self.engine.kv_groups is not None
                        else self.engine.storage.meta.num_layers),
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
            num_blocks=self.engine.storage.num_blocks,
            http_address=f"{self.addr_host}:{cfg.port}",
            worker_rpc_addrs=worker_addrs, transfer_keys=keys,
            pp_size=cfg.pipeline_parallel_size,  # (each stage's layers, in stage order)
            rank_kv=[[*r.layers, *r.heads] for r in kv_layout(
                mc.num_layers, mc.num_kv_heads, cfg.tensor_parallel_size,
                cfg.pipeline_parallel_size, cfg.pp_layer_partition).ranks],
            latency_profile=self._latency_profile(),
            kv_tiers=self.engine.tiering.describe() if self.engine.tiering is not None else {},
            elastic=self.elastic)
        self.agent = InstanceAgent(cfg.etcd_addr, self.meta, ttl_s=cfg.etcd_ttl_s,
                                   namespace=cfg.etcd_namespace,
                                   heartbeat_interval_s=cfg.heartbeat_interval_s,
                                   load_fn=self._load, credentials=etcd_credentials_from_env(),
                                   cache_fn=self.cache_events.drain, tls=cfg.security.tls,
                                   etcd_tls=cfg.security.etcd_tls)
        self.meta = self.agent.meta  # with its incarnation id
        if self.runs_pd:
            local = InProcessWorker(self.worker.worker, cfg.rpc_timeout_s,
                                    cfg.transfer.timeout_s)  # rank 0's moves: no gRPC to itself
            ranks = [GrpcWorkerClient(a, cfg.rpc_timeout_s, cfg.transfer.timeout_s,
                                      self._client_credentials)
                     for a in self.meta.worker_rpc_addrs[1:]]
            peers = InstancePeers(self.meta, PDServiceClient(cfg.rpc_timeout_s,
                                                             self._client_credentials),
                                  [local, *ranks],
                                  tuple(mc.layer_window(i) for i in range(mc.num_layers)))
            self.pd = PDRole(self.engine, cfg, self.meta, self.reporter, peers,
                             self.metas.get, self._list_decodes, pd_config=cfg.pd,
                             registry=self.backend.metrics_registry,
                             forget_meta=self.metas.invalidate,
                             list_prefills=self._list_prefills,
                             latency_profile=self.engine.latency_profile)
            self.pd.start()
            servicer.attach(self.pd)
        if self.pd is not None and self.pd.duty is not None:
            self.follower = RoleFollower(self.pd.duty, self._read_assignment,
                                         self._publish_duty, cfg.heartbeat_interval_s)
            self._follow_task = asyncio.create_task(self.follower.loop())
        await self.agent.start()
        if self.engine.profile_corrector is not None:
            self._profile_task = asyncio.create_task(self._republish_profile())
        logger.info("instance %s (%s) joined etcd %s: rpc %s, transfer %s", self.name,
                    self.role.value, cfg.etcd_addr, self.meta.rpc_address, transfer_addr or "-")

    async def _read_assignment(self) -> RoleAssignment | None:
        kv = await self.agent.etcd.get(role_key(self.name))
        return RoleAssignment.from_json(kv.value) if kv is not None else None

    def _publish_duty(self, role: InstanceRole, epoch: int) -> None:
        """Acknowledge the assignment followed: in the registration, which every
        service replica watches and routes by (heartbeats reach only the master)."""
        self.agent.update_meta(duty=role.value, duty_epoch=epoch)
        self.meta = self.agent.meta

    def _register_transfer_metrics(self, rank_addrs: list[str]) -> None:
        """Our KV worker's transfer counters on /metrics (label rank="0"); TP > 1: every
        rank's, the others' fetched over their WorkerService at each scrape."""
        local = self.worker.worker.metrics
        if not rank_addrs:
            self.backend.metrics_registry.register(local)
            return
        from xllm_py.parallel.rank_metrics import RankTransferMetrics

        ranks = RankTransferMetrics(local, rank_addrs, self._channels.get)
        self.backend.metrics_registry.register(ranks)
        self.backend.metrics_refreshers.append(ranks.refresh)

    def _latency_profile(self) -> dict:
        """The profile the engine registers (self_profile.py: the latency_profile file, a
        simulated engine's time model, or measured at start-up); {}: none."""
        profile = self.engine.latency_profile
        return profile.to_dict() if profile is not None else {}

    async def _republish_profile(self) -> None:
        """Every PROFILE_CHECK_S: once the measured profile, corrected by the steps, moved
        by more than a tenth, derive the TPOT guard's settings from it again and register
        it (the service's predictions and targets follow)."""
        corrector = self.engine.profile_corrector
        published = self.engine.latency_profile
        while True:
            await asyncio.sleep(PROFILE_CHECK_S)
            current = corrector.profile()
            if not moved(published, current):
                continue
            try:
                published = await asyncio.wrap_future(self.engine.call(
                    lambda: apply_derived(self.engine, current, GUARD_SETTINGS)))
                self.engine.set_latency_profile(published)
                self.agent.update_meta(latency_profile=published.to_dict())
            except Exception as exc:  # (the next check tries again)
                logger.warning("could not register the corrected latency profile: %s", exc)
                continue
            logger.info("latency profile corrected by %d steps (prompt steps %+.2f ms, decode "
                        "steps %+.2f ms): registered again", corrector.num_observed,
                        corrector.prefill_extra_ms, corrector.decode_extra_ms)

    def _kv_meta(self, cluster_id: int) -> InstanceMeta:
        mc = self.engine.model_config
        return InstanceMeta(name=self.name, model=self.backend.model_name,
                            block_size=self.config.cache.block_size, kv_layout=KV_LAYOUT,
                            kv_dtype=self.config.dtype, num_layers=self.engine.storage.meta.num_layers,
                            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim)

    def _load(self) -> LoadReport:
        s = self.engine.stats()
        pool = self.engine.scheduler.kv.block_pool
        waiting = s["waiting"] + (self.pd.num_pending() if self.pd else 0)
        return LoadReport(waiting=int(waiting), running=int(s["running"]),
                          kv_usage=float(pool.usage),
                          recent_max_ttft_ms=int(self.engine.recent_max_ttft_ms),
                          recent_max_tbt_ms=int(self.engine.recent_max_tbt_ms))

    async def _fetch_meta(self, name: str) -> InstanceMeta | None:
        for role in (InstanceRole.DECODE, InstanceRole.PREFILL, InstanceRole.MIX):
            kv = await self.agent.etcd.get(instance_key(role, name))
            if kv is not None:
                return InstanceMeta.from_json(kv.value)
        return None

    async def _list_decodes(self) -> list[str]:
        addr = self.agent.master_addr
        if not addr:
            return []
        stub = pb_grpc.XllmRpcServiceStub(self._channels.get(addr))
        reply = await stub.GetStaticDecodeList(wire.instance_id_to_proto(self.name),
                                               timeout=self.config.rpc_timeout_s)
        return wire.instance_ids_from_proto(reply)

    async def _list_prefills(self) -> list[str]:
        addr = self.agent.master_addr
        if not addr:
            return []
        stub = pb_grpc.XllmRpcServiceStub(self._channels.get(addr))
        reply = await stub.GetStaticPrefillList(wire.instance_id_to_proto(self.name),
                                                timeout=self.config.rpc_timeout_s)
        return wire.instance_ids_from_proto(reply)

    async def stop(self) -> None:
        for task in (self._profile_task, self._follow_task):
            if task is not None:
                task.cancel()
        steps = []
        if self.agent is not None:
            steps.append(self.agent.stop())
        if self.pd is not None:
            steps.append(self.pd.stop())
        if self._server is not None:
            steps.append(self._server.stop(1.0))
        if self.reporter is not None:
            steps.append(self.reporter.close())
        if self.worker is not None:
            steps.append(self.worker.stop())
        for step in steps:
            try:
                await wait_for(step, 5.0)
            except Exception as exc:
                logger.warning("cluster shutdown step failed: %s", exc)
        await self._channels.close()
