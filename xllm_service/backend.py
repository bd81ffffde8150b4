"""ServiceBackend: the master's GenerateBackend. Routes a request to an engine over gRPC
and relays the engine's `Generations` back to the HTTP client, in order.

Stages of one client request:
  route (MIX instance, or a (prefill, decode) pair; n > 1 on a PD pair is split into n
  single-sequence sub-requests with seed + i) -> Generate RPC to the engine (retried on
  another instance when the RPC itself fails) -> Generations arrive (first token from
  prefill, the rest from decode; decode outputs wait until prefill's first one is in) ->
  merged RequestOutputs to the client -> finished, failed (engine error, instance
  evicted: on a PD pair the prefill only until decode's first output is relayed, idle
  timeout) or cancelled (client gone: the next Generations reply says ok=false for it
  and the engine frees its blocks).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import uuid
from typing import AsyncIterator

import grpc

from xllm_py.api.errors import InvalidRequestError, ServiceUnavailableError
from xllm_py.engine.async_engine import sampling_params_from
from xllm_py.outputs import RequestOutput
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.rpc.convert import EngineRequestSpec, output_from_proto, spec_to_proto
from xllm_py.utils.aio import wait_for
from xllm_py.utils.grpc_channels import ChannelPool, PipelinedStream, StreamBroken
from xllm_service.instance_table import InstanceInfo
from xllm_service.router import NoInstanceError, Route, Router

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Sub:
    """One engine request of a client request."""
    engine_request_id: str
    index_offset: int  # its sequence indices are shifted by this (PD n-split)
    route: Route
    queue: asyncio.Queue
    first_seen: bool = False  # PD: prefill's first output arrived
    held: list = dataclasses.field(default_factory=list)  # decode outputs before that
    finished: bool = False
    cancelled: bool = False


class ServiceBackend:
    def __init__(self, tokenizer, model_name: str, max_model_len: int, router: Router,
                 my_rpc_addr: str, rpc_timeout_s: float = 5.0, idle_timeout_s: float = 120.0,
                 instance_counts=None) -> None:
        self._tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.router = router
        self.my_rpc_addr = my_rpc_addr
        self.rpc_timeout_s = rpc_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.instance_counts = instance_counts  # () -> {state: count}
        self._subs: dict[str, _Sub] = {}
        self._by_instance: dict[str, set[str]] = collections.defaultdict(set)
        self._channels = ChannelPool()
        self._gen_streams: dict[str, PipelinedStream] = {}
        self._cancels: set[asyncio.Task] = set()  # referenced until done
        self.outcomes: collections.Counter = collections.Counter()
        # (instance, outcome) -> requests; an instance counts every request it served
        self.instance_outcomes: collections.Counter = collections.Counter()

    # ------------------------------------------------------------------ GenerateBackend
    def tokenizer(self):
        return self._tokenizer

    def check_ready(self) -> tuple[bool, str]:
        reason = self.router.unavailable_reason()
        return (False, reason) if reason else (True, "ok")

    def inflight(self, name: str) -> int:
        return len(self._by_instance.get(name, ()))

    async def generate(self, req) -> AsyncIterator[RequestOutput]:
        try:
            route = self.router.route(req)
        except NoInstanceError as exc:
            raise ServiceUnavailableError(str(exc)) from None
        params = sampling_params_from(req)
        if route.is_pd and params.n > 1 or route.is_pd and (params.best_of or 0) > params.n:
            if (params.best_of or 0) > params.n:
                raise InvalidRequestError("best_of > n is not supported on prefill/decode pairs",
                                          param="best_of")
            parts = [(i, dataclasses.replace(
                params, n=1, best_of=None, seed=None if params.seed is None else params.seed + i))
                for i in range(params.n)]
        else:
            parts = [(0, params)]
        queue: asyncio.Queue = asyncio.Queue()
        subs: list[_Sub] = []
        try:
            for offset, p in parts:
                sub_route = route if offset == 0 else self._route_or(route, req)
                sub = await self._start(req, p, offset, sub_route, queue)
                subs.append(sub)
            async for out in self._merge(req.request_id, subs, queue):
                yield out
        finally:
            for sub in subs:
                self._forget(sub, cancelled=not sub.finished)

    def _route_or(self, fallback: Route, req) -> Route:
        try:
            return self.router.route(req)
        except NoInstanceError:
            return fallback

    async def _start(self, req, params, offset: int, route: Route, queue) -> _Sub:
        tried: list[str] = []
        while True:
            # A fresh id per attempt: a late copy of a failed attempt is unknown here, so
            # its first Generations gets ok=false and the engine drops it.
            engine_id = f"{req.request_id}-{offset}-{uuid.uuid4().hex[:8]}"
            sub = _Sub(engine_id, offset, route, queue)
            self._subs[engine_id] = sub
            for name in route.instance_names:
                self._by_instance[name].add(engine_id)
            spec = EngineRequestSpec(
                request_id=engine_id, service_request_id=engine_id,
                prompt_token_ids=list(req.prompt_token_ids), params=params,
                stream=req.stream, x_request_id=req.x_request_id or "",
                source_xservice_addr=self.my_rpc_addr,
                prefill_name=route.target.name if route.is_pd else "",
                decode_name=route.decode.name if route.is_pd else "")
            try:
                status = await self._send_generate(route.target.meta.rpc_address,
                                                   spec_to_proto(spec))
            except (grpc.aio.AioRpcError, StreamBroken, asyncio.TimeoutError) as exc:
                self._forget(sub, cancelled=True)
                logger.warning("Generate on %s failed (%s); trying another instance",
                               route.target.name, type(exc).__name__)
                tried.append(route.target.name)
                try:
                    route = self.router.route(req, exclude=tried)
                except NoInstanceError:
                    raise ServiceUnavailableError(
                        f"no instance could take the request (tried {', '.join(tried)})") from None
                continue
            if status.ok:
                return sub
            self._forget(sub, cancelled=False)
            if status.code == 400:
                raise InvalidRequestError(status.message or "invalid request")
            raise ServiceUnavailableError(f"instance {route.target.name} refused the request: "
                                          f"{status.message}")

    async def _send_generate(self, addr: str, msg: pb.DisaggRequest) -> pb.Status:
        """Generate over the engine's long-lived GenerateStream (unary if it broke before
        the message went out)."""
        stream = self._gen_streams.get(addr)
        if stream is None:
            stub = pb_grpc.DisaggPDServiceStub(self._channels.get(addr))
            stream = PipelinedStream(lambda: stub.GenerateStream())
            self._gen_streams[addr] = stream
        try:
            return await stream.request(msg, self.rpc_timeout_s)
        except StreamBroken as exc:
            if exc.maybe_delivered:
                raise
        try:
            return await self._stub(addr).Generate(msg, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                return pb.Status(ok=False, code=400, message=exc.details() or "invalid request")
            raise

    async def _merge(self, request_id: str, subs: list[_Sub],
                     queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Merge the sub-requests' outputs into one stream with global choice indices."""
        remaining = len(subs)
        generated = {s.engine_request_id: 0 for s in subs}
        prompt_sent = False
        while remaining:
            try:
                sub, out = await wait_for(queue.get(), self.idle_timeout_s)
            except asyncio.TimeoutError:
                self._count_outcome(subs, "timeout")
                yield RequestOutput(request_id=request_id, finished=True, error_code=504,
                                    error_message=f"no output from the engine for "
                                                  f"{self.idle_timeout_s:.0f}s")
                return
            if out.failed:
                self._count_outcome(subs, "error")
                yield RequestOutput(request_id=request_id, finished=True,
                                    num_prompt_tokens=out.num_prompt_tokens,
                                    error_code=out.error_code, error_message=out.error_message)
                return
            generated[sub.engine_request_id] = out.num_generated_tokens
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
                prompt_token_ids=None if prompt_sent else out.prompt_token_ids)
            if out.prompt_token_ids is not None:
                prompt_sent = True
            yield merged

    def _count_outcome(self, subs: list[_Sub], outcome: str) -> None:
        self.outcomes[outcome] += 1
        for name in {n for sub in subs for n in sub.route.instance_names}:
            self.instance_outcomes[(name, outcome)] += 1

    # ------------------------------------------------------------------ Generations
    async def on_generations(self, msg: pb.DisaggStreamGenerations) -> pb.StatusSet:
        reply = pb.StatusSet()
        for gen in msg.gens:
            sub = self._subs.get(gen.service_req_id)
            if sub is None or sub.cancelled:
                reply.all_status.add(ok=False, message="unknown or cancelled request")
                continue
            reply.all_status.add(ok=True)
            out = output_from_proto(gen)
            if out.failed or not sub.route.is_pd:
                self._deliver(sub, out)
            elif gen.finished_on_prefill_instance:
                sub.first_seen = True
                self._deliver(sub, out)
                for held in sub.held:
                    self._deliver(sub, held)
                if sub.held:
                    self._release_prefill(sub)
                sub.held.clear()
            elif sub.first_seen:
                self._deliver(sub, out)
                self._release_prefill(sub)
            else:
                sub.held.append(out)
        return reply

    def _release_prefill(self, sub: _Sub) -> None:
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
            self._by_instance.get(prefill, set()).discard(sub.engine_request_id)

    def _deliver(self, sub: _Sub, out: RequestOutput) -> None:
        if sub.finished:
            return
        if out.finished:
            sub.finished = True
        sub.queue.put_nowait((sub, out))

    def on_evict(self, info: InstanceInfo) -> None:
        """An instance is gone: the requests that still depend on it (`_by_instance`, see
        `_release_prefill`) end with an error now."""
        for engine_id in list(self._by_instance.pop(info.name, ())):
            sub = self._subs.get(engine_id)
            if sub is None or sub.finished:
                continue
            logger.warning("instance %s evicted: failing request %s", info.name, engine_id)
            self._deliver(sub, RequestOutput(
                request_id=engine_id, finished=True, error_code=503,
                error_message=f"instance {info.name} left the cluster while serving the request"))

    def _forget(self, sub: _Sub, cancelled: bool) -> None:
        if cancelled:
            sub.cancelled = True
            self._spawn_cancel(sub)
        self._subs.pop(sub.engine_request_id, None)
        for name in sub.route.instance_names:
            self._by_instance.get(name, set()).discard(sub.engine_request_id)

    def _spawn_cancel(self, sub: _Sub) -> None:
        async def cancel() -> None:
            for info in (sub.route.target, sub.route.decode):
                if info is None:
                    continue
                try:
                    await self._stub(info.meta.rpc_address).Cancel(
                        pb.PullSignal(req_id=sub.engine_request_id), timeout=1.0)
                except grpc.aio.AioRpcError:
                    pass
        try:
            task = asyncio.get_running_loop().create_task(cancel())
        except RuntimeError:
            return
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    def _stub(self, addr: str) -> pb_grpc.DisaggPDServiceStub:
        return pb_grpc.DisaggPDServiceStub(self._channels.get(addr))

    def metrics_text(self) -> str:
        lines = ["# HELP xllm_service_requests_total Requests by outcome",
                 "# TYPE xllm_service_requests_total counter"]
        for outcome, n in sorted(self.outcomes.items()):
            lines.append(f'xllm_service_requests_total{{outcome="{outcome}"}} {n}')
        lines += ["# HELP xllm_service_instance_requests_total Finished requests by instance and outcome",
                  "# TYPE xllm_service_instance_requests_total counter"]
        for (name, outcome), n in sorted(self.instance_outcomes.items()):
            lines.append(f'xllm_service_instance_requests_total{{instance="{name}",'
                         f'outcome="{outcome}"}} {n}')
        lines += ["# HELP xllm_service_inflight_requests In-flight requests by instance",
                  "# TYPE xllm_service_inflight_requests gauge"]
        for name, ids in sorted(self._by_instance.items()):
            lines.append(f'xllm_service_inflight_requests{{instance="{name}"}} {len(ids)}')
        if self.instance_counts is not None:
            lines += ["# HELP xllm_service_instances Registered instances by state",
                      "# TYPE xllm_service_instances gauge"]
            for state, n in sorted(self.instance_counts().items()):
                lines.append(f'xllm_service_instances{{state="{state}"}} {n}')
        return "\n".join(lines) + "\n"

    async def close(self) -> None:
        for stream in self._gen_streams.values():
            await stream.close()
        await self._channels.close()
