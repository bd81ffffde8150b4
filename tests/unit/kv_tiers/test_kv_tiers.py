"""The KV tiers one class at a time (xllm_py/kv_tiers/): the host tier's LRU bound, the disk
tier's checks (a truncated, flipped or misnamed file is a miss and is removed), its index
after a restart and its bound, a disk that refuses writes; keys that differ with anything
that changes the bytes; the writer dropping (and counting) what a full queue cannot take;
the store's breaker around a client that fails or hangs."""
from __future__ import annotations

import os
import threading
import time

import pytest

from xllm_py.kv_tiers.disk import DiskTier
from xllm_py.kv_tiers.host import HostTier
from xllm_py.kv_tiers.keys import TierKeyspace
from xllm_py.kv_tiers.stack import TierStack
from xllm_py.kv_tiers.store import MooncakeStore


def test_host_tier_keeps_the_most_recently_used_within_its_bound():
    t = HostTier(300)
    assert t.put("a", b"x" * 100) == [] and t.put("b", b"y" * 100) == []
    assert t.get("a") == b"x" * 100  # a is now the most recent
    assert t.put("c", b"z" * 150) == [("b", b"y" * 100)]
    assert t.used_bytes == 250 and t.contains("a") and not t.contains("b")
    assert t.put("huge", b"h" * 301) == [("huge", b"h" * 301)]  # larger than the tier
    assert not t.contains("huge")


def test_disk_tier_returns_what_it_wrote_and_survives_a_restart(tmp_path):
    d = DiskTier(str(tmp_path), 1 << 20)
    assert d.put("k1", b"one" * 10) and d.put("k2", b"two" * 10)
    again = DiskTier(str(tmp_path), 1 << 20)
    assert again.contains("k1") and again.get("k2") == b"two" * 10
    assert again.used_bytes == d.used_bytes


@pytest.mark.parametrize("damage", ["truncate", "flip", "rename", "empty"])
def test_a_damaged_disk_file_is_a_miss_and_is_removed(tmp_path, damage):
    d = DiskTier(str(tmp_path), 1 << 20)
    d.put("key-a", b"payload" * 20)
    path = d._path("key-a")
    raw = bytearray(open(path, "rb").read())
    if damage == "truncate":
        raw = raw[:-5]
    elif damage == "flip":
        raw[-3] ^= 0x01
    elif damage == "empty":
        raw = bytearray()
    else:  # another key's file under this name
        d.put("key-b", b"payload" * 20)
        raw = bytearray(open(d._path("key-b"), "rb").read())
    open(path, "wb").write(bytes(raw))
    assert d.get("key-a") is None
    assert d.num_corrupt == 1 and not d.contains("key-a") and not os.path.exists(path)


def test_disk_tier_evicts_the_least_recently_used_files(tmp_path):
    d = DiskTier(str(tmp_path), 3 * 1100)
    for k in ("a", "b", "c"):
        assert d.put(k, b"x" * 1000)
    d.get("a")
    assert d.put("d", b"x" * 1000)
    assert [k for k in "abcd" if d.contains(k)] == ["a", "c", "d"]
    assert not os.path.exists(d._path("b"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to a read-only directory")
def test_a_read_only_disk_drops_the_block_and_counts_it(tmp_path):
    d = DiskTier(str(tmp_path), 1 << 20)
    os.chmod(tmp_path, 0o500)
    try:
        assert d.put("zz", b"x") is False
    finally:
        os.chmod(tmp_path, 0o700)
    assert d.num_write_errors == 1 and not d.contains("zz")


def test_a_full_disk_drops_the_block_and_counts_it(tmp_path, monkeypatch):
    d = DiskTier(str(tmp_path), 1 << 20)

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("xllm_py.kv_tiers.disk.os.replace", full)
    assert d.put("zz", b"x") is False
    assert d.num_write_errors == 1 and not d.contains("zz")
    assert not any(name.endswith(".tmp") for _, _, files in os.walk(tmp_path) for name in files)


def test_keys_differ_with_everything_that_changes_the_bytes():
    base = TierKeyspace(model="m:abc", kv_dtype="float32", block_size=16, layout="L",
                        num_slots=3, num_kv_heads=1, head_dim=256, group_windows=(0, 512))
    variants = [dict(model="m:abd"), dict(kv_dtype="bfloat16"), dict(block_size=32),
                dict(num_slots=2), dict(num_kv_heads=2), dict(head_dim=128),
                dict(head_slice=(0, 1)), dict(group_windows=(0, 1024))]
    import dataclasses

    keys = {base.key(7, 0)} | {dataclasses.replace(base, **v).key(7, 0) for v in variants}
    assert len(keys) == 1 + len(variants)
    assert base.key(7, 0) != base.key(7, 1) != base.key(8, 1)


def test_the_writer_drops_and_counts_what_a_full_queue_cannot_take():
    stack = TierStack(HostTier(1 << 20), queue_items=1)
    gate = threading.Event()
    real = stack._write
    stack._write = lambda keys, rows: (gate.wait(5), real(keys, rows))  # a slow tier
    try:
        assert stack.offer(["a"], [b"1"])  # taken by the writer, which now waits
        deadline = time.monotonic() + 5
        while stack._queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stack.offer(["b"], [b"2"])  # queued
        assert not stack.offer(["c", "d"], [b"3", b"4"])  # full: dropped
        assert stack.num_dropped_blocks == 2
        gate.set()
        assert stack.flush()
        assert stack.known("a") and stack.known("b") and not stack.known("c")
    finally:
        gate.set()
        stack.close()


class _Client:
    """A store client whose calls fail or hang on demand."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.mode = "ok"

    def setup(self, *args) -> int:
        return 0

    def _check(self) -> None:
        if self.mode == "hang":
            time.sleep(0.5)
        if self.mode != "ok":
            raise RuntimeError("master gone")

    def batch_is_exist(self, keys):
        self._check()
        return [1 if k in self.data else 0 for k in keys]

    def put_batch(self, keys, values):
        self._check()
        self.data.update(zip(keys, values))
        return 0

    def get_batch(self, keys):
        self._check()
        return [self.data.get(k, b"") for k in keys]

    def close(self) -> None:
        pass


@pytest.mark.parametrize("failure", ["error", "hang"])
def test_the_store_answers_unavailable_at_once_while_its_breaker_is_open(failure):
    client = _Client()
    store = MooncakeStore("m:1", "etcd://e:2", timeout_s=0.2, retry_s=0.3,
                          client_factory=lambda: client)
    assert store.connect()
    try:
        assert store.put(["a"], [b"1"]) == 1 and store.get(["a", "b"]) == [b"1", None]
        client.mode = failure
        assert store.exist(["a"]) is None and store.num_errors == 1
        t0 = time.monotonic()
        assert store.exist(["a"]) is None and store.get(["a"]) == [None]
        assert time.monotonic() - t0 < 0.1  # (open: no call made)
        client.mode = "ok"
        time.sleep(0.6)  # past the retry time and any call still hanging
        assert store.exist(["a", "b"]) == [True, False]
    finally:
        store.close()


def test_a_store_that_comes_back_gets_the_host_tier_again():
    """A restarted master lost its blocks, and those computed while it was down were never
    put: once a call succeeds again the writer puts the host tier's blocks back."""
    client = _Client()
    store = MooncakeStore("m:1", "etcd://e:2", timeout_s=0.2, retry_s=0.1,
                          client_factory=lambda: client)
    assert store.connect()
    stack = TierStack(HostTier(1 << 20), store=store)
    try:
        stack.offer(["a"], [b"1"])
        assert stack.flush() and client.data == {"a": b"1"}
        client.mode = "error"
        assert store.exist(["a"]) is None  # the breaker opens
        stack.offer(["b"], [b"2"])  # (not put: the store is down)
        assert stack.flush() and "b" not in client.data
        client.mode, client.data = "ok", {}  # back, empty
        time.sleep(0.15)
        assert store.exist(["a"]) == [False]  # the call that finds it back
        deadline = time.monotonic() + 5
        while client.data != {"a": b"1", "b": b"2"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.data == {"a": b"1", "b": b"2"}
        assert stack.known("a") and stack.known("b")
    finally:
        stack.close()
