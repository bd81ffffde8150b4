"""ServiceBackend: the master's GenerateBackend. Routes a request to an engine over gRPC
and relays the engine's `Generations` back to the HTTP client, in order.

Stages of one client request:
  route (MIX instance, a (prefill, decode) pair, or a decode that prefills the prompt
  itself: the DECODE path of conditional disaggregation, pd_decision.py; counted in
  xllm_service_pd_decisions_total{path} and logged with why; n > 1 on a decode is split
  into n single-sequence sub-requests with seed + i) -> Generate RPC to the engine (retried on
  another instance when the RPC itself fails) -> Generations arrive (first token from
  prefill, the rest from decode; decode outputs wait until prefill's first one is in) ->
  merged RequestOutputs to the client -> finished, migrated (below), failed (engine
  error, instance evicted: on a PD pair the prefill only until decode's first output is
  relayed, idle timeout) or cancelled (client gone: the next Generations reply says
  ok=false for it and the engine frees its blocks). The phases of one engine request
  (a sub-request) are in sub_request.py; SubRequests keeps the book of them.

Migration off an evicted decode or MIX instance. A PD sub-request is single-sequence,
and so is a MIX request with n == 1 and best_of <= 1: the service knows its generated
token ids, the ones it relayed to the client (`SubRequest.generated`). Once one is relayed
(PD: prefill's first token; decode took the sub over, or is still pulling its KV:
recomputing does not need that KV), the eviction of the instance generating it (its
decode, or its MIX instance) does not fail it:
  1. pick another instance of that kind through `Router.route_decode` (PD and
     DECODE-path subs) or `Router.route_mix` (the dead one excluded);
  2. re-key the sub under a fresh engine request id (`SubRequests.rekey`) and point
     its route at the new instance, so Cancel goes there, and an instance that lost its
     lease but still runs gets ok=false for its late outputs under the old id and
     aborts: no token reaches the client twice, none is lost (outputs dropped that way
     were never relayed, so they are not in `generated` and the new instance makes them);
     a PD sub no longer depends on its prefill (a late failure from it, under the old id,
     is ignored the same way);
  3. MultiGenerations(original spec under the new id, generated ids, no KV) to it, with
     the RPC deadline: it recomputes the KV of prompt + generated and resumes after the
     last generated token; max_tokens/min_tokens are counted there from the k generated
     tokens, usage includes them, and text continues with prompt + generated as
     detokenizer context, starting with the text of the generated tokens the client has
     not got yet (`num_unread_tokens`: those after the last output with text; the dead
     instance held them back, an incomplete character). prompt_logprobs and echo are
     dropped: the client already got them with the first output.
The client's stream pauses (lease TTL + eviction grace + recompute) and continues; a
greedy request ends with the tokens an uninterrupted run gives (a seeded sampled one
continues, but its random stream restarts). When no other instance of the kind is
registered, the sub had already generated max_tokens (its last output was lost), or
MultiGenerations fails or refuses, the request fails with a 503 that says why. Outcomes
are counted in `xllm_service_migrations_total{outcome="ok"|"failed"}` ("ok": the new
instance accepted it). A sub re-keyed again (its new instance evicted during the RPC)
ignores the stale RPC's answer. Still failed with a 503: a MIX request with n > 1 or
best_of > 1 (the message says why: its sequences are interleaved in one engine request,
and only one sequence's tokens can be handed over), and requests with no token relayed
yet (PD: prefill's first token).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator

import grpc

from xllm_py.api.errors import InvalidRequestError, ServiceUnavailableError, TooManyRequestsError
from xllm_py.config import InstanceRole, RelayConfig
from xllm_py.outputs import RequestOutput
from xllm_py.rpc import service as wire
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.sampling_params import SamplingParams
from xllm_py.utils.aio import wait_for
from xllm_service.engine_client import SEND_ERRORS, Engines
from xllm_service.instance_table import InstanceInfo
from xllm_service.metrics import ServiceMetrics
from xllm_service.router import NoInstanceError, Path, Route, Router
from xllm_service.sub_request import SubPhase, SubRequest, SubRequests

logger = logging.getLogger(__name__)


def _engine_id(request_id: str, offset: int) -> str:
    return f"{request_id}-{offset}-{uuid.uuid4().hex[:8]}"


class ServiceBackend:
    def __init__(self, tokenizer, model_name: str, max_model_len: int, router: Router,
                 engines: Engines, my_rpc_addr: str, config: RelayConfig = RelayConfig(),
                 subs: SubRequests | None = None, metrics: ServiceMetrics | None = None) -> None:
        self._tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.router = router
        self.engines = engines
        self.my_rpc_addr = my_rpc_addr
        self.config = config
        self.subs = subs if subs is not None else SubRequests()
        self.metrics = metrics or ServiceMetrics(self.subs.inflight_by_instance)
        self.metrics_registry = self.metrics.registry  # the process's one (GenerateBackend)
        self._tasks: set[asyncio.Task] = set()  # Cancel and migration RPCs, until done

    # ------------------------------------------------------------------ GenerateBackend
    def tokenizer(self):
        return self._tokenizer

    def check_live(self) -> tuple[bool, str]:
        """/health: the process serves HTTP (with or without engines)."""
        return True, "ok"

    def check_ready(self) -> tuple[bool, str]:
        reason = self.router.unavailable_reason()
        return (False, reason) if reason else (True, "ok")

    def inflight(self, name: str) -> int:
        return self.subs.inflight(name)

    def metrics_text(self) -> str:
        return self.metrics.render()

    async def generate(self, req) -> AsyncIterator[RequestOutput]:
        try:
            route = self.router.route(req)
        except NoInstanceError as exc:
            raise ServiceUnavailableError(str(exc)) from None
        params = SamplingParams.from_request(req)
        split = route.on_decode_role  # generated on a decode: single-sequence subs
        if split and (params.n > 1 or (params.best_of or 0) > params.n):
            if (params.best_of or 0) > params.n:
                raise InvalidRequestError("best_of > n is not supported on prefill/decode "
                                          "instances", param="best_of")
            parts = [(i, dataclasses.replace(
                params, n=1, best_of=None, seed=None if params.seed is None else params.seed + i))
                for i in range(params.n)]
        else:
            parts = [(0, params)]
        queue: asyncio.Queue = asyncio.Queue()
        subs: list[SubRequest] = []
        try:
            for offset, p in parts:
                sub_route = route if offset == 0 else self._route_or(route, req)
                sub = await self._start(req, p, offset, sub_route, queue)
                subs.append(sub)
            async for out in self._merge(req.request_id, subs, queue):
                yield out
        finally:
            for sub in subs:
                self._forget(sub, cancel=not sub.finished)

    def _route_or(self, fallback: Route, req) -> Route:
        try:
            return self.router.route(req)
        except NoInstanceError:
            return fallback

    async def _start(self, req, params: SamplingParams, offset: int, route: Route,
                     queue: asyncio.Queue) -> SubRequest:
        tried: list[str] = []
        num_full = 0  # instances that answered RESOURCE_EXHAUSTED (their queue is full)
        while True:
            # A fresh id per attempt: a late copy of a failed attempt is unknown here, so
            # its first Generations gets ok=false and the engine drops it.
            engine_id = _engine_id(req.request_id, offset)
            spec = EngineRequestSpec(
                request_id=engine_id, service_request_id=engine_id,
                prompt_token_ids=list(req.prompt_token_ids), params=params,
                stream=req.stream, x_request_id=req.x_request_id or "",
                source_xservice_addr=self.my_rpc_addr,
                prefill_name=route.target.name if route.is_pd else "",
                decode_name=route.decode.name if route.is_pd else "")
            sub = SubRequest(engine_id, offset, route, queue, spec, request_id=req.request_id)
            self.subs.add(sub)
            self._log_route(engine_id, route, len(spec.prompt_token_ids))
            sub.sent_s = time.monotonic()
            try:
                status = await self.engines.generate(route.target.meta.rpc_address, spec)
            except SEND_ERRORS as exc:
                self._forget(sub, cancel=True)
                logger.warning("Generate on %s failed (%s); trying another instance",
                               route.target.name, type(exc).__name__)
                tried.append(route.target.name)
                if (isinstance(exc, grpc.aio.AioRpcError)
                        and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED):
                    num_full += 1
                try:
                    route = self.router.route(req, exclude=tried)
                except NoInstanceError:
                    if num_full == len(tried):
                        raise TooManyRequestsError(
                            "every instance is full; retry later") from None
                    raise ServiceUnavailableError(
                        f"no instance could take the request (tried {', '.join(tried)})") from None
                continue
            if status.ok:
                return sub
            self._forget(sub, cancel=False)
            if status.code == 429:  # RESOURCE_EXHAUSTED over GenerateStream: its queue is full
                tried.append(route.target.name)
                num_full += 1
                try:
                    route = self.router.route(req, exclude=tried)
                except NoInstanceError:
                    raise TooManyRequestsError("every instance is full; retry later") from None
                continue
            if status.code == 400:
                raise InvalidRequestError(status.message or "invalid request")
            raise ServiceUnavailableError(f"instance {route.target.name} refused the request: "
                                          f"{status.message}")

    def _log_route(self, engine_id: str, route: Route, num_prompt_tokens: int) -> None:
        """The request log line: where it went and why; PD decisions are counted."""
        if route.path is not Path.MIX:
            self.metrics.pd_decisions[route.path.value] += 1
        logger.info("request %s: %d prompt tokens, path %s on %s%s", engine_id,
                    num_prompt_tokens, route.path.value, "/".join(route.instance_names),
                    f" ({route.reason})" if route.reason else "")

    async def _merge(self, request_id: str, subs: list[SubRequest],
                     queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Merge the sub-requests' outputs into one stream with global choice indices."""
        remaining = len(subs)
        generated = {s.index_offset: 0 for s in subs}  # engine ids change on migration
        prompt_sent = prompt_logprobs_sent = False
        idle_timeout_s = self.config.idle_timeout_s
        while remaining:
            try:
                sub, out = await wait_for(queue.get(), idle_timeout_s)
            except asyncio.TimeoutError:
                self._count_outcome(subs, "timeout")
                yield RequestOutput(request_id=request_id, finished=True, error_code=504,
                                    error_message=f"no output from the engine for "
                                                  f"{idle_timeout_s:.0f}s")
                return
            if out.failed:
                self._count_outcome(subs, "error")
                yield RequestOutput(request_id=request_id, finished=True,
                                    num_prompt_tokens=out.num_prompt_tokens,
                                    error_code=out.error_code, error_message=out.error_message)
                return
            generated[sub.index_offset] = out.num_generated_tokens
            if out.finished:
                remaining -= 1
                if remaining == 0:
                    self._count_outcome(subs, "ok")
            merged = RequestOutput(
                request_id=request_id,
                outputs=[dataclasses.replace(d, index=d.index + sub.index_offset)
                         for d in out.outputs],
                finished=remaining == 0, num_prompt_tokens=out.num_prompt_tokens,
                num_generated_tokens=sum(generated.values()),
                num_cached_tokens=out.num_cached_tokens,
                prompt_token_ids=None if prompt_sent else out.prompt_token_ids,
                prompt_logprobs=None if prompt_logprobs_sent else out.prompt_logprobs)
            if out.prompt_token_ids is not None:
                prompt_sent = True
            if out.prompt_logprobs is not None:  # each sub of a split n has them: once
                prompt_logprobs_sent = True
            yield merged

    def _count_outcome(self, subs: list[SubRequest], outcome: str) -> None:
        self.metrics.count_outcome({n for sub in subs for n in sub.route.instance_names},
                                   outcome)

    # ------------------------------------------------------------------ Generations
    async def on_generations(self, msg) -> object:
        """XllmRpcService.Generations: relay each output to its client; the reply says
        ok=false for the ones no client waits for (the engine aborts them)."""
        batch = wire.generations_from_proto(msg)
        return wire.generations_reply([self._on_generation(batch.instance_name, g)
                                       for g in batch.gens])

    def _on_generation(self, instance_name: str, gen: wire.Generation) -> bool:
        sub = self.subs.get(gen.service_request_id)
        if sub is None or sub.phase is SubPhase.CANCELLED:
            return False
        out = gen.output
        if (sub.route.is_pd and instance_name and not gen.on_prefill
                and instance_name != sub.route.decode.name):
            self._follow_decode(sub, instance_name)
        if out.failed and self._resumable(sub, out):
            self._migrate(sub, out.unreachable_instance, why=(
                f"decode instance {out.unreachable_instance} could not be reached "
                f"({out.error_message})"))
        elif out.failed:
            self._deliver(sub, out)
        elif not sub.route.is_pd:
            self._advance(sub, SubPhase.STREAMING)
            self._deliver(sub, out)
        elif gen.on_prefill:
            held, sub.held = sub.held, []
            self._advance(sub, SubPhase.STREAMING if held else SubPhase.FIRST_RELAYED)
            self._deliver(sub, out)
            for h in held:
                self._deliver(sub, h)
            if held:
                self._release_prefill(sub)
        elif sub.phase in (SubPhase.FIRST_RELAYED, SubPhase.STREAMING):
            self._advance(sub, SubPhase.STREAMING)
            self._deliver(sub, out)
            self._release_prefill(sub)
        else:
            self._advance(sub, SubPhase.HOLDING)
            sub.held.append(out)
        return True

    @staticmethod
    def _advance(sub: SubRequest, phase: SubPhase) -> None:
        """On to `phase`, unless the sub is there or past it already."""
        if sub.phase < phase and not sub.phase.is_done:
            sub.transition(phase)

    def _follow_decode(self, sub: SubRequest, name: str) -> None:
        """The prefill handed the sub to another decode than the one chosen here (that one
        was full, or unreachable): from now on eviction, Cancel and the counts go to the
        decode that runs it."""
        info = next((i for i in self.router.schedulable(InstanceRole.DECODE)
                     if i.name == name), None)
        if info is None:
            logger.warning("request %s is on decode %s, which is not registered",
                           sub.engine_request_id, name)
            return
        old = sub.route.decode.name
        self.subs.move(sub, info)
        logger.info("request %s: prefill handed it to decode %s instead of %s",
                    sub.engine_request_id, name, old)

    def _resumable(self, sub: SubRequest, out: RequestOutput) -> bool:
        """A PD sub whose prefill could not reach its decode to hand it over (the decode
        died, or hangs) after its first token was relayed, and before any decode output:
        it moves to another decode like one whose decode was evicted, rather than
        failing. (After a decode output the decode has it: its eviction decides.)"""
        return (sub.route.is_pd and out.unreachable_instance == sub.route.decode.name
                and len(sub.generated) == 1 and not sub.held and sub.spec is not None
                and sub.single_sequence and not sub.phase.is_done)

    def _release_prefill(self, sub: SubRequest) -> None:
        """PD: the request no longer depends on its prefill instance, so that instance's
        eviction must not fail it. Called once the service holds both prefill's first
        token and a decode output: a decode output means decode has the KV and is
        generating. A decode output alone (held, prefill's token not in yet) is not enough:
        the first token can only come from prefill, so if prefill dies the request must
        fail now rather than wait for the idle timeout. `inflight(prefill)` stops counting
        it; `sub.route` keeps both names, so Cancel and the outcome counters still go to
        both instances."""
        prefill, decode = sub.route.target.name, sub.route.decode.name
        if prefill != decode:
            self.subs.release(sub, prefill)

    def _deliver(self, sub: SubRequest, out: RequestOutput) -> None:
        if sub.phase.is_done:
            return
        if out.finished:
            sub.transition(SubPhase.FINISHED)
        self._measure(sub, out)
        if sub.single_sequence and out.outputs:
            sub.generated.extend(out.outputs[0].token_ids)
            if out.outputs[0].text:  # the engine emits text only up to a whole character
                sub.num_read = len(sub.generated)
        sub.queue.put_nowait((sub, out))

    def _measure(self, sub: SubRequest, out: RequestOutput) -> None:
        """TTFT and TPOT as the service sees them, for SLO_AWARE's correction."""
        n = sum(len(o.token_ids) for o in out.outputs)
        if n:
            now = time.monotonic()
            sub.first_s = sub.first_s or now
            sub.last_s, sub.num_tokens = now, sub.num_tokens + n
        if out.finished and sub.first_s is not None and not out.failed:
            tpot = ((sub.last_s - sub.first_s) * 1000 / (sub.num_tokens - 1)
                    if sub.num_tokens > 1 else None)
            self.router.observe(sub.route, (sub.first_s - sub.sent_s) * 1000, tpot)

    def on_evict(self, info: InstanceInfo) -> None:
        """An instance is gone: the requests that still depend on it (see
        `_release_prefill`) move to another instance of its kind if it was generating them
        (their decode, or their MIX instance), they are single-sequence and a token was
        relayed (see the module docstring), else end with an error now."""
        for sub in self.subs.pop_instance(info.name):
            if sub.phase.is_done:
                continue
            why = f"instance {info.name} left the cluster while serving the request"
            if sub.serving == info.name and sub.generated and sub.spec is not None:
                self._migrate(sub, info.name)
                continue
            if sub.serving == info.name and sub.spec is not None and not sub.single_sequence:
                p = sub.spec.params
                why += (f"; it cannot be migrated: only a single-sequence request can resume "
                        f"elsewhere, and it asked for n={p.n}, best_of={p.best_of or p.n}")
            logger.warning("instance %s evicted: failing request %s", info.name,
                           sub.engine_request_id)
            self._fail(sub, why)

    def _fail(self, sub: SubRequest, message: str) -> None:
        self._deliver(sub, RequestOutput(request_id=sub.engine_request_id, finished=True,
                                         error_code=503, error_message=message))

    def _migrate(self, sub: SubRequest, dead: str, why: str = "") -> None:
        """Re-key `sub` and hand it to another instance of the dead one's kind (DECODE for
        a PD sub, MIX for a MIX one) with MultiGenerations (async)."""
        spec, k = sub.spec, len(sub.generated)
        why = why or f"instance {dead} left the cluster while serving the request"
        target, reason = None, ""
        if spec.params.max_tokens is not None and k >= spec.params.max_tokens:
            reason = "it had generated max_tokens but its last output was lost"
        else:
            pick = (self.router.route_decode if sub.route.on_decode_role
                    else self.router.route_mix)
            try:
                target = pick(spec, exclude=[dead])
            except NoInstanceError as exc:
                reason = str(exc)
        if target is None:
            logger.warning("instance %s lost: cannot migrate request %s (%s)", dead,
                           sub.engine_request_id, reason)
            self.metrics.migrations["failed"] += 1
            self._fail(sub, f"{why}; could not migrate it: {reason}")
            return
        old_id, new_id = sub.engine_request_id, _engine_id(sub.request_id, sub.index_offset)
        if sub.route.is_pd:
            route = Route(sub.route.target, target)
        else:  # a DECODE-path sub migrates to another decode, a MIX one to a MIX
            route = Route(target, on_decode=sub.route.on_decode)
        self.subs.rekey(sub, new_id, route)
        self._advance(sub, SubPhase.STREAMING)  # no longer waits for its prefill
        logger.warning("instance %s lost: migrating request %s (%d tokens generated) to %s "
                       "as %s", dead, old_id, k, target.name, new_id)
        params = dataclasses.replace(spec.params, prompt_logprobs=None, echo=False)
        resumed = dataclasses.replace(spec, request_id=new_id, service_request_id=new_id,
                                      params=params,
                                      decode_name=target.name if route.is_pd else "")
        self._spawn(self._send_migration(sub, resumed, k - sub.num_read, target, why))

    async def _send_migration(self, sub: SubRequest, spec: EngineRequestSpec, num_unread: int,
                              target: InstanceInfo, why: str) -> None:
        new_id, t0 = spec.service_request_id, time.monotonic()
        try:
            status = await self.engines.migrate(target.meta.rpc_address, spec,
                                                list(sub.generated), num_unread)
            error = "" if status.ok else status.message or "refused"
        except grpc.aio.AioRpcError as exc:
            error = f"{exc.code().name}: {exc.details()}"
        except Exception as exc:  # the client must hear of it, not wait out the idle timeout
            logger.exception("MultiGenerations of %s on %s failed", new_id, target.name)
            error = repr(exc)
        self.metrics.migrations["failed" if error else "ok"] += 1
        if error:
            logger.warning("MultiGenerations of %s on %s failed after %.2fs: %s", new_id,
                           target.name, time.monotonic() - t0, error)
        else:
            logger.info("request %s migrated to %s in %.2fs", new_id, target.name,
                        time.monotonic() - t0)
        if error and sub.engine_request_id == new_id:  # else re-keyed again or forgotten
            self._fail(sub, f"{why}; migrating it to {target.name} failed: {error}")

    def _forget(self, sub: SubRequest, cancel: bool) -> None:
        if cancel and not sub.phase.is_done:
            sub.transition(SubPhase.CANCELLED)
            self._spawn(self._cancel(sub, "the client went away"))
        self.subs.forget(sub)

    async def _cancel(self, sub: SubRequest, reason: str) -> None:
        for info in (sub.route.target, sub.route.decode):
            if info is not None:
                await self.engines.cancel(info.meta.rpc_address, sub.engine_request_id,
                                          sub.request_id, reason)

    def _spawn(self, coro) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        await self.engines.close()
