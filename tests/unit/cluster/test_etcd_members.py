"""EtcdClient over several members: parsing, moving to the next member, watch resumption.

A fake aetcd client per member stands in for etcd (one class under test: EtcdClient);
the real three-member cluster with its leader killed is tests/integration/test_etcd_members.py.
"""
from __future__ import annotations

import asyncio
import types

import aetcd.exceptions
import pytest

from xllm_py.cluster.etcd_client import EtcdClient, EtcdError
from xllm_py.utils.cli import parse_etcd_endpoints


class FakeMember:
    """What EtcdClient asks of aetcd.Client, for one member that is up or down."""

    def __init__(self, endpoint: str, store: dict[bytes, bytes], log: list[str]) -> None:
        self.endpoint = endpoint
        self.store = store
        self.log = log
        self.down = False
        self.hang = False
        self.watch_events: asyncio.Queue | None = None
        self.watch_starts: list[int | None] = []
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

    async def put(self, key: bytes, value: bytes, lease=None):  # noqa: ANN001
        await self._answer()
        self.store[key] = value
        return types.SimpleNamespace(header=types.SimpleNamespace(revision=len(self.store)))

    async def get(self, key: bytes):  # noqa: ANN201
        await self._answer()
        if key not in self.store:
            return None
        return types.SimpleNamespace(value=self.store[key], mod_revision=1, lease=0)

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
    log: list[str] = []
    members: dict[str, FakeMember] = {}

    for endpoint in ENDPOINTS.split(","):
        members[endpoint] = FakeMember(endpoint, store, log)
    monkeypatch.setattr(EtcdClient, "_make_client", lambda self, endpoint: members[endpoint])
    return types.SimpleNamespace(members=members, log=log, store=store)


ENDPOINTS = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"


def test_parse_endpoints() -> None:
    assert parse_etcd_endpoints("a:1") == ["a:1"]
    assert parse_etcd_endpoints("a:1, b:2,http://c:3") == ["a:1", "b:2", "http://c:3"]
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


async def test_a_hung_member_spends_the_deadline_and_the_next_call_moves_on(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=0.4)
    await client.connect()
    cluster.members["127.0.0.1:1"].hang = True
    with pytest.raises(EtcdError, match="deadline of 0.4s exceeded"):
        await client.put("k", "v")  # the call keeps its deadline: no second try past it
    assert client.endpoint == "127.0.0.1:2"
    await client.put("k", "v")
    assert cluster.log[-1] == "127.0.0.1:2" and cluster.store == {b"k": b"v"}


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
    await asyncio.sleep(0.05)
    first = cluster.members["127.0.0.1:1"]
    assert first.watch_starts == [5]
    first.watch_events.put_nowait(_event(b"XLLM:MIX:a", 5))
    first.watch_events.put_nowait(_event(b"XLLM:MIX:b", 6))
    await asyncio.sleep(0.05)
    first.down = True
    first.watch_events.put_nowait(aetcd.exceptions.ConnectionFailedError("gone"))
    await asyncio.sleep(0.05)
    second = cluster.members["127.0.0.1:2"]
    assert second.watch_starts == [7]  # from the revision after the last one delivered
    second.watch_events.put_nowait(_event(b"XLLM:MIX:c", 7))
    await asyncio.sleep(0.05)
    assert seen == [5, 6, 7] and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_watch_gives_up_after_every_member_broke(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=1.0)
    it = client.watch_prefix("XLLM:", start_revision=1).__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    for endpoint in ENDPOINTS.split(","):
        while cluster.members[endpoint].watch_events is None:
            await asyncio.sleep(0.01)
        cluster.members[endpoint].watch_events.put_nowait(aetcd.exceptions.ConnectionFailedError("gone"))
    with pytest.raises(EtcdError, match="watch on 'XLLM:' broke"):
        await nxt


async def test_a_compacted_watch_is_not_reopened(cluster) -> None:  # noqa: ANN001
    client = EtcdClient(ENDPOINTS, timeout_s=1.0)
    it = client.watch_prefix("XLLM:", start_revision=1).__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    await asyncio.sleep(0.05)
    cluster.members["127.0.0.1:1"].watch_events.put_nowait(aetcd.exceptions.RevisionCompactedError(9))
    with pytest.raises(EtcdError, match="compacted"):
        await nxt
    assert client.num_rotations == 0
