"""PrefillSide: the prefill role of a PD pair, on top of LLMEngine.

Stages of a request (its PrefillPhase, see phases.py):
  add_request -> QUEUED (online queue, kept by the side's PrefillPacer, prefill_pacing.py,
  taken in `prefill_order` (xllm_py/cluster/prefill_order.py: deadline order by the
  request's TTFT target, the most on time and short prompts first where there is time,
  or FCFS), or offline (offline_queue.py: handed only to a decode that pulls,
  SendPullSignal, after every online one, in arrival order); taken while the prompts
  placed on decodes and not handed over yet hold fewer than `max_placed_prompt_tokens`:
  a decode sets blocks aside for a request only shortly before its prompt is computed,
  not for the whole time it queues here)
  -> DISPATCHING: the service's decode first, then the master's list (round robin), up
  to `max_decodes_per_request`: link it (links.py), AddNewRequests (RESOURCE_EXHAUSTED:
  bounded retry with backoff, then the next decode; a refusal or an incompatible decode
  fails the request with decode's status)
  -> PREFILLING: the engine computes the prompt and samples the first token, which goes
  to the service (finished_on_prefill_instance); the engine holds the KV (SENDING_KV)
  and tells the connector (pd/connector.py: request_finished)
  (PUSH, a prompt of at least `stream_min_tokens`: each chunk's blocks go to decode as
  soon as they are computed, kv_stream.py)
  -> HANDING_OVER: PUSH mode: our worker writes the KV (the streamed part already
  there: the last chunk's blocks) into decode's blocks; then
  FirstGeneration to decode (PULL: where our KV is); decode confirms or fails; our
  blocks are freed either way (the connector's SendDone)
  -> FINISHED, or FAILED (reported to the service with its status; a decode that could
  not be reached is named so the service can migrate; a step of the engine that failed
  the request before its first token: the engine reported it, decode is told to drop).
Cancel (the service's): QUEUED/DISPATCHING stop before reaching the engine (a decode
that placed it meanwhile is told to drop it); PREFILLING: decode is told to drop the
blocks it set aside and the engine aborts the request (if the step sampling its first
token already ran, the hook finds it cancelled and frees the held KV); HANDING_OVER:
nothing to do, the hand-over ends as usual.
Phases change on the event loop only; the connector brings the engine's word to it.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import AsyncIterator, Callable, Coroutine

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.config import EngineConfig, KVTransferMode, PDSchedulerConfig
from xllm_py.engine.generations_reporter import GenerationsReporter
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.engine.output_processor import parent_of
from xllm_py.engine.pd.connector import PDConnector
from xllm_py.engine.pd.kv_stream import KVStream
from xllm_py.engine.pd.links import Links
from xllm_py.pd_messages import HandOver, KVMove, OfflinePull, Placement
from xllm_py.engine.pd.metrics import PDMetrics
from xllm_py.engine.pd.offline_queue import OfflineQueue
from xllm_py.engine.pd.prefill_pacing import PrefillPacer, cost_model
from xllm_py.engine.pd.peers import PDPeers
from xllm_py.engine.pd.phases import PrefillPhase, PrefillRequest
from xllm_py.request import RequestStatus
from xllm_py.outputs import RequestOutput, TokenLogprob
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.status import Status, StatusError

logger = logging.getLogger(__name__)

P = PrefillPhase
# KV pushes of streaming prompts in flight at once (each request streams one at a time).
STREAM_SLOTS = 4
_PENDING = (P.QUEUED, P.DISPATCHING, P.PREFILLING)  # not handed over yet


class PrefillSide:
    def __init__(self, engine: LLMEngine, connector: PDConnector, config: EngineConfig,
                 pd_config: PDSchedulerConfig, meta: InstanceMeta,
                 reporter: GenerationsReporter, links: Links, peers: PDPeers,
                 metrics: PDMetrics, spawn: Callable[[Coroutine], asyncio.Task],
                 latency_profile: LatencyProfile | None) -> None:
        """`latency_profile`: this instance's, as registered at start-up (the deadline
        order's predictions; None: FCFS)."""
        self.engine = engine  # (submit; its pool and KV layout, read only)
        self.connector = connector
        self.config = config
        self.pd_config = pd_config
        self.meta = meta
        self.reporter = reporter
        self.links = links
        self.peers = peers
        self.metrics = metrics
        self.spawn = spawn
        self._requests: dict[str, PrefillRequest] = {}  # until a final phase
        self.pacer = PrefillPacer(pd_config, self._requests, cost_model(
            latency_profile, engine.step_budget_tokens, pd_config))  # the online queue
        self._offline = OfflineQueue()
        self._queued = asyncio.Event()  # set when either queue may hold work
        self._dispatch_sem = asyncio.Semaphore(pd_config.max_dispatching)
        self._rr = itertools.count()
        connector.on_first_token = self._first_token
        connector.on_failed = self._engine_failed
        # Streaming: PUSH only (the decode pulls nothing before FirstGeneration).
        self.streams = (config.transfer.mode == KVTransferMode.PUSH
                        and config.transfer.stream_min_tokens > 0)
        if self.streams:
            connector.on_progress = self._progress
            connector.on_preempted = self._preempted
        self._stream_slots = asyncio.Semaphore(STREAM_SLOTS)

    def phase(self, request_id: str) -> RequestStatus | None:
        rec = self._requests.get(request_id)
        return rec.phase if rec is not None else None

    def num_pending(self) -> int:
        """Requests not handed over yet (queued, finding a decode, prefilling)."""
        return sum(1 for r in self._requests.values() if r.phase in _PENDING)

    def _end(self, rec: PrefillRequest, phase: RequestStatus) -> None:
        rec.transition(phase)
        self._requests.pop(rec.request_id, None)
        self.pacer.room.set()

    # ------------------------------------------------------------------ queue, dispatch
    def add_request(self, spec: EngineRequestSpec) -> None:
        if spec.request_id in self._requests:  # answered to the caller: a report would
            raise StatusError(Status.INVALID_ARGUMENT,  # end the live request's stream
                              f"request id {spec.request_id} is already live here")
        rec = self._requests[spec.request_id] = PrefillRequest(spec)
        if spec.offline:
            self._offline.add(rec)
            return
        self.pacer.queue(rec)
        self._queued.set()

    def on_pull(self, pull: OfflinePull) -> int:
        """A decode with room pulls offline work: how many requests go to it."""
        granted = self._offline.grant(pull)
        self.metrics.pulls_received.inc()
        if granted:
            self.metrics.offline_handed.inc(len(granted))
            self._queued.set()
        return len(granted)

    async def dispatch_loop(self) -> None:
        """Online requests first; offline ones a decode pulled when no online one is queued."""
        while True:
            if not self.pacer.online and not self._offline.has_granted():
                self._queued.clear()
                await self._queued.wait()
                continue
            await self.pacer.wait_for_room()
            rec = self.pacer.take() if self.pacer.online else self._offline.take()
            if rec is None:  # every queued online one was cancelled
                continue
            if rec.phase is not P.QUEUED:  # cancelled while queued
                continue
            rec.transition(P.DISPATCHING)
            try:
                await self._dispatch_sem.acquire()
            except BaseException:
                self._requests.pop(rec.request_id, None)
                raise
            self.spawn(self._dispatch_guarded(rec))

    async def _dispatch_guarded(self, rec: PrefillRequest) -> None:
        try:
            await self._dispatch(rec)
        except StatusError as exc:
            self._fail_dispatch(rec, exc.status, exc.message)
        except Exception as exc:
            logger.exception("dispatch of request %s failed", rec.request_id)
            self._fail_dispatch(rec, Status.INTERNAL, f"dispatch failed: {exc}")
        finally:
            self._dispatch_sem.release()

    def _fail_dispatch(self, rec: PrefillRequest, status: Status, message: str) -> None:
        if rec.phase is not P.DISPATCHING:  # cancelled meanwhile: nobody waits for it
            return
        logger.warning("request %s failed before prefill: %s", rec.request_id, message)
        self._end(rec, P.FAILED)
        self._report_error(rec.spec, status, message)

    async def _decode_candidates(self, spec: EngineRequestSpec) -> AsyncIterator[str]:
        """The service's choice first; the master's list (one RPC) only if that fails.
        Never this instance (elastic: it may be on the list as a decode, and a request
        placed on itself would meet its own id)."""
        if spec.decode_name and spec.decode_name != self.meta.name:
            yield spec.decode_name
        try:
            others = await self.links.list_decodes()
        except Exception as exc:  # the master may be switching over
            logger.warning("could not list decode instances: %s", exc)
            others = []
        start = next(self._rr)
        rotated = others[start % len(others):] + others[: start % len(others)] if others else []
        for name in rotated:
            if name not in (spec.decode_name, self.meta.name):
                yield name

    async def _dispatch(self, rec: PrefillRequest) -> None:
        last_error = "no decode instance is available"
        async with contextlib.aclosing(self._decode_candidates(rec.spec)) as names:
            tried = 0
            async for name in names:
                if rec.phase is not P.DISPATCHING:
                    return
                last_error = await self._try_decode(rec, name)
                if last_error is None:
                    return
                tried += 1
                if tried == self.pd_config.max_decodes_per_request:
                    break
        raise StatusError(Status.UNAVAILABLE, last_error)

    async def _try_decode(self, rec: PrefillRequest, name: str) -> str | None:
        """Place the request on decode `name` and start its prefill; None when done, else
        why not (StatusError for what another decode would not change)."""
        decode = await self.links.resolve_meta(name)
        if decode is None:
            return f"decode instance {name} is not registered"
        try:  # (a cached meta may name where the decode listened before a restart)
            decode = await self.links.link_current(decode)
        except StatusError as exc:
            if exc.status is Status.FAILED_PRECONDITION:  # incompatible: no point retrying
                raise
            return exc.message
        placement = await self._place(rec.spec, decode)
        if isinstance(placement, str):  # not reached, or no answer
            return placement
        if placement is None:
            return f"decode instance {name} has no KV space"
        if not placement.status.ok:  # decode's status, as it said it
            raise StatusError(placement.status, placement.message or "decode refused the request")
        if rec.phase is not P.DISPATCHING:  # cancelled while being placed
            self.spawn(self._tell_decode_to_drop(rec.request_id, decode))
            return None
        rec.decode, rec.decode_blocks = decode, placement.block_ids
        rec.num_cached_on_decode = placement.num_cached_tokens
        if self.streams and len(rec.spec.prompt_token_ids) >= self.config.transfer.stream_min_tokens:
            rec.stream = KVStream(
                rec.request_id, lambda src, dst, rec=rec: self._push(rec, src, dst, (len(src),)),
                rec.decode_blocks, rec.num_cached_on_decode // self.engine.storage.block_size,
                self.engine.storage.block_size, self._stream_slots, self.spawn)
        rec.transition(P.PREFILLING)
        self._submit_prefill(rec)
        return None

    async def _place(self, spec: EngineRequestSpec,
                     decode: InstanceMeta) -> Placement | str | None:
        """AddNewRequests with bounded retries while decode has no KV space; None when it
        stays full, why when it could not be reached or did not answer (it may have set
        blocks aside all the same: it is told to drop them)."""
        cfg = self.pd_config
        backoff = cfg.backoff_s
        for _ in range(cfg.attempts_per_decode):
            try:
                placement = await self.peers.add_new_request(decode, self.meta, spec)
            except StatusError as exc:
                logger.warning("AddNewRequests to %s failed: %s", decode.name, exc.message)
                self.links.forget(decode.name)
                self.spawn(self._tell_decode_to_drop(spec.request_id, decode))
                return f"AddNewRequests to decode {decode.name} failed: {exc.message}"
            if placement.status is not Status.RESOURCE_EXHAUSTED:
                return placement
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, cfg.max_backoff_s)
        return None

    def _submit_prefill(self, rec: PrefillRequest) -> None:
        spec = rec.spec
        sink = self.reporter.sink(spec.source_xservice_addr, spec.service_request_id,
                                  spec.request_id, on_output=self._watch(spec.request_id))
        sink.finished_on_prefill = True
        rec.submitted_s = time.monotonic()
        self.engine.submit(EngineRequest(spec.request_id, spec.prompt_token_ids, spec.params,
                                         sink, remote_decode=True, offline=spec.offline))

    def _watch(self, request_id: str) -> Callable[[RequestOutput], bool]:
        """Engine thread: an error ending the request before its hand-over (a failed
        step) ends its record too, or it would hold its place (and decode's blocks)."""
        def on_output(out: RequestOutput) -> bool:
            if out.finished and out.error_code:
                self.connector.request_failed(request_id)
            return True
        return on_output

    def _engine_failed(self, request_id: str) -> None:
        rec = self._requests.get(request_id)
        if rec is None or rec.phase is not P.PREFILLING:
            return
        self._end(rec, P.FAILED)
        self.spawn(self._tell_decode_to_drop(request_id, rec.decode, rec.stream))

    def _progress(self, request_id: str, table: list[int], num_computed: int) -> None:
        rec = self._requests.get(parent_of(request_id)[0])
        if rec is not None and rec.phase is P.PREFILLING and rec.stream is not None:
            rec.stream.computed(table, num_computed)

    def _preempted(self, request_id: str) -> None:
        rec = self._requests.get(parent_of(request_id)[0])
        if rec is not None and rec.stream is not None:
            rec.stream.preempted()

    # ------------------------------------------------------------------ hand-over
    def _first_token(self, child: str, tables: list[list[int]], first: int | None,
                     lp: TokenLogprob | None, finished_here: bool, kv_held: bool) -> None:
        """A request sampled its first token (its KV held, or it ended)."""
        rec = self._requests.get(parent_of(child)[0])
        if rec is None or rec.phase is not P.PREFILLING:  # cancelled while the step ran:
            if kv_held:                                     # its abort found nothing
                self.connector.send_done(child)
            return
        self.pacer.first_token(rec)
        rec.transition(P.HANDING_OVER)
        self.pacer.room.set()
        self.spawn(self._hand_over(rec, child, tables, first, lp, finished_here, kv_held))

    async def _hand_over(self, rec: PrefillRequest, child: str, tables: list[list[int]],
                         first_token: int | None, lp: TokenLogprob | None,
                         finished_here: bool, kv_held: bool) -> None:
        """Move the KV (PUSH) and tell decode to take over (or to drop its blocks)."""
        spec, decode = rec.spec, rec.decode
        mode = self.config.transfer.mode
        handover = HandOver(spec.request_id, prefill_name=self.meta.name, mode=mode.value,
                            dp_size=self.meta.dp_size,
                            num_computed_tokens=len(spec.prompt_token_ids))
        error: StatusError | None = None
        unreachable = ""  # decode, when FirstGeneration could not reach it
        streamed = 0  # of the blocks, those in place before the first token
        t0 = time.monotonic()
        if finished_here or first_token is None:
            handover.failed, handover.status_msg = True, "finished on prefill"
        else:
            try:
                self._fill_handover(handover, rec, tables, first_token, lp)
                if mode == KVTransferMode.PUSH:
                    src, dst = handover.block_ids, rec.decode_blocks
                    if rec.stream is not None:
                        streamed = await rec.stream.finish(src)
                    if streamed < len(src):  # streamed: only the last chunk's blocks are left
                        n = self.engine.handover_group_sizes(
                            rec.num_cached_on_decode, len(rec.spec.prompt_token_ids))
                        await self._push(rec, src[streamed:], dst[streamed:], (n[0] - streamed, *n[1:]))
            except StatusError as exc:  # decode must still hear of it to free its blocks
                error = exc
                handover.failed, handover.status_msg = True, exc.message
        if rec.stream is not None:  # no push may write decode's blocks once it has them
            await rec.stream.settle()
        try:
            problem = await self.peers.first_generation(
                decode, handover, self.config.rpc_timeout_s + self.config.transfer.timeout_s)
            if error is None and problem and not handover.failed:
                error = StatusError(Status.BAD_GATEWAY, f"decode could not take over: {problem}")
        except StatusError as exc:
            logger.warning("FirstGeneration for %s to %s failed: %s", spec.request_id,
                           decode.name, exc.message)
            if error is None and not handover.failed:
                error = StatusError(Status.BAD_GATEWAY,
                                    f"decode instance {decode.name} failed: {exc.message}")
            if error is not None and exc.status in (Status.UNAVAILABLE,
                                                    Status.DEADLINE_EXCEEDED):
                unreachable = decode.name  # (PUSH: the push into it failed first)
        finally:
            if kv_held:
                self.connector.send_done(child)
        if error is not None:
            self.metrics.transfer_failures.inc()
            self._end(rec, P.FAILED)
            self._report_error(spec, error.status, error.message, unreachable)
            return
        self._end(rec, P.FINISHED)
        if not handover.failed:
            logger.info("PD prefill handed request %s to %s: %d blocks (%d streamed during the "
                        "prefill), %d bytes in %.1f ms (%s)",
                        spec.request_id, decode.name, len(handover.block_ids), streamed,
                        len(handover.block_ids) * self.engine.storage.block_bytes,
                        (time.monotonic() - t0) * 1000, handover.mode)

    def _fill_handover(self, handover: HandOver, rec: PrefillRequest, tables: list[list[int]],
                       first_token: int, lp: TokenLogprob | None) -> None:
        """First token (with logprobs) and where our KV is: the blocks decode lacks (of a
        sliding-window layer only its window's: KVCacheManager.handover_block_ids)."""
        src = self.engine.handover_block_ids(
            tables, rec.num_cached_on_decode, len(rec.spec.prompt_token_ids))
        if len(src) != len(rec.decode_blocks):
            raise StatusError(Status.INTERNAL, f"block count mismatch: prefill {len(src)}, "
                                               f"decode {len(rec.decode_blocks)}")
        handover.token_ids, handover.logprobs = [first_token], [lp]
        handover.cluster_ids = list(self.meta.cluster_ids)
        handover.addrs = list(self.meta.addrs)
        handover.worker_rpc_addrs = list(self.meta.worker_rpc_addrs)
        handover.block_ids = src

    async def _push(self, rec: PrefillRequest, src: list[int], dst: list[int],
                    group_blocks: tuple[int, ...]) -> None:
        """``group_blocks``: per KV group, its count of the blocks (a stream's: group 0's)."""
        decode = rec.decode
        if not decode.addrs:
            raise StatusError(Status.BAD_GATEWAY,
                              f"decode {decode.name} publishes no transfer address")
        await self.peers.push_kv(KVMove(
            rec.request_id, decode.cluster_ids[0] if decode.cluster_ids else 0,
            decode.addrs[0], src, dst, group_blocks=group_blocks,
            transfer_key=decode.transfer_keys[0] if decode.transfer_keys else ""))

    def _report_error(self, spec: EngineRequestSpec, status: Status, message: str,
                      unreachable_instance: str = "") -> None:
        if not spec.source_xservice_addr:
            return
        out = RequestOutput(request_id=spec.request_id, finished=True,
                            num_prompt_tokens=len(spec.prompt_token_ids),
                            error_code=status.http_status, error_message=message,
                            unreachable_instance=unreachable_instance)
        sink = self.reporter.sink(spec.source_xservice_addr, spec.service_request_id,
                                  spec.request_id)
        sink.emit(out)
        self.reporter.flush()

    # ------------------------------------------------------------------ cancel
    def cancel(self, request_id: str) -> None:
        """The service cancelled the request: its PD work here stops (a decode that set
        blocks aside for it is told to drop them). What the engine holds is the engine's
        abort to free; what it holds for a hand-over under way, the hand-over's."""
        rec = self._requests.get(request_id)
        if rec is None or rec.phase is P.HANDING_OVER:
            return
        was = rec.phase
        self._end(rec, P.CANCELLED)
        if was is P.PREFILLING:  # decode drops the blocks it set aside
            self.spawn(self._tell_decode_to_drop(request_id, rec.decode, rec.stream))

    async def _tell_decode_to_drop(self, request_id: str, decode: InstanceMeta,
                                   stream: KVStream | None = None) -> None:
        if stream is not None:  # its push in flight writes decode's blocks: let it end
            await stream.settle()
        handover = HandOver(request_id, prefill_name=self.meta.name, failed=True,
                            status_msg="cancelled")
        # Retried while the decode cannot be reached (a partition may heal and deliver a
        # delayed AddNewRequests: the drop must follow it), until the decode's reaper
        # would free the blocks anyway.
        give_up = time.monotonic() + self.pd_config.orphan_timeout_s
        delay = self.pd_config.backoff_s
        while True:
            try:
                await self.peers.first_generation(decode, handover, self.config.rpc_timeout_s)
                return
            except StatusError as exc:
                if time.monotonic() + delay > give_up:  # decode's reaper frees them
                    logger.info("could not tell %s to drop cancelled request %s: %s",
                                decode.name, request_id, exc.message)
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.pd_config.max_backoff_s)
