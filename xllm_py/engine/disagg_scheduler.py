"""DisaggPDScheduler: the prefill and decode roles of a PD pair, on top of LLMEngine.

Prefill stages (per request):
  add_request -> online/offline queue -> dispatch loop -> AddNewRequests to the decode
  (bounded retry with backoff on 404, then another decode, then a clean failure) ->
  engine prefill (remote_decode: samples the first token, holds the KV) -> first token
  to the service (finished_on_prefill_instance) -> PUSH: our worker writes the KV into
  decode's blocks -> FirstGeneration to decode (PULL: where our KV is) -> decode
  confirms (or fails) -> finish_sending frees our blocks.
Decode stages:
  AddNewRequests -> link the prefill on first contact -> allocate_for_remote (prefix
  aware) -> 200 + the block ids decode needs filled (404: no KV space) ->
  FirstGeneration -> PULL: PullKVCache on our worker -> finish_remote_kvs (or
  fail_remote_kvs: never decode on KV that did not arrive) -> decode steps, every token
  to the service through Generations. A request whose FirstGeneration never comes is
  dropped after `orphan_timeout_s` so its blocks cannot leak.
Cancel (the service's, when the client is gone) never frees blocks that a transfer may
still touch: prefill tells decode to drop the blocks it set aside, and frees its own at
the hand-over hook if the first token was already being sampled; decode frees a request
whose pull is running when the pull ends, and one waiting for its FirstGeneration (a
PUSH may be writing into its blocks) when that comes or after `cancel_grace_s`. A
FirstGeneration whose caller gives up (deadline, prefill gone) still lets its pulls end
before the blocks are freed.
Everything that touches the scheduler runs on the engine thread through engine.call.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import random
import time
from typing import AsyncIterator, Awaitable, Callable

import grpc

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import EngineConfig, InstanceRole, KVTransferMode
from xllm_py.engine.generations_reporter import GenerationsReporter
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.engine.migration import Resumption, multi_generations
from xllm_py.engine.output_processor import child_id
from xllm_py.outputs import RequestOutput, TokenLogprob
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.request import Request
from xllm_py.rpc.convert import EngineRequestSpec, spec_to_proto
from xllm_py.utils.grpc_channels import ChannelPool

logger = logging.getLogger(__name__)

# Resolves an instance name to its published meta (etcd), or None.
MetaResolver = Callable[[str], Awaitable[InstanceMeta | None]]
# Names of the schedulable decode instances (from the master).
DecodeLister = Callable[[], Awaitable[list[str]]]

# Prefill: how often it links the decodes it has not linked yet (prelink_once).
PRELINK_INTERVAL_S = 2.0


class PDError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclasses.dataclass
class _PrefillState:
    spec: EngineRequestSpec
    decode: InstanceMeta
    decode_blocks: list[int]  # blocks decode needs filled
    num_cached_on_decode: int
    sink: object = None


@dataclasses.dataclass
class _DecodeState:
    spec: EngineRequestSpec
    prefill_name: str
    new_block_ids: list[int]
    num_cached_tokens: int
    created: float = dataclasses.field(default_factory=time.monotonic)
    cancelled_at: float | None = None  # the service cancelled it before its FirstGeneration


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    attempts_per_decode: int = 8  # ~4.5 s of backoff before trying another decode
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0


class DisaggPDScheduler:
    def __init__(self, engine: LLMEngine, config: EngineConfig, meta: InstanceMeta,
                 reporter: GenerationsReporter, resolve_meta: MetaResolver,
                 list_decodes: DecodeLister, worker_rpc_addr: str,
                 retry: RetryPolicy = RetryPolicy(), orphan_timeout_s: float = 60.0) -> None:
        self.engine = engine
        self.config = config
        self.meta = meta
        self.reporter = reporter
        self.resolve_meta = resolve_meta
        self.list_decodes = list_decodes
        self.worker_rpc_addr = worker_rpc_addr
        self.retry = retry
        self.orphan_timeout_s = orphan_timeout_s
        self.timeout_s = config.rpc_timeout_s
        self.role = config.role
        self.loop = asyncio.get_running_loop()
        self._online: asyncio.Queue[EngineRequestSpec] = asyncio.Queue()
        self._offline: asyncio.Queue[EngineRequestSpec] = asyncio.Queue()
        self._queued = asyncio.Event()  # set when either queue may hold work
        self._prefill: dict[str, _PrefillState] = {}
        self._decode: dict[str, _DecodeState] = {}
        self._linked: dict[str, InstanceMeta] = {}
        self._channels = ChannelPool()
        self._rr = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self._dispatch_sem = asyncio.Semaphore(64)
        self._dispatcher: asyncio.Task | None = None
        self._reaper: asyncio.Task | None = None
        self._prelinker: asyncio.Task | None = None
        self._num_dispatching = 0  # prefill: taken off a queue, not in _prefill yet
        self._refused_links: set[tuple[str, str]] = set()  # (decode, incarnation) incompatible
        self._pulling: set[str] = set()  # decode: requests whose KV pull is running
        self._gone: set[str] = set()  # ... of which the service or the caller gave up
        # decode: how long a request cancelled before its FirstGeneration keeps its blocks
        # when no FirstGeneration comes (a push into them has ended by then)
        self.cancel_grace_s = config.transfer.timeout_s + config.rpc_timeout_s
        self.num_transfer_failures = 0
        if self.role == InstanceRole.PREFILL:
            engine.on_remote_decode_update = self._on_prefill_update

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.role == InstanceRole.PREFILL:
            self._dispatcher = asyncio.create_task(self._dispatch_loop())
            self._prelinker = asyncio.create_task(self._prelink_loop())
        if self.role == InstanceRole.DECODE:
            self._reaper = asyncio.create_task(self._reap_orphans())

    async def stop(self) -> None:
        for task in [self._dispatcher, self._reaper, self._prelinker, *self._tasks]:
            if task is not None:
                task.cancel()
        await self._channels.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _pd_stub(self, addr: str) -> pb_grpc.DisaggPDServiceStub:
        return pb_grpc.DisaggPDServiceStub(self._channels.get(addr))

    def _worker_stub(self) -> pb_grpc.WorkerServiceStub:
        return pb_grpc.WorkerServiceStub(self._channels.get(self.worker_rpc_addr))

    def _cluster_info(self) -> pb.ClusterInfo:
        return pb.ClusterInfo(cluster_ids=self.meta.cluster_ids, addrs=self.meta.addrs,
                              ports=self.meta.ports, dp_size=self.meta.dp_size,
                              worker_rpc_addrs=self.meta.worker_rpc_addrs)

    # ================================================================== prefill side
    async def add_request(self, spec: EngineRequestSpec) -> None:
        (self._offline if spec.offline else self._online).put_nowait(spec)
        self._queued.set()

    async def _dispatch_loop(self) -> None:
        """Online requests first; offline ones whenever no online one is queued."""
        while True:
            if self._online.empty() and self._offline.empty():
                self._queued.clear()
                await self._queued.wait()
                continue
            queue = self._online if not self._online.empty() else self._offline
            spec = queue.get_nowait()
            self._num_dispatching += 1  # until it is in _prefill (or failed)
            try:
                await self._dispatch_sem.acquire()
            except BaseException:
                self._num_dispatching -= 1
                raise
            self._spawn(self._dispatch_guarded(spec))

    async def _dispatch_guarded(self, spec: EngineRequestSpec) -> None:
        try:
            await self._dispatch(spec)
        except PDError as exc:
            logger.warning("request %s failed before prefill: %s", spec.request_id, exc.message)
            self._report_error(spec, exc.code, exc.message)
        except Exception as exc:
            logger.exception("dispatch of request %s failed", spec.request_id)
            self._report_error(spec, 500, f"dispatch failed: {exc}")
        finally:
            self._num_dispatching -= 1
            self._dispatch_sem.release()

    async def _decode_candidates(self, spec: EngineRequestSpec) -> AsyncIterator[str]:
        """The service's choice first; the master's list (one RPC) only if that fails."""
        if spec.decode_name:
            yield spec.decode_name
        try:
            others = await self.list_decodes()
        except Exception as exc:  # the master may be switching over
            logger.warning("could not list decode instances: %s", exc)
            others = []
        start = next(self._rr)
        rotated = others[start % len(others):] + others[: start % len(others)] if others else []
        for name in rotated:
            if name != spec.decode_name:
                yield name

    async def _dispatch(self, spec: EngineRequestSpec) -> None:
        last_error = "no decode instance is available"
        async with contextlib.aclosing(self._decode_candidates(spec)) as names:
            tried = 0
            async for name in names:
                last_error = await self._try_decode(spec, name)
                if last_error is None:
                    return
                tried += 1
                if tried == 3:
                    break
        raise PDError(503, last_error)

    async def _try_decode(self, spec: EngineRequestSpec, name: str) -> str | None:
        """Place the request on decode `name` and start its prefill; None when done, else
        why not (PDError for what another decode would not change)."""
        decode = await self.resolve_meta(name)
        if decode is None:
            return f"decode instance {name} is not registered"
        try:
            await self._link(decode)
        except PDError as exc:
            if exc.code == 412:  # incompatible: no point retrying this pair
                raise
            return exc.message
        resp = await self._add_on_decode(spec, decode)
        if resp is None:
            return f"decode instance {name} has no KV space"
        if resp.status_code == 500:
            raise PDError(400, resp.status_msg or "decode refused the request")
        state = _PrefillState(spec, decode, list(resp.blocks_ids), resp.num_cached_tokens)
        self._prefill[spec.request_id] = state
        self._submit_prefill(spec, state)
        return None

    async def _prelink_loop(self) -> None:
        while True:
            try:
                await self.prelink_once()
            except Exception:  # never stop linking for one bad round
                logger.exception("prelink round failed")
            await asyncio.sleep(PRELINK_INTERVAL_S)

    async def prelink_once(self) -> list[str]:
        """Prefill: link the decodes the master lists that are not linked yet (new, or a new
        incarnation), before a request needs them: the link (LinkInstance, the decode
        workers' LinkCluster: UCX endpoints, mapping this pool on the same host) otherwise
        lands on the first request's TTFT. Returns the names linked now."""
        try:
            names = await self.list_decodes()
        except Exception as exc:  # no master yet, or switching over: next round
            logger.debug("prelink: could not list decode instances: %s", exc)
            return []
        if names:  # (none listed: maybe no master right now; keep what is linked)
            for gone in set(self._linked) - set(names):  # left, or draining: relink if back
                del self._linked[gone]
        linked = []
        for name in names:
            try:
                meta = await self.resolve_meta(name)
            except Exception as exc:  # etcd down and never seen: next round
                logger.debug("prelink: no meta for %s: %s", name, exc)
                continue
            if meta is None or (name, meta.incarnation_id) in self._refused_links:
                continue
            known = self._linked.get(name)
            if known is not None and known.incarnation_id == meta.incarnation_id:
                continue
            try:
                await self._link(meta)
            except PDError as exc:
                if exc.code == 412:  # incompatible: say it once per incarnation
                    self._refused_links.add((name, meta.incarnation_id))
                    logger.warning("prelink: %s", exc.message)
                else:
                    logger.debug("prelink: %s", exc.message)
                continue
            linked.append(name)
            logger.info("linked decode %s ahead of requests", name)
        return linked

    async def _link(self, decode: InstanceMeta) -> None:
        linked = self._linked.get(decode.name)
        if linked is not None and linked.incarnation_id == decode.incarnation_id:
            return  # a restarted decode (same name, new incarnation) is linked afresh
        problems = self.meta.compatibility_problems(decode)
        if problems:
            raise PDError(412, f"decode {decode.name} is incompatible: " + "; ".join(problems))
        info = pb.InstanceClusterInfo(instance_name=self.meta.name,
                                      cluster_ids=self.meta.cluster_ids, addrs=self.meta.addrs,
                                      ports=self.meta.ports, dp_size=self.meta.dp_size,
                                      worker_rpc_addrs=self.meta.worker_rpc_addrs,
                                      meta=self.meta.to_proto())
        try:
            status = await self._pd_stub(decode.rpc_address).LinkInstance(
                info, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise PDError(412, exc.details()) from None
            raise PDError(503, f"cannot link decode {decode.name}: {exc.code().name}") from None
        if not status.ok:
            raise PDError(503, f"decode {decode.name} refused the link: {status.message}")
        self._linked[decode.name] = decode

    async def _add_on_decode(self, spec: EngineRequestSpec,
                             decode: InstanceMeta) -> pb.DisaggResponse | None:
        """AddNewRequests with bounded retries on 404; None when decode stays full."""
        msg = pb.DisaggRequests(prefill_name=self.meta.name, cluster_infos=self._cluster_info())
        msg.reqs.append(spec_to_proto(spec))
        backoff = self.retry.backoff_s
        for attempt in range(self.retry.attempts_per_decode):
            try:
                reply = await self._pd_stub(decode.rpc_address).AddNewRequests(
                    msg, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                logger.warning("AddNewRequests to %s failed: %s", decode.name, exc.code().name)
                self._linked.pop(decode.name, None)
                return None
            resp = reply.reqs[0] if reply.reqs else pb.DisaggResponse(status_code=500)
            if resp.status_code != 404:
                return resp
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.retry.max_backoff_s)
        return None

    def _submit_prefill(self, spec: EngineRequestSpec, state: _PrefillState) -> None:
        sink = self.reporter.sink(spec.source_xservice_addr, spec.service_request_id,
                                  spec.request_id)
        sink.finished_on_prefill = True
        state.sink = sink
        self.engine.submit(EngineRequest(spec.request_id, spec.prompt_token_ids, spec.params,
                                         sink, remote_decode=True))

    def _on_prefill_update(self, upd, delta, block_ids: list[int]) -> None:
        """Engine thread: a remote-decode request sampled its first token."""
        parent_id = upd.request_id.rpartition("#")[0]
        state = self._prefill.pop(parent_id, None)
        if state is None:  # cancelled while this step ran: its abort finds nothing now
            if upd.kv_held:
                self.engine.scheduler.finish_sending(upd.request_id)
            return
        finished_here = delta is not None and delta.finish_reason is not None
        first = (delta.token_ids[0] if delta and delta.token_ids else None)
        lp = delta.logprobs[0] if delta and delta.logprobs else None
        self.loop.call_soon_threadsafe(
            self._spawn, self._hand_over(state, upd.request_id, block_ids, first, lp,
                                         finished_here, upd.kv_held))

    async def _hand_over(self, state: _PrefillState, child: str, block_ids: list[int],
                         first_token: int | None, lp: TokenLogprob | None,
                         finished_here: bool, kv_held: bool) -> None:
        """Move the KV (PUSH) and tell decode to take over (or to drop its blocks)."""
        spec = state.spec
        decode = state.decode
        gen = pb.DisaggGenerationsRequest(
            req_id=spec.request_id, kv_cache_transfer_mode=self.config.transfer.mode.value,
            dp_size=self.meta.dp_size, prefill_name=self.meta.name,
            num_computed_tokens=len(spec.prompt_token_ids))
        error: PDError | None = None
        unreachable = ""  # decode, when FirstGeneration could not reach it
        t0 = time.monotonic()
        if finished_here or first_token is None:
            gen.failed, gen.status_msg = True, "finished on prefill"
        else:
            try:
                self._fill_handover(gen, state, block_ids, first_token, lp)
                if self.config.transfer.mode == KVTransferMode.PUSH:
                    await self._push(spec.request_id, decode, list(gen.block_ids),
                                     state.decode_blocks)
            except PDError as exc:  # decode must still hear of it to free its blocks
                error = exc
                gen.failed, gen.status_msg = True, exc.message
        try:
            reply = await self._pd_stub(decode.rpc_address).FirstGeneration(
                pb.DisaggGenerationsRequests(gens=[gen]),
                timeout=self.timeout_s + self.config.transfer.timeout_s)
            if error is None and not reply.ok and not gen.failed:
                error = PDError(502, f"decode could not take over: {reply.message}")
        except grpc.aio.AioRpcError as exc:
            logger.warning("FirstGeneration for %s to %s failed: %s", spec.request_id,
                           decode.name, exc.code().name)
            if error is None and not gen.failed:
                error = PDError(502, f"decode instance {decode.name} failed: {exc.code().name}")
            if error is not None and exc.code() in (grpc.StatusCode.UNAVAILABLE,
                                                    grpc.StatusCode.DEADLINE_EXCEEDED):
                unreachable = decode.name  # (PUSH: the push into it failed first)
        finally:
            if kv_held:
                self.engine.call(lambda: self.engine.scheduler.finish_sending(child))
        if error is not None:
            self.num_transfer_failures += 1
            self._report_error(spec, error.code, error.message, unreachable)
            return
        if not gen.failed:
            logger.info("PD prefill handed request %s to %s: %d blocks, %d bytes in %.1f ms (%s)",
                        spec.request_id, decode.name, len(gen.block_ids),
                        len(gen.block_ids) * self.engine.storage.block_bytes,
                        (time.monotonic() - t0) * 1000, gen.kv_cache_transfer_mode)

    def _fill_handover(self, gen: pb.DisaggGenerationsRequest, state: _PrefillState,
                       block_ids: list[int], first_token: int, lp: TokenLogprob | None) -> None:
        """First token (with logprobs) and where our KV is: the blocks decode lacks."""
        tok = gen.tokens.add(token_id=first_token)
        if lp is not None:
            tok.has_logprob = True
            tok.logprob = lp.logprob
            tok.top_tokens.extend(t for t, _ in lp.top)
            tok.top_logprobs.extend(v for _, v in lp.top)
        bs = self.config.cache.block_size
        first_block = state.num_cached_on_decode // bs
        num_prompt_blocks = -(-len(state.spec.prompt_token_ids) // bs)
        src = block_ids[first_block:num_prompt_blocks]
        if len(src) != len(state.decode_blocks):
            raise PDError(500, f"block count mismatch: prefill {len(src)}, "
                               f"decode {len(state.decode_blocks)}")
        gen.cluster_ids.extend(self.meta.cluster_ids)
        gen.addrs.extend(self.meta.addrs)
        gen.worker_rpc_addrs.extend(self.meta.worker_rpc_addrs)
        gen.block_ids.extend(src)

    def _maybe_inject_fault(self, op: str) -> None:
        rate = self.config.transfer.fault_rate
        if rate and random.random() < rate:
            raise PDError(502, f"KV {op} failed: injected fault (XLLM_KV_TRANSFER_FAULT_RATE)")

    async def _push(self, req_id: str, decode: InstanceMeta, src: list[int],
                    dst: list[int]) -> None:
        self._maybe_inject_fault("push")
        if not decode.addrs:
            raise PDError(502, f"decode {decode.name} publishes no transfer address")
        req = pb.PushKVCacheRequest(cluster_id=decode.cluster_ids[0] if decode.cluster_ids else 0,
                                    addr=decode.addrs[0], src_blocks=src, dst_blocks=dst,
                                    req_id=req_id)
        await self._worker_transfer("push", req)

    async def _worker_transfer(self, op: str, req) -> None:
        """PullKVCache / PushKVCache on our worker; any failure becomes PDError(502)."""
        stub = self._worker_stub()
        rpc = stub.PullKVCache if op == "pull" else stub.PushKVCache
        try:
            status = await rpc(req, timeout=self.config.transfer.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise PDError(502, f"KV {op} failed: {exc.details() or exc.code().name}") from None
        if not status.ok:
            raise PDError(502, f"KV {op} failed: {status.message}")

    def _report_error(self, spec: EngineRequestSpec, code: int, message: str,
                      unreachable_instance: str = "") -> None:
        if not spec.source_xservice_addr:
            return
        out = RequestOutput(request_id=spec.request_id, finished=True,
                            num_prompt_tokens=len(spec.prompt_token_ids),
                            error_code=code, error_message=message,
                            unreachable_instance=unreachable_instance)
        sink = self.reporter.sink(spec.source_xservice_addr, spec.service_request_id,
                                  spec.request_id)
        sink.emit(out)
        self.reporter.flush()

    # ================================================================== decode side
    async def link_instance(self, info: pb.InstanceClusterInfo) -> None:
        """Decode: a prefill links on first contact; its workers link to ours."""
        peer = InstanceMeta.from_proto(info.meta) if info.HasField("meta") else None
        if peer is not None:
            problems = self.meta.compatibility_problems(peer)
            if problems:
                raise PDError(412, f"prefill {peer.name} is incompatible: " + "; ".join(problems))
        link = pb.ClusterLink(cluster_ids=info.cluster_ids, addrs=info.addrs,
                              meta=info.meta if info.HasField("meta") else None)
        try:
            status = await self._worker_stub().LinkCluster(link, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise PDError(412, exc.details()) from None
            raise PDError(503, f"worker link failed: {exc.code().name}") from None
        if not status.ok:
            raise PDError(503, f"worker link failed: {status.message}")
        if peer is not None:
            self._linked[peer.name] = peer

    async def add_new_requests(self, msg: pb.DisaggRequests) -> pb.DisaggResponses:
        from xllm_py.rpc.convert import spec_from_proto

        replies = pb.DisaggResponses()
        for req in msg.reqs:
            try:
                spec = spec_from_proto(req)
            except ValueError as exc:
                replies.reqs.add(req_id=req.req_id, status_code=500, status_msg=str(exc))
                continue
            if spec.request_id in self._decode:
                replies.reqs.add(req_id=req.req_id, status_code=500,
                                 status_msg="duplicate request id")
                continue
            alloc = await asyncio.wrap_future(self.engine.call(
                lambda spec=spec: self._allocate_remote(spec)))
            if isinstance(alloc, str):
                replies.reqs.add(req_id=req.req_id, status_code=500, status_msg=alloc)
            elif alloc is None:
                replies.reqs.add(req_id=req.req_id, status_code=404,
                                 status_msg="no KV space on decode")
            else:
                self._decode[spec.request_id] = _DecodeState(
                    spec, msg.prefill_name, alloc.new_block_ids, alloc.num_cached_tokens)
                replies.reqs.add(req_id=req.req_id, status_code=200,
                                 blocks_ids=alloc.new_block_ids, dp_rank=0,
                                 num_cached_tokens=alloc.num_cached_tokens)
        return replies

    def _allocate_remote(self, spec: EngineRequestSpec, usage_prompt_tokens: int | None = None,
                         generated_offset: int = 0, num_unread: int | None = None):
        """Engine thread. RemoteAllocation, None (no space) or an error message."""
        engine = self.engine
        limit = min(engine.max_model_len, engine.scheduler.max_model_len)
        if len(spec.prompt_token_ids) + 1 > limit:
            return (f"prompt has {len(spec.prompt_token_ids)} tokens; decode can hold at most "
                    f"{limit} tokens per request")
        params = spec.params
        if not params.eos_token_ids:
            params = dataclasses.replace(params, eos_token_ids=list(engine.eos_token_ids))
        params = dataclasses.replace(params, n=1, best_of=None)
        request = Request(child_id(spec.request_id, 0), spec.prompt_token_ids, params)
        try:
            alloc = engine.scheduler.allocate_for_remote(request)
        except ValueError as exc:
            return str(exc)
        if alloc is None:
            return None
        sink = self.reporter.sink(spec.source_xservice_addr, spec.service_request_id,
                                  spec.request_id)
        engine.outputs.add_parent(
            spec.request_id, spec.prompt_token_ids, sink, n=1, best_of=1,
            stop=list(params.stop or []), include_stop_str=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            want_logprobs=params.logprobs is not None,
            num_prompt_tokens=usage_prompt_tokens, generated_offset=generated_offset,
            num_unread=num_unread)
        engine.outputs.set_cached_tokens(spec.request_id, alloc.num_cached_tokens)
        return alloc

    async def multi_generations(self, msg: pb.MultiGenerationsRequests) -> pb.Status:
        """Take over requests that already generated tokens elsewhere (migration; see
        xllm_py.engine.migration). With `kv` (where the KV of prompt + generated[:-1]
        lives) the blocks are pulled like a FirstGeneration; without it the KV is
        recomputed here, as on a MIX instance."""
        return await multi_generations(self.engine, self.reporter, msg.reqs,
                                       self._resume_with_kv, self.role.value)

    async def _resume_with_kv(self, item: pb.MultiGenerationsRequest, r: Resumption) -> str:
        """Allocate for prompt + generated[:-1] and pull their KV; "" or the problem."""
        k, unread = len(r.generated), r.num_unread
        ext = dataclasses.replace(r.spec, prompt_token_ids=r.spec.prompt_token_ids
                                  + r.generated[:-1], params=r.params)
        # generated[-1] comes as a first token, fed silently: what was unread before it
        # is one less (none if its text completed everything).
        alloc = await asyncio.wrap_future(self.engine.call(
            lambda: self._allocate_remote(ext, r.num_prompt_tokens, k - 1,
                                          None if unread is None else max(0, unread - 1))))
        if alloc is None or isinstance(alloc, str):
            return f"{r.spec.request_id}: {alloc or 'no KV space on decode'}"
        self._decode[r.spec.request_id] = _DecodeState(
            ext, item.kv.prefill_name or "migration source", alloc.new_block_ids,
            alloc.num_cached_tokens)
        gen = pb.DisaggGenerationsRequest()
        gen.CopyFrom(item.kv)
        gen.req_id = r.spec.request_id
        del gen.tokens[:]
        gen.tokens.add(token_id=r.generated[-1])
        return await self._take_over(gen)

    async def first_generation(self, msg: pb.DisaggGenerationsRequests) -> pb.Status:
        # The take-overs run in tasks of their own: a caller that gives up must not cut a
        # pull short (its blocks would be freed while the transfer writes into them).
        tasks = [self._spawn(self._take_over(g)) for g in msg.gens]
        try:
            results = await asyncio.shield(asyncio.gather(*tasks))
        except asyncio.CancelledError:
            for g in msg.gens:  # dropped once their pulls end; prefill reports the error
                if g.req_id in self._pulling:
                    self._gone.add(g.req_id)
            raise
        bad = [m for m in results if m]
        return pb.Status(ok=not bad, message="; ".join(bad))

    async def _take_over(self, gen: pb.DisaggGenerationsRequest) -> str:
        state = self._decode.pop(gen.req_id, None)
        if state is None:
            return f"unknown request {gen.req_id}"
        child = child_id(gen.req_id, 0)
        if gen.failed or state.cancelled_at is not None:
            await asyncio.wrap_future(self.engine.call(lambda: self._drop(gen.req_id, child)))
            return ""
        t0 = time.monotonic()
        self._pulling.add(gen.req_id)
        try:
            if gen.kv_cache_transfer_mode != KVTransferMode.PUSH.value:
                await self._pull(gen, state)
        except PDError as exc:
            self.num_transfer_failures += 1
            message = exc.message
            await asyncio.wrap_future(self.engine.call(
                lambda: self._fail(gen.req_id, child, message)))
            return message
        except BaseException:  # stopping: the blocks must not stay held
            self.engine.call(lambda: self._fail(gen.req_id, child, "decode instance stopped"))
            raise
        finally:
            self._pulling.discard(gen.req_id)
        if gen.req_id in self._gone:
            self._gone.discard(gen.req_id)
            await asyncio.wrap_future(self.engine.call(lambda: self._drop(gen.req_id, child)))
            return f"request {gen.req_id} was cancelled during its KV transfer"
        tokens = [t.token_id for t in gen.tokens]
        lps = [TokenLogprob(t.token_id, t.logprob, list(zip(t.top_tokens, t.top_logprobs)))
               if t.has_logprob else None for t in gen.tokens]
        await asyncio.wrap_future(self.engine.call(
            lambda: self._start_decoding(gen.req_id, child, tokens, lps)))
        logger.info("PD decode took over request %s from %s: %d blocks, %d bytes (%d cached "
                    "tokens) in %.1f ms (%s)", gen.req_id, state.prefill_name,
                    len(state.new_block_ids),
                    len(state.new_block_ids) * self.engine.storage.block_bytes,
                    state.num_cached_tokens, (time.monotonic() - t0) * 1000,
                    gen.kv_cache_transfer_mode or "PULL")
        return ""

    async def _pull(self, gen: pb.DisaggGenerationsRequest, state: _DecodeState) -> None:
        if len(gen.block_ids) != len(state.new_block_ids):
            raise PDError(500, f"prefill sent {len(gen.block_ids)} blocks, decode expects "
                               f"{len(state.new_block_ids)}")
        if not state.new_block_ids:
            return
        self._maybe_inject_fault("pull")
        if not gen.addrs:
            raise PDError(500, "FirstGeneration carries no transfer address")
        req = pb.PullKVCacheRequest(cluster_id=gen.cluster_ids[0] if gen.cluster_ids else 0,
                                    addr=gen.addrs[0], src_blocks=gen.block_ids,
                                    dst_blocks=state.new_block_ids, req_id=gen.req_id)
        await self._worker_transfer("pull", req)

    # engine-thread helpers
    def _drop(self, parent_id: str, child: str) -> None:
        self.engine.scheduler.abort_request(child)
        self.engine.outputs.drop_parent(parent_id)

    def _fail(self, parent_id: str, child: str, message: str) -> None:
        self.engine.scheduler.fail_remote_kvs(child, message)
        self.engine.outputs.fail_parent(parent_id, 502, message)

    def _start_decoding(self, parent_id: str, child: str, tokens: list[int], lps) -> None:
        engine = self.engine
        if engine.scheduler.get_request(child) is None:
            engine.outputs.drop_parent(parent_id)
            return
        upd = engine.scheduler.finish_remote_kvs(child, tokens)
        # The first token was reported by prefill: feed it to the detokenizer silently.
        delta = engine.outputs.process(child, tokens, lps, None, None,
                                       lambda rid, s: None)
        if upd is not None:  # the first token already ends the request
            engine.outputs.process(child, [], None, upd.finish_reason, upd.stop_reason,
                                   lambda rid, s: None)
            engine.outputs.drop_parent(parent_id)
        del delta

    async def _reap_orphans(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.reap_orphans(time.monotonic())

    def reap_orphans(self, now: float) -> list[str]:
        """Decode: free the requests whose FirstGeneration never came (cancelled ones
        after cancel_grace_s). Returns their ids."""
        stale = [rid for rid, st in self._decode.items()
                 if now - st.created > self.orphan_timeout_s or (
                     st.cancelled_at is not None and now - st.cancelled_at > self.cancel_grace_s)]
        for rid in stale:
            if self._decode.pop(rid).cancelled_at is not None:
                self.engine.call(lambda rid=rid: self._drop(rid, child_id(rid, 0)))
                continue
            logger.warning("request %s: no FirstGeneration within %.0fs; freeing its blocks",
                           rid, self.orphan_timeout_s)
            self.engine.call(lambda rid=rid: self._fail(
                rid, child_id(rid, 0), "prefill instance never handed the request over"))
        return stale

    def cancel(self, request_id: str) -> bool:
        """The service cancelled the request. True: its blocks are freed here once no
        transfer can touch them; False: the engine may abort it now."""
        state = self._prefill.pop(request_id, None)
        if state is not None:  # not handed over yet: decode drops the blocks it set aside
            self._spawn(self._tell_decode_to_drop(state))
            return False
        if request_id in self._pulling:
            self._gone.add(request_id)
            return True
        waiting = self._decode.get(request_id)
        if waiting is not None:  # a PUSH may be writing into its blocks right now
            if waiting.cancelled_at is None:
                waiting.cancelled_at = time.monotonic()
            return True
        return False

    async def _tell_decode_to_drop(self, state: _PrefillState) -> None:
        gen = pb.DisaggGenerationsRequest(req_id=state.spec.request_id, failed=True,
                                          status_msg="cancelled", prefill_name=self.meta.name)
        try:
            await self._pd_stub(state.decode.rpc_address).FirstGeneration(
                pb.DisaggGenerationsRequests(gens=[gen]), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:  # decode's reaper frees them in the end
            logger.info("could not tell %s to drop cancelled request %s: %s",
                        state.decode.name, state.spec.request_id, exc.code().name)

    def metrics_text(self) -> str:
        name, linked = "xllm_pd_transfer_failures_total", "xllm_pd_linked_instances"
        return (f"# HELP {name} PD hand-overs that failed (transfer, link or decode take-over)\n"
                f"# TYPE {name} counter\n{name} {self.num_transfer_failures}\n"
                f"# HELP {linked} Peer instances linked for KV transfer\n"
                f"# TYPE {linked} gauge\n{linked} {len(self._linked)}\n")

    def num_pending(self) -> int:
        """Prefill: requests not handed over yet (queued, finding a decode, prefilling)."""
        return (self._online.qsize() + self._offline.qsize() + self._num_dispatching
                + len(self._prefill))
