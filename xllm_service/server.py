"""The master process.

Stages: tokenizer + model config (no weights, no torch) -> connect etcd -> bind the gRPC
port (the service's own address) -> build the components from ServiceConfig -> serve
XllmRpcService -> registry watch (instance table) -> master election -> OpenAI HTTP API
-> serve until SIGTERM -> resign, stop, close.
"""
from __future__ import annotations

import asyncio
import logging
import signal

from xllm_py.config import advertised_host, etcd_credentials_from_env
from xllm_service.config import ServiceConfig
from xllm_py.utils.aio import wait_for

logger = logging.getLogger(__name__)


async def run_service(config: ServiceConfig) -> None:
    from xllm_py.api.app import build_app
    from xllm_py.api.server import serve
    from xllm_py.cluster.etcd_client import EtcdClient
    from xllm_py.cluster.etcd_startup import check_etcd
    from xllm_py.model.config import ModelConfig
    from xllm_py.model.tiny import model_files_dir
    from xllm_py.model.tokenizer import Tokenizer
    from xllm_py.tls import channel_credentials, server_credentials
    from xllm_service.backend import ServiceBackend
    from xllm_service.batch.service import BatchService
    from xllm_service.elastic import DemandWindow, ElasticMetrics, RoleAssigner
    from xllm_service.elastic_policy import ElasticPolicy
    from xllm_service.election import MasterElection
    from xllm_service.engine_client import EngineClient
    from xllm_service.metrics import ServiceMetrics
    from xllm_service.prefix_index import PrefixIndex
    from xllm_service.registry import Registry
    from xllm_service.response_store import EtcdResponseStore
    from xllm_service.pd_decision import build_router
    from xllm_service.rpc_service import (ProxyRegistrations, XllmRpcServicer, bind_server,
                                          start_serving)
    from xllm_service.sub_request import SubRequests

    model_dir = model_files_dir(config.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    max_len = config.max_model_len or ModelConfig.from_dir(model_dir).max_position_embeddings

    tls = config.security.tls
    etcd_tls = config.security.etcd_tls
    etcd = EtcdClient(config.etcd_addr, namespace=config.etcd_namespace,
                      credentials=etcd_credentials_from_env(), tls=etcd_tls)
    try:
        await check_etcd(etcd, etcd_tls is not None)  # EtcdStartupError: the CLI's one line
    except BaseException:
        await etcd.close()
        raise
    server, port = bind_server(config.host, config.rpc_port,
                               server_credentials(tls) if tls is not None else None)
    rpc_addr = f"{advertised_host(config.host, config.advertise_host)}:{port}"

    registry = Registry(etcd, config.registry)
    prefix_index = PrefixIndex()
    subs = SubRequests()
    router = build_router(config.router, registry.schedulable, subs.inflight, subs.work,
                          prefix_index)
    metrics = ServiceMetrics(subs.inflight_by_instance, prefix_index.sizes, registry.counts,
                             router.stated_targets)
    demand = (DemandWindow(config.elastic.window_s,
                           local_prompt_max_tokens=config.router.local_prefill_max_tokens)
              if config.elastic.enabled else None)
    backend = ServiceBackend(tokenizer, config.model_name, max_len, router,
                             EngineClient(config.relay, channel_credentials(tls) if tls is not None else None), rpc_addr, config.relay, subs, metrics,
                             demand=demand)
    registry.on_cache_event(prefix_index.update)
    registry.on_evict(lambda info, reason: backend.on_evict(info))
    registry.on_evict(lambda info, reason: prefix_index.forget(info.name))
    proxy = ProxyRegistrations(etcd, registry, ttl_s=config.etcd_ttl_s)
    await start_serving(server, XllmRpcServicer(registry, proxy=proxy,
                                                on_generations=backend.on_generations))
    await registry.start()
    election = MasterElection(etcd, rpc_addr, ttl_s=config.etcd_ttl_s)
    election.on_change(lambda is_master, addr: logger.info(
        "master is now %s%s", addr, " (this service)" if is_master else ""))
    await election.start()
    elastic_task = None
    if demand is not None:
        elastic_metrics = ElasticMetrics()
        metrics.registry.register(elastic_metrics)
        assigner = RoleAssigner(etcd, registry.all, lambda: election.is_master, demand,
                                router.stated_targets, ElasticPolicy(config.elastic),
                                elastic_metrics, decodes_prefill=lambda: router.conditional,
                                measured_scale=router.measured_scale)
        elastic_task = asyncio.create_task(assigner.run(config.elastic.interval_s))

    app = build_app(backend, served_model_name=config.model_name,
                    api_keys=config.security.api_keys,
                    protect_metrics=config.security.protect_metrics, limits=config.api,
                    response_store=EtcdResponseStore(etcd, config.responses))
    batches = BatchService(app, config.batch_root, config.security.api_keys,
                           lambda: election.is_master)
    batches.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.create_task(serve(app, config.host, config.http_port, stop_event=stop))
    logger.info("xllm_service on http://%s:%d (rpc %s%s), etcd %s%s", config.host,
                config.http_port, rpc_addr, ", mutual TLS" if tls else "", config.etcd_addr,
                f", {len(config.security.api_keys)} API keys" if config.security.api_keys else "")
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if http_task in done and http_task.exception():
        logger.error("HTTP server failed: %s", http_task.exception())
    logger.info("shutting down")
    stop.set()
    if elastic_task is not None:
        elastic_task.cancel()
    try:
        await wait_for(http_task, config.http_shutdown_s)
    except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
        pass
    for coro in (batches.stop(), election.stop(), proxy.stop(), registry.stop(),
                 server.stop(1.0), backend.close()):
        try:
            await wait_for(coro, config.component_shutdown_s)
        except Exception as exc:
            logger.warning("shutdown step failed: %s", exc)
    await etcd.close()
