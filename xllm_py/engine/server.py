"""The engine process: engine thread + OpenAI HTTP API (+ cluster RPCs with --etcd).

Stages: load model -> latency profile (a PREFILL / DECODE in a cluster measures its own:
self_profile.py) -> start engine thread -> freeze the start-up heap out of the garbage
collector -> start HTTP API -> (cluster mode: start the
DisaggPDService and worker gRPC servers, register in etcd, heartbeat) -> serve until
SIGTERM/SIGINT (TP > 1: or a lost rank, see watch_tp_ranks) -> drain (below) ->
deregister -> stop servers -> stop the engine thread.

Drain (`--drain-timeout`, default 30 s; 0 skips it): new HTTP requests get a 503 and
/readiness fails; in a cluster the instance's etcd entry says `draining`, so the service
routes nothing new here (decode and prefill lists included); the requests in flight run
to completion (on a prefill: until decode has pulled their KV). A second signal, or the
timeout, ends the drain; what still runs then is cut off (in a cluster, the requests a
decode or MIX engine was generating move to another instance once this one leaves).
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from xllm_py.config import EngineConfig
from xllm_py.engine.async_engine import AsyncEngine
from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.engine.self_profile import start_up_profile
from xllm_py.utils.aio import wait_for

logger = logging.getLogger(__name__)


async def run_engine_server(config: EngineConfig, stop: asyncio.Event | None = None,
                            force: asyncio.Event | None = None,
                            make_engine: Callable[[EngineConfig], LLMEngine] = LLMEngine) -> None:
    """Serve until SIGTERM/SIGINT (a second one: `force`), or until `stop` is set where the
    caller passes its events (several engines in one process: xllm_py/sim/host.py).
    `make_engine`: the engine loop over the model, or the simulator's SimulatedEngine (the
    simulator sits above the engine: its entry points pass it)."""
    from xllm_py.api.app import build_app
    from xllm_py.api.server import serve

    if config.etcd_addr:  # before the weights load: a wrong etcd is one line, at once
        from xllm_py.cluster.etcd_startup import check_etcd_endpoint

        await check_etcd_endpoint(config.etcd_addr, config.etcd_namespace,
                                  config.security.etcd_tls)
    engine = await start_engine_thread(config, make_engine)
    backend = AsyncEngine(engine, config.served_model_name)
    app = build_app(backend, api_keys=config.security.api_keys,
                    protect_metrics=config.security.protect_metrics, limits=config.api)
    freeze_startup_heap()
    if stop is None:
        stop, force = asyncio.Event(), asyncio.Event()  # a first signal, a second one
        install_signal_handlers(stop, force)
    force = force or asyncio.Event()
    lost_rank = watch_tp_ranks(engine, asyncio.get_running_loop(), stop, force,
                               in_cluster=bool(config.etcd_addr))
    cluster = None
    if config.etcd_addr:
        from xllm_py.engine.cluster_node import ClusterNode

        cluster = ClusterNode(config, engine, backend)
        await cluster.start()
    http_stop = asyncio.Event()
    http_task = asyncio.create_task(serve(app, config.host, config.port, stop_event=http_stop,
                                          capture_signals=False))
    logger.info("engine %s serving on http://%s:%d", config.role.value, config.host, config.port)
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if http_task in done and http_task.exception():
        logger.error("HTTP server failed: %s", http_task.exception())
    if not http_task.done() and config.drain_timeout_s > 0:
        drained = await drain(engine, backend, cluster, config.drain_timeout_s, force)
        if not drained and cluster is None:  # end the streams now rather than mid-shutdown
            engine.abort_all("engine shutting down")
    logger.info("shutting down")
    http_stop.set()
    if cluster is not None:
        await cluster.stop()
    try:
        await wait_for(http_task, 10)
    except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
        pass
    engine.stop()
    if lost_rank:
        raise SystemExit(1)


async def start_engine_thread(config: EngineConfig,
                              make_engine: Callable[[EngineConfig], LLMEngine] = LLMEngine
                              ) -> LLMEngine:
    """Build the engine, measure its start-up profile (before it serves: it times steps
    itself) and run its loop, all in one thread, and return once it runs. One thread for
    all of it: the OpenMP team that computes the steps is then the only one, as libgomp
    counts every team's threads and, with more of them than cores, lets its workers barely
    spin between parallel regions: a gemma-3-270m decode step at batch 1 on 2 cores took
    14.7 ms stepped by another thread than the one that loaded the model, 9.5 ms by the
    same one (the decode runner's 90 short regions a step pay a wake-up each). How long
    the workers spin: xllm_py/utils/omp_env.py."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future = loop.create_future()

    def settle(result: object) -> None:
        if ready.done():
            return
        if isinstance(result, BaseException):
            ready.set_exception(result)
        else:
            ready.set_result(result)

    def body() -> None:
        try:
            engine = make_engine(config)
            start_up_profile(engine, config)
        except BaseException as exc:  # the caller raises it: the same errors as inline
            loop.call_soon_threadsafe(settle, exc)
            return
        loop.call_soon_threadsafe(settle, engine)
        engine.run_here()

    threading.Thread(target=body, name="xllm-engine", daemon=True).start()
    return await ready


def watch_tp_ranks(engine: LLMEngine, loop: asyncio.AbstractEventLoop, stop: asyncio.Event,
                   force: asyncio.Event, in_cluster: bool) -> list[str]:
    """TP > 1: a lost rank (exited, or a step's collective failed or timed out) takes the
    instance out. In a cluster the process exits at once, from the thread that noticed,
    before the engine reports anything: the service sees a dead instance (lease expiry)
    and moves or fails its requests as for any other. Alone, its requests end with an
    error naming the cause, then the server stops (no drain) and exits with 1. Returns the
    list the cause lands in."""
    lost: list[str] = []
    tp = engine.tp  # (None: TP 1, or the simulated engine)
    if tp is None:
        return lost

    def on_lost(reason: str) -> None:
        lost.append(reason)
        engine.abort_all(f"the instance lost a tensor-parallel rank: {reason}")
        force.set()
        stop.set()

    def on_broken(reason: str) -> None:  # (engine thread or the executor's watch thread)
        if in_cluster:
            logger.error("leaving the cluster (exit 1): %s", reason)
            os._exit(1)
        loop.call_soon_threadsafe(on_lost, reason)

    tp.on_broken.append(on_broken)
    return lost


def install_signal_handlers(stop: asyncio.Event, force: asyncio.Event) -> None:
    """SIGTERM/SIGINT set `stop`; one more sets `force` too."""
    def on_signal() -> None:
        if stop.is_set():
            force.set()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)


# The engine counts as drained once nothing was in flight for this long: a request the
# service routed just before it saw `draining` may still be on its way.
DRAIN_SETTLE_S = 0.5


def in_flight(engine: LLMEngine, cluster) -> int:
    """Requests still using this engine: submitted, scheduled, waiting, or (PD) not handed
    over, and KV blocks held for a transfer (a prefill keeps them until decode pulled);
    outputs its services have not answered yet count too."""
    s = engine.stats()
    pending = cluster.pd.num_pending() if cluster is not None and cluster.pd is not None else 0
    unsent = (cluster.reporter.num_unsent()
              if cluster is not None and cluster.reporter is not None else 0)
    return int(s["running"] + s["waiting"] + pending + (s["kv_blocks_used"] > 0)
               + (engine.num_queued_commands > 0) + (unsent > 0))


async def drain(engine: LLMEngine, backend: AsyncEngine, cluster, timeout_s: float,
                force: asyncio.Event) -> bool:
    """Take no new requests, let the ones in flight finish; True when none is left."""
    backend.draining = True
    if cluster is not None:  # the service must know before the engine looks idle
        cluster.agent.update_meta(draining=True)
        try:
            await wait_for(cluster.agent.publish(), 2.0)
        except Exception as exc:
            logger.warning("could not publish 'draining' to etcd (%s); the service may "
                           "still route requests here", exc)
    t0, left = time.monotonic(), in_flight(engine, cluster)
    logger.info("draining: %d request(s) in flight, up to %.0f s (signal again to stop now)",
                left, timeout_s)
    idle_since: float | None = None
    while not force.is_set():
        left = in_flight(engine, cluster)
        now = time.monotonic()
        idle_since = (idle_since or now) if not left else None
        if idle_since is not None and now - idle_since >= DRAIN_SETTLE_S:
            break
        if now - t0 > timeout_s:
            logger.warning("drain timed out after %.0f s with %d request(s) in flight",
                           timeout_s, left)
            return False
        try:
            await wait_for(force.wait(), 0.1)
        except asyncio.TimeoutError:
            pass
    if left:
        logger.warning("drain stopped by a second signal with %d request(s) in flight", left)
        return False
    logger.info("drained in %.2f s", time.monotonic() - t0)
    return True


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (model, tokenizer, app) out of the collector's
    reach (gc.freeze, as vLLM and SGLang do): otherwise a full collection walks them all,
    stopping the HTTP loop and the engine thread for ~0.2 s at random (seen at the start
    of a burst of requests, whose allocations trigger it)."""
    gc.collect()
    gc.freeze()
    logger.debug("froze %d start-up objects out of the garbage collector", gc.get_freeze_count())
    release_free_heap()


def release_free_heap() -> None:
    """Give the pages malloc holds free back to the system (glibc's malloc_trim): loading
    a GGUF frees ~0.3 GB of dequantized copies that the loading thread's malloc arena
    otherwise keeps (gemma-3-270m's resident set 1.20 -> 0.92 GB). A no-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
