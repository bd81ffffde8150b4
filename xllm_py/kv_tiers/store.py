"""MooncakeStore: the shared tier, a Mooncake Store (its master, its metadata in etcd or an
HTTP metadata server, segments of memory contributed by its clients).

Every call runs on one of two threads of this object (reads, writes) and is waited for up
to `timeout_s`: a master that is gone makes the client block for seconds, and no engine
step or prompt may wait on that. A failed or late call opens the breaker: for `retry_s`
every call answers "unavailable" at once (the tiers above serve, or the prompt is
computed); the next call after that is a trial, and a success closes it. The client
reconnects to a master that comes back by itself (metadata in etcd keeps the segments
known); blocks held by a master that died are gone, new ones are put and found again.

Without the Mooncake package or its system libraries the store is off, said once.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

INSTALL_HINT = ("pip install 'mooncake-transfer-engine==0.3.6.post1' (and, on Debian, "
                "apt-get install libibverbs1 libnuma1)")
# A get_batch reads into the client's local buffer: batches stay well under it.
GET_BATCH = 128


def load_client_class() -> tuple[Any, str | None]:
    """(MooncakeDistributedStore, None), or (None, why it cannot be had here)."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        return None, f"the Mooncake client does not load ({e}): {INSTALL_HINT}"
    except OSError as e:  # a shared library missing
        return None, f"the Mooncake client does not load ({e}): {INSTALL_HINT}"
    return MooncakeDistributedStore, None


class MooncakeStore:
    name = "store"

    def __init__(self, master: str, metadata: str, local_host: str = "127.0.0.1",
                 segment_bytes: int = 0, buffer_bytes: int = 64 << 20,
                 timeout_s: float = 2.0, retry_s: float = 2.0,
                 client_factory: Callable[[], Any] | None = None) -> None:
        self.master = master
        self.metadata = metadata
        self.local_host = local_host
        self.segment_bytes = segment_bytes
        self.buffer_bytes = buffer_bytes
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._factory = client_factory
        self._client: Any = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down_logged = False
        self._busy: dict[str, float] = {}  # lane -> when its call in flight started
        self._lanes = {lane: concurrent.futures.ThreadPoolExecutor(1, f"kv-store-{lane}")
                       for lane in ("read", "write")}
        # Counts the store's returns after an outage: a master that restarted lost its
        # blocks, and what was computed meanwhile was never put (stack.py puts them again).
        self.generation = 0
        self.num_errors = 0  # calls that failed or timed out
        self.num_put_blocks = 0
        self.num_get_blocks = 0

    # -- health ------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._client is not None and time.monotonic() >= self._down_until

    def _trip(self, why: str) -> None:
        self.num_errors += 1
        self._down_until = time.monotonic() + self.retry_s
        if not self._down_logged:
            self._down_logged = True
            logger.warning("KV store at %s unavailable (%s): prompts are served from the local "
                           "tiers or computed; retrying every %.0f s", self.master, why, self.retry_s)

    def _ok(self) -> None:
        if self._down_logged:
            self._down_logged = False
            self.generation += 1
            logger.info("KV store at %s is back", self.master)

    def _run(self, lane: str, fn: Callable[[Any], Any]) -> Any:
        """fn(client) on `lane`'s thread within the deadline; raises _Unavailable."""
        now = time.monotonic()
        if self._client is None or now < self._down_until:
            raise _Unavailable()
        started = self._busy.get(lane)
        if started is not None and now - started > self.timeout_s:
            raise _Unavailable()  # (its thread is still stuck in a call)

        def call() -> Any:
            self._busy[lane] = time.monotonic()
            try:
                return fn(self._client)
            finally:
                self._busy.pop(lane, None)

        fut = self._lanes[lane].submit(call)
        try:
            return fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._trip(f"no answer within {self.timeout_s:.1f} s")
            raise _Unavailable() from None
        except Exception as e:
            self._trip(f"{type(e).__name__}: {e}")
            raise _Unavailable() from None

    # -- life ----------------------------------------------------------------------------
    def connect(self) -> bool:
        """Set the client up (blocking, up to the deadline); False when it cannot be."""
        factory = self._factory
        if factory is None:
            cls, why = load_client_class()
            if cls is None:
                logger.warning("KV store off: %s", why)
                return False
            factory = cls
        fut = self._lanes["write"].submit(self._setup, factory)
        try:
            client = fut.result(timeout=max(self.timeout_s, 10.0))
        except Exception as e:
            logger.warning("KV store at %s off: the client could not be set up (%s)",
                           self.master, e)
            return False
        self._client = client
        logger.info("KV store: master %s, metadata %s", self.master, self.metadata)
        return True

    def _setup(self, factory: Callable[[], Any]) -> Any:
        client = factory()
        rc = client.setup(self.local_host, self.metadata, self.segment_bytes, self.buffer_bytes,
                          "tcp", "", self.master)
        if rc != 0:
            raise RuntimeError(f"setup returned {rc}")
        return client

    def close(self) -> None:
        client, self._client = self._client, None
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            try:
                client.close()
            except Exception:  # (closing a client whose master is gone)
                logger.debug("KV store client close failed", exc_info=True)

    # -- calls ---------------------------------------------------------------------------
    def exist(self, keys: Sequence[str]) -> list[bool] | None:
        """Whether each key is in the store; None when the store cannot answer."""
        if not keys:
            return []
        try:
            found = self._run("read", lambda c: c.batch_is_exist(list(keys)))
        except _Unavailable:
            return None
        if len(found) != len(keys) or any(f < 0 for f in found):
            self._trip("a lookup failed")
            return None
        self._ok()
        return [f == 1 for f in found]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's bytes, None for a miss or when the store cannot answer."""
        out: list[bytes | None] = []
        for i in range(0, len(keys), GET_BATCH):
            part = list(keys[i:i + GET_BATCH])
            try:
                got = self._run("read", lambda c: c.get_batch(part))
            except _Unavailable:
                got = []
            else:
                self._ok()
            got = list(got) + [b""] * (len(part) - len(got))
            out.extend(g if g else None for g in got)
        self.num_get_blocks += sum(1 for g in out if g is not None)
        return out

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> int:
        """Put the blocks the store lacks; how many were put (0 when it cannot be)."""
        if not keys:
            return 0
        try:
            have = self._run("write", lambda c: c.batch_is_exist(list(keys)))
            new = [(k, v) for k, v, h in zip(keys, values, have) if h != 1]
            if not new:
                return 0
            rc = self._run("write", lambda c: c.put_batch([k for k, _ in new], [v for _, v in new]))
        except _Unavailable:
            return 0
        if rc != 0:
            self.num_errors += 1
            logger.debug("KV store put of %d blocks returned %s", len(new), rc)
            return 0
        self._ok()
        self.num_put_blocks += len(new)
        return len(new)


class _Unavailable(Exception):
    pass
