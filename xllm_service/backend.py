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

What each Generation does to its sub: relay.py (Relay). Moving a sub off an instance that
is gone or cannot serve it: migration.py (Relocator). Both are built here.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from typing import AsyncIterator

import grpc

from xllm_py.api.errors import InvalidRequestError, ServiceUnavailableError, TooManyRequestsError
from xllm_py.config import InstanceRole
from xllm_py.outputs import RequestOutput
from xllm_py.rpc import service as wire
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.sampling_params import SamplingParams
from xllm_py.utils.aio import wait_for
from xllm_service.config import RelayConfig
from xllm_service.elastic import DemandWindow
from xllm_service.engine_client import SEND_ERRORS, Engines
from xllm_service.instance_table import InstanceInfo
from xllm_service.metrics import ServiceMetrics
from xllm_service.migration import Relocator, new_engine_id
from xllm_service.relay import Relay
from xllm_service.router import NoInstanceError, Path, Route, Router
from xllm_service.sub_request import SubPhase, SubRequest, SubRequests

logger = logging.getLogger(__name__)

# Tokens a stream relays after its second output, at least, for its pace to correct the
# decode's TPOT prediction (SloPredictor.observe).
MIN_PACED_TOKENS = 8
# A latency target travels as an int32 of ms (DisaggRequest.ttft_slo / tpot_slo).
SLO_MAX_MS = 2**31 - 1


class ServiceBackend:
    def __init__(self, tokenizer, model_name: str, max_model_len: int, router: Router,
                 engines: Engines, my_rpc_addr: str, config: RelayConfig = RelayConfig(),
                 subs: SubRequests | None = None, metrics: ServiceMetrics | None = None,
                 demand: DemandWindow | None = None) -> None:
        """`demand`: told every request routed (elastic PD's decisions read it)."""
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
        self.demand = demand
        self._tasks: set[asyncio.Task] = set()  # Cancel and migration RPCs, until done
        self.relocator = Relocator(self.subs, router, engines, self.metrics.migrations,
                                   fail=self._fail, log_route=self._log_route, spawn=self._spawn)
        self.relay = Relay(self.subs, self.relocator,
                           lambda: router.schedulable(InstanceRole.DECODE), self._deliver)

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
        params = req.sampling
        if self.demand is not None:
            self.demand.add(len(getattr(req, "prompt_token_ids", None) or []),
                            (params.max_tokens or 16) * params.n)
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
        ttft_slo, tpot_slo = (math.ceil(min(float(SLO_MAX_MS), x))
                              for x in self.router.targets(req))
        while True:
            # A fresh id per attempt: a late copy of a failed attempt is unknown here, so
            # its first Generations gets ok=false and the engine drops it.
            engine_id = new_engine_id(req.request_id, offset)
            spec = EngineRequestSpec(
                request_id=engine_id, service_request_id=engine_id,
                prompt_token_ids=list(req.prompt_token_ids), params=params,
                stream=req.stream, x_request_id=req.x_request_id or "",
                source_xservice_addr=self.my_rpc_addr,
                prefill_name=route.target.name if route.is_pd else "",
                decode_name=route.decode.name if route.is_pd else "",
                ttft_slo_ms=ttft_slo, tpot_slo_ms=tpot_slo,
                offline=bool(getattr(req, "offline", False)))
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
        predicted = {s.index_offset: (0, 0) for s in subs}  # (accepted, rejected) guesses
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
            predicted[sub.index_offset] = (out.num_accepted_prediction_tokens,
                                           out.num_rejected_prediction_tokens)
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
                num_accepted_prediction_tokens=sum(a for a, _ in predicted.values()),
                num_rejected_prediction_tokens=sum(r for _, r in predicted.values()),
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
        return wire.generations_reply([self.relay.on_generation(batch.instance_name, g)
                                       for g in batch.gens])

    def on_evict(self, info: InstanceInfo) -> None:
        """An instance left the cluster (registry): the subs that depend on it move or fail
        (Relocator.on_evict)."""
        self.relocator.on_evict(info)

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
            if sub.first_s is None:
                sub.first_s = now
            elif sub.paced_s is None:
                sub.paced_s, sub.paced_tokens = now, sub.num_tokens + n
            sub.last_s, sub.num_tokens = now, sub.num_tokens + n
        if out.finished and sub.first_s is not None and not out.failed:
            # (a short stream tells no pace, its TTFT still corrects: its few tokens may
            # come in one or two reports, a step apart or together)
            paced = sub.num_tokens - sub.paced_tokens
            tpot = ((sub.last_s - sub.paced_s) * 1000 / paced
                    if sub.paced_s is not None and paced >= MIN_PACED_TOKENS else None)
            self.router.observe(sub.route, (sub.first_s - sub.sent_s) * 1000, tpot)

    def _fail(self, sub: SubRequest, message: str) -> None:
        self._deliver(sub, RequestOutput(request_id=sub.engine_request_id, finished=True,
                                         error_code=503, error_message=message))

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
