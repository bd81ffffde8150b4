"""The master process.

Stages: connect etcd -> registry watch (instance table) -> XllmRpcService (gRPC) ->
master election -> OpenAI HTTP API -> serve until SIGTERM -> resign, stop, close.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from xllm_py.config import advertised_host, etcd_credentials_from_env
from xllm_py.model.config import ModelConfig
from xllm_py.utils.aio import wait_for

logger = logging.getLogger(__name__)


async def run_service(args: argparse.Namespace) -> None:
    from xllm_py.api.app import build_app
    from xllm_py.api.server import serve
    from xllm_py.cluster.etcd_client import EtcdClient
    from xllm_py.engine.llm_engine import resolve_model_dir
    from xllm_py.model.tokenizer import Tokenizer
    from xllm_service.backend import ServiceBackend
    from xllm_service.election import MasterElection
    from xllm_service.prefix_index import PrefixIndex
    from xllm_service.registry import Registry
    from xllm_service.router import Router, make_policy
    from xllm_service.rpc_service import ProxyRegistrations, XllmRpcServicer, create_server

    model_dir = resolve_model_dir(args.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    model_config = ModelConfig.from_dir(model_dir)
    max_len = args.max_model_len or model_config.max_position_embeddings
    name = args.served_model_name or (args.model.rstrip("/").rsplit("/", 1)[-1] or args.model)

    etcd = EtcdClient(args.etcd, namespace=args.etcd_namespace,
                      credentials=etcd_credentials_from_env())
    await etcd.connect()
    registry = Registry(etcd, evict_grace_s=args.evict_grace_s)
    addr_host = advertised_host(args.host, args.advertise_host)
    rpc_addr = f"{addr_host}:{args.rpc_port}"
    backend_ref: list[ServiceBackend] = []
    prefix_index = PrefixIndex()
    registry.on_cache_event(prefix_index.update)
    router = Router(registry.schedulable,
                    make_policy(args.load_balance_policy, lambda n: backend_ref[0].inflight(n),
                                prefix_index))
    backend = ServiceBackend(tokenizer, name, max_len, router, rpc_addr,
                             rpc_timeout_s=args.rpc_timeout,
                             idle_timeout_s=args.request_idle_timeout,
                             instance_counts=registry.counts, prefix_index=prefix_index)
    backend_ref.append(backend)
    registry.on_evict(lambda info, reason: backend.on_evict(info))
    registry.on_evict(lambda info, reason: prefix_index.forget(info.name))
    proxy = ProxyRegistrations(etcd, registry, ttl_s=args.etcd_ttl)
    servicer = XllmRpcServicer(registry, proxy=proxy, on_generations=backend.on_generations)
    server, port = await create_server(servicer, args.host, args.rpc_port)
    rpc_addr = f"{addr_host}:{port}"
    backend.my_rpc_addr = rpc_addr
    await registry.start()
    election = MasterElection(etcd, rpc_addr, ttl_s=args.etcd_ttl)
    election.on_change(lambda is_master, addr: logger.info(
        "master is now %s%s", addr, " (this service)" if is_master else ""))
    await election.start()

    app = build_app(backend, served_model_name=name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.create_task(serve(app, args.host, args.http_port, stop_event=stop))
    logger.info("xllm_service on http://%s:%d (rpc %s), etcd %s", args.host, args.http_port,
                rpc_addr, args.etcd)
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if http_task in done and http_task.exception():
        logger.error("HTTP server failed: %s", http_task.exception())
    logger.info("shutting down")
    stop.set()
    try:
        await wait_for(http_task, 10)
    except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
        pass
    for coro in (election.stop(), proxy.stop(), registry.stop(), server.stop(1.0),
                 backend.close()):
        try:
            await wait_for(coro, 5.0)
        except Exception as exc:
            logger.warning("shutdown step failed: %s", exc)
    await etcd.close()
