"""EtcdClient over several members: parsing, moving to the next member, watch resumption.

A fake aetcd client per member stands in for etcd (one class under test: EtcdClient);
the real three-member cluster with its leader killed is tests/integration/test_etcd_members.py.
"""
from __future__ import annotations

import asyncio
import types

import aetcd.exceptions
import aetcd.rpc
import aetcd.transactions
import pytest

from xllm_py.cluster.etcd_client import MASTER_KEY, EtcdClient, EtcdError
from xllm_py.utils.cli import parse_etcd_endpoints
from xllm_service.election import MasterElection
from tests.waiting import wait_until


class FakeMember:
    """What EtcdClient asks of aetcd.Client, for one member that is up or down."""

    def __init__(self, endpoint: str, store: dict[bytes, bytes], log: list[str],
                 leases: dict[bytes, int]) -> None:
        self.endpoint = endpoint
        self.store = store
        self.leases = leases    # key -> its lease (shared, like the store)
        self.log = log
        self.down = False
        self.hang = False
        # "transaction" / "lease": the write commits, then this is raised instead of
        # its reply (the member died or the deadline passed after the commit).
        self.lost_reply: dict[str, BaseException] = {}
        self.watch_events: asyncio.Queue | None = None
        self.watch_starts: list[int | None] = []
        self.granted: list[int] = []
        self.closed = False

    async def _answer(self) -> None:
        self.log.append(self.endpoint)
        if self.hang:
            await asyncio.sleep(3600)
        if self.down:
            raise aetcd.exceptions.ConnectionFailedError("connection refused")

    async def connect(self) -> None:
        await self._answer()

    async def close(self) -> None:
        self.closed = True

    def _reply(self, call: str) -> None:
        if call in self.lost_reply:
            raise self.lost_reply[call]

    async def put(self, key: bytes, value: bytes, lease=None):  # noqa: ANN001
        await self._answer()
        self.store[key] = value
        self.leases[key] = lease or 0
        return types.SimpleNamespace(header=types.SimpleNamespace(revision=len(self.store)))

    async def get(self, key: bytes):  # noqa: ANN201
        await self._answer()
        if key not in self.store:
            return None
        return types.SimpleNamespace(value=self.store[key], mod_revision=1, lease=self.leases[key])

    async def transaction(self, compare, success=None, failure=None):  # noqa: ANN001, ANN201
        """Equality compares on a key's version (present or not) or value; puts, gets."""
        await self._answer()

        def holds(c) -> bool:  # noqa: ANN001
            assert c.op == aetcd.rpc.Compare.EQUAL
            if isinstance(c, aetcd.transactions.Version):
                return int(c.key in self.store) == c.value
            return self.store.get(c.key) == c.value

        succeeded = all(holds(c) for c in compare)
        responses = []
        for op in (success if succeeded else failure) or []:
            if isinstance(op, aetcd.transactions.Put):
                self.store[op.key], self.leases[op.key] = op.value, op.lease or 0
                responses.append(None)
            elif isinstance(op, aetcd.transactions.Delete):
                self.store.pop(op.key, None)
                responses.append(None)
            else:
                kv = types.SimpleNamespace(lease=self.leases.get(op.key))
                responses.append([(self.store[op.key], kv)] if op.key in self.store else [])
        self._reply("transaction")
        return succeeded, responses

    async def lease(self, ttl: int):  # noqa: ANN201
        await self._answer()
        lease = types.SimpleNamespace(id=100 + len(self.log))  # unique across members
        self.granted.append(lease.id)
        self._reply("lease")
        return lease

    async def revoke_lease(self, lease_id: int) -> None:
        await self._answer()
        for key in [k for k, lease in self.leases.items() if lease == lease_id]:
            del self.store[key], self.leases[key]

    async def refresh_lease(self, lease_id: int):  # noqa: ANN201
        await self._answer()
        return types.SimpleNamespace(TTL=3)

    async def watch_prefix(self, key: bytes, start_revision: int | None = None):  # noqa: ANN201
        await self._answer()
        self.watch_starts.append(start_revision)
        queue = self.watch_events = asyncio.Queue()

        async def iterate():  # noqa: ANN202
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item

        return _Watch(iterate())


class _Watch:
    """aetcd's Watch: async-iterable, cancellable."""

    def __init__(self, it) -> None:  # noqa: ANN001
        self._it = it

    def __aiter__(self):  # noqa: ANN204
        return self._it

    async def cancel(self) -> None:
        pass


def _event(key: bytes, rev: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(kind="PUT", kv=types.SimpleNamespace(key=key, value=b"v", mod_revision=rev))


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    store: dict[bytes, bytes] = {}
    leases: dict[bytes, int] = {}
    log: list[str] = []
    members: dict[str, FakeMember] = {}

    for endpoint in ENDPOINTS.split(","):
        members[endpoint] = FakeMember(endpoint, store, log, leases)
    monkeypatch.setattr(EtcdClient, "_make_client", lambda self, endpoint: members[endpoint])
    return types.SimpleNamespace(members=members, log=log, store=store)


ENDPOINTS = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"


def test_parse_endpoints() -> None:
    assert parse_etcd_endpoints("a:1") == ["a:1"]
    assert parse_etcd_endpoints("a:1, b:2,http://c:3,https://d:4") == ["a:1", "b:2", "c:3", "d:4"]
    for bad in ("", "a:1,", "a:1,b", "a:1,:2", "a:x", "a:70000"):
        with pytest.raises(ValueError, match="host:port"):
            parse_etcd_endpoints(bad)
    with pytest.raises(ValueError, match="'b'"):
        EtcdClient("a:1,b")


async def test_a_call_moves_past_a_dead_member(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=1.0)
    await client.put("k", "v")
    assert cluster.log == ["127.0.0.1:1"]
    cluster.members["127.0.0.1:1"].down = True
    assert (await client.get("k")).value == b"v"
    assert cluster.log[1:] == ["127.0.0.1:1", "127.0.0.1:2"]
    assert client.endpoint == "127.0.0.1:2" and client.num_rotations == 1
    # Later calls stay on the member that answered.
    await client.refresh_lease(7)
    assert cluster.log[-1] == "127.0.0.1:2" and client.num_rotations == 1


async def test_a_hung_member_keeps_its_share_and_the_next_answers(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=1.5)
    await client.connect()
    cluster.members["127.0.0.1:1"].hang = True
    await client.put("k", "v")  # within the call's deadline, on the next member
    assert cluster.log[-2:] == ["127.0.0.1:1", "127.0.0.1:2"] and cluster.store == {b"k": b"v"}
    assert client.endpoint == "127.0.0.1:2"


async def test_every_member_hung_fails_within_the_deadline(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=0.4)
    for member in cluster.members.values():
        member.hang = True
    with pytest.raises(EtcdError, match="deadline of 0.4s exceeded"):
        await client.put("k", "v")


async def test_a_write_is_not_sent_again_after_its_member_went_silent(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=0.5)
    silent = aetcd.exceptions.ConnectionTimeoutError("deadline exceeded")
    for member in cluster.members.values():
        member.lost_reply = {"transaction": silent, "lease": silent}
    with pytest.raises(EtcdError, match="ConnectionTimeoutError"):
        await client.grant_lease(3)
    with pytest.raises(EtcdError, match="ConnectionTimeoutError"):
        await client.put_if_absent("k", "v", 7)
    # each committed once on the member that went silent, never sent again: the next
    # call went to the next member
    assert cluster.log == ["127.0.0.1:1", "127.0.0.1:2"]
    assert [len(m.granted) for m in cluster.members.values()] == [1, 0, 0]
    assert cluster.store == {b"k": b"v"}


async def test_put_if_absent_that_finds_its_own_write_has_created_the_key(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=0.5)
    cluster.members["127.0.0.1:1"].lost_reply = {
        "transaction": aetcd.exceptions.ConnectionFailedError("reset")}
    assert await client.put_if_absent("k", "me", 7) == (True, b"me")  # sent again on member 2
    assert client.endpoint == "127.0.0.1:2"
    # the same value on another lease, or another value, is somebody else's key
    assert await client.put_if_absent("k", "me", 8) == (False, b"me")
    assert await client.put_if_absent("k", "you", 7) == (False, b"me")


async def test_a_campaign_whose_write_went_unanswered_wins_the_next_round(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=0.5)
    election = MasterElection(client, "me:1", ttl_s=3.0)
    first = cluster.members["127.0.0.1:1"]
    first.lost_reply = {"transaction": aetcd.exceptions.ConnectionTimeoutError("deadline")}
    with pytest.raises(EtcdError):
        await election._campaign()
    # the key written under the unanswered transaction went with its lease
    assert MASTER_KEY.encode() not in cluster.store and not election.is_master
    await election._campaign()
    assert election.is_master and cluster.store[MASTER_KEY.encode()] == b"me:1"


async def test_a_call_after_close_fails_and_opens_no_client(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=0.5)
    await client.put("k", "v")
    await client.close()
    assert cluster.members["127.0.0.1:1"].closed
    with pytest.raises(EtcdError, match="closed"):
        await client.get("k")
    assert cluster.log == ["127.0.0.1:1"]


async def test_every_member_down_fails_once_round_within_the_deadline(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=0.5)
    for member in cluster.members.values():
        member.down = True
    with pytest.raises(EtcdError, match="ConnectionFailedError"):
        await client.get("k")
    # Each member tried once: no loop without end.
    assert cluster.log == ENDPOINTS.split(",")


async def test_a_single_member_does_not_rotate(cluster) -> None:  # noqa: ANN001
    client = EtcdClient("127.0.0.1:1", timeout_s=0.5)
    await client.connect()
    cluster.members["127.0.0.1:1"].down = True
    with pytest.raises(EtcdError, match="127.0.0.1:1"):
        await client.get("k")
    assert cluster.log == ["127.0.0.1:1", "127.0.0.1:1"] and client.num_rotations == 0


async def test_a_watch_resumes_on_the_next_member_after_the_last_event(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=1.0)
    seen: list[int] = []

    async def consume() -> None:
        async for ev in client.watch_prefix("XLLM:", start_revision=5):
            seen.append(ev.revision)

    task = asyncio.create_task(consume())
    first, second = cluster.members["127.0.0.1:1"], cluster.members["127.0.0.1:2"]
    await wait_until(lambda: first.watch_starts, 2.0)
    assert first.watch_starts == [5]
    first.watch_events.put_nowait(_event(b"XLLM:MIX:a", 5))
    first.watch_events.put_nowait(_event(b"XLLM:MIX:b", 6))
    await wait_until(lambda: len(seen) == 2, 2.0)
    first.down = True
    first.watch_events.put_nowait(aetcd.exceptions.ConnectionFailedError("gone"))
    await wait_until(lambda: second.watch_starts, 2.0)
    assert second.watch_starts == [7]  # from the revision after the last one delivered
    second.watch_events.put_nowait(_event(b"XLLM:MIX:c", 7))
    await wait_until(lambda: len(seen) == 3, 2.0)
    assert seen == [5, 6, 7] and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_watch_gives_up_after_every_member_broke(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=1.0)
    it = client.watch_prefix("XLLM:", start_revision=1).__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    for endpoint in ENDPOINTS.split(","):
        await wait_until(lambda: cluster.members[endpoint].watch_events is not None, 2.0)
        cluster.members[endpoint].watch_events.put_nowait(aetcd.exceptions.ConnectionFailedError("gone"))
    with pytest.raises(EtcdError, match="watch on 'XLLM:' broke"):
        await nxt


async def test_a_compacted_watch_is_not_reopened(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=1.0)
    it = client.watch_prefix("XLLM:", start_revision=1).__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    first = cluster.members["127.0.0.1:1"]
    await wait_until(lambda: first.watch_events is not None, 2.0)
    first.watch_events.put_nowait(aetcd.exceptions.RevisionCompactedError(9))
    with pytest.raises(EtcdError, match="compacted"):
        await nxt
    assert client.num_rotations == 0
