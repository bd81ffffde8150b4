"""CacheEvents: the prefix-cache block hashes an engine stored and removed since its last
heartbeat, for the service's cache-aware routing (HeartbeatRequest.cache_event).

The block pool keeps the net change since its last `take_events()`; the engine thread
moves it here after each step (`collect`), and the heartbeat (event-loop thread) takes the
net change since the previous heartbeat (`drain`). A hash stored and removed between two
heartbeats is never reported. Bounded by the number of distinct hashes in flight.

A delta is only right for a master that got every delta before it: `drain(full=True)`
instead returns every hash the pool holds (kept here as a mirror of the pool's cached
hashes), which the master's index replaces the instance's entry with (`full_snapshot`).
"""
from __future__ import annotations

import threading


def hash_to_bytes(block_hash: int) -> bytes:
    return block_hash.to_bytes(8, "big")


def hash_from_bytes(raw: bytes) -> int:
    return int.from_bytes(raw, "big")


class CacheEvents:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stored: dict[int, None] = {}
        self._removed: dict[int, None] = {}
        self._held: set[int] = set()  # every hash the pool holds now

    def collect(self, pool) -> None:
        """Engine thread: move the pool's events here."""
        stored, removed = pool.take_events()
        if not stored and not removed:
            return
        with self._lock:
            self._held.difference_update(removed)
            self._held.update(stored)
            for h in stored:
                if h in self._removed:  # reported stored, removed, now stored again
                    del self._removed[h]
                else:
                    self._stored[h] = None
            for h in removed:
                if h in self._stored:  # stored since the last drain: never reported
                    del self._stored[h]
                else:
                    self._removed[h] = None

    def drain(self, full: bool = False) -> tuple[list[bytes], list[bytes]]:
        """Any thread: (stored, removed) hashes since the last drain, as proto bytes; with
        `full`, (every hash held, []) and the next drain's delta starts from here."""
        with self._lock:
            if full:
                stored, removed = list(self._held), []
            else:
                stored, removed = list(self._stored), list(self._removed)
            self._stored, self._removed = {}, {}
        return [hash_to_bytes(h) for h in stored], [hash_to_bytes(h) for h in removed]
