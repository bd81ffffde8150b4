"""Faults across a real network: etcd and the service on one namespace host, each engine on
its own (netns_lab), KV over UCX restricted to TCP and over the TCP backend, under
streaming load. Every request must end within BOUND_S with the reference tokens (an
undisturbed run's) or a clean OpenAI-shaped error, none hung, none with a wrong or doubled
token; every engine's KV pool empty afterwards; the registry back to every instance.
Each test prints its line of figures (requests, exact, clean errors, hung, wrong, blocks
left, longest pause). Skipped where not root or `ip netns` is missing (CI runs as root).
"""
from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from tests.integration.netns_cluster import GRACE_S, TTL_S, Load, NetCluster, prompts
from benchmarks.netns_lab import NetLab, unavailable_reason

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=f"network-namespace faults: {unavailable_reason()}")]

BOUND_S = 45.0      # every request ends within this of its start
SETTLE_S = 15.0     # pools empty within this after the load
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    backend = request.param
    lab = NetLab()
    c = None
    try:
        c = NetCluster(lab, tmp_path_factory.mktemp(f"netns-{backend}"), backend=backend)
        c.wait_ready()
        yield c
    finally:
        if c is not None:
            c.stop()
        lab.close()
        assert lab.leftovers() == [], "namespaces or links left behind"


def _check(c: NetCluster, tally, allow_errors: bool = False) -> None:
    print("\n" + tally.line())
    for note in tally.notes:
        print("   ", note)
    assert tally.hung == 0 and tally.wrong == 0, tally.notes
    assert tally.blocks_left == 0, tally.notes
    if not allow_errors:
        assert tally.errors == 0, tally.notes
    c.wait_active(len(c.engines()), 20)  # the registry converges


async def _wait(pred, timeout_s: float, what: str, step_s: float = 0.05) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what} not within {timeout_s}s")
        await asyncio.sleep(step_s)
    return time.monotonic() - t0


def _running(c: NetCluster, host: str) -> int:
    from tests.integration.netns_cluster import metric

    return int(metric(c.url(host), "xllm_requests_running"))


async def _decode_link_down(c: NetCluster, until_evicted: bool):
    _everyone_up(c)
    load = Load(c, prompts(6), MAX_TOKENS, BOUND_S)
    try:
        await load.reference()
        for p in load.prompts:
            load.start(p)
        # every stream has tokens from its decode, and none has ended (judged by the
        # client: on a loaded machine the engines' gauges lag a step behind)
        await _wait(lambda: all(len(r.ids) >= 2 for r in load.runs)
                    and sum(_running(c, d) for d in c.decodes) > 0, 30,
                    "every stream decoding", step_s=0.1)
        assert not any(r.done for r in load.runs), "a stream ended before the fault"
        counts = {d: _running(c, d) for d in c.decodes}
        victim = max(counts, key=counts.get)
        c.lab.down(victim)
        t_down = time.monotonic()
        if until_evicted:  # lease expired, SUSPECT, evicted: its streams move meanwhile
            await _wait(lambda: c.registered() == len(c.engines()) - 1, TTL_S + GRACE_S + 10,
                        "the victim's eviction", step_s=0.1)
            await asyncio.sleep(1.0)
        else:  # past its lease and its Generations deadline, back before its eviction
            await _wait(lambda: c.active() == len(c.engines()) - 1, TTL_S + 10,
                        "the victim's lease lost", step_s=0.1)
            await asyncio.sleep(1.5)
        c.lab.up(victim)
        down_s = time.monotonic() - t_down
        await load.finish()
        what = "past its eviction" if until_evicted else "past its lease"
        tally = load.tally(f"{c.backend}: decode {victim} link down {down_s:.1f}s ({what}) "
                           f"with {counts[victim]} of {len(load.runs)} streams", SETTLE_S)
        _check(c, tally)
        assert tally.pause_s < down_s + TTL_S + GRACE_S + 8
    finally:
        await load.close()


@pytest.mark.parametrize("cluster", ["ucx", "tcp"], indirect=True)
async def test_decode_link_down_past_its_eviction(cluster):
    """A decode's link goes away for longer than its lease and eviction: its streams move
    to the other decode (recomputed there) and finish with the reference tokens; when the
    link comes back the old decode's late outputs are refused (fenced: the moved streams
    have new ids it never had), it frees its KV and rejoins."""
    await _decode_link_down(cluster, until_evicted=True)


@pytest.mark.parametrize("cluster", ["ucx"], indirect=True)
async def test_decode_link_down_past_its_lease(cluster):
    """Down past its lease and its Generations deadline (it drops its streams), back
    before its eviction: it tells the service what it dropped, the streams move (they
    used to hang until the service's idle timeout)."""
    await _decode_link_down(cluster, until_evicted=False)


LONG = dict(words=16)  # prompts of ~50 tokens: 7 blocks, ~0.9 MB of KV to move each


@pytest.mark.parametrize("cluster", ["ucx"], indirect=True)
async def test_prefill_link_slowed_during_transfers(cluster):
    """The prefill's link at 4 Mbit/s while its KV is pulled (a few hundred KB a request):
    slower hand-overs, the same tokens."""
    c = cluster
    _everyone_up(c)
    load = Load(c, prompts(6, offset=100, **LONG), 40, BOUND_S)
    try:
        await load.reference()
        c.lab.slow("p0", "4mbit")
        try:
            for p in load.prompts:
                load.start(p)
            await load.finish()
        finally:
            c.lab.unslow("p0")
        _check(c, load.tally(f"{c.backend}: prefill link at 4 Mbit/s", SETTLE_S))
    finally:
        await load.close()


@pytest.mark.parametrize("cluster", ["ucx"], indirect=True)
async def test_prefill_partitioned_from_the_decodes(cluster):
    """The prefill cut off from every decode (subnets apart, ctl forwarding off) while all
    still reach etcd and the service: streams already decoding go on; new requests, which
    the prefill cannot place on a decode, are served whole by a decode (the service's
    fallback) or get through once it heals, none fails; after it heals every request gets
    through again."""
    c = cluster
    _everyone_up(c)
    load = Load(c, prompts(8, offset=200), 80, BOUND_S)
    try:
        await load.reference()
        for p in load.prompts[:4]:
            load.start(p)
        await _wait(lambda: all(len(r.ids) >= 2 for r in load.runs), 20, "streams decoding",
                    step_s=0.1)
        c.lab.partition(True)
        try:
            for p in load.prompts[4:]:
                load.start(p)
            await asyncio.sleep(4.0)
        finally:
            c.lab.partition(False)
        await load.finish()
        during = load.tally(f"{c.backend}: prefill partitioned from the decodes 4s", SETTLE_S)
        _check(c, during)
        assert all(r.done for r in load.runs[:4]), "a stream already decoding failed"
        after = Load(c, load.prompts[4:], 80, BOUND_S)
        try:
            after.refs = load.refs
            for p in after.prompts:
                after.start(p)
            await after.finish()
            _check(c, after.tally(f"{c.backend}: after the partition healed", SETTLE_S))
        finally:
            await after.close()
    finally:
        await load.close()


@pytest.mark.parametrize("cluster", ["ucx"], indirect=True)
async def test_cancel_at_each_moment_of_the_hand_over(cluster):
    """Clients hang up at spread moments (queued, prefilling, KV in flight over a slowed
    link, first decode tokens, decoding) beside streams that run to the end: those end
    with the reference tokens, and nothing stays allocated anywhere."""
    c = cluster
    _everyone_up(c)
    load = Load(c, prompts(9, offset=300, **LONG), 60, BOUND_S)
    try:
        await load.reference()
        c.lab.slow("p0", "8mbit")
        try:
            for i, p in enumerate(load.prompts):
                load.start(p, cancel_after_s=None if i % 3 == 2 else 0.05 + 0.4 * i)
            await load.finish()
        finally:
            c.lab.unslow("p0")
        tally = load.tally(f"{c.backend}: cancels across the hand-over", SETTLE_S)
        _check(c, tally)
        assert tally.cancelled >= 3
    finally:
        await load.close()


def _stopped(c: NetCluster, host: str, timeout_s: float = 30.0) -> None:
    """`host`'s engine has exited: it is given `timeout_s` to end a drain, then killed."""
    try:
        c.procs[host].popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        c.procs[host].kill()


def _everyone_up(c: NetCluster) -> None:
    """An engine a previous test stopped (drained, killed) comes back first."""
    for host in c.engines():
        if not c.procs[host].alive():
            c.start_engine(host).wait_ready(180)
    c.wait_active(len(c.engines()), 30)


@pytest.mark.parametrize("cluster", ["ucx"], indirect=True)
async def test_prefill_drain_during_transfers(cluster):
    """SIGTERM to the prefill while its KV is being pulled over a slowed link: the drain
    waits for the hand-overs, the streams end with the reference tokens."""
    c = cluster
    _everyone_up(c)
    load = Load(c, prompts(4, offset=400, **LONG), 40, BOUND_S)
    try:
        await load.reference()
        c.lab.slow("p0", "4mbit")
        try:
            for p in load.prompts:
                load.start(p)
            await _wait(lambda: any(r.ids for r in load.runs), 20, "a first token",
                        step_s=0.05)
            c.procs["p0"].popen.send_signal(15)
            await load.finish()
        finally:
            c.lab.unslow("p0")
        tally = load.tally(f"{c.backend}: prefill drained during transfers", SETTLE_S)
        print("\n" + tally.line(), tally.notes)
        assert tally.hung == 0 and tally.wrong == 0 and tally.blocks_left == 0
        assert tally.exact == len(load.runs), tally.notes  # the drain waited for the pulls
        assert c.procs["p0"].popen.wait(30) == 0
    finally:
        await load.close()
        _stopped(c, "p0")  # never left draining for the next test


@pytest.mark.parametrize("cluster", ["ucx", "tcp"], indirect=True)
async def test_prefill_killed_mid_transfer(cluster):
    """SIGKILL to the prefill while decodes pull its KV over a slowed link: every request
    whose first token was out goes on with the reference tokens (its decode had the KV, or
    a decode recomputes the prompt: the pull failed, or the prefill's eviction came
    first); one still queued on the prefill may end with a clean error; no decode keeps a
    block."""
    c = cluster
    _everyone_up(c)
    load = Load(c, prompts(6, offset=500, **LONG), 40, BOUND_S)
    try:
        await load.reference()
        c.lab.slow("p0", "4mbit")
        try:
            for p in load.prompts:
                load.start(p)
            await _wait(lambda: any(r.ids for r in load.runs), 20, "a first token",
                        step_s=0.05)
            await asyncio.sleep(0.3)
            c.procs["p0"].kill()
            started = [i for i, r in enumerate(load.runs) if r.ids]
            await load.finish()
        finally:
            c.lab.unslow("p0")
        tally = load.tally(f"{c.backend}: prefill killed mid-transfer", SETTLE_S)
        print("\n" + tally.line())
        for note in tally.notes:
            print("   ", note)
        assert tally.hung == 0 and tally.wrong == 0, tally.notes
        assert tally.blocks_left == 0, tally.notes  # the decodes' blocks set aside for it
        assert all(load.runs[i].done for i in started), tally.notes
    finally:
        await load.close()
