"""DiskTier: blocks in files under one directory, bounded in bytes, least recently used
out first; it outlives the engine (a restart indexes what the directory holds).

A file is `MAGIC | key length, data length, CRC-32 | key | data`, written to a temporary
name and renamed, so a reader sees a whole file or none. A read checks all four (a file
truncated, corrupted or holding another key is a miss, and removed): wrong KV is never
returned. A full or read-only disk makes a write fail: counted, warned about once, the
block dropped (the pool and the other tiers go on).

Writer thread puts; loader thread gets; the engine thread asks `contains`: thread-safe.
"""
from __future__ import annotations

import collections
import logging
import os
import struct
import threading
import zlib

logger = logging.getLogger(__name__)

MAGIC = b"XKV1"
_HEAD = struct.Struct("<4sIQI")  # magic, key length, data length, crc32 of the data
SUFFIX = ".kv"


class DiskTier:
    name = "disk"

    def __init__(self, root: str, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"disk tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.root = root
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._files: collections.OrderedDict[str, int] = collections.OrderedDict()  # key -> size
        self.used_bytes = 0
        self.num_write_errors = 0
        self.num_corrupt = 0
        self._warned: set[int] = set()
        os.makedirs(root, exist_ok=True)
        self._index()

    def __len__(self) -> int:
        return len(self._files)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key[-2:], key + SUFFIX)

    def _index(self) -> None:
        """What an earlier run left, oldest access first; stray temporaries removed."""
        found = []
        for sub in sorted(os.listdir(self.root)):
            d = os.path.join(self.root, sub)
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                path = os.path.join(d, name)
                if not name.endswith(SUFFIX):
                    _unlink(path)
                    continue
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                found.append((st.st_mtime, name[:-len(SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self.used_bytes += size
        self._shrink(0)
        if found:
            logger.info("disk KV tier %s: %d blocks (%.1f MB) from an earlier run",
                        self.root, len(self._files), self.used_bytes / 2**20)

    def contains(self, key: str) -> bool:
        return key in self._files

    def put(self, key: str, data: bytes) -> bool:
        size = _HEAD.size + len(key) + len(data)
        if size > self.capacity_bytes or key in self._files:
            return key in self._files
        path = self._path(key)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        kb = key.encode()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_HEAD.pack(MAGIC, len(kb), len(data), zlib.crc32(data)))
                f.write(kb)
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            self.num_write_errors += 1
            if e.errno not in self._warned:
                self._warned.add(e.errno)
                logger.warning("disk KV tier %s: a write failed (%s); blocks that do not fit "
                               "are dropped", self.root, e.strerror or e)
            return False
        with self._lock:
            self._files[key] = size
            self.used_bytes += size
            self._shrink(0)
        return True

    def get(self, key: str) -> bytes | None:
        if key not in self._files:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError:
            self._forget(key, path)
            return None
        data = _parse(raw, key)
        if data is None:
            self.num_corrupt += 1
            logger.warning("disk KV tier %s: a corrupt block file was removed", self.root)
            self._forget(key, path)
            return None
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
        try:
            os.utime(path)  # (the order a restart indexes them in)
        except OSError:
            pass
        return data

    def discard(self, keys) -> None:
        for key in keys:
            self._forget(key, self._path(key))

    def _forget(self, key: str, path: str) -> None:
        with self._lock:
            size = self._files.pop(key, None)
            if size is not None:
                self.used_bytes -= size
        _unlink(path)

    def _shrink(self, extra: int) -> None:
        """Caller holds the lock (or is the constructor)."""
        while self._files and self.used_bytes + extra > self.capacity_bytes:
            key, size = self._files.popitem(last=False)
            self.used_bytes -= size
            _unlink(self._path(key))


def _parse(raw: bytes, key: str) -> bytes | None:
    if len(raw) < _HEAD.size:
        return None
    magic, klen, dlen, crc = _HEAD.unpack_from(raw)
    start = _HEAD.size + klen
    if magic != MAGIC or len(raw) != start + dlen or raw[_HEAD.size:start] != key.encode():
        return None
    data = raw[start:]
    return data if zlib.crc32(data) == crc else None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
