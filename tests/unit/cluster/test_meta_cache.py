"""MetaCache: fresh metas from memory, a failed etcd read falls back to the last known."""
from __future__ import annotations

import pytest

from xllm_py.cluster.etcd_client import EtcdError
from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.cluster.meta_cache import MetaCache


class _Etcd:
    def __init__(self) -> None:
        self.metas: dict[str, InstanceMeta] = {}
        self.down = False
        self.reads = 0

    async def fetch(self, name: str) -> InstanceMeta | None:
        self.reads += 1
        if self.down:
            raise EtcdError("etcd unreachable")
        return self.metas.get(name)


@pytest.fixture
def setup():
    etcd, now = _Etcd(), [100.0]
    return etcd, now, MetaCache(etcd.fetch, ttl_s=2.0, clock=lambda: now[0])


async def test_fresh_entries_come_from_memory(setup):
    etcd, now, cache = setup
    etcd.metas["d:1"] = InstanceMeta(name="d:1", incarnation_id="a")
    assert (await cache.get("d:1")).incarnation_id == "a"
    etcd.metas["d:1"] = InstanceMeta(name="d:1", incarnation_id="b")
    now[0] += 1.0
    assert (await cache.get("d:1")).incarnation_id == "a" and etcd.reads == 1
    now[0] += 1.5  # stale: read again, the restarted instance is seen
    assert (await cache.get("d:1")).incarnation_id == "b" and etcd.reads == 2


async def test_etcd_down_serves_the_last_known_meta(setup):
    etcd, now, cache = setup
    etcd.metas["d:1"] = InstanceMeta(name="d:1", incarnation_id="a")
    await cache.get("d:1")
    etcd.down = True
    now[0] += 60
    assert (await cache.get("d:1")).incarnation_id == "a"
    with pytest.raises(EtcdError):  # never seen: nothing to fall back to
        await cache.get("d:2")


async def test_a_deregistered_instance_is_read_again(setup):
    etcd, now, cache = setup
    etcd.metas["d:1"] = InstanceMeta(name="d:1")
    await cache.get("d:1")
    del etcd.metas["d:1"]
    now[0] += 3
    assert await cache.get("d:1") is None
    etcd.down = True
    with pytest.raises(EtcdError):  # a deregistered instance is not served from memory
        await cache.get("d:1")
    etcd.down = False
    etcd.metas["d:1"] = InstanceMeta(name="d:1", incarnation_id="c")
    assert (await cache.get("d:1")).incarnation_id == "c"


async def test_invalidate_reads_etcd_again_at_once(setup):
    """A call to a cached meta's address failed: invalidate, and the next get sees the
    instance restarted under its name (new address) without waiting for the TTL."""
    etcd, now, cache = setup
    etcd.metas["d:1"] = InstanceMeta(name="d:1", incarnation_id="a", rpc_address="h:1")
    assert (await cache.get("d:1")).rpc_address == "h:1"
    etcd.metas["d:1"] = InstanceMeta(name="d:1", incarnation_id="b", rpc_address="h:2")
    assert (await cache.get("d:1")).rpc_address == "h:1"  # still fresh
    cache.invalidate("d:1")
    cache.invalidate("never-seen")  # nothing to drop: no error
    assert (await cache.get("d:1")).rpc_address == "h:2" and etcd.reads == 2
