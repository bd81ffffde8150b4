"""Elastic duty: what an instance started MIX in a cluster does for the PD cluster now,
as the master assigns it (cluster/role_assignment.py), and how it gets there without
losing a request.

Such an instance runs both PD sides from the start (pd/role.py: a PrefillSide and a
DecodeSide over one connector, which hands over only the requests the prefill side
submitted). Its duty decides what it takes *new*; what it already holds always
finishes where it is:
  - `Generate` follows the service's route, not the duty: a request routed as the
    prompt of a PD pair (it names its decode) goes to the prefill side, any other runs
    whole on the engine (MIX, or a decode's conditional disaggregation). So a decode
    turning prefill takes new prompts at once, and a prefill turning decode hands over
    what it queued through its still-running dispatch loop;
  - AddNewRequests (new decode placements) is refused in PREFILL duty (the prefill
    asking tries its next decode); FirstGeneration, MultiGenerations and LinkInstance
    are always served, so placements made before a flip complete, and streams already
    running keep running until they end.

States (DutyState) and the table `_ALLOWED`; `transition()` checks it:

    assigned PREFILL:  -> PREFILL_LEAVING_DECODE while the decode side holds open
                       placements, else -> PREFILL
    assigned DECODE:   -> DECODE_LEAVING_PREFILL while the prefill side holds requests
                       not handed over, else -> DECODE
    assigned MIX:      -> MIX_LEAVING_PREFILL, likewise, else -> MIX
    X_LEAVING_Y --(Y's side empty)--> X
    (a newer epoch of the duty served now changes nothing)

`X_LEAVING_Y` serves as X and still finishes Y's work. The instance acknowledges an
assignment (its registration's `duty`, `duty_epoch`) as soon as it serves the new duty,
which is at once: the service routes by the acknowledged duty.
"""
from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable

from xllm_py.cluster.role_assignment import RoleAssignment
from xllm_py.config import InstanceRole

logger = logging.getLogger(__name__)


class DutyState(str, enum.Enum):
    MIX = "MIX"
    PREFILL = "PREFILL"
    DECODE = "DECODE"
    DECODE_LEAVING_PREFILL = "DECODE_LEAVING_PREFILL"
    MIX_LEAVING_PREFILL = "MIX_LEAVING_PREFILL"
    PREFILL_LEAVING_DECODE = "PREFILL_LEAVING_DECODE"

    @property
    def serves(self) -> InstanceRole:
        """The duty it serves (what the service routes to it)."""
        return InstanceRole(self.value.split("_", 1)[0])


D = DutyState
_ALLOWED: dict[DutyState, frozenset[DutyState]] = {
    D.MIX: frozenset({D.PREFILL, D.PREFILL_LEAVING_DECODE, D.DECODE, D.DECODE_LEAVING_PREFILL}),
    D.PREFILL: frozenset({D.DECODE, D.DECODE_LEAVING_PREFILL, D.MIX, D.MIX_LEAVING_PREFILL}),
    D.DECODE: frozenset({D.PREFILL, D.PREFILL_LEAVING_DECODE, D.MIX, D.MIX_LEAVING_PREFILL}),
    # a leaving state: settled (its old side's work done), or assigned another duty
    D.DECODE_LEAVING_PREFILL: frozenset({D.DECODE, D.PREFILL, D.PREFILL_LEAVING_DECODE,
                                         D.MIX, D.MIX_LEAVING_PREFILL}),
    D.MIX_LEAVING_PREFILL: frozenset({D.MIX, D.PREFILL, D.PREFILL_LEAVING_DECODE,
                                      D.DECODE, D.DECODE_LEAVING_PREFILL}),
    D.PREFILL_LEAVING_DECODE: frozenset({D.PREFILL, D.DECODE, D.DECODE_LEAVING_PREFILL,
                                         D.MIX, D.MIX_LEAVING_PREFILL}),
}


def is_duty_transition_allowed(old: DutyState, new: DutyState) -> bool:
    return new in _ALLOWED[old]


class Duty:
    """The instance's duty and the epoch of the assignment it follows. `pending()`
    -> (requests the prefill side has not handed over, placements the decode side
    holds open): what a flip leaves to finish."""

    def __init__(self, pending: Callable[[], tuple[int, int]]) -> None:
        self.state = DutyState.MIX
        self.epoch = 0
        self._pending = pending

    @property
    def serves(self) -> InstanceRole:
        return self.state.serves

    @property
    def takes_placements(self) -> bool:
        """AddNewRequests are taken (not in PREFILL duty: it was flipped away from
        decoding; its open placements still complete)."""
        return self.serves is not InstanceRole.PREFILL

    def transition(self, new: DutyState) -> None:
        """Move to `new`; ValueError (and no change) if the table does not allow it."""
        if not is_duty_transition_allowed(self.state, new):
            raise ValueError(f"duty transition {self.state.value} -> {new.value} is not allowed")
        logger.info("duty %s -> %s", self.state.value, new.value)
        self.state = new

    def assign(self, assignment: RoleAssignment) -> bool:
        """Follow `assignment` if it is newer than the one followed; True if it was."""
        if assignment.epoch <= self.epoch:
            return False
        self.epoch = assignment.epoch
        target = self._target(assignment.role)
        if target is not self.state:
            self.transition(target)
        self.settle()
        return True

    def _target(self, role: InstanceRole) -> DutyState:
        was = self.state
        if role is was.serves:  # (a newer epoch of the same duty)
            return was
        prefill_left, decode_left = self._pending()
        if role is InstanceRole.PREFILL:
            return D.PREFILL_LEAVING_DECODE if decode_left > 0 else D.PREFILL
        if role is InstanceRole.DECODE:
            return D.DECODE_LEAVING_PREFILL if prefill_left > 0 else D.DECODE
        return D.MIX_LEAVING_PREFILL if prefill_left > 0 else D.MIX

    def settle(self) -> None:
        """A leaving state whose old side's work is done becomes the duty it serves."""
        if self.state in (D.MIX, D.PREFILL, D.DECODE):
            return
        prefill_left, decode_left = self._pending()
        left = decode_left if self.state is D.PREFILL_LEAVING_DECODE else prefill_left
        if left == 0:
            self.transition(DutyState(self.serves.value))


class RoleFollower:
    """Reads the instance's assignment every `interval_s` (a get, not a watch: it
    survives etcd restarts with nothing to re-establish), has the duty follow it, and
    publishes what it follows (`publish(role, epoch)`: the registration's `duty`,
    `duty_epoch`). Settles a leaving duty between reads. An unreadable or bad assignment
    keeps the duty as it is."""

    def __init__(self, duty: Duty, read: Callable[[], Awaitable[RoleAssignment | None]],
                 publish: Callable[[InstanceRole, int], None], interval_s: float) -> None:
        self.duty = duty
        self.read = read
        self.publish = publish
        self.interval_s = interval_s
        self._published: tuple[InstanceRole, int] | None = None

    async def once(self) -> None:
        try:
            assignment = await self.read()
        except Exception as exc:  # (etcd down, a bad value: next time)
            logger.warning("could not read this instance's role assignment: %s", exc)
            assignment = None
        if assignment is not None and self.duty.assign(assignment):
            logger.info("assigned %s (epoch %d): serving as %s", assignment.role.value,
                        assignment.epoch, self.duty.state.value)
        self.duty.settle()
        current = (self.duty.serves, self.duty.epoch)
        if current != self._published and self.duty.epoch > 0:
            self.publish(*current)
            self._published = current

    async def loop(self) -> None:
        while True:
            await self.once()
            await asyncio.sleep(self.interval_s)
