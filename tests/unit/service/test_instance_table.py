"""Every edge of the instance table's state machine, driven with explicit times."""
import pytest

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole
from xllm_service.instance_table import (
    ChangeKind,
    InstanceState,
    InstanceTable,
    InvalidInstanceTransition,
    LoadInfo,
)

GRACE = 3.0


def meta(name="d1:1", role=InstanceRole.DECODE, inc="inc-1", ts=1000, **kw) -> InstanceMeta:
    return InstanceMeta(name=name, type=role, incarnation_id=inc, register_ts_ms=ts, **kw)


def table_with(*metas, now=0.0) -> InstanceTable:
    t = InstanceTable(evict_grace_s=GRACE)
    for m in metas:
        t.key_put(m, now)
    return t


def kinds(changes):
    return [c.kind for c in changes]


def test_key_put_adds_active():
    t = InstanceTable(evict_grace_s=GRACE)
    changes = t.key_put(meta(), 1.0)
    assert kinds(changes) == [ChangeKind.ADDED]
    info = t.get("d1:1")
    assert info.state is InstanceState.ACTIVE and info.schedulable and info.key_present
    assert info.state_since_s == 1.0
    assert t.counts() == {"ACTIVE": 1, "LEASE_LOST": 0, "SUSPECT": 0, "DRAINING": 0}


def test_same_key_put_again_is_no_change_and_updated_meta_is_update():
    t = table_with(meta())
    assert t.key_put(meta(), 1.0) == []
    changes = t.key_put(meta(num_blocks=99), 2.0)
    assert kinds(changes) == [ChangeKind.UPDATED]
    assert t.get("d1:1").meta.num_blocks == 99


def test_key_deleted_makes_suspect_not_schedulable():
    t = table_with(meta())
    changes = t.key_deleted("d1:1", 5.0)
    assert kinds(changes) == [ChangeKind.STATE]
    assert changes[0].old_state is InstanceState.ACTIVE
    info = t.get("d1:1")
    assert info.state is InstanceState.SUSPECT and not info.schedulable and not info.key_present
    assert t.schedulable(InstanceRole.DECODE) == []


def test_key_deleted_unknown_name_or_other_role_is_ignored():
    t = table_with(meta())
    assert t.key_deleted("nope:1", 1.0) == []
    assert t.key_deleted("d1:1", 1.0, role=InstanceRole.PREFILL) == []
    assert t.get("d1:1").state is InstanceState.ACTIVE


def test_health_ok_while_key_gone_is_lease_lost_and_schedulable():
    t = table_with(meta())
    t.key_deleted("d1:1", 1.0)
    changes = t.health_result("d1:1", True, 1.1)
    assert [(c.old_state, c.info.state) for c in changes] == [(InstanceState.SUSPECT, InstanceState.LEASE_LOST)]
    assert [i.name for i in t.schedulable(InstanceRole.DECODE)] == ["d1:1"]
    # Not evicted however long it stays alive.
    assert t.tick(100.0) == []


def test_lease_lost_then_health_fails_goes_suspect_and_grace_starts_then():
    t = table_with(meta())
    t.key_deleted("d1:1", 1.0)
    t.health_result("d1:1", True, 1.1)
    changes = t.health_result("d1:1", False, 10.0)
    assert changes[0].info.state is InstanceState.SUSPECT
    assert t.next_eviction_s() == 10.0 + GRACE
    assert t.tick(10.0 + GRACE - 0.01) == []
    assert kinds(t.tick(10.0 + GRACE)) == [ChangeKind.EVICTED]


def test_health_results_ignored_while_key_present_or_for_other_incarnation():
    t = table_with(meta())
    assert t.health_result("d1:1", False, 1.0) == []
    assert t.get("d1:1").state is InstanceState.ACTIVE
    t.key_deleted("d1:1", 2.0)
    assert t.health_result("d1:1", True, 2.1, incarnation_id="other") == []
    assert t.get("d1:1").state is InstanceState.SUSPECT
    assert t.health_result("nope:1", True, 2.1) == []


def test_suspect_evicted_after_grace_with_old_info():
    t = table_with(meta())
    t.key_deleted("d1:1", 1.0)
    assert t.tick(1.0 + GRACE - 0.5) == []
    changes = t.tick(1.0 + GRACE)
    assert kinds(changes) == [ChangeKind.EVICTED]
    assert changes[0].info.state is InstanceState.EVICTED
    assert changes[0].info.incarnation_id == "inc-1"
    assert changes[0].old_state is InstanceState.SUSPECT
    assert "d1:1" not in t and len(t) == 0
    assert t.next_eviction_s() is None


def test_eviction_warns_unless_the_instance_had_drained(caplog):
    """A crash (key gone, no drain) is a warning; an engine that drained and deregistered
    (a clean shutdown) is only information."""
    t = table_with(meta(), meta(name="d2:1", inc="inc-2", draining=True))
    t.key_deleted("d1:1", 1.0)
    t.key_deleted("d2:1", 1.0)
    with caplog.at_level("INFO", logger="xllm_service.instance_table"):
        assert kinds(t.tick(1.0 + GRACE)) == [ChangeKind.EVICTED, ChangeKind.EVICTED]
    levels = {r.getMessage().split()[1]: r.levelname for r in caplog.records}
    assert levels == {"d1:1": "WARNING", "d2:1": "INFO"}


def test_zero_grace_evicts_on_next_tick():
    t = InstanceTable(evict_grace_s=0.0)
    t.key_put(meta(), 0.0)
    t.key_deleted("d1:1", 1.0)
    assert kinds(t.tick(1.0)) == [ChangeKind.EVICTED]


def test_negative_grace_rejected():
    with pytest.raises(ValueError):
        InstanceTable(evict_grace_s=-1)


@pytest.mark.parametrize("via_lease_lost", [False, True])
def test_key_back_same_incarnation_is_active_again(via_lease_lost):
    t = table_with(meta())
    t.key_deleted("d1:1", 1.0)
    if via_lease_lost:
        t.health_result("d1:1", True, 1.1)
    changes = t.key_put(meta(), 2.0)
    assert [c.info.state for c in changes] == [InstanceState.ACTIVE]
    info = t.get("d1:1")
    assert info.state is InstanceState.ACTIVE and info.key_present
    assert t.tick(100.0) == []


def test_new_incarnation_replaces_entry_and_reports_old():
    t = table_with(meta())
    t.heartbeat("d1:1", "inc-1", LoadInfo(waiting=5), 0.5)
    changes = t.key_put(meta(inc="inc-2", ts=2000), 1.0)
    assert kinds(changes) == [ChangeKind.REPLACED, ChangeKind.ADDED]
    assert changes[0].info.incarnation_id == "inc-1"
    assert changes[0].info.state is InstanceState.EVICTED
    info = t.get("d1:1")
    assert info.incarnation_id == "inc-2" and info.state is InstanceState.ACTIVE
    assert info.load.waiting == 0 and info.load.last_heartbeat_s is None  # fresh load


def test_new_incarnation_within_ttl_while_suspect_is_accepted():
    t = table_with(meta())
    t.key_deleted("d1:1", 1.0)
    changes = t.key_put(meta(inc="inc-2", ts=2000), 1.5)
    assert ChangeKind.REPLACED in kinds(changes)
    assert t.get("d1:1").state is InstanceState.ACTIVE
    assert t.tick(100.0) == []


def test_older_incarnation_registration_ignored():
    t = table_with(meta(inc="inc-2", ts=2000))
    assert t.key_put(meta(inc="inc-1", ts=1000), 1.0) == []
    assert t.get("d1:1").incarnation_id == "inc-2"


def test_heartbeat_stores_load_and_time():
    t = table_with(meta())
    res = t.heartbeat("d1:1", "inc-1", LoadInfo(waiting=3, running=7, kv_usage=0.25, recent_max_ttft_ms=120, recent_max_tbt_ms=15), 4.0)
    assert res.ok and res.changes == ()
    load = t.get("d1:1").load
    assert (load.waiting, load.running, load.kv_usage, load.recent_max_ttft_ms, load.recent_max_tbt_ms) == (3, 7, 0.25, 120, 15)
    assert load.last_heartbeat_s == 4.0 and load.num_heartbeats == 1
    t.heartbeat("d1:1", "inc-1", LoadInfo(), 5.0)
    assert t.get("d1:1").load.num_heartbeats == 2


def test_heartbeat_stale_incarnation_refused_and_load_untouched():
    t = table_with(meta(inc="inc-2"))
    t.heartbeat("d1:1", "inc-2", LoadInfo(waiting=1), 1.0)
    res = t.heartbeat("d1:1", "inc-1", LoadInfo(waiting=99), 2.0)
    assert not res.ok and "stale incarnation" in res.message
    assert t.get("d1:1").load.waiting == 1 and t.get("d1:1").load.last_heartbeat_s == 1.0


def test_heartbeat_unknown_instance_refused():
    res = InstanceTable().heartbeat("x:1", "inc", LoadInfo(), 0.0)
    assert not res.ok and "unknown instance" in res.message


def test_heartbeat_from_suspect_proves_alive():
    t = table_with(meta())
    t.key_deleted("d1:1", 1.0)
    res = t.heartbeat("d1:1", "inc-1", LoadInfo(), 1.2)
    assert res.ok
    assert [c.info.state for c in res.changes] == [InstanceState.LEASE_LOST]
    assert t.get("d1:1").schedulable


def test_schedulable_filters_role_and_state_sorted_by_name():
    t = table_with(
        meta("d2:1"), meta("d1:1"), meta("p1:1", InstanceRole.PREFILL), meta("d3:1"), meta("m1:1", InstanceRole.MIX)
    )
    t.key_deleted("d3:1", 1.0)
    assert [i.name for i in t.schedulable(InstanceRole.DECODE)] == ["d1:1", "d2:1"]
    assert [i.name for i in t.schedulable(InstanceRole.PREFILL)] == ["p1:1"]
    assert len(t.schedulable()) == 4
    assert t.counts() == {"ACTIVE": 4, "LEASE_LOST": 0, "SUSPECT": 1, "DRAINING": 0}


def test_resync_adds_new_and_suspects_missing():
    t = table_with(meta("d1:1"), meta("d2:1"))
    changes = t.resync([meta("d1:1"), meta("d3:1")], 5.0)
    assert sorted((c.kind, c.info.name) for c in changes) == [
        (ChangeKind.ADDED, "d3:1"),
        (ChangeKind.STATE, "d2:1"),
    ]
    assert t.get("d2:1").state is InstanceState.SUSPECT


def test_remove_reports_eviction():
    t = table_with(meta())
    changes = t.remove("d1:1")
    assert kinds(changes) == [ChangeKind.EVICTED] and changes[0].old_state is InstanceState.ACTIVE
    assert t.remove("d1:1") == []


def test_change_snapshots_do_not_alias_table_entries():
    t = InstanceTable()
    info = t.key_put(meta(), 0.0)[0].info
    t.heartbeat("d1:1", "inc-1", LoadInfo(waiting=9), 1.0)
    assert info.load.waiting == 0


def test_a_draining_instance_takes_no_new_requests_but_stays_registered():
    t = table_with(meta("d1:1"), meta("d2:1"))
    changes = t.key_put(meta("d1:1", draining=True), 1.0)  # same incarnation, meta rewritten
    assert kinds(changes) == [ChangeKind.UPDATED]
    assert [i.name for i in t.schedulable(InstanceRole.DECODE)] == ["d2:1"]
    assert t.get("d1:1").state is InstanceState.ACTIVE  # its requests keep streaming
    assert t.heartbeat("d1:1", "inc-1", LoadInfo(running=2), 1.5).ok
    assert t.counts() == {"ACTIVE": 1, "LEASE_LOST": 0, "SUSPECT": 0, "DRAINING": 1}
    t.key_deleted("d1:1", 2.0)  # drained and gone
    assert t.counts() == {"ACTIVE": 1, "LEASE_LOST": 0, "SUSPECT": 1, "DRAINING": 0}


def test_a_move_outside_the_transition_table_raises():
    t = table_with(meta())
    info = t.get("d1:1")
    with pytest.raises(InvalidInstanceTransition, match="ACTIVE -> LEASE_LOST"):
        t._set_state(info, InstanceState.LEASE_LOST, 1.0)  # (alive without a lost key)
    assert info.state is InstanceState.ACTIVE
