"""RemoteKV: the engine's side of the KV connector (kv_connector.py). Engine thread only.

The engine polls its connector at every turn of its loop and applies each event here,
through the public methods of the engine (`admit`), its scheduler (`scheduler.remote`,
scheduler_pd.RemoteKVAdmission: allocate_for_remote, finish_remote_kvs, fail_remote_kvs,
finish_sending), its grammars (whether the first tokens fit a request's grammar) and its
output processor; nothing else touches them for PD. A decode request's life here:

  AdmitRemote -> WAITING -> WAITING_FOR_REMOTE_KVS (blocks set aside, prefix aware)
  -> RecvDone -> RUNNING (the prefill's first token fed to the detokenizer silently)
  | RecvFailed -> FINISHED_ERROR | Drop -> FINISHED_ABORTED (blocks freed)

A prefill request: RUNNING -> SENDING_KV at its first token (blocks held; the
connector's request_finished hands it over) -> SendDone -> FINISHED_LENGTH_CAPPED.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from xllm_py.engine.kv_connector import (AdmitRemote, Drop, Event, OfflineRoom, RecvDone,
                                         RecvFailed, SendDone)
from xllm_py.engine.output_processor import child_id
from xllm_py.engine.scheduler_types import RemoteAllocation, RequestUpdate
from xllm_py.request import RequestStatus
from xllm_py.status import Status

if TYPE_CHECKING:
    from xllm_py.engine.engine_request import EngineRequest
    from xllm_py.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def offline_room(sched) -> tuple[int, int] | None:
    """(free seats, free KV tokens) for offline work a decode could pull, or None
    (`scheduler.offline.has_room()`: a free seat, KV use under 0.9, the online streams'
    last step under 0.9 x their TPOT target)."""
    if not sched.offline.has_room():
        return None
    seats = sched.config.max_num_seqs - len(sched.requests)
    if seats <= 0:
        return None
    return seats, sched.kv.block_pool.num_free_blocks * sched.block_size


class RemoteKV:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def poll(self) -> bool:
        """Apply the connector's events; whether there were any."""
        events = self.engine.connector.poll()
        for event, token in events:
            try:
                result = self.apply(event)
            except Exception as exc:  # delivered to whoever posted it
                logger.exception("connector event %s failed", type(event).__name__)
                result = exc
            self.engine.connector.resolve(token, result)
        return bool(events)

    def apply(self, event: Event) -> Any:
        if isinstance(event, AdmitRemote):
            return self.add_remote(event.request)
        if isinstance(event, RecvDone):
            return self._start_decoding(event)
        if isinstance(event, RecvFailed):
            return self._fail(event.parent_id, event.message, event.code)
        if isinstance(event, Drop):
            return self._drop(event.parent_id)
        if isinstance(event, SendDone):
            return self.engine.scheduler.remote.finish_sending(event.request_id)
        if isinstance(event, OfflineRoom):
            return offline_room(self.engine.scheduler)
        raise TypeError(f"unknown connector event {event!r}")

    # ---------------------------------------------------------------- decode
    def add_remote(self, req: EngineRequest) -> RemoteAllocation | str | None:
        """Admit `req` as one sequence whose prompt KV comes from a peer, its blocks
        allocated now (prefix aware), WAITING_FOR_REMOTE_KVS until RecvDone. The
        allocation, None when there is no KV space now, or why it cannot be served."""
        engine = self.engine
        if req.request_id in engine.outputs:
            return "duplicate request id"
        # The prompt's logprobs (if asked for) come from the prefill: decode computes none.
        req = dataclasses.replace(req, params=dataclasses.replace(
            req.params, n=1, best_of=None, prompt_logprobs=None))
        requests = engine.admit(req, limit_what="decode can hold at most {} tokens per request")
        if isinstance(requests, str):
            return requests
        try:
            try:
                alloc = engine.scheduler.remote.allocate_for_remote(requests[0])
            except ValueError as exc:
                alloc = str(exc)
            if alloc is None or isinstance(alloc, str):
                engine.outputs.drop_parent(req.request_id)
                return alloc
            problem = engine.grammars.prepare_remote(requests[0], req)
        except Exception:  # nothing stays allocated
            engine.scheduler.abort_request(requests[0].request_id)
            engine.outputs.drop_parent(req.request_id)
            raise
        if problem is not None:
            engine.scheduler.abort_request(requests[0].request_id)
            engine.outputs.drop_parent(req.request_id)
            return problem
        return alloc

    def _drop(self, parent_id: str) -> None:
        self.engine.scheduler.abort_request(child_id(parent_id, 0))
        self.engine.outputs.drop_parent(parent_id)

    def _fail(self, parent_id: str, message: str, code: int) -> None:
        self.engine.scheduler.remote.fail_remote_kvs(child_id(parent_id, 0), message)
        self.engine.outputs.fail_parent(parent_id, code, message)

    def _start_decoding(self, ev: RecvDone) -> None:
        engine, child = self.engine, child_id(ev.parent_id, 0)
        try:
            if engine.scheduler.get_request(child) is None:  # aborted meanwhile
                engine.outputs.drop_parent(ev.parent_id)
                return
            upd = self._join(child, ev.token_ids)
            # The first token was reported by prefill: feed it to the detokenizer silently.
            engine.outputs.process(child, ev.token_ids, ev.logprobs or None, None, None,
                                   _no_stop)
            if upd is not None:  # the first token already ends the request
                engine.outputs.process(child, [], None, upd.finish_reason, upd.stop_reason,
                                       _no_stop)
                engine.outputs.drop_parent(ev.parent_id)
        except Exception as exc:  # after allocation: whatever failed, free it
            logger.exception("request %s: starting to decode failed", ev.parent_id)
            if engine.scheduler.get_request(child) is not None:
                engine.scheduler.abort_request(child)
            engine.outputs.fail_parent(ev.parent_id, Status.INTERNAL.http_status,
                                       f"decode could not start ({type(exc).__name__})")


    def _join(self, child: str, token_ids: list[int]) -> RequestUpdate | None:
        """The prompt's KV and first tokens came: the request joins the decode batch and
        its grammar (if any) replays them. A finished update when they end it (a
        complete grammar: "stop"; tokens the grammar refuses: "error")."""
        scheduler, grammars = self.engine.scheduler, self.engine.grammars
        upd = scheduler.remote.finish_remote_kvs(child, list(token_ids))
        if upd is not None:
            grammars.forget_remote(child)
            return upd
        verdict = grammars.replay_remote(scheduler.get_request(child), token_ids)
        if verdict is None:
            return None
        if verdict == "stop":
            scheduler.finish_request(child, RequestStatus.FINISHED_STOPPED)
            return RequestUpdate(child, [], True, "stop")
        logger.warning("request %s: %s", child, verdict)
        scheduler.finish_request(child, RequestStatus.FINISHED_ERROR)
        return RequestUpdate(child, [], True, "error")


def _no_stop(request_id: str, stop_str: str) -> None:
    """A stop string in replayed tokens is the decode's next output's business."""
