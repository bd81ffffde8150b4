"""Relay: what the service does with each Generation an engine reports.

`classify` names the event one Generation is for its sub-request (`RelayEvent`); `STEPS`
says, for each event, the phase the sub moves on to (`SubRequest.advance`, checked against
sub_request.py's table of phases) and the action taken: relay it to the client, hold it,
move the sub elsewhere (Relocator: migrate, recompute, serve on a decode) or fail it. The
reply's ok is false only for a Generation no client waits for (the engine aborts it).

A PD sub's outputs come from two instances: the first token from its prefill, the rest
from its decode. A decode output that arrives before the prefill's first token is held
until that token is relayed (HOLDING); once the service has both, the sub no longer
depends on its prefill (`release_prefill`).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Callable

from xllm_py.outputs import RequestOutput
from xllm_py.rpc import service as wire
from xllm_py.status import Status
from xllm_service.instance_table import InstanceInfo
from xllm_service.migration import Relocator
from xllm_service.sub_request import SubPhase, SubRequest, SubRequests

logger = logging.getLogger(__name__)
# an engine's code for "a peer failed": for a PD sub, its KV transfer
KV_LOST = Status.BAD_GATEWAY.http_status
UNAVAILABLE = Status.UNAVAILABLE.http_status


class RelayEvent(enum.Enum):
    # No client waits for it: an unknown (old) id, or a cancelled sub.
    STALE = enum.auto()
    # Failures that move the sub (Relocator) instead of failing it:
    # PD: the prefill could not reach the decode to hand the sub over, after its first
    # token was relayed (after a decode output the decode has it: its eviction decides).
    DECODE_UNREACHABLE = enum.auto()
    # The instance generating it could not reach the service and gave it up (a cut link:
    # its notice names itself), after tokens were relayed.
    DROPPED = enum.auto()
    # PD: the KV never reached the decode, the first token relayed.
    KV_LOST = enum.auto()
    # PD: the decode's KV pull failed before the prefill's first token came in: noted,
    # recomputed once that token is relayed.
    KV_LOST_EARLY = enum.auto()
    # PD: its prefill could not place it on any decode (502/503), before any token.
    UNPLACED = enum.auto()
    # Failures the client gets: a PD sub's before a decode output was relayed (the decodes
    # may hold blocks for it), and the others.
    FAILED_BEFORE_TAKE_OVER = enum.auto()
    FAILED = enum.auto()
    # Outputs: of an instance serving the sub whole (MIX, DECODE path); PD: the prefill's
    # first token, with no decode output held or after held ones; a decode output after
    # the prefill's first token, or before it.
    OUTPUT = enum.auto()
    PREFILL_FIRST = enum.auto()
    PREFILL_FIRST_AFTER_HELD = enum.auto()
    DECODE_OUTPUT = enum.auto()
    DECODE_EARLY = enum.auto()


def classify(sub: SubRequest | None, instance_name: str, gen: wire.Generation) -> RelayEvent:
    """The event Generation `gen`, reported by `instance_name`, is for `sub` (the sub its
    service request id names, None: none)."""
    if sub is None or sub.phase is SubPhase.CANCELLED:
        return RelayEvent.STALE
    out, route = gen.output, sub.route
    if out.failed:
        if sub.awaiting_take_over and out.unreachable_instance == route.decode.name:
            return RelayEvent.DECODE_UNREACHABLE
        if (instance_name and out.unreachable_instance == instance_name
                and sub.serving == instance_name and sub.generated and sub.spec is not None
                and sub.single_sequence and not sub.phase.is_done):
            return RelayEvent.DROPPED
        if out.error_code == KV_LOST and sub.awaiting_take_over:
            return RelayEvent.KV_LOST
        if (out.error_code == KV_LOST and route.is_pd and sub.phase is SubPhase.DISPATCHED
                and not gen.on_prefill and instance_name != route.target.name):
            return RelayEvent.KV_LOST_EARLY
        if (route.is_pd and instance_name == route.target.name
                and sub.phase is SubPhase.DISPATCHED and not sub.generated and not sub.held
                and sub.spec is not None and out.error_code in (KV_LOST, UNAVAILABLE)):
            return RelayEvent.UNPLACED
        if route.is_pd and sub.phase < SubPhase.STREAMING:
            return RelayEvent.FAILED_BEFORE_TAKE_OVER
        return RelayEvent.FAILED
    if not route.is_pd:
        return RelayEvent.OUTPUT
    if gen.on_prefill:
        return RelayEvent.PREFILL_FIRST_AFTER_HELD if sub.held else RelayEvent.PREFILL_FIRST
    if sub.phase in (SubPhase.FIRST_RELAYED, SubPhase.STREAMING):
        return RelayEvent.DECODE_OUTPUT
    return RelayEvent.DECODE_EARLY


class Relay:
    """Drives each sub-request through STEPS (module docstring). Built by ServiceBackend
    with its book of subs, its Relocator, where the schedulable decodes are read, and how
    an output reaches the sub's client."""

    def __init__(self, subs: SubRequests, relocator: Relocator,
                 decodes: Callable[[], list[InstanceInfo]],
                 deliver: Callable[[SubRequest, RequestOutput], None]) -> None:
        self.subs = subs
        self.relocator = relocator
        self._decodes = decodes
        self._deliver = deliver

    def on_generation(self, instance_name: str, gen: wire.Generation) -> bool:
        """Relay one Generation; False: no client waits for it."""
        sub = self.subs.get(gen.service_request_id)
        if (sub is not None and sub.phase is not SubPhase.CANCELLED and sub.route.is_pd
                and instance_name and not gen.on_prefill
                and instance_name != sub.route.decode.name):
            self.follow_decode(sub, instance_name)
        step = STEPS[classify(sub, instance_name, gen)]
        if step.phase is not None:
            sub.advance(step.phase)
        step.action(self, sub, gen.output, instance_name)
        return step.relayed

    def follow_decode(self, sub: SubRequest, name: str) -> None:
        """The prefill handed the sub to another decode than the one chosen here (that one
        was full, or unreachable): from now on eviction, Cancel and the counts go to the
        decode that runs it."""
        info = next((i for i in self._decodes() if i.name == name), None)
        if info is None:
            logger.warning("request %s is on decode %s, which is not registered",
                           sub.engine_request_id, name)
            return
        old = sub.route.decode.name
        self.subs.move(sub, info)
        logger.info("request %s: prefill handed it to decode %s instead of %s",
                    sub.engine_request_id, name, old)

    def release_prefill(self, sub: SubRequest) -> None:
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

    # ------------------------------------------------------------------ actions (STEPS)
    def _ignore(self, sub, out: RequestOutput, instance_name: str) -> None:
        pass

    def _migrate_off_decode(self, sub: SubRequest, out: RequestOutput, instance_name: str) -> None:
        self.relocator.migrate(sub, out.unreachable_instance, why=(
            f"decode instance {out.unreachable_instance} could not be reached "
            f"({out.error_message})"))

    def _migrate_off_reporter(self, sub: SubRequest, out: RequestOutput,
                              instance_name: str) -> None:
        self.relocator.migrate(sub, instance_name, why=out.error_message)

    def _recompute(self, sub: SubRequest, out: RequestOutput, instance_name: str) -> None:
        self.relocator.recompute_on_a_decode(
            sub, f"its KV could not reach the decode ({out.error_message})")

    def _note_kv_lost(self, sub: SubRequest, out: RequestOutput, instance_name: str) -> None:
        sub.kv_lost = out.error_message

    def _serve_on_a_decode(self, sub: SubRequest, out: RequestOutput,
                           instance_name: str) -> None:
        self.relocator.serve_on_a_decode(sub, out.error_message)

    def _fail_before_take_over(self, sub: SubRequest, out: RequestOutput,
                               instance_name: str) -> None:
        self.relocator.cancel_on_decodes(sub, out.error_message)
        self._deliver(sub, out)

    def _relay(self, sub: SubRequest, out: RequestOutput, instance_name: str) -> None:
        self._deliver(sub, out)

    def _relay_first(self, sub: SubRequest, out: RequestOutput, instance_name: str) -> None:
        self._deliver(sub, out)
        if sub.kv_lost and sub.awaiting_take_over:
            self.relocator.recompute_on_a_decode(
                sub, f"its KV could not reach the decode ({sub.kv_lost})")

    def _relay_first_and_held(self, sub: SubRequest, out: RequestOutput,
                              instance_name: str) -> None:
        held, sub.held = sub.held, []
        self._deliver(sub, out)
        for h in held:
            self._deliver(sub, h)
        self.release_prefill(sub)

    def _relay_and_release(self, sub: SubRequest, out: RequestOutput,
                           instance_name: str) -> None:
        self._deliver(sub, out)
        self.release_prefill(sub)

    def _hold(self, sub: SubRequest, out: RequestOutput, instance_name: str) -> None:
        sub.held.append(out)


@dataclasses.dataclass(frozen=True)
class Step:
    phase: SubPhase | None  # the sub advances to it first (None: stays where it is)
    action: Callable[[Relay, SubRequest, RequestOutput, str], None]
    relayed: bool = True  # the reply's ok (False: the engine aborts the request)


E = RelayEvent
STEPS: dict[RelayEvent, Step] = {
    E.STALE: Step(None, Relay._ignore, relayed=False),
    E.DECODE_UNREACHABLE: Step(None, Relay._migrate_off_decode),
    E.DROPPED: Step(None, Relay._migrate_off_reporter),
    E.KV_LOST: Step(None, Relay._recompute),
    E.KV_LOST_EARLY: Step(None, Relay._note_kv_lost),
    E.UNPLACED: Step(None, Relay._serve_on_a_decode),
    E.FAILED_BEFORE_TAKE_OVER: Step(None, Relay._fail_before_take_over),
    E.FAILED: Step(None, Relay._relay),
    E.OUTPUT: Step(SubPhase.STREAMING, Relay._relay),
    E.PREFILL_FIRST: Step(SubPhase.FIRST_RELAYED, Relay._relay_first),
    E.PREFILL_FIRST_AFTER_HELD: Step(SubPhase.STREAMING, Relay._relay_first_and_held),
    E.DECODE_OUTPUT: Step(SubPhase.STREAMING, Relay._relay_and_release),
    E.DECODE_EARLY: Step(SubPhase.HOLDING, Relay._hold),
}
del E
