"""AsyncEngine: the asyncio facade of LLMEngine. Implements the API layer's GenerateBackend.

A request's outputs travel from the engine thread to the caller's event loop through an
asyncio.Queue; closing the caller's iterator (client gone) aborts the request, which
frees its blocks on the engine thread.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import weakref
from typing import AsyncIterator, Awaitable, Callable

from prometheus_client import CollectorRegistry

from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.engine.metrics import EngineStatsCollector
from xllm_py.outputs import RequestOutput

logger = logging.getLogger(__name__)


class _LoopBridge:
    """Hands outputs from the engine thread to one event loop, coalescing wake-ups: the
    outputs of an engine step (one per running request) arrive in a burst and cost one
    ``call_soon_threadsafe`` instead of one each."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, queue: asyncio.Queue, output: RequestOutput) -> None:
        with self._lock:
            self._pending.append((queue, output))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items = list(self._pending)
            self._pending.clear()
            self._scheduled = False
        for queue, output in items:
            queue.put_nowait(output)


_bridges: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopBridge]" = \
    weakref.WeakKeyDictionary()


def _bridge_for(loop: asyncio.AbstractEventLoop) -> _LoopBridge:
    bridge = _bridges.get(loop)
    if bridge is None:
        bridge = _bridges[loop] = _LoopBridge(loop)
    return bridge


class QueueSink:
    """Delivers RequestOutputs from the engine thread into an asyncio.Queue.

    ``final_only`` (a non-streaming request, vLLM's FINAL_ONLY): read by the engine's
    OutputProcessor, which then emits the first output that carries tokens (it stamps the
    time to first token) and one merged output at the end, so the event loop is not woken
    once per token for a client that reads only the end.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, final_only: bool = False) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._bridge = _bridge_for(loop)
        self.final_only = final_only

    def emit(self, output: RequestOutput) -> None:
        self._bridge.put(self.queue, output)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, served_model_name: str | None = None,
                 max_waiting: int = 4096) -> None:
        self.engine = engine
        self.model_name = served_model_name or _default_name(engine.config.model)
        self.max_model_len = engine.max_model_len
        self.max_waiting = max_waiting
        # The process's one metrics registry: /metrics renders it (engine/metrics.py).
        self.metrics_registry = CollectorRegistry(auto_describe=True)
        self.metrics_registry.register(EngineStatsCollector(engine))
        if engine.tiering is not None:
            self.metrics_registry.register(engine.tiering.collector())
        # Awaited before each /metrics render (a TP instance's other ranks' counters).
        self.metrics_refreshers: list[Callable[[], Awaitable[None]]] = []
        self.draining = False  # shutting down: new requests get a 503 (see server.drain)
        # Parts that can break for good (the KV transfer): each answers why, or None.
        self.health_checks: list[Callable[[], str | None]] = []

    async def refresh_metrics(self) -> None:
        """Run every refresher at once; one that fails is logged, the scrape goes on."""
        results = await asyncio.gather(*(f() for f in self.metrics_refreshers),
                                       return_exceptions=True)
        for exc in results:
            if isinstance(exc, Exception):
                logger.warning("a metrics refresh failed: %r", exc)

    def tokenizer(self):
        return self.engine.tokenizer

    def check_live(self) -> tuple[bool, str]:
        thread = self.engine._thread
        if thread is None or not thread.is_alive():
            return False, "engine loop is not running"
        for check in self.health_checks:
            why = check()
            if why:
                return False, why
        return True, "ok"

    def check_ready(self) -> tuple[bool, str]:
        live, reason = self.check_live()
        if not live:
            return live, reason
        if self.draining:
            return False, "draining: finishing the requests in flight before shutting down"
        return True, "ok"

    async def generate(self, req) -> AsyncIterator[RequestOutput]:
        from xllm_py.api.errors import BackendBusyError, TooManyRequestsError

        if self.draining:
            raise BackendBusyError("engine is shutting down (draining); send new requests "
                                   "to another instance")
        if self.engine.scheduler.num_waiting >= self.max_waiting:
            raise TooManyRequestsError(
                f"engine has {self.engine.scheduler.num_waiting} waiting requests; try again later")
        params = req.sampling
        sink = QueueSink(asyncio.get_running_loop(), final_only=not getattr(req, "stream", True))
        self.engine.submit(EngineRequest(
            req.request_id, list(req.prompt_token_ids), params, sink,
            offline=bool(getattr(req, "offline", False)),
            tpot_slo_ms=float(getattr(req, "tpot_slo_ms", None) or 0.0)))
        finished = False
        try:
            while not finished:
                out = await sink.queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.engine.abort(req.request_id)



def _default_name(model: str) -> str:
    return model.rstrip("/").rsplit("/", 1)[-1] or model
