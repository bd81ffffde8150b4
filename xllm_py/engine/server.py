"""The engine process: engine thread + OpenAI HTTP API (+ cluster RPCs with --etcd).

Stages: load model -> start engine thread -> freeze the start-up heap out of the garbage
collector -> start HTTP API -> (cluster mode: start the
DisaggPDService and worker gRPC servers, register in etcd, heartbeat) -> serve until
SIGTERM/SIGINT -> deregister -> stop servers -> stop the engine thread.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal

from xllm_py.config import EngineConfig
from xllm_py.engine.async_engine import AsyncEngine
from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.utils.aio import wait_for

logger = logging.getLogger(__name__)


async def run_engine_server(config: EngineConfig) -> None:
    from xllm_py.api.app import build_app
    from xllm_py.api.server import serve

    engine = LLMEngine(config)
    engine.start()
    backend = AsyncEngine(engine, config.served_model_name)
    app = build_app(backend)
    freeze_startup_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cluster = None
    if config.etcd_addr:
        from xllm_py.engine.cluster_node import ClusterNode

        cluster = ClusterNode(config, engine, backend)
        await cluster.start()
    http_task = asyncio.create_task(serve(app, config.host, config.port, stop_event=stop))
    logger.info("engine %s serving on http://%s:%d", config.role.value, config.host, config.port)
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if http_task in done and http_task.exception():
        logger.error("HTTP server failed: %s", http_task.exception())
    logger.info("shutting down")
    stop.set()
    if cluster is not None:
        await cluster.stop()
    try:
        await wait_for(http_task, 10)
    except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
        pass
    engine.stop()


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (model, tokenizer, app) out of the collector's
    reach (gc.freeze, as vLLM and SGLang do): otherwise a full collection walks them all,
    stopping the HTTP loop and the engine thread for ~0.2 s at random (seen at the start
    of a burst of requests, whose allocations trigger it)."""
    gc.collect()
    gc.freeze()
    logger.debug("froze %d start-up objects out of the garbage collector", gc.get_freeze_count())
