"""IovWorker: a UCX worker of its own, driven by one thread, for host-memory KV data.

Why a separate worker: ucxx's asyncio path costs a notifier-thread hop plus an event-loop
hop per completion (~0.1 - 0.3 ms each, several per pull) and sends one buffer per
message. Here one thread owns a UCP context + worker (created through ucxx's low-level
API) and everything on it: it posts iov tag messages (``ucp_ffi``), progresses the worker,
and polls request status. It sleeps in epoll on the worker's event fd (``worker.arm()``)
plus an eventfd for submissions, so an idle process burns no CPU.

Work is expressed as generator *tasks* that yield lists of ``ucp_ffi.Op`` and resume when
all of them completed, or an ``AnyOf`` of ops and resume when one of them did (a failed op
is thrown into the generator as ``UcpError``). A task is built by ``make(track)``: every op
it posts goes into ``track``, whether it waits on it yet or not. Each task has a deadline;
``cancel_key`` fails every task registered under a key (a peer that went away). When a
task ends in any way, its tracked ops that are still in flight are cancelled; those UCX
cannot cancel any more (already matched) are kept alive and polled until they finish, so
the buffers they point into are never released under them.

Late answers. A task that fails (deadline, cancellation, error) may have cancelled receives
whose message is still on its way: the owner answers after the puller gave up. Unmatched,
that message would stay in UCX's unexpected queue for good (a pull's DATA is the whole pull,
sent eagerly over shared memory). So each receive such a task cancelled before it matched
gets a *drain* receive on the same tag into a small scratch buffer of the worker: a late
message completes it truncated and UCX drops the data (never into the cache). A drain lives
``drain_s`` seconds (``DRAIN_S``), then is cancelled; it outlives the task's peer endpoint
(a failed pull unlinks the peer, yet the owner's answer may be in flight) and ends with the
worker. A task that knows no answer will come (a refusal) cancels its receives itself: no
drain. Tags cannot be reused while a drain waits on them: request ids come from
``new_req_id()``, one counter per worker from a random start.

Incoming messages whose tag kind is ``KIND_REQ`` are handed to ``on_request(tag, bytes)``
(called on this thread), which may return ``(task generator, timeout, key, what)`` to serve them.
"""
from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import itertools
import logging
import os
import secrets
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from xllm_py.kv_transfer.ucx import ucp_ffi as ffi
from xllm_py.kv_transfer.ucx.iov_task import (KIND_DATA, KIND_MASK, KIND_REQ, KIND_SHIFT,  # noqa: F401
                                              KIND_STATUS, ID_MASK, AnyOf, MakeTask, TaskCancelled,
                                              TaskGen, poll_ready, ready, tag)  # (tags, AnyOf: for tests)
from xllm_py.kv_transfer.ucx.shared_memory import RemotePool, host_context

logger = logging.getLogger(__name__)

DRAIN_S = 60.0  # how long a drain receive waits for a late answer
_DRAIN_BYTES = 64


class _Task:
    __slots__ = ("gen", "deadline", "key", "fut", "ops", "what", "track")

    def __init__(self, deadline: float, key: Any, fut: concurrent.futures.Future, what: str) -> None:
        self.deadline, self.key, self.fut, self.what = deadline, key, fut, what
        self.ops: list[ffi.Op] = []
        self.track: list[ffi.Op] = []
        self.gen: TaskGen | None = None


class IovWorker:
    def __init__(self, config: dict[str, str],
                 on_request: Callable[[int, bytes], tuple[MakeTask, float, Any, str] | None],
                 name: str = "kv-ucx-iov", drain_s: float = DRAIN_S) -> None:
        import ucxx._lib.libucxx as ucxx_lib

        self._lib = ucxx_lib
        self._ctx = host_context(config)  # (shared with the pools allocated for mapping)
        self._worker = ucxx_lib.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        self.handle: int = self._worker.handle
        self.address: bytes = self._worker.address.tobytes()
        self._on_request = on_request
        self._eps: dict[Any, Any] = {}
        self._maps: dict[Any, RemotePool] = {}  # peers' pools mapped over the endpoint of the same key
        self._calls: collections.deque = collections.deque()
        self._tasks: list[_Task] = []
        self._zombies: list[tuple[ffi.Op, float]] = []
        self.drain_s = drain_s
        self._drains: list[tuple[ffi.Op, float]] = []  # (drain receive, expiry)
        self._drain_due = float("inf")  # earliest expiry in _drains
        self._drain_buf = ctypes.create_string_buffer(_DRAIN_BYTES)  # never read
        self.num_drained = 0  # late messages consumed by a drain receive
        self.num_drains_expired = 0  # drain receives cancelled after drain_s without a message
        self._req_ids = itertools.count(secrets.randbits(KIND_SHIFT - 1))
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self._worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API (any thread)

    @property
    def num_draining(self) -> int:
        return len(self._drains)

    def new_req_id(self) -> int:
        """A request id no other request of this worker had (any thread): the tags of our
        receives are never reused, so a drain receive cannot take a later request's message."""
        return next(self._req_ids) & ID_MASK

    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the worker thread."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.append((fn, args, fut))
        self._wake()
        return fut

    def start(self, make: MakeTask, timeout: float, key: Any = None,
              what: str = "transfer") -> concurrent.futures.Future:
        """Run the task ``make(track)`` on the worker thread; its future fails after ``timeout`` seconds.

        (Every request is posted on the worker thread: posting from the calling thread
        would need UCS_THREAD_MODE_MULTI, and the two threads would contend for the
        worker's spinlock.)
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.add_done_callback(lambda f: self._wake() if f.cancelled() else None)
        self._calls.append((self._add_task, (make, time.monotonic() + timeout, key, fut, what), None))
        self._wake()
        return fut

    def cancel_key(self, key: Any, reason: str) -> None:
        self._calls.append((self._cancel_key, (key, reason), None))
        self._wake()

    def connect(self, key: Any, address: bytes) -> concurrent.futures.Future:
        """Endpoint (no error handling: lets UCX use shared memory) to a peer worker address."""
        return self.call(self._connect, key, address)

    def map_remote(self, key: Any, export: dict) -> concurrent.futures.Future:
        """Map the pool the peer of endpoint ``key`` exported (``SharedHostMemory.export``):
        a future of the ``RemotePool``, failed with UcpError when it cannot be mapped here.
        It is closed with the endpoint (``disconnect``, a reconnect, ``close``)."""
        return self.call(self._map_remote, key, export)

    def disconnect(self, key: Any) -> None:
        self._calls.append((self._disconnect, (key,), None))
        self._wake()

    def ep_handle(self, key: Any) -> int | None:
        ep = self._eps.get(key)
        return None if ep is None else ep.handle

    def close(self, timeout: float = 5.0) -> None:
        if self._stop or not self._thread.is_alive():
            return
        self._calls.append((self._shutdown, (), None))
        self._wake()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ worker thread

    def _wake(self) -> None:
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:  # closed during shutdown
            pass

    def _connect(self, key: Any, address: bytes) -> None:
        self._unmap(key)
        old = self._eps.pop(key, None)
        if old is not None:
            old.close()
        addr = self._lib.UCXAddress.create_from_buffer(address)
        self._eps[key] = self._lib.UCXEndpoint.create_from_worker_address(self._worker, addr, False)

    def _map_remote(self, key: Any, export: dict) -> RemotePool:
        ep = self._eps.get(key)
        if ep is None:
            raise ffi.UcpError("no endpoint to map the peer's pool over", -1)
        self._unmap(key)
        pool = RemotePool.map(ep.handle, export, self._later)
        self._maps[key] = pool
        return pool

    def _unmap(self, key: Any) -> None:
        pool = self._maps.pop(key, None)
        if pool is not None:
            pool.close()

    def _later(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the worker thread (from any thread), result ignored."""
        self._calls.append((fn, (), None))
        self._wake()

    def _disconnect(self, key: Any) -> None:
        self._cancel_key(key, "peer disconnected")
        self._unmap(key)
        ep = self._eps.pop(key, None)
        if ep is not None:
            ep.close()

    def _add_task(self, make: MakeTask, deadline: float, key: Any, fut: concurrent.futures.Future | None,
                  what: str) -> None:
        if fut is not None and fut.cancelled():
            return
        t = _Task(deadline, key, fut or concurrent.futures.Future(), what)
        try:
            t.gen = make(t.track)
        except BaseException as e:  # noqa: BLE001
            self._release(t, drain=True)
            if not t.fut.done():
                t.fut.set_exception(e)
            return
        if self._advance(t, None):
            self._tasks.append(t)

    def _release(self, t: _Task, drain: bool) -> None:
        """The task is over: cancel what it left in flight; keep what UCX still holds as zombies.
        ``drain``: the task failed, an answer may still come: drain the receives cancelled here."""
        now = time.monotonic()
        for op in t.track:
            if not op.poll():
                op.cancel(self.handle)
                if not op.poll():
                    self._zombies.append((op, now))
                elif drain and op.tag is not None and op.status == ffi.UCS_ERR_CANCELED:
                    self._post_drain(op.tag, now)
        t.track.clear()
        t.ops = []

    def _post_drain(self, msg_tag: int, now: float) -> None:
        op = ffi.tag_recv_drain(self.handle, self._drain_buf, msg_tag)
        if op.done:  # the late message was already here
            self._drained(op)
            return
        expiry = now + self.drain_s
        self._drains.append((op, expiry))
        self._drain_due = min(self._drain_due, expiry)

    def _drained(self, op: ffi.Op) -> None:
        if op.status == ffi.UCS_ERR_CANCELED:
            self.num_drains_expired += 1
            return
        self.num_drained += 1
        logger.debug("ucx iov: drained a late message (tag %x, %d bytes: %s)", op.tag, op.info.length,
                     ffi.status_string(op.status))

    def _poll_drains(self, now: float) -> None:
        """Count the drain receives that took their message; cancel those past their expiry."""
        keep: list[tuple[ffi.Op, float]] = []
        due = float("inf")
        for op, expiry in self._drains:
            if not op.poll() and now >= expiry:
                op.cancel(self.handle)
                if not op.poll():  # matched meanwhile: UCX finishes it
                    self._zombies.append((op, now))
                    continue
            if op.done:
                self._drained(op)
            else:
                keep.append((op, expiry))
                due = min(due, expiry)
        self._drains, self._drain_due = keep, due

    def _advance(self, t: _Task, err: BaseException | None) -> bool:
        """Resume a task; returns True while it still waits on ops."""
        try:
            ops = t.gen.throw(err) if err is not None else t.gen.send(None)
            while ready(ops):  # completed immediately: resume at once
                failed = next((op for op in ops if op.done and op.status != ffi.UCS_OK), None)
                ops = (t.gen.throw(ffi.UcpError(failed.what, failed.status)) if failed
                       else t.gen.send(None))
            t.ops = ops
            return True
        except StopIteration as stop:
            self._release(t, drain=False)
            if not t.fut.done():
                t.fut.set_result(stop.value)
        except BaseException as e:  # noqa: BLE001 - delivered to the waiter
            self._release(t, drain=True)
            if not t.fut.done():
                t.fut.set_exception(e)
            else:
                logger.debug("ucx iov task %s ended after its waiter: %s", t.what, e)
        return False

    def _fail(self, t: _Task, exc: BaseException, drain: bool = True) -> None:
        try:
            if t.gen is not None:
                t.gen.close()
        except Exception as e:  # noqa: BLE001
            logger.debug("ucx iov task %s close: %s", t.what, e)
        self._release(t, drain)
        if not t.fut.done():
            t.fut.set_exception(exc)

    def _cancel_key(self, key: Any, reason: str) -> None:
        keep = []
        for t in self._tasks:
            if key is not None and t.key == key:
                self._fail(t, TaskCancelled(f"ucx: {t.what} cancelled: {reason}"))
            else:
                keep.append(t)
        self._tasks = keep

    def _poll_tasks(self, progressed: bool) -> bool:
        """``progressed``: the worker made progress since the last call (a drain may be done)."""
        now = time.monotonic()
        busy = False
        keep: list[_Task] = []
        for t in self._tasks:
            if t.fut.cancelled():
                self._fail(t, TaskCancelled(f"ucx: {t.what} cancelled by the caller"))
                continue
            if poll_ready(t.ops):
                busy = True
                failed = next((op for op in t.ops if op.done and op.status != ffi.UCS_OK), None)
                err = ffi.UcpError(failed.what, failed.status) if failed else None
                if self._advance(t, err):
                    keep.append(t)
            elif now >= t.deadline:
                self._fail(t, TimeoutError(f"ucx: {t.what} timed out"))
            else:
                keep.append(t)
        self._tasks = keep
        if self._zombies:
            still = []
            for op, since in self._zombies:
                if not op.poll():
                    if now - since > 10.0:
                        logger.warning("ucx: a cancelled %s is still in flight after %.0f s", op.what, now - since)
                        since = now
                    still.append((op, since))
            self._zombies = still
        if self._drains and (progressed or now >= self._drain_due):
            self._poll_drains(now)
        return busy

    def _poll_requests(self) -> bool:
        got = False
        while (r := ffi.probe_recv(self.handle, tag(KIND_REQ, 0), KIND_MASK)) is not None:
            op, buf, sender_tag, length = r
            got = True
            if op.done:  # the usual case: a small message, already here; serve it at once
                if op.status == ffi.UCS_OK:  # (no generator task just to wait for it)
                    self._serve(sender_tag, buf.raw[:length])
                else:
                    logger.warning("ucx iov: receiving a request failed: %s", ffi.status_string(op.status))
                continue
            self._add_task(self._request(op, buf, sender_tag, length), time.monotonic() + 30.0, None, None,
                           "request receive")
        return got

    def _request(self, op: ffi.Op, buf: Any, sender_tag: int, length: int) -> MakeTask:
        """Receive a request message, then start the task that serves it (its own deadline and key)."""
        def make(track: list[ffi.Op]) -> TaskGen:
            track.append(op)
            yield [op]
            self._serve(sender_tag, buf.raw[:length])
        return make

    def _serve(self, sender_tag: int, data: bytes) -> None:
        served = self._on_request(sender_tag, data)
        if served is not None:
            make_served, timeout, key, what = served
            self._add_task(make_served, time.monotonic() + timeout, key, None, what)

    def _run_calls(self) -> bool:
        ran = False
        while self._calls:
            fn, args, fut = self._calls.popleft()
            ran = True
            try:
                res = fn(*args)
                if fut is not None:
                    fut.set_result(res)
            except BaseException as e:  # noqa: BLE001
                if fut is not None:
                    fut.set_exception(e)
                else:
                    logger.warning("ucx iov worker: %s failed: %s", getattr(fn, "__name__", fn), e)
        return ran

    def _run(self) -> None:
        w = self._worker
        while not self._stop:
            busy = self._run_calls()
            progressed = False
            while w.progress_once():
                progressed = True
            busy = self._poll_requests() | self._poll_tasks(progressed) | busy | progressed
            if busy or self._calls:
                continue
            if not w.arm():  # events pending: progress again
                continue
            timeout = -1.0
            if self._tasks or self._zombies or self._drains:
                now = time.monotonic()
                nearest = min((t.deadline for t in self._tasks), default=self._drain_due)
                timeout = max(0.0, min(nearest, self._drain_due) - now)
                if self._tasks or self._zombies:
                    timeout = min(timeout, 1.0)
            for fd, _ in self._epoll.poll(timeout):
                if fd == self._wake_fd:
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass

    def _shutdown(self) -> None:
        self._stop = True
        for t in self._tasks:
            self._fail(t, TaskCancelled("ucx: transfer worker closed"), drain=False)
        self._tasks = []
        for op, _ in self._drains:
            op.cancel(self.handle)
            op.poll()
        self._drains = []
        for key in list(self._maps):
            self._unmap(key)
        for ep in self._eps.values():
            try:
                ep.close()
            except Exception as e:  # noqa: BLE001
                logger.debug("ucx iov: closing endpoint: %s", e)
        self._eps.clear()
        for _ in range(100):
            if not self._worker.progress_once():
                break
        self._epoll.close()
        os.close(self._wake_fd)
