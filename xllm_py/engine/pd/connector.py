"""PDConnector: the KV connector (engine/kv_connector.py) of a PREFILL or DECODE engine,
and the only place the PD code crosses between the event loop and the engine thread.

Two crossings, one each way:
  `_to_engine(event)`  event loop -> engine: the event joins the connector's queue and
                       the engine is woken; the engine's next poll() applies it
                       (engine/remote_kv.py) and resolve() answers the awaiting caller
  `_to_loop(fn, ...)`  engine -> event loop: resolve()'s answers, a prefill's first
                       token (request_finished), a request a step failed, and (a PUSH
                       prefill streaming its KV, kv_stream.py: the connector is then one
                       of the engine's step observers) each prompt chunk computed and
                       each request preempted

The PD sides (decode.py, prefill.py, offline_pull.py) await the connector's methods on
the event loop; none of them touches the engine's scheduler or output processor.
"""
from __future__ import annotations

import asyncio
import logging
import queue
from typing import Any, Callable

from xllm_py.engine.engine_request import EngineRequest
from xllm_py.engine.kv_connector import (AdmitRemote, Drop, Event, KVConnector, OfflineRoom,
                                         RecvDone, RecvFailed, SendDone)
from xllm_py.outputs import TokenLogprob

logger = logging.getLogger(__name__)

# (request id, its block table, prompt tokens computed): a chunk of a prompt computed
ProgressHook = Callable[[str, list[int], int], None]
# (child id, block tables, first token or None, its logprob, finished on prefill, kv held)
FirstTokenHook = Callable[[str, list[list[int]], int | None, TokenLogprob | None, bool, bool],
                          None]


class PDConnector(KVConnector):
    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None],
                 hands_over: bool) -> None:
        self.loop = loop
        self.wake = wake  # makes an idle engine poll at once
        self.hands_over = hands_over
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.on_first_token: FirstTokenHook | None = None  # prefill.py, on the event loop
        self.on_failed: Callable[[str], None] | None = None  # (parent id)
        self.on_progress: ProgressHook | None = None  # prefill.py, streaming KV
        self.on_preempted: Callable[[str], None] | None = None  # (request id)

    # ---------------------------------------------------------------- the two crossings
    def _to_engine(self, event: Event) -> asyncio.Future:
        fut = self.loop.create_future()
        self._events.put((event, fut))
        self.wake()
        return fut

    def _to_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the node is stopping
            logger.debug("event loop closed; %s not delivered", getattr(fn, "__name__", fn))

    # ---------------------------------------------------------------- engine thread
    def poll(self) -> list[tuple[Event, Any]]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def resolve(self, token: asyncio.Future, result: Any) -> None:
        self._to_loop(_settle, token, result)

    def request_finished(self, update, delta, tables: list[list[int]]) -> None:
        finished_here = delta is not None and delta.finish_reason is not None
        first = delta.token_ids[0] if delta and delta.token_ids else None
        lp = delta.logprobs[0] if delta and delta.logprobs else None
        if self.on_first_token is not None:
            self._to_loop(self.on_first_token, update.request_id, tables, first, lp,
                          finished_here, update.kv_held)

    def request_failed(self, request_id: str) -> None:
        if self.on_failed is not None:
            self._to_loop(self.on_failed, request_id)

    def on_step(self, step) -> None:
        """A step observer (engine/step_observers.py): the prompt chunks it computed that
        do not end their prompt (those sample: request_finished), with the table of KV
        group 0 (a hybrid model's full-attention layers), and the requests it preempted."""
        if self.on_progress is None:
            return
        out = step.out
        for rid in out.preempted_ids:
            self._to_loop(self.on_preempted, rid)
        for seq in out.seqs:
            if not seq.sample:
                self._to_loop(self.on_progress, seq.request_id, list(seq.block_table),
                              seq.start_pos + len(seq.token_ids))

    # ---------------------------------------------------------------- event loop: decode
    def admit_remote(self, req: EngineRequest) -> asyncio.Future:
        """Resolves to a RemoteAllocation, a reason it cannot be served, or None (no KV
        space now). The engine admits it even if the caller stops waiting."""
        return self._to_engine(AdmitRemote(req))

    async def recv_done(self, parent_id: str, token_ids: list[int],
                        logprobs: list[TokenLogprob | None]) -> None:
        await self._to_engine(RecvDone(parent_id, token_ids, logprobs))

    def recv_failed(self, parent_id: str, message: str, code: int) -> asyncio.Future:
        return _quiet(self._to_engine(RecvFailed(parent_id, message, code)))

    def drop(self, parent_id: str) -> asyncio.Future:
        return _quiet(self._to_engine(Drop(parent_id)))

    async def offline_room(self) -> tuple[int, int] | None:
        return await self._to_engine(OfflineRoom())

    # ---------------------------------------------------------------- event loop: prefill
    def send_done(self, request_id: str) -> asyncio.Future:
        return _quiet(self._to_engine(SendDone(request_id)))


def _quiet(fut: asyncio.Future) -> asyncio.Future:
    """A future that may go unawaited: its exception (logged by the engine) is not
    reported again as never retrieved."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


def _settle(fut: asyncio.Future, result: Any) -> None:
    if fut.done():  # its caller gave up
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)
