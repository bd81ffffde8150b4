"""DecodeSide: the decode role of a PD pair, on top of LLMEngine.

Stages of a request (its record's status, named by DecodePhase, see phases.py):
  AddNewRequests -> the engine admits it with blocks for prompt + 1 (prefix aware; the
  connector's AdmitRemote, engine/remote_kv.py) -> ALLOCATED: the block ids prefill must
  fill go back (RESOURCE_EXHAUSTED: no KV space now; INVALID_ARGUMENT: it cannot be
  served here) -> FirstGeneration -> PULLING: our worker pulls prefill's KV (PUSH: it is
  already in our blocks) -> DECODING: the connector's RecvDone moves the engine's request
  from WAITING_FOR_REMOTE_KVS into the decode batch with prefill's first token; every
  later token goes to the service through Generations.
  A failed pull ends it FAILED (RecvFailed: never decode on KV that did not arrive); a
  FirstGeneration that says `failed` DROPs it (one for an id not known yet makes that id's
  AddNewRequests refused if it comes later, delayed by the network past its deadline, or
  frees what it set aside if it came while the engine admitted it);
  one that never comes FAILs it after `orphan_timeout_s` so its blocks cannot leak; an
  AddNewRequests given up while the engine admits it drops what the admission set aside.
Cancel (the service's): ALLOCATED -> DROPPED at once in PULL mode (nothing but our own
pull writes into its blocks); PUSH: -> CANCELLED, freed when FirstGeneration comes (a
PUSH may be writing into its blocks until then) or after `cancel_grace_s`; PULLING ->
GONE: freed when the pull ends; DECODING: the engine aborts it. A FirstGeneration whose
caller gives up (deadline, prefill gone) moves its pulls to GONE the same way: the
take-overs run shielded, so a pull is never cut short under its blocks.
MultiGenerations with KV (migration) takes the same path from ALLOCATED on.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable, Coroutine

from xllm_py.config import EngineConfig, KVTransferMode, PDSchedulerConfig
from xllm_py.engine.generations_reporter import GenerationsReporter
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.engine.migration import Resumption
from xllm_py.engine.kv_connector import RemoteAllocation
from xllm_py.engine.pd.connector import PDConnector
from xllm_py.pd_messages import HandOver, KVMove, Placement
from xllm_py.engine.pd.metrics import PDMetrics
from xllm_py.engine.pd.peers import PDPeers
from xllm_py.engine.pd.phases import DecodePhase, DecodeRequest
from xllm_py.request import RequestStatus
from xllm_py.rpc import pd as wire
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.status import Status, StatusError

logger = logging.getLogger(__name__)

D = DecodePhase


class DecodeSide:
    def __init__(self, engine: LLMEngine, connector: PDConnector, config: EngineConfig,
                 pd_config: PDSchedulerConfig, reporter: GenerationsReporter, peers: PDPeers,
                 metrics: PDMetrics, spawn: Callable[[Coroutine], asyncio.Task]) -> None:
        self.engine = engine  # (its model config and pool size; the connector for the rest)
        self.connector = connector
        self.config = config
        self.pd_config = pd_config
        self.reporter = reporter
        self.peers = peers
        self.metrics = metrics
        self.spawn = spawn
        self._requests: dict[str, DecodeRequest] = {}  # until a final phase
        # How long a request cancelled before its FirstGeneration keeps its blocks when
        # no FirstGeneration comes (a push into them has ended by then).
        self.cancel_grace_s = config.transfer.timeout_s + config.rpc_timeout_s
        self.num_offline_placed = 0  # offline requests placed here (the puller's count)
        # Ids a prefill dropped before their AddNewRequests reached us (a call delayed by
        # the network past its deadline may still arrive): refused when it does, until
        # the orphan timeout (when the reaper would have freed it anyway).
        self._dropped_early: dict[str, float] = {}

    def phase(self, request_id: str) -> RequestStatus | None:
        rec = self._requests.get(request_id)
        return rec.phase if rec is not None else None

    def num_open(self) -> int:
        """Placements not running on the engine yet (blocks set aside, KV arriving)."""
        return len(self._requests)

    def _end(self, rec: DecodeRequest, phase: RequestStatus) -> None:
        rec.transition(phase)
        if phase in D.LEAVES:
            self._requests.pop(rec.request_id, None)

    # ------------------------------------------------------------------ AddNewRequests
    async def add_new_requests(self, prefill_name: str,
                               items: list[EngineRequestSpec | Placement]) -> list[Placement]:
        """One Placement per item (a Placement item is a request that could not be read).
        Each item is checked (LLMEngine.admit: token ids, length) before it allocates."""
        replies = []
        for spec in items:
            if isinstance(spec, Placement):
                replies.append(spec)
                continue
            rid = spec.request_id
            if rid in self._requests:  # (the engine refuses an id it runs)
                replies.append(Placement(rid, Status.INVALID_ARGUMENT,
                                         message="duplicate request id"))
                continue
            if self._dropped_early.pop(rid, None) is not None:
                replies.append(_dropped_placement(rid))
                continue
            try:
                alloc = await self._admit(spec)
            except Exception as exc:  # nothing stays allocated: add_remote frees on failure
                logger.exception("request %s: admitting it on decode failed", rid)
                alloc = f"request refused ({type(exc).__name__})"
            if self._dropped_early.pop(rid, None) is not None:
                # The drop came while the engine admitted it (the record did not exist
                # yet): free what the admission set aside, or it is held until the reaper.
                if alloc is not None and not isinstance(alloc, str):
                    await self.connector.drop(rid)
                replies.append(_dropped_placement(rid))
            elif isinstance(alloc, str):
                replies.append(Placement(rid, Status.INVALID_ARGUMENT, message=alloc))
            elif alloc is None:
                replies.append(Placement(rid, Status.RESOURCE_EXHAUSTED,
                                         message="no KV space on decode"))
            else:
                self.num_offline_placed += spec.offline
                self._requests[rid] = DecodeRequest(spec, prefill_name, alloc.new_block_ids,
                                                    alloc.num_cached_tokens)
                replies.append(Placement(rid, Status.OK, alloc.new_block_ids,
                                         alloc.num_cached_tokens))
        return replies

    async def _admit(self, spec: EngineRequestSpec, usage_prompt_tokens: int | None = None,
                     generated_offset: int = 0,
                     num_unread: int | None = None) -> RemoteAllocation | str | None:
        """The engine admits it (AdmitRemote), with a sink to the service."""
        sink = self.reporter.sink(spec.source_xservice_addr, spec.service_request_id,
                                  spec.request_id)
        admitted = self.connector.admit_remote(EngineRequest(
            spec.request_id, spec.prompt_token_ids, spec.params, sink, arrival_time=0.0,
            usage_prompt_tokens=usage_prompt_tokens, generated_offset=generated_offset,
            num_unread=num_unread, offline=spec.offline, tpot_slo_ms=spec.tpot_slo_ms))
        try:
            return await asyncio.shield(admitted)
        except asyncio.CancelledError:
            # The call was given up (its deadline, a client that hung up: a call delayed
            # by a partition arrives with its cancel right behind it) while the engine
            # admits it: no record will hold what the admission sets aside, so it is
            # dropped when the engine answers.
            admitted.add_done_callback(lambda f: self._drop_unrecorded(f, spec.request_id))
            raise

    def _drop_unrecorded(self, admitted: asyncio.Future, request_id: str) -> None:
        if admitted.cancelled() or admitted.exception() is not None:
            return  # nothing was set aside
        if isinstance(admitted.result(), RemoteAllocation):
            logger.info("request %s: AddNewRequests given up during its admission; "
                        "freeing its blocks", request_id)
            self.connector.drop(request_id)

    # ------------------------------------------------------------------ FirstGeneration
    async def first_generation(self, handovers: list[HandOver]) -> list[str]:
        """Take the requests over; one problem per hand-over ("" when taken or dropped)."""
        # The take-overs run in tasks of their own: a caller that gives up must not cut a
        # pull short (its blocks would be freed while the transfer writes into them).
        tasks = [self.spawn(self._take_over(h)) for h in handovers]
        try:
            return list(await asyncio.shield(asyncio.gather(*tasks)))
        except asyncio.CancelledError:
            for h in handovers:  # dropped once their pulls end; prefill reports the error
                rec = self._requests.get(h.request_id)
                if rec is not None and rec.phase is D.PULLING:
                    rec.transition(D.GONE)
            raise

    async def _take_over(self, h: HandOver) -> str:
        rid = h.request_id
        rec = self._requests.get(rid)
        if rec is None:
            if h.failed:  # its AddNewRequests may still be on its way: refuse it then
                self._dropped_early[rid] = time.monotonic()
            return f"unknown request {rid}"
        if rec.phase not in (D.ALLOCATED, D.CANCELLED):
            return f"request {rid} is {rec.phase.name}: FirstGeneration came twice"
        if h.failed or rec.phase is D.CANCELLED:
            self._end(rec, D.DROPPED)
            await self.connector.drop(rid)
            return ""
        problem = handover_problem(h, len(rec.new_block_ids), self.engine.model_config.vocab_size)
        if problem:  # it cannot be decoded: end it here and free its blocks
            self._end(rec, D.FAILED)
            await self.connector.recv_failed(rid, problem, 400)
            return f"request {rid}: {problem}"
        t0 = time.monotonic()
        rec.transition(D.PULLING)
        try:
            if h.mode != KVTransferMode.PUSH.value:
                await self._pull(h, rec)
        except StatusError as exc:
            self.metrics.transfer_failures.inc()
            self._end(rec, D.FAILED)
            await self.connector.recv_failed(rid, exc.message, Status.BAD_GATEWAY.http_status)
            return exc.message
        except BaseException:  # stopping: the blocks must not stay held
            self._end(rec, D.FAILED)
            self.connector.recv_failed(rid, "decode instance stopped",
                                       Status.BAD_GATEWAY.http_status)
            raise
        if rec.phase is D.GONE:
            self._end(rec, D.DROPPED)
            await self.connector.drop(rid)
            return f"request {rid} was cancelled during its KV transfer"
        self._end(rec, D.DECODING)
        await self.connector.recv_done(rid, h.token_ids, h.logprobs)
        logger.info("PD decode took over request %s from %s: %d blocks, %d bytes (%d cached "
                    "tokens) in %.1f ms (%s)", rid, rec.prefill_name, len(rec.new_block_ids),
                    len(rec.new_block_ids) * self.engine.storage.block_bytes,
                    rec.num_cached_tokens, (time.monotonic() - t0) * 1000, h.mode or "PULL")
        return ""

    async def _pull(self, h: HandOver, rec: DecodeRequest) -> None:
        if not rec.new_block_ids:
            return
        groups = self.engine.handover_group_sizes(rec.num_cached_tokens,
                                                  len(rec.spec.prompt_token_ids))
        await self.peers.pull_kv(KVMove(rec.request_id, h.cluster_ids[0] if h.cluster_ids else 0,
                                        h.addrs[0], h.block_ids, rec.new_block_ids,
                                        group_blocks=groups))

    # ------------------------------------------------------------------ migration with KV
    async def resume_with_kv(self, item, r: Resumption) -> str:
        """MultiGenerations item with kv (migration.KVPuller): allocate for prompt +
        generated[:-1] and pull their KV like a FirstGeneration; "" or the problem."""
        kv = wire.migration_kv_from_proto(item)
        rid, k, unread = r.spec.request_id, len(r.generated), r.num_unread
        ext = dataclasses.replace(r.spec, prompt_token_ids=r.spec.prompt_token_ids
                                  + r.generated[:-1], params=r.params)
        # generated[-1] comes as a first token, fed silently: what was unread before it
        # is one less (none if its text completed everything).
        alloc = await self._admit(
            ext, r.num_prompt_tokens, k - 1, None if unread is None else max(0, unread - 1))
        if alloc is None or isinstance(alloc, str):
            return f"{rid}: {alloc or 'no KV space on decode'}"
        self._requests[rid] = DecodeRequest(ext, kv.prefill_name or "migration source",
                                            alloc.new_block_ids, alloc.num_cached_tokens)
        return await self._take_over(dataclasses.replace(
            kv, request_id=rid, token_ids=[r.generated[-1]], logprobs=[None]))

    # ------------------------------------------------------------------ reaping, cancel
    async def reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.pd_config.reap_interval_s)
            self.reap_orphans(time.monotonic())

    def reap_orphans(self, now: float) -> list[str]:
        """Free the requests whose FirstGeneration never came (cancelled ones after
        cancel_grace_s). Returns their ids."""
        timeout = self.pd_config.orphan_timeout_s
        for rid in [r for r, t in self._dropped_early.items() if now - t > timeout]:
            del self._dropped_early[rid]
        stale = [rec for rec in self._requests.values()
                 if rec.phase in (D.ALLOCATED, D.CANCELLED) and (
                     now - rec.created > timeout or (
                         rec.cancelled_at is not None
                         and now - rec.cancelled_at > self.cancel_grace_s))]
        for rec in stale:
            rid = rec.request_id
            if rec.phase is D.CANCELLED:
                self._end(rec, D.DROPPED)
                self.connector.drop(rid)
                continue
            logger.warning("request %s: no FirstGeneration within %.0fs; freeing its blocks",
                           rid, timeout)
            self._end(rec, D.FAILED)
            self.connector.recv_failed(rid, "prefill instance never handed the request over",
                                       Status.BAD_GATEWAY.http_status)
        return [rec.request_id for rec in stale]

    def cancel(self, request_id: str) -> bool:
        """The service cancelled the request. True: its blocks are freed here once no
        transfer can touch them; False: the engine may abort it now."""
        rec = self._requests.get(request_id)
        if rec is None:  # decoding (the engine's) or unknown
            return False
        if rec.phase is D.ALLOCATED and self.config.transfer.mode is KVTransferMode.PULL:
            # Only our own pull writes into its blocks: free them now (the service cancels
            # here too when the prefill died before the hand-over; waiting for the orphan
            # timeout held them a minute).
            self._end(rec, D.DROPPED)
            self.connector.drop(rec.request_id)
        elif rec.phase is D.ALLOCATED:  # a PUSH may be writing into its blocks right now
            rec.transition(D.CANCELLED)
            rec.cancelled_at = time.monotonic()
        elif rec.phase is D.PULLING:
            rec.transition(D.GONE)
        return True


def _dropped_placement(request_id: str) -> Placement:
    return Placement(request_id, Status.INVALID_ARGUMENT, message="the prefill dropped this request")


def handover_problem(h: HandOver, num_blocks: int, vocab_size: int) -> str:
    """Why a FirstGeneration (or a migration's hand-over) cannot be decoded, or "": one
    first token in the vocabulary (its logprobs' tokens too), as many source blocks as
    decode allocated, and where to pull them from."""
    if len(h.token_ids) != 1:
        return f"FirstGeneration carries {len(h.token_ids)} first tokens; expected 1"
    ids = list(h.token_ids)
    for lp in h.logprobs or []:
        if lp is not None:
            if lp.logprob != lp.logprob:  # NaN
                return "FirstGeneration carries a NaN logprob"
            ids.extend(t for t, _ in lp.top)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        return f"token id {bad[0]} is out of range: the vocabulary has {vocab_size} tokens"
    if h.mode not in ("", KVTransferMode.PULL.value, KVTransferMode.PUSH.value):
        return f"unknown kv_cache_transfer_mode {h.mode!r}"
    if h.mode != KVTransferMode.PUSH.value and num_blocks:
        if len(h.block_ids) != num_blocks:
            return f"prefill sent {len(h.block_ids)} blocks, decode expects {num_blocks}"
        if any(b < 0 for b in h.block_ids):
            return "block ids must be >= 0"
        if not h.addrs:
            return "FirstGeneration carries no transfer address"
    return ""
