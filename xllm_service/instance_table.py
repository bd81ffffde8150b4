"""InstanceTable: the service's view of the engine instances (pure state machine).

No etcd, no gRPC, no clock: every method takes `now` (monotonic seconds) and returns the
changes it made, so `registry.py` can dispatch callbacks and the unit tests can drive
every edge by hand.

States of an instance (one entry per name, holding its current incarnation):

    (absent) --key put--> ACTIVE                  registered: key present in etcd
    ACTIVE --key deleted--> SUSPECT               not schedulable until shown alive
    SUSPECT --health 200 / heartbeat--> LEASE_LOST   key gone but the process answers:
                                                  still schedulable (etcd trouble, not death)
    LEASE_LOST --health fails--> SUSPECT
    LEASE_LOST / SUSPECT --key put--> ACTIVE
    SUSPECT --evict_grace_s elapsed--> evicted    entry removed; evict callbacks run
    any --key put with a new incarnation_id--> ACTIVE, old incarnation reported "replaced"

Heartbeats carry the incarnation id; one that does not match the entry is refused
(stale process or not registered yet), so a dead incarnation cannot refresh load data.
"""
from __future__ import annotations

import dataclasses
import enum
import logging

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole
from xllm_service.config import RegistryConfig

logger = logging.getLogger(__name__)

DEFAULT_EVICT_GRACE_S = RegistryConfig.evict_grace_s


class InstanceState(str, enum.Enum):
    ACTIVE = "ACTIVE"
    LEASE_LOST = "LEASE_LOST"
    SUSPECT = "SUSPECT"
    EVICTED = "EVICTED"  # only on the InstanceInfo handed to evict callbacks

    @property
    def schedulable(self) -> bool:
        return self in (InstanceState.ACTIVE, InstanceState.LEASE_LOST)


# The moves `_set_state` makes (the module doc says which event makes each). EVICTED is
# no state of a live entry: an evicted or replaced entry leaves the table, and the
# snapshot handed to callbacks carries it.
_ALLOWED: dict[InstanceState, frozenset[InstanceState]] = {
    InstanceState.ACTIVE: frozenset({InstanceState.SUSPECT}),
    InstanceState.SUSPECT: frozenset({InstanceState.LEASE_LOST, InstanceState.ACTIVE}),
    InstanceState.LEASE_LOST: frozenset({InstanceState.SUSPECT, InstanceState.ACTIVE}),
    InstanceState.EVICTED: frozenset(),
}


class InvalidInstanceTransition(RuntimeError):
    pass


class ChangeKind(str, enum.Enum):
    ADDED = "ADDED"          # a new name
    UPDATED = "UPDATED"      # same incarnation, meta rewritten
    STATE = "STATE"          # state changed
    REPLACED = "REPLACED"    # a new incarnation took over the name (old one is gone)
    EVICTED = "EVICTED"      # removed after the grace period


@dataclasses.dataclass
class LoadInfo:
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0            # 0..1
    recent_max_ttft_ms: int = 0
    recent_max_tbt_ms: int = 0
    last_heartbeat_s: float | None = None  # monotonic
    num_heartbeats: int = 0


@dataclasses.dataclass
class InstanceInfo:
    meta: InstanceMeta
    state: InstanceState
    state_since_s: float
    load: LoadInfo = dataclasses.field(default_factory=LoadInfo)
    key_present: bool = True
    registered_s: float = 0.0

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def role(self) -> InstanceRole:
        """The role it serves (routing): an elastic instance's acknowledged duty."""
        return self.meta.serving_role

    @property
    def incarnation_id(self) -> str:
        return self.meta.incarnation_id

    @property
    def schedulable(self) -> bool:
        """New requests may go here: alive and not draining (shutting down)."""
        return self.state.schedulable and not self.meta.draining

    def snapshot(self) -> "InstanceInfo":
        """A copy that later table changes do not touch (for callbacks)."""
        return dataclasses.replace(self, load=dataclasses.replace(self.load))


@dataclasses.dataclass(frozen=True)
class Change:
    kind: ChangeKind
    info: InstanceInfo              # snapshot after the change (for REPLACED/EVICTED: the old one)
    old_state: InstanceState | None = None


@dataclasses.dataclass(frozen=True)
class HeartbeatResult:
    ok: bool
    message: str = ""
    changes: tuple[Change, ...] = ()


class InstanceTable:
    def __init__(self, evict_grace_s: float = DEFAULT_EVICT_GRACE_S) -> None:
        if evict_grace_s < 0:
            raise ValueError(f"evict_grace_s must be >= 0, got {evict_grace_s}")
        self.evict_grace_s = evict_grace_s
        self._entries: dict[str, InstanceInfo] = {}

    # ------------------------------------------------------------------ queries

    def get(self, name: str) -> InstanceInfo | None:
        return self._entries.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def all(self) -> list[InstanceInfo]:
        return sorted(self._entries.values(), key=lambda i: i.name)

    def schedulable(self, role: InstanceRole | None = None) -> list[InstanceInfo]:
        # The role first (cheap), then sort only what is left: the router asks once per
        # role for every request (benchmarks/bench_fleet.py route_micro times it).
        return sorted((i for i in self._entries.values()
                       if (role is None or i.role == role) and i.schedulable),
                      key=lambda i: i.name)

    def counts(self) -> dict[str, int]:
        """Instances per state (every live state present, zero included); a schedulable
        one that is shutting down counts as DRAINING."""
        out = {s.value: 0 for s in InstanceState if s is not InstanceState.EVICTED}
        out["DRAINING"] = 0
        for info in self._entries.values():
            draining = info.meta.draining and info.state.schedulable
            out["DRAINING" if draining else info.state.value] += 1
        return out

    def next_eviction_s(self) -> float | None:
        """When the next SUSPECT entry is due for eviction (for the registry's timer)."""
        due = [i.state_since_s + self.evict_grace_s for i in self._entries.values() if i.state is InstanceState.SUSPECT]
        return min(due) if due else None

    # ------------------------------------------------------------------ transitions

    def _set_state(self, info: InstanceInfo, state: InstanceState, now: float) -> list[Change]:
        if info.state is state:
            return []
        if state not in _ALLOWED[info.state]:
            raise InvalidInstanceTransition(
                f"instance {info.name}: {info.state.value} -> {state.value}")
        old = info.state
        info.state = state
        info.state_since_s = now
        logger.info("instance %s (%s): %s -> %s", info.name, info.role.value, old.value, state.value)
        return [Change(ChangeKind.STATE, info.snapshot(), old)]

    def key_put(self, meta: InstanceMeta, now: float) -> list[Change]:
        """The instance key was written (registration, re-registration, or update)."""
        cur = self._entries.get(meta.name)
        if cur is None:
            info = InstanceInfo(meta=meta, state=InstanceState.ACTIVE, state_since_s=now, registered_s=now)
            self._entries[meta.name] = info
            logger.info("instance %s (%s) registered, incarnation %s", meta.name, meta.type.value, meta.incarnation_id)
            return [Change(ChangeKind.ADDED, info.snapshot())]
        if cur.incarnation_id == meta.incarnation_id:
            changes: list[Change] = []
            if cur.meta != meta:
                cur.meta = meta
                changes.append(Change(ChangeKind.UPDATED, cur.snapshot()))
            cur.key_present = True
            return changes + self._set_state(cur, InstanceState.ACTIVE, now)
        if meta.register_ts_ms and cur.meta.register_ts_ms and meta.register_ts_ms < cur.meta.register_ts_ms:
            logger.warning(
                "instance %s: ignoring registration of an older incarnation %s (current %s)",
                meta.name, meta.incarnation_id, cur.incarnation_id,
            )
            return []
        # A new process took the name (restart, possibly within the TTL): the old
        # incarnation is gone, with whatever it had in flight.
        old = cur.snapshot()
        old.state = InstanceState.EVICTED
        info = InstanceInfo(meta=meta, state=InstanceState.ACTIVE, state_since_s=now, registered_s=now)
        self._entries[meta.name] = info
        logger.info(
            "instance %s re-registered: incarnation %s replaces %s", meta.name, meta.incarnation_id, cur.incarnation_id
        )
        return [Change(ChangeKind.REPLACED, old, cur.state), Change(ChangeKind.ADDED, info.snapshot())]

    def key_deleted(self, name: str, now: float, role: InstanceRole | None = None) -> list[Change]:
        """The key vanished (lease expired, deleted): not schedulable until shown alive.

        `role`: the role in the deleted key; a delete of another role's key (the name
        re-registered under a new role) does not touch the entry.
        """
        cur = self._entries.get(name)
        if cur is None or (role is not None and role != cur.meta.type):
            return []
        cur.key_present = False
        if cur.state is InstanceState.ACTIVE:
            return self._set_state(cur, InstanceState.SUSPECT, now)
        return []

    def health_result(self, name: str, ok: bool, now: float, incarnation_id: str | None = None) -> list[Change]:
        """Outcome of probing the instance's /health while its key is gone."""
        cur = self._entries.get(name)
        if cur is None or cur.key_present:
            return []  # key present: etcd is the truth, probes do not demote
        if incarnation_id is not None and incarnation_id != cur.incarnation_id:
            return []
        if ok:
            return self._set_state(cur, InstanceState.LEASE_LOST, now)
        return self._set_state(cur, InstanceState.SUSPECT, now)

    def heartbeat(self, name: str, incarnation_id: str, load: LoadInfo, now: float) -> HeartbeatResult:
        cur = self._entries.get(name)
        if cur is None:
            return HeartbeatResult(False, f"unknown instance {name!r}: register first")
        if cur.incarnation_id != incarnation_id:
            return HeartbeatResult(
                False,
                f"stale incarnation {incarnation_id!r} for {name!r} (current {cur.incarnation_id!r})",
            )
        load.last_heartbeat_s = now
        load.num_heartbeats = cur.load.num_heartbeats + 1
        cur.load = load
        changes: list[Change] = []
        if not cur.key_present and cur.state is InstanceState.SUSPECT:
            # The process is talking to us: alive, only its lease is gone.
            changes = self._set_state(cur, InstanceState.LEASE_LOST, now)
        return HeartbeatResult(True, "", tuple(changes))

    def tick(self, now: float) -> list[Change]:
        """Evict SUSPECT entries whose grace period has run out."""
        changes = []
        for name in [n for n, i in self._entries.items() if i.state is InstanceState.SUSPECT]:
            info = self._entries[name]
            if now - info.state_since_s >= self.evict_grace_s:
                del self._entries[name]
                old = info.snapshot()
                old.state = InstanceState.EVICTED
                # (one that was draining shut down as asked: its leaving is no warning)
                log = logger.info if info.meta.draining else logger.warning
                log("instance %s (%s) evicted after %.1fs suspect%s", name, info.role.value,
                    now - info.state_since_s, " (it had drained)" if info.meta.draining else "")
                changes.append(Change(ChangeKind.EVICTED, old, InstanceState.SUSPECT))
        return changes

    def resync(self, metas: list[InstanceMeta], now: float) -> list[Change]:
        """Align with a full listing of the instance prefix (start-up, watch restart)."""
        changes: list[Change] = []
        present = {m.name for m in metas}
        for meta in metas:
            changes += self.key_put(meta, now)
        for name in [n for n in self._entries if n not in present]:
            changes += self.key_deleted(name, now)
        return changes

    def remove(self, name: str) -> list[Change]:
        """Drop an entry at once (clean deregistration is still a key delete; this is for admin use)."""
        info = self._entries.pop(name, None)
        if info is None:
            return []
        old = info.snapshot()
        old_state = old.state
        old.state = InstanceState.EVICTED
        return [Change(ChangeKind.EVICTED, old, old_state)]
