"""Transfer backend contract: the ABC every KV transfer backend implements.

Lifecycle of a backend (xLLM: link_cluster / pull_kv_blocks):

1. ``start()``   init the transport and listen; returns this worker's transfer address.
2. ``link(peer)`` connect to a peer's address (optional: pull/push link on demand).
3. ``pull(peer, src, dst)`` fetch the peer's ``src`` blocks into our ``dst`` blocks;
   ``push(peer, src, dst)`` send our ``src`` blocks into the peer's ``dst`` blocks.
4. ``unlink(peer)`` drop the connection; ``close()`` stop listening, free everything.

Transfer keys: a backend built with ``access_key`` (every engine's KV worker: a random
secret made at start) serves only requesters whose connection hello carries that key,
compared in constant time; anyone else gets ``TransferError(denied=True)`` and nothing is
read or written. A requester learns a peer's key only through the cluster's authenticated
paths (the peer's registration in TLS etcd, LinkInstance -> LinkCluster over mutual TLS)
and passes it with ``link(peer, key=...)`` or ``set_peer_key``.

Every backend runs its transport on its own event-loop thread. The async methods can be
awaited from any event loop (they wrap a concurrent future); ``submit_pull`` /
``submit_push`` return a ``concurrent.futures.Future`` for callers on plain threads
(the model thread). Both sides check block ids against their own pool: an out-of-range id
is refused and reported to the requester, never read or written. Any failure or timeout
raises ``TransferError`` so the caller fails or retries the request.
"""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
import hmac
import logging
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np

from xllm_py.kv_transfer.head_slices import Heads, check_slice, has_layers, slice_bytes
from xllm_py.kv_transfer.health import TransferHealth
from xllm_py.kv_transfer.kv_storage import SMALL_LIST, KVCacheStorage
from xllm_py.utils.aio import wait_for

logger = logging.getLogger(__name__)

T = TypeVar("T")

Run = tuple[int, int, int]  # (src_start, dst_start, length)


class TransferError(RuntimeError):
    """A KV transfer failed. ``invalid_argument``: the request itself was wrong (bad ids);
    ``denied``: the owner refused a requester without its transfer key."""

    def __init__(self, message: str, *, invalid_argument: bool = False, timeout: bool = False,
                 denied: bool = False) -> None:
        super().__init__(message)
        self.invalid_argument = invalid_argument
        self.timeout = timeout
        self.denied = denied


NOT_LINKED = ("transfer refused: the requester has not linked through the cluster "
              "(missing or wrong transfer key)")


class TransferTimeout(TransferError):
    def __init__(self, message: str) -> None:
        super().__init__(message, timeout=True)


@dataclasses.dataclass(frozen=True)
class TransferResult:
    num_blocks: int
    num_runs: int
    num_bytes: int
    seconds: float
    path: str = ""  # how the bytes moved, where a backend has several ways (ucx: mapped | iov | tag)

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def group_contiguous(src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray) -> list[Run]:
    """Split paired block lists into runs where both sides advance by one.

    Returns ``[(src_start, dst_start, length), ...]`` in input order; each run moves as one
    message per (kv, layer). Example: src [0,1,2,10,11,20], dst [5,6,7,15,16,25] ->
    [(0,5,3), (10,15,2), (20,25,1)].
    """
    s = np.asarray(src, dtype=np.int64).reshape(-1)
    d = np.asarray(dst, dtype=np.int64).reshape(-1)
    if s.size != d.size:
        raise ValueError(f"src_blocks ({s.size}) and dst_blocks ({d.size}) differ in length")
    if s.size == 0:
        return []
    if s.size <= SMALL_LIST:  # a loop over Python ints: ~5 vs ~35-45 us of numpy calls for 8 blocks
        sl, dl = s.tolist(), d.tolist()
        runs, i0 = [], 0
        for i in range(1, len(sl)):
            if sl[i] != sl[i - 1] + 1 or dl[i] != dl[i - 1] + 1:
                runs.append((sl[i0], dl[i0], i - i0))
                i0 = i
        runs.append((sl[i0], dl[i0], len(sl) - i0))
        return runs
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [s.size])))
    return list(zip(s[starts].tolist(), d[starts].tolist(), lengths.tolist()))


def runs_to_ids(runs: Sequence[Run]) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of group_contiguous: (src_ids, dst_ids)."""
    if not runs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    lengths = r[:, 2]
    if (lengths <= 0).any():
        raise ValueError("run lengths must be positive")
    offs = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(r[:, 0], lengths) + offs, np.repeat(r[:, 1], lengths) + offs


class LoopThread:
    """A daemon thread running one asyncio loop; coroutines are submitted thread-safely."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run on the loop thread and wait (from a thread that is not the loop thread)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.call from its own thread would deadlock")
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


async def _await_future(fut: concurrent.futures.Future[T]) -> T:
    return await asyncio.wrap_future(fut)


class KVTransferBackend(abc.ABC):
    """Moves whole KV blocks between this worker's storage and a peer's.

    Subclasses implement the ``_*_impl`` coroutines, which run on ``self._lt`` (the
    backend's own loop thread) and receive validated runs.
    """

    name: str = "base"
    # Whether pull/push take ``heads`` (KV head slices between instances of different TP).
    supports_head_slices: bool = False
    # Whether a slice may name a layer range (pipeline stages: pools of different layers).
    supports_layer_slices: bool = False

    def __init__(self, storage: KVCacheStorage, default_timeout_s: float = 30.0,
                 access_key: str | None = None) -> None:
        self.storage = storage
        self.default_timeout_s = default_timeout_s
        # None: serve any requester (library tests, benchmarks); engines always set one.
        self._access_key = access_key.encode() if access_key else None
        self._peer_keys: dict[str, str] = {}  # peer address -> its key, sent in our hello
        self._lt, self._owns_loop = self._make_loop_thread()
        self._address: str | None = None
        self._closed = False
        self._stats = {"pulls": 0, "pushes": 0, "failures": 0, "bytes": 0, "served": 0}
        self.health = TransferHealth()

    def _make_loop_thread(self) -> tuple[LoopThread, bool]:
        """(loop thread, owned). Backends whose library needs one loop per process override this."""
        return LoopThread(f"kv-{self.name}"), True

    # ------------------------------------------------------------------ public API

    @property
    def address(self) -> str:
        if self._address is None:
            raise RuntimeError(f"{self.name} backend not started")
        return self._address

    def start(self) -> str:
        """Init the transport and listen. Returns this worker's address ``host:port``."""
        if self._address is None:
            self._address = self._lt.call(self._start_impl())
        return self._address

    def set_peer_key(self, peer_addr: str, key: str) -> None:
        """The key to show `peer_addr` when connecting to it (empty: keep the known one)."""
        if key:
            self._peer_keys[peer_addr] = key

    def peer_key(self, peer_addr: str) -> str:
        return self._peer_keys.get(peer_addr, "")

    def admits(self, presented: object) -> bool:
        """Owner side: does a requester's hello key open our data plane?"""
        if self._access_key is None:
            return True
        if not isinstance(presented, str):
            return False
        return hmac.compare_digest(presented.encode(), self._access_key)

    async def link(self, peer_addr: str, timeout: float | None = None, key: str = "") -> None:
        self.set_peer_key(peer_addr, key)
        await _await_future(self._lt.submit(self._timed(self._link_impl(peer_addr), timeout, f"link {peer_addr}")))

    async def unlink(self, peer_addr: str) -> None:
        self._peer_keys.pop(peer_addr, None)
        await _await_future(self._lt.submit(self._unlink_impl(peer_addr)))

    async def pull(self, peer_addr: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                   timeout: float | None = None, heads: Heads | None = None) -> TransferResult:
        """Fetch the peer's ``src_blocks`` into our ``dst_blocks``; with ``heads``
        ``(src_start, dst_start, count[, src_layer, dst_layer, layers])`` only those KV
        heads (and layers) (head_slices.py)."""
        if heads is None:  # (some backends override submit_pull without ``heads``)
            return await _await_future(self.submit_pull(peer_addr, src_blocks, dst_blocks, timeout))
        self._check_head_slices(heads)
        return await _await_future(self.submit_pull(peer_addr, src_blocks, dst_blocks, timeout,
                                                    heads=heads))

    async def push(self, peer_addr: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                   timeout: float | None = None, heads: Heads | None = None) -> TransferResult:
        """Send our ``src_blocks`` into the peer's ``dst_blocks`` (``heads``: as ``pull``)."""
        if heads is None:
            return await _await_future(self.submit_push(peer_addr, src_blocks, dst_blocks, timeout))
        self._check_head_slices(heads)
        return await _await_future(self.submit_push(peer_addr, src_blocks, dst_blocks, timeout,
                                                    heads=heads))

    def submit_pull(self, peer_addr: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                    timeout: float | None = None, heads: Heads | None = None
                    ) -> concurrent.futures.Future[TransferResult]:
        runs = self._prepare(src_blocks, dst_blocks, local_is_dst=True, heads=heads)
        return self._lt.submit(self._run_op("pull", peer_addr, runs, timeout, heads))

    def submit_push(self, peer_addr: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                    timeout: float | None = None, heads: Heads | None = None
                    ) -> concurrent.futures.Future[TransferResult]:
        runs = self._prepare(src_blocks, dst_blocks, local_is_dst=False, heads=heads)
        return self._lt.submit(self._run_op("push", peer_addr, runs, timeout, heads))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await _await_future(self._lt.submit(self._close_impl()))
        finally:
            if self._owns_loop:
                self._lt.stop()

    def close_sync(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._lt.call(self._close_impl(), timeout=10)
        except Exception as e:  # noqa: BLE001 - closing must not raise
            logger.warning("%s backend close failed: %s", self.name, e)
        finally:
            if self._owns_loop:
                self._lt.stop()

    def broken(self) -> str | None:
        """Why this transport is broken for good (TransferHealth), or None."""
        return self.health.broken(loop_alive=self._closed or self._lt._thread.is_alive())

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    # ------------------------------------------------------------------ helpers

    def _prepare(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], local_is_dst: bool,
                 heads: Heads | None = None) -> list[Run]:
        if self._closed:
            raise TransferError(f"{self.name} backend is closed")
        if heads is not None:
            self._check_head_slices(heads)
            check_slice(self.storage, heads, 1 if local_is_dst else 0)
        src = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
        dst = np.asarray(dst_blocks, dtype=np.int64).reshape(-1)
        if src.size != dst.size:
            raise ValueError(f"src_blocks ({src.size}) and dst_blocks ({dst.size}) differ in length")
        if local_is_dst:
            self.storage.check_block_ids(dst, unique=True)
        else:
            self.storage.check_block_ids(src)
        return group_contiguous(src, dst)

    def _check_head_slices(self, heads: Heads | None = None) -> None:
        if not self.supports_head_slices:
            raise ValueError(f"the {self.name} backend moves whole blocks only (no KV head "
                             "slices: instances of different TP need the tcp or ucx backend)")
        if has_layers(heads) and not self.supports_layer_slices:
            raise ValueError(f"the {self.name} backend moves every layer of a block (no "
                             "layer slices: pipeline stages in PD need the tcp or ucx backend)")

    async def _timed(self, coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
        t = self.default_timeout_s if timeout is None else timeout
        try:
            return await wait_for(coro, t)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"{self.name}: {what} timed out after {t:.3g}s") from None

    async def _run_op(self, op: str, peer_addr: str, runs: list[Run], timeout: float | None,
                      heads: Heads | None = None) -> TransferResult:
        t0 = time.perf_counter()
        num_blocks = sum(r[2] for r in runs)
        impl = self._pull_impl if op == "pull" else self._push_impl
        t = self.default_timeout_s if timeout is None else timeout
        try:
            if num_blocks:
                await wait_for(impl(peer_addr, runs, t) if heads is None
                               else impl(peer_addr, runs, t, heads=heads), t)
        except Exception as e:
            err = self._failed(op, peer_addr, num_blocks, t, e)
            if not err.invalid_argument:  # (a refusal is an answer: the connection is fine, keep it)
                await self._on_failure(peer_addr)
            raise err from (None if err is e else e)
        return self._succeeded(op, runs, t0, self._path_of(peer_addr), heads)

    def _succeeded(self, op: str, runs: list[Run], t0: float, path: str = "",
                   heads: Heads | None = None) -> TransferResult:
        """Count a finished op; its result (``t0``: when it started, perf_counter)."""
        num_blocks = sum(r[2] for r in runs)
        nbytes = num_blocks * slice_bytes(self.storage, heads)
        self._stats["pulls" if op == "pull" else "pushes"] += 1
        self._stats["bytes"] += nbytes
        self.health.succeeded()
        return TransferResult(num_blocks=num_blocks, num_runs=len(runs), num_bytes=nbytes, path=path,
                              seconds=time.perf_counter() - t0)

    def _failed(self, op: str, peer_addr: str, num_blocks: int, timeout: float, exc: BaseException) -> TransferError:
        """Count a failed op; the error to raise: TransferError as it is, a timeout as
        TransferTimeout, any transport error wrapped in a TransferError."""
        self._stats["failures"] += 1
        if isinstance(exc, TransferError):
            err = exc
        elif isinstance(exc, TimeoutError):  # (asyncio.TimeoutError too)
            err = TransferTimeout(f"{self.name}: {op} of {num_blocks} blocks from {peer_addr} timed out after {timeout:.3g}s")
        else:
            err = TransferError(f"{self.name}: {op} with {peer_addr} failed: {type(exc).__name__}: {exc}")
        if not err.invalid_argument:  # (a refusal is an answer, not a broken transport)
            self.health.failed(str(err))
        return err

    async def _on_failure(self, peer_addr: str) -> None:
        """After a failed op the connection state is unknown: drop it (cancels pending I/O)."""
        try:
            await self._unlink_impl(peer_addr)
        except Exception as e:  # noqa: BLE001
            logger.warning("%s: dropping link to %s after failure: %s", self.name, peer_addr, e)

    def _path_of(self, peer_addr: str) -> str:
        """How transfers with this peer move (for logs); backends with one way answer ''."""
        return ""

    def _check_remote_runs(self, runs: list[Run], side: str) -> tuple[np.ndarray, np.ndarray] | str:
        """Server-side validation; returns (src_ids, dst_ids) or an error message."""
        try:
            src, dst = runs_to_ids(runs)
            if side == "src":
                self.storage.check_block_ids(src)
            else:
                self.storage.check_block_ids(dst, unique=True)
            return src, dst
        except ValueError as e:
            return f"peer refused: {e}"

    # ------------------------------------------------------------------ to implement

    @abc.abstractmethod
    async def _start_impl(self) -> str: ...

    @abc.abstractmethod
    async def _link_impl(self, peer_addr: str) -> None: ...

    @abc.abstractmethod
    async def _unlink_impl(self, peer_addr: str) -> None: ...

    @abc.abstractmethod
    async def _pull_impl(self, peer_addr: str, runs: list[Run], timeout: float) -> None: ...

    @abc.abstractmethod
    async def _push_impl(self, peer_addr: str, runs: list[Run], timeout: float) -> None: ...

    @abc.abstractmethod
    async def _close_impl(self) -> None: ...


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise TransferError(f"bad transfer address {addr!r}; expected host:port", invalid_argument=True)
    return host.strip("[]"), int(port)
