"""TierStack: the tiers below one engine's pool, fastest first (host, disk, store), with a
background writer.

Writes are write-through: each block the pool computes is offered once (`offer`) and the
writer thread puts it into every tier. A CPU engine computes KV at a few MB/s a core, far
below what memory, a disk or the store take, so a block costs one copy per tier and
eviction never has to write anything (a restart finds every block on disk, the other
instances every block in the store). The writer's queue is bounded: when it is full an
offer is dropped and counted, and the engine step never waits.

Reads (`where`, `read`: the engine's loader thread) look in the fastest tier first; a block
read from the disk or the store is kept in host memory for the next read.

Counters per tier (hits, misses, bytes, load seconds), the store's errors and the writer's
drops are plain attributes the engine's /metrics reads.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from xllm_py.kv_tiers.disk import DiskTier
from xllm_py.kv_tiers.host import HostTier
from xllm_py.kv_tiers.store import MooncakeStore

logger = logging.getLogger(__name__)

TIERS = ("host", "disk", "store")
# Keys known to be in the store (put or read here): bounded, oldest forgotten first.
STORE_KNOWN_MAX = 1 << 20
# Putting the host tier into a store that came back: this many blocks at a time, while
# no offer waited this long.
RESYNC_BATCH = 64
RESYNC_IDLE_S = 0.05


@dataclasses.dataclass
class TierCounters:
    hits: int = 0  # blocks read from this tier
    misses: int = 0  # blocks looked for here and not found
    bytes: int = 0
    load_s: float = 0.0
    written: int = 0  # blocks put here


class TierStack:
    def __init__(self, host: HostTier | None = None, disk: DiskTier | None = None,
                 store: MooncakeStore | None = None, queue_items: int = 256) -> None:
        self.host, self.disk, self.store = host, disk, store
        self.counters = {name: TierCounters() for name in TIERS}
        self.num_dropped_blocks = 0  # offers the writer's full queue refused
        self._store_known: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._known_lock = threading.Lock()
        self._store_generation = store.generation if store is not None else 0
        self._resync: list[str] = []  # host tier keys to put into the store again
        self._queue: queue.Queue = queue.Queue(maxsize=queue_items)
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

    @property
    def tiers(self) -> list[str]:
        return [name for name in TIERS if getattr(self, name) is not None]

    def close(self) -> None:
        try:
            self._queue.put(None, timeout=5)  # (after what is queued: a full queue drains)
        except queue.Full:
            logger.warning("KV tier writer still busy at close; unwritten blocks are lost")
        self._writer.join(timeout=5)
        if self.store is not None:
            self.store.close()

    # -- writes (offer: engine thread; the rest: the writer thread) ----------------------
    def known(self, key: str) -> bool:
        """Whether every tier already has `key` (an offer of it would change nothing)."""
        return ((self.host is None or self.host.contains(key))
                and (self.disk is None or self.disk.contains(key))
                and (self.store is None or key in self._store_known))

    def offer(self, keys: Sequence[str], rows: Any) -> bool:
        """Queue blocks for writing (`rows[i]`: the bytes of `keys[i]`, any buffer); False
        when the queue is full (the blocks are dropped and counted)."""
        try:
            self._queue.put_nowait((list(keys), rows))
        except queue.Full:
            self.num_dropped_blocks += len(keys)
            return False
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every offer so far is written (tests, shutdown)."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=RESYNC_IDLE_S if self._resync else 1.0)
            except queue.Empty:
                self._check_store_generation()
                if self._resync:
                    self._resync_some()
                continue
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._write(*item)
            except Exception:
                logger.exception("KV tier writer: a batch of blocks was lost")

    def _check_store_generation(self) -> None:
        """After an outage the store may have lost what it held (a restarted master) and
        lacks what was computed meanwhile: forget what it was known to hold, and put what
        the host tier holds again, a batch at a time while the writer is idle."""
        store = self.store
        if store is None or store.generation == self._store_generation:
            return
        self._store_generation = store.generation
        with self._known_lock:
            self._store_known.clear()
        self._resync = self.host.keys() if self.host is not None else []
        logger.info("KV store is back: putting the host tier's %d blocks again", len(self._resync))

    def _resync_some(self) -> None:
        batch, self._resync = self._resync[:RESYNC_BATCH], self._resync[RESYNC_BATCH:]
        if not self.store.available:
            self._resync = []  # (down again: the next return starts over)
            return
        pairs = [(k, d) for k in batch if (d := self.host.get(k)) is not None]
        if pairs:
            self.counters["store"].written += self.store.put([k for k, _ in pairs],
                                                             [d for _, d in pairs])
            if self.store.available:
                self._note_in_store(k for k, _ in pairs)

    def _write(self, keys: list[str], rows: Any) -> None:
        self._check_store_generation()
        datas = [bytes(rows[i]) for i in range(len(keys))]
        for key, data in zip(keys, datas):
            if self.host is not None and not self.host.contains(key):
                self.host.put(key, data)
                self.counters["host"].written += 1
            if self.disk is not None and not self.disk.contains(key) and self.disk.put(key, data):
                self.counters["disk"].written += 1
        if self.store is not None:
            new = [(k, d) for k, d in zip(keys, datas) if k not in self._store_known]
            if new and self.store.available:
                self.counters["store"].written += self.store.put([k for k, _ in new],
                                                                 [d for _, d in new])
                if self.store.available:
                    self._note_in_store(k for k, _ in new)

    def _note_in_store(self, keys) -> None:
        """(The writer and the loader thread both note: one lock.)"""
        known = self._store_known
        with self._known_lock:
            for key in keys:
                known[key] = None
                known.move_to_end(key)
            while len(known) > STORE_KNOWN_MAX:
                known.popitem(last=False)

    # -- reads (the loader thread) -----------------------------------------------------
    def where(self, keys: Sequence[str]) -> list[str | None]:
        """The fastest tier holding each key (None: none does). The store is asked once,
        for the keys no local tier has; when it cannot answer they are misses."""
        out: list[str | None] = []
        ask: list[int] = []
        for i, key in enumerate(keys):
            if self.host is not None and self.host.contains(key):
                out.append("host")
            elif self.disk is not None and self.disk.contains(key):
                out.append("disk")
            else:
                out.append(None)
                ask.append(i)
        if ask and self.store is not None and self.store.available:
            found = self.store.exist([keys[i] for i in ask])
            for i, there in zip(ask, found or []):
                if there:
                    out[i] = "store"
        return out

    def read(self, keys: Sequence[str], where: Sequence[str | None]) -> list[bytes | None]:
        """Each key's bytes from the tier `where` names (None: a miss, e.g. a corrupt file
        or a store that stopped answering). Disk and store reads are kept in host memory."""
        out: list[bytes | None] = [None] * len(keys)
        by_tier: dict[str, list[int]] = {}
        for i, tier in enumerate(where):
            if tier is not None:
                by_tier.setdefault(tier, []).append(i)
        for tier, idx in by_tier.items():
            t0 = time.perf_counter()
            if tier == "store":
                got = self.store.get([keys[i] for i in idx])
            else:
                src = self.host if tier == "host" else self.disk
                got = [src.get(keys[i]) for i in idx]
            c = self.counters[tier]
            c.load_s += time.perf_counter() - t0
            for i, data in zip(idx, got):
                if data is None:
                    c.misses += 1
                    continue
                out[i] = data
                c.hits += 1
                c.bytes += len(data)
                if tier != "host" and self.host is not None:
                    self.host.put(keys[i], data)
                if tier == "store":
                    self._note_in_store((keys[i],))
        return out

    def measure_load_ms(self, block_bytes: int, n: int = 8) -> dict[str, float]:
        """Each tier's time to read one block of `block_bytes` (n written under probe keys,
        then read back): the routing's load cost. A tier that cannot answer now is left out."""
        data = os.urandom(block_bytes)
        tag = os.urandom(6).hex()
        keys = [f"xkv-probe-{tag}-{i}" for i in range(n)]
        costs: dict[str, float] = {}
        for name in self.tiers:
            tier = getattr(self, name)
            if name == "store":
                if tier.put(keys, [data] * n) < n:
                    continue
                t0 = time.perf_counter()
                got = tier.get(keys)
            else:
                for key in keys:
                    tier.put(key, data)
                t0 = time.perf_counter()
                got = [tier.get(key) for key in keys]
            elapsed = time.perf_counter() - t0
            if all(g is not None for g in got):
                costs[name] = round(elapsed * 1000 / n, 4)
            if name != "store":
                tier.discard(keys)
        return costs

    def count_misses(self, num_blocks: int) -> None:
        """Blocks a prompt looked for below the pool that no tier had."""
        for name in self.tiers:
            self.counters[name].misses += num_blocks
