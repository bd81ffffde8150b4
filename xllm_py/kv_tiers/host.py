"""HostTier: blocks in host memory, bounded in bytes, least recently used out first.

Thread-safe: the engine thread asks `contains` before it snapshots a block, the writer
thread puts, the loader thread gets. What `put` pushes out is returned to the caller
(the stack writes it to the disk tier below).
"""
from __future__ import annotations

import collections
import threading


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._blocks: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def contains(self, key: str) -> bool:
        return key in self._blocks

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
            return data

    def put(self, key: str, data: bytes) -> list[tuple[str, bytes]]:
        """Keep `data` under `key` (most recently used); returns what was pushed out to
        make room, oldest first (a block larger than the whole tier is returned itself)."""
        if len(data) > self.capacity_bytes:
            return [(key, data)]
        evicted: list[tuple[str, bytes]] = []
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self.used_bytes -= len(old)
            while self._blocks and self.used_bytes + len(data) > self.capacity_bytes:
                k, v = self._blocks.popitem(last=False)
                self.used_bytes -= len(v)
                evicted.append((k, v))
            self._blocks[key] = data
            self.used_bytes += len(data)
        return evicted

    def discard(self, keys) -> None:
        with self._lock:
            for key in keys:
                data = self._blocks.pop(key, None)
                if data is not None:
                    self.used_bytes -= len(data)

    def keys(self) -> list[str]:
        """Every key, most recently used first."""
        with self._lock:
            return list(reversed(self._blocks))
