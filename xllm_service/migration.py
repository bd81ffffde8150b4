"""Relocator: the service's half of moving a request off an instance that is gone or
cannot serve it. ServiceBackend builds one and hands it the book of sub-requests, the
instance picks it may make (`Placement`), the engine RPCs, the migrations counter and
three callables of its own (fail a sub, log a route, run a task); the relay calls it for
the failures a Generation reports, the registry (through the backend) for evictions.

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
ignores the stale RPC's answer. The same move recomputes a PD sub whose KV never reached
its decode (its prefill died after relaying the first token, or the transfer failed: an
engine's 502) on a decode (`recompute_on_a_decode`). Still failed with a 503: a MIX
request with n > 1 or best_of > 1 (the message says why: its sequences are interleaved
in one engine request, and only one sequence's tokens can be handed over).
A request with nothing relayed yet (the client has seen no token) whose instance dies
is sent again whole (`_resend_unstarted`): a MIX or DECODE-path one to another instance
of its kind, a PD one whose prefill died to a decode that serves it whole; the client
only waits longer for its first token. Counted as migrations too.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
import uuid
from typing import Callable, Coroutine, Protocol, Sequence

import grpc

from xllm_py.config import InstanceRole
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_service.engine_client import SEND_ERRORS, Engines
from xllm_service.instance_table import InstanceInfo
from xllm_service.router import NoInstanceError, Route
from xllm_service.sub_request import SubPhase, SubRequest, SubRequests

logger = logging.getLogger(__name__)


def new_engine_id(request_id: str, offset: int) -> str:
    """A fresh engine request id for sequence offset `offset` of client request `request_id`."""
    return f"{request_id}-{offset}-{uuid.uuid4().hex[:8]}"


class Placement(Protocol):
    """The instance picks a move needs (Router has them)."""

    def route_decode(self, request: object = None,
                     exclude: Sequence[str] = ()) -> InstanceInfo: ...

    def route_mix(self, request: object = None,
                  exclude: Sequence[str] = ()) -> InstanceInfo: ...

    def schedulable(self, role: InstanceRole) -> list[InstanceInfo]: ...


class Relocator:
    def __init__(self, subs: SubRequests, placement: Placement, engines: Engines,
                 migrations: collections.Counter, *, fail: Callable[[SubRequest, str], None],
                 log_route: Callable[[str, Route, int], None],
                 spawn: Callable[[Coroutine], None]) -> None:
        self.subs = subs
        self.placement = placement
        self.engines = engines
        self.migrations = migrations  # "ok" / "failed": xllm_service_migrations_total
        self._fail = fail  # the client gets a 503 with this message
        self._log_route = log_route  # the request log line of a new engine request
        self._spawn = spawn  # runs an RPC in the background, kept until done

    def on_evict(self, info: InstanceInfo) -> None:
        """An instance is gone: the requests that still depend on it (see
        `Relay.release_prefill`) move to another instance of its kind if it was generating them
        (their decode, or their MIX instance), they are single-sequence and a token was
        relayed (see the module docstring); a PD sub whose prefill died after relaying its
        first token, before a decode took it over, is recomputed on a decode; the others
        end with an error now."""
        for sub in self.subs.pop_instance(info.name):
            if sub.phase.is_done:
                continue
            why = f"instance {info.name} left the cluster while serving the request"
            if sub.serving == info.name and sub.generated and sub.spec is not None:
                self.migrate(sub, info.name)
                continue
            if info.name == sub.route.target.name and sub.awaiting_take_over:
                self.recompute_on_a_decode(sub, f"its prefill {info.name} left the cluster")
                continue
            if sub.unstarted_on(info.name):
                self._resend_unstarted(sub, info.name, why)
                continue
            if sub.serving == info.name and sub.spec is not None and not sub.single_sequence:
                p = sub.spec.params
                why += (f"; it cannot be migrated: only a single-sequence request can resume "
                        f"elsewhere, and it asked for n={p.n}, best_of={p.best_of or p.n}")
            logger.warning("instance %s evicted: failing request %s", info.name,
                           sub.engine_request_id)
            if sub.route.is_pd and info.name != sub.route.decode.name:
                self.cancel_on_decodes(sub, why)  # its prefill died before the hand-over
            self._fail(sub, why)

    def cancel_on_decodes(self, sub: SubRequest, why: str) -> None:
        """A PD sub ends failed before its decode took it over: a decode may still hold
        the blocks it set aside for it (ours, or the one the prefill picked instead),
        because the prefill that would tell it to drop them is dead or cut off from it.
        Each decode is told (a Cancel of an id it does not hold is a no-op), so they are
        freed now, not after the decode's orphan timeout."""
        for decode in self.placement.schedulable(InstanceRole.DECODE):
            self._spawn(self.engines.cancel(decode.meta.rpc_address, sub.engine_request_id,
                                            sub.request_id, why))

    def recompute_on_a_decode(self, sub: SubRequest, why: str) -> None:
        """A PD sub lost its KV before its decode took it over (its prefill died, or the
        transfer failed) with the first token relayed: like vLLM's recompute policy for a
        failed KV load, a decode computes the prompt again and resumes after that token
        (MultiGenerations without KV), instead of the client getting an error. Whatever a
        decode set aside for it under the old id is dropped first."""
        self.cancel_on_decodes(sub, why)
        self.migrate(sub, sub.route.target.name, why=why)

    def serve_on_a_decode(self, sub: SubRequest, why: str, counted: bool = False) -> None:
        """A PD sub its prefill could not place on any decode (or that died), before any
        token: a decode serves it whole (the DECODE path: Generate under a fresh id, as
        conditional disaggregation sends short prompts), else the client gets the error.
        `counted`: a move off an evicted instance (xllm_service_migrations_total)."""
        prefill = sub.route.target.name
        try:
            target = self.placement.route_decode(sub.spec)
        except NoInstanceError as exc:
            if counted:
                self.migrations["failed"] += 1
            self._fail(sub, f"{why}; no decode to serve it instead: {exc}")
            return
        self.cancel_on_decodes(sub, why)
        route = Route(target, on_decode=True, reason=f"prefill {prefill} could not place it")
        logger.warning("request %s: prefill %s could not serve it; %s serves it whole",
                       sub.engine_request_id, prefill, target.name)
        self._send_elsewhere(sub, target, route, why, counted)

    def _resend_unstarted(self, sub: SubRequest, dead: str, why: str) -> None:
        """`SubRequest.unstarted_on`: send it again whole, elsewhere (the module docstring)."""
        if sub.route.is_pd:
            self.serve_on_a_decode(sub, why, counted=True)
            return
        try:
            target = self._another_of_its_kind(sub, dead)
        except NoInstanceError as exc:
            self.migrations["failed"] += 1
            self._fail(sub, f"{why}; no other instance to send it to: {exc}")
            return
        logger.warning("instance %s lost before request %s's first token: sending it to %s",
                       dead, sub.engine_request_id, target.name)
        route = Route(target, on_decode=sub.route.on_decode, reason=f"{dead} left the cluster")
        self._send_elsewhere(sub, target, route, why, counted=True)

    def _send_elsewhere(self, sub: SubRequest, target: InstanceInfo, route: Route, why: str,
                        counted: bool) -> None:
        """Re-key `sub` onto `route` under a fresh id and Generate it whole on `target`."""
        new_id = new_engine_id(sub.request_id, sub.index_offset)
        self.subs.rekey(sub, new_id, route)
        spec = dataclasses.replace(sub.spec, request_id=new_id, service_request_id=new_id,
                                   prefill_name="", decode_name="")
        sub.spec = spec
        self._log_route(new_id, route, len(spec.prompt_token_ids))
        self._spawn(self._send_whole(sub, spec, target, why, counted))

    async def _send_whole(self, sub: SubRequest, spec: EngineRequestSpec,
                          target: InstanceInfo, why: str, counted: bool = False) -> None:
        try:
            status = await self.engines.generate(target.meta.rpc_address, spec)
            error = "" if status.ok else status.message or "refused"
        except SEND_ERRORS as exc:
            error = f"{type(exc).__name__}: {exc}"
        if counted:
            self.migrations["failed" if error else "ok"] += 1
        if error and sub.engine_request_id == spec.service_request_id:
            self._fail(sub, f"{why}; {target.name} could not serve it instead: {error}")

    def _another_of_its_kind(self, sub: SubRequest, dead: str) -> InstanceInfo:
        """An instance to move `sub` to from `dead`: a decode for a PD or DECODE-path sub,
        a MIX for a MIX one (NoInstanceError: none other is registered)."""
        pick = self.placement.route_decode if sub.route.on_decode_role else self.placement.route_mix
        return pick(sub.spec, exclude=[dead])

    def migrate(self, sub: SubRequest, dead: str, why: str = "") -> None:
        """Re-key `sub` and hand it to another instance of the dead one's kind (DECODE for
        a PD sub, MIX for a MIX one) with MultiGenerations (async)."""
        spec, k = sub.spec, len(sub.generated)
        why = why or f"instance {dead} left the cluster while serving the request"
        target, reason = None, ""
        if spec.params.max_tokens is not None and k >= spec.params.max_tokens:
            reason = "it had generated max_tokens but its last output was lost"
        else:
            try:
                target = self._another_of_its_kind(sub, dead)
            except NoInstanceError as exc:
                reason = str(exc)
        if target is None:
            logger.warning("instance %s lost: cannot migrate request %s (%s)", dead,
                           sub.engine_request_id, reason)
            self.migrations["failed"] += 1
            self._fail(sub, f"{why}; could not migrate it: {reason}")
            return
        old_id, new_id = sub.engine_request_id, new_engine_id(sub.request_id, sub.index_offset)
        if sub.route.is_pd:
            route = Route(sub.route.target, target)
        else:  # a DECODE-path sub migrates to another decode, a MIX one to a MIX
            route = Route(target, on_decode=sub.route.on_decode)
        self.subs.rekey(sub, new_id, route)
        sub.advance(SubPhase.STREAMING)  # no longer waits for its prefill
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
        self.migrations["failed" if error else "ok"] += 1
        if error:
            logger.warning("MultiGenerations of %s on %s failed after %.2fs: %s", new_id,
                           target.name, time.monotonic() - t0, error)
        else:
            logger.info("request %s migrated to %s in %.2fs", new_id, target.name,
                        time.monotonic() - t0)
        if error and sub.engine_request_id == new_id:  # else re-keyed again or forgotten
            self._fail(sub, f"{why}; migrating it to {target.name} failed: {error}")
