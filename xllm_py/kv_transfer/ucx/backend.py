"""UcxKVTransferBackend: KV blocks over UCX, host or CUDA memory.

UCXX's Python API has no one-sided get/put, so a pull is a request from the puller
answered by the owner sending the blocks.

Host memory (mode ``auto`` / ``iov``): each backend runs an ``IovWorker`` (own UCP worker,
own thread, event-driven) and moves a whole block list as ONE iov tag message straight
between the two caches over shared memory; request and status travel on the same
endpoints (see ``iov_protocol.py``). The ucxx control connection below only links the
peers (hello, layout check, worker addresses) and detects a dead peer.

CUDA memory, or mode ``direct`` / ``gather`` (the tag path, below). Per peer two endpoints:

- control: sockaddr endpoint to the peer's listener, with error handling (tcp). Carries
  JSON headers and status replies; every receive of *data* is also posted through it, so
  a dead peer or ``abort()`` cancels them (no late write into blocks that were freed).
- data: endpoint created from the peer's UCX worker address without error handling, which
  lets UCX pick shared memory (cma zero-copy get) instead of tcp (see env.py for numbers).

Stages of a pull (requester R, owner O):
1. R -> O  control: {op: pull, req, runs, mode}  (R validated its dst ids already)
2. O validates its src ids; O -> R status {ok, error} on tag ``req``
3. R posts receives into its storage; O sends the data on the data endpoint with tags
   ``req | i``: ``direct`` = one message per (run, kv, layer) slice, received in place;
   ``gather`` = one message with all blocks ``index_select``ed, received into a staging
   buffer and scattered (fewer messages for fragmented lists).
Push: R -> O {op: push}; O validates dst ids, posts receives, replies ok; R sends data;
O replies done once all bytes are in place.

UCXX needs one asyncio loop per process for all its calls (its notifier thread completes
futures there): every backend instance of a process shares ``_shared_loop()``.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import logging
import os
import secrets
import threading
import time
from typing import Any

import numpy as np
import torch

from xllm_py.kv_transfer.base import (
    KVTransferBackend,
    LoopThread,
    Run,
    TransferError,
    TransferResult,
    runs_to_ids,
    split_addr,
)
from xllm_py.kv_transfer.kv_storage import KVCacheMeta, KVCacheStorage, StagingPool, prefault_pages
from xllm_py.kv_transfer.ucx import iov_protocol, shared_memory
from xllm_py.kv_transfer.ucx.env import import_ucxx, iov_worker_config
from xllm_py.kv_transfer.ucx.iov_worker import IovWorker
from xllm_py.utils.aio import wait_for

logger = logging.getLogger(__name__)

_IDX_BITS = 24
# Mapped-pool transfers up to this size are copied on the caller's thread (~0.1 ms at 10 GB/s;
# a hop to the copy thread and back costs ~0.1 - 0.2 ms here).
_INLINE_COPY_BYTES = 1 << 20
_MAX_MSGS = 1 << _IDX_BITS

_shared_lock = threading.Lock()
_shared: LoopThread | None = None


def _shared_loop() -> LoopThread:
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = LoopThread("kv-ucx")
        return _shared


def _shutdown_ucx(ucxx: Any) -> None:
    """Stop UCXX's notifier and progress threads before the interpreter exits (else: std::terminate)."""
    ctx = ucxx.core._ctx
    if ctx is None:
        return
    try:
        ctx.stop_notifier_thread()
        if ctx.progress_mode.startswith("thread"):
            ctx.worker.stop_progress_thread()
    except Exception as e:  # noqa: BLE001
        logger.warning("ucx: stopping UCXX threads at exit failed: %s", e)


def _new_req() -> int:
    return secrets.randbits(63 - _IDX_BITS) << _IDX_BITS


# Right after linking, a few pulls of the peer's blocks into a scratch buffer (half one run,
# half one run per block): the first pulls over a new link cost 2 - 7 ms for 1 MB instead of
# ~0.5 (first touch of the shared-memory FIFO and receive buffers on both sides, UCX protocol
# selection per iov shape, cold Python paths), and it takes about ten to settle.
_WARMUP_PULLS = 12
_WARMUP_BYTES = 1 << 20
_WARMUP_TIMEOUT_S = 2.0

_CTRL_SIZE = 4096  # control messages are one fixed-size message (JSON padded with spaces)


async def send_ctrl(ep: Any, obj: dict, tag: int | None = None) -> None:
    """One message when the JSON fits in _CTRL_SIZE, else a {"more": n} message then the payload.

    A fixed size lets the receiver post its buffer without a size message first (ucxx's
    send_obj/recv_obj take two messages, i.e. an extra wake-up per hop). Callers sending
    on a shared tag must serialise (the two-message form must not interleave).
    """
    data = json.dumps(obj).encode()
    if len(data) <= _CTRL_SIZE:
        await ep.send(bytearray(data.ljust(_CTRL_SIZE)), tag=tag)
        return
    await ep.send(bytearray(json.dumps({"more": len(data)}).encode().ljust(_CTRL_SIZE)), tag=tag)
    await ep.send(bytearray(data), tag=tag)


async def recv_ctrl(ep: Any, tag: int | None = None) -> dict:
    buf = bytearray(_CTRL_SIZE)
    await ep.recv(buf, tag=tag)
    obj = json.loads(buf)
    if "more" in obj:
        buf = bytearray(int(obj["more"]))
        await ep.recv(buf, tag=tag)
        obj = json.loads(buf)
    return obj


def _buf(t: torch.Tensor) -> Any:
    """Buffer object UCXX accepts: numpy view for host memory, the tensor (CUDA array interface) on GPU."""
    return t if t.is_cuda else t.numpy()


class _MappedPool:
    """A linked peer's pool mapped into this process: transfers with it are memcpys."""

    __slots__ = ("pool", "layout")

    def __init__(self, pool: shared_memory.RemotePool, layout: iov_protocol.IovLayout) -> None:
        self.pool, self.layout = pool, layout


class _Peer:
    def __init__(self, ctrl: Any, data: Any, iov_key: Any = None, iov: IovWorker | None = None,
                 mapped: _MappedPool | None = None) -> None:
        self.ctrl = ctrl
        self.data = data
        self.iov_key = iov_key  # key of this peer's endpoint on our IovWorker (None: tag path)
        self.mapped = mapped  # the peer's pool mapped here (closed with the iov endpoint)
        self.path = "tag" if iov_key is None else "mapped" if mapped is not None else "iov"  # (for logs)
        self.send_lock = asyncio.Lock()
        # Set when the control endpoint reports an error (peer died / closed). UCX calls the
        # callback from its progress thread: fail the peer's iov tasks, hop onto the loop.
        self.lost = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_close() -> None:
            if iov is not None and iov_key is not None:
                iov.cancel_key(iov_key, "connection to the peer lost")
            if not loop.is_closed():
                loop.call_soon_threadsafe(self.lost.set)

        if ctrl is not None:
            ctrl.set_close_callback(on_close)

    async def guard(self, aw: Any, what: str) -> Any:
        """Await ``aw`` unless the connection is lost first (then raise TransferError)."""
        task = asyncio.ensure_future(aw)
        lost = asyncio.ensure_future(self.lost.wait())
        try:
            done, _ = await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            lost.cancel()
        if task in done:
            return task.result()
        task.cancel()
        raise TransferError(f"ucx: connection to the peer lost during {what}")

    def abort(self) -> None:
        for ep in (self.ctrl, self.data):
            try:
                if ep is not None and not ep.closed:
                    ep.abort()
            except Exception as e:  # noqa: BLE001
                logger.warning("ucx: aborting endpoint failed: %s", e)

    async def close(self, timeout: float = 1.0) -> None:
        """Graceful close: the peer learns that the connection is gone (abort tells it nothing)."""
        for ep in (self.ctrl, self.data):
            try:
                if ep is not None and not ep.closed:
                    await wait_for(ep.close(), timeout)
            except Exception as e:  # noqa: BLE001
                logger.debug("ucx: graceful close failed (%s), aborting", e)
        self.abort()


class UcxKVTransferBackend(KVTransferBackend):
    name = "ucx"

    def __init__(self, storage: KVCacheStorage, default_timeout_s: float = 30.0,
                 listen_host: str = "127.0.0.1", listen_port: int = 0, mode: str = "auto",
                 direct_max_msgs: int = 1024, direct_min_slice_bytes: int = 256 << 10) -> None:
        if mode not in ("auto", "iov", "direct", "gather"):
            raise ValueError(f"mode must be auto|iov|direct|gather, got {mode!r}")
        if mode == "iov" and storage.is_cuda:
            raise ValueError("mode 'iov' moves host memory only; CUDA pools use auto|direct|gather")
        self._ucxx = import_ucxx(gpu=storage.is_cuda)
        super().__init__(storage, default_timeout_s)
        self._stats["mapped"] = 0  # transfers done as memcpys with a mapped peer pool
        self._listen_host = listen_host
        self._listen_port = listen_port
        self.mode = mode
        self.direct_max_msgs = direct_max_msgs
        self.direct_min_slice_bytes = direct_min_slice_bytes
        self._listener: Any = None
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, asyncio.Future] = {}
        self._server_eps: set[_Peer] = set()
        self._bytes = storage.byte_view()  # uint8 [2, L, B, bs, H, D*itemsize]
        self._pool = StagingPool(storage.device)
        self._use_iov = not storage.is_cuda and mode in ("auto", "iov")
        self._iov: IovWorker | None = None
        self._iov_layout = iov_protocol.IovLayout(storage) if self._use_iov else None
        self._token = secrets.randbits(60)  # names our IovWorker endpoint on the peers
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None  # mapped-pool copies

    def _make_loop_thread(self) -> tuple[LoopThread, bool]:
        return _shared_loop(), False

    # ------------------------------------------------------------------ setup

    def _ensure_init(self) -> None:
        ucxx = self._ucxx
        if ucxx.core._ctx is None:
            ucxx.init(progress_mode=os.environ.get("UCXPY_PROGRESS_MODE", "thread"),
                      enable_python_future=os.environ.get("UCXPY_ENABLE_PYTHON_FUTURE", "1") != "0")
            atexit.register(_shutdown_ucx, ucxx)
        if self._use_iov and self._iov is None:
            self._iov = IovWorker(iov_worker_config(), self._on_iov_request)

    def _worker_address(self) -> bytes:
        return bytes(self._ucxx.get_worker_address())

    def _hello(self) -> dict:
        return {"worker_addr": self._worker_address().hex(), "meta": self.storage.meta.to_dict(),
                "iov_addr": self._iov.address.hex() if self._iov is not None else None, "token": self._token,
                "pool": self._pool_export()}

    def _pool_export(self) -> dict | None:
        """Our pool's remote key when UCX allocated it as mappable memory (see shared_memory.py)."""
        if self._iov is None or not shared_memory.mapping_enabled():
            return None
        mem = shared_memory.lookup(self.storage.kv.data_ptr())
        return None if mem is None else mem.export()

    def _check_meta(self, d: dict, peer: str) -> None:
        theirs = KVCacheMeta.from_dict(d)
        if theirs.block_shape_key() != self.storage.meta.block_shape_key():
            raise TransferError(f"ucx: peer {peer} has an incompatible KV block layout: "
                                f"theirs {theirs.block_shape_key()} vs ours {self.storage.meta.block_shape_key()}")

    async def _start_impl(self) -> str:
        self._ensure_init()
        self._listener = self._ucxx.create_listener(self._on_connect, port=self._listen_port)
        port = self._listener.port
        logger.info("ucx KV transfer listening on %s:%d", self._listen_host, port)
        return f"{self._listen_host}:{port}"

    async def _create_data_ep(self, hex_addr: str) -> Any:
        ucxx = self._ucxx
        addr = ucxx.get_ucx_address_from_buffer(bytes.fromhex(hex_addr))
        return await ucxx.create_endpoint_from_worker_address(addr, endpoint_error_handling=False)

    # ------------------------------------------------------------------ server side

    async def _on_connect(self, ep: Any) -> None:
        peer: _Peer | None = None
        try:
            hello = await recv_ctrl(ep)
            try:
                self._check_meta(hello["meta"], "client")
                err = None
            except TransferError as e:
                err = str(e)
            data = await self._create_data_ep(hello["worker_addr"])
            iov_key = None
            if self._iov is not None and hello.get("iov_addr") and not err:
                iov_key = await self._iov_connect(("in", int(hello["token"])), hello["iov_addr"])
            peer = _Peer(ep, data, iov_key, self._iov)
            self._server_eps.add(peer)
            reply = self._hello()
            if iov_key is None:
                reply["iov_addr"] = None  # the peer must use the tag path with us
            await send_ctrl(ep, {**reply, "error": err})
            if err:
                return
            tasks: set[asyncio.Task] = set()
            while True:
                req = await recv_ctrl(ep)
                t = asyncio.get_running_loop().create_task(self._serve(peer, req))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - peer went away: normal end of a connection
            logger.debug("ucx: control connection ended: %s: %s", type(e).__name__, e)
        finally:
            if peer is not None:
                self._server_eps.discard(peer)
                self._drop_iov(peer)
                peer.abort()

    async def _iov_connect(self, key: Any, hex_addr: str) -> Any:
        """Endpoint on our IovWorker to the peer's; None when its transports cannot reach it
        (e.g. shared memory only, peer on another host): that peer then uses the tag path."""
        try:
            await asyncio.wrap_future(self._iov.connect(key, bytes.fromhex(hex_addr)))
            return key
        except Exception as e:  # noqa: BLE001
            logger.info("ucx: no iov data path to %s (%s: %s); using the tag path", key, type(e).__name__, e)
            return None

    def _drop_iov(self, peer: _Peer) -> None:
        if self._iov is not None and peer.iov_key is not None:
            self._iov.disconnect(peer.iov_key)

    def _on_iov_request(self, sender_tag: int, data: bytes) -> tuple | None:
        """IovWorker thread: a peer's pull/push request; returns the task that serves it."""
        op, req_id, token, timeout, runs = iov_protocol.decode_request(data)
        key = ("in", token)
        iov = self._iov
        ep = iov.ep_handle(key) if iov is not None else None
        if ep is None:
            logger.warning("ucx: request %x from an unknown peer (token %x): dropped", req_id, token)
            return None

        def served() -> None:
            self._stats["served"] += 1

        def make(track: list) -> Any:
            return iov_protocol.serve_task(track, iov.handle, ep, self._iov_layout, op, req_id, runs,
                                           self._check_remote_runs, served)

        return make, timeout, key, f"serving op {op} (req {req_id:x}, {len(runs)} runs)"

    async def _serve(self, peer: _Peer, req: dict) -> None:
        op, tag, runs = req.get("op"), int(req["req"]), [tuple(r) for r in req.get("runs", [])]
        timeout = float(req.get("timeout", self.default_timeout_s))
        try:
            checked = self._check_remote_runs(runs, side="src" if op == "pull" else "dst")
            if op not in ("pull", "push"):
                checked = f"unknown op {op!r}"
            if isinstance(checked, str):
                await send_ctrl(peer.ctrl, {"ok": False, "error": checked}, tag=tag)
                if op == "pull":
                    await wait_for(self._release_recvs(peer.data, tag, runs, req["mode"]), timeout)
                return
            if op == "pull":
                # status and data go out together: the requester pre-posted its receives
                await wait_for(asyncio.gather(send_ctrl(peer.ctrl, {"ok": True}, tag=tag),
                                                      self._send_blocks(peer.data, tag, runs, req["mode"], checked[0])),
                                       timeout)
            else:
                recv = self._recv_blocks(peer.ctrl, tag, runs, req["mode"], checked[1])
                task = asyncio.ensure_future(recv)
                await send_ctrl(peer.ctrl, {"ok": True}, tag=tag)
                await wait_for(task, timeout)
                await send_ctrl(peer.ctrl, {"ok": True}, tag=tag)
            self._stats["served"] += 1
        except Exception as e:  # noqa: BLE001
            logger.warning("ucx: serving %s (req %x, %d runs) failed: %s: %s; dropping the connection",
                           op, tag, len(runs), type(e).__name__, e)
            peer.abort()

    # ------------------------------------------------------------------ data movement

    def _choose_mode(self, runs: list[Run]) -> str:
        """direct (zero-copy, one message per slice) only for few, large slices.

        Measured (2-core VM, 16 KiB slices, 4 layers): per-message overhead dominates small
        slices: fragmented 64 MB direct 743 ms vs gather 68 ms; contiguous 64 MB (8 MB
        slices) direct 33 ms vs gather 60 ms; contiguous 1 MB: equal within noise.
        """
        if self.mode in ("direct", "gather"):
            return self.mode if len(runs) * 2 * self.storage.num_layers < _MAX_MSGS else "gather"
        n_msgs = 2 * self.storage.num_layers * len(runs)
        avg_slice = sum(r[2] for r in runs) * self.storage.slice_bytes / max(len(runs), 1)
        if n_msgs <= self.direct_max_msgs and avg_slice >= self.direct_min_slice_bytes:
            return "direct"
        return "gather"

    def _slices(self, runs: list[Run], side: int) -> list[torch.Tensor]:
        """Contiguous uint8 slices in wire order: run-major, then kv, then layer."""
        b, L = self._bytes, self.storage.num_layers
        out = []
        for r in runs:
            start, n = r[side], r[2]
            for k in range(2):
                for layer in range(L):
                    out.append(b[k, layer, start:start + n])
        return out

    async def _send_blocks(self, ep: Any, tag: int, runs: list[Run], mode: str, src_ids: Any) -> None:
        if mode == "direct":
            slices = self._slices(runs, side=0)
            await asyncio.gather(*(ep.send(_buf(s), tag=tag | i, force_tag=True) for i, s in enumerate(slices)))
        else:
            buf = self._pool.acquire(len(src_ids) * self.storage.block_bytes)
            try:
                self.storage.read_blocks(src_ids, out=buf)
                await ep.send(_buf(buf), tag=tag, force_tag=True)
            finally:
                self._pool.release(buf)

    def _post_recv_blocks(self, ep: Any, tag: int, runs: list[Run], mode: str,
                          dst_ids: Any) -> tuple[asyncio.Future, Any]:
        """Post the data receives now; returns (completion, commit). ``commit()`` scatters the
        gather staging buffer into the cache: call it only after the peer said ok (a refusal
        completes the receives with empty messages, see ``_release_recvs``)."""
        if mode == "direct":
            slices = self._slices(runs, side=1)
            fut = asyncio.gather(*(ep.recv(_buf(s), tag=tag | i, force_tag=True) for i, s in enumerate(slices)))
            return fut, lambda: None
        staging = self._pool.acquire(len(dst_ids) * self.storage.block_bytes)
        fut = asyncio.ensure_future(ep.recv(_buf(staging), tag=tag, force_tag=True))

        def commit() -> None:
            self.storage.write_blocks(dst_ids, staging)
            # Back to the pool only after a completed receive: after a failure UCX may still
            # hold the buffer (the pending request keeps it alive), so it must not be reused.
            self._pool.release(staging)

        return fut, commit

    async def _recv_blocks(self, ep: Any, tag: int, runs: list[Run], mode: str, dst_ids: Any) -> None:
        fut, commit = self._post_recv_blocks(ep, tag, runs, mode, dst_ids)
        await fut
        commit()

    def _num_msgs(self, runs: list[Run], mode: str) -> int:
        return 2 * self.storage.num_layers * len(runs) if mode == "direct" else 1

    async def _release_recvs(self, ep: Any, tag: int, runs: list[Run], mode: str) -> None:
        """After refusing a pull: complete the requester's pre-posted receives with empty messages."""
        empty = bytearray(0)
        await asyncio.gather(*(ep.send(empty, tag=tag | i, force_tag=True) for i in range(self._num_msgs(runs, mode))))

    # ------------------------------------------------------------------ client side

    async def _peer(self, peer_addr: str) -> _Peer:
        p = self._peers.get(peer_addr)
        if p is not None and not p.ctrl.closed:
            return p
        pending = self._connecting.get(peer_addr)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._connecting[peer_addr] = fut
        try:
            p = await self._connect(peer_addr)
            self._peers[peer_addr] = p
            fut.set_result(p)
            return p
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # mark retrieved
            raise
        finally:
            self._connecting.pop(peer_addr, None)

    async def _connect(self, peer_addr: str) -> _Peer:
        host, port = split_addr(peer_addr)
        self._ensure_init()
        ctrl = await self._ucxx.create_endpoint(host, port)
        data = None
        try:
            await send_ctrl(ctrl, self._hello())
            rep = await recv_ctrl(ctrl)
            if rep.get("error"):
                raise TransferError(f"ucx: peer {peer_addr} refused the link: {rep['error']}")
            self._check_meta(rep["meta"], peer_addr)
            data = await self._create_data_ep(rep["worker_addr"])
            iov_key = None
            if self._iov is not None and rep.get("iov_addr"):
                iov_key = await self._iov_connect(("out", peer_addr), rep["iov_addr"])
            mapped = None
            if iov_key is not None and rep.get("pool") and self.mode == "auto":
                mapped = await self._map_peer(iov_key, rep["pool"], KVCacheMeta.from_dict(rep["meta"]), peer_addr)
            if iov_key is not None and mapped is None:
                await self._iov_warmup(iov_key, int(rep["meta"]["num_blocks"]), peer_addr)
            return _Peer(ctrl, data, iov_key, self._iov, mapped)
        except BaseException:
            _Peer(ctrl, data).abort()
            raise

    async def _map_peer(self, key: Any, export: dict, meta: KVCacheMeta, peer_addr: str) -> _MappedPool | None:
        """Map the peer's pool over our iov endpoint to it; None (the iov path) when that is not
        possible here. The mapping's page tables are filled now, not by the first pulls."""
        if not shared_memory.mapping_enabled():
            return None
        need = meta.num_blocks * meta.block_bytes
        if int(export.get("nbytes", 0)) != need:
            logger.warning("ucx: %s exports a pool of %s bytes, its layout needs %d: not mapped",
                           peer_addr, export.get("nbytes"), need)
            return None
        try:
            pool = await asyncio.wrap_future(self._iov.map_remote(key, export))
        except Exception as e:  # noqa: BLE001 - e.g. UNREACHABLE: another host or IPC namespace
            logger.info("ucx: cannot map the KV pool of %s (%s); using the iov path", peer_addr, e)
            return None
        t0 = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(None, prefault_pages, pool.address, pool.nbytes)
        layout = iov_protocol.IovLayout.of_pool(pool.address, meta.num_layers, meta.num_blocks,
                                                meta.block_bytes // (2 * meta.num_layers))
        logger.info("ucx: mapped the KV pool of %s (%d MB, prefaulted in %.1f ms): transfers are memcpys",
                    peer_addr, need >> 20, (time.perf_counter() - t0) * 1e3)
        return _MappedPool(pool, layout)

    def _path_of(self, peer_addr: str) -> str:
        p = self._peers.get(peer_addr)
        return "tag" if p is None else p.path

    async def _link_impl(self, peer_addr: str) -> None:
        await self._peer(peer_addr)

    async def _unlink_impl(self, peer_addr: str) -> None:
        p = self._peers.pop(peer_addr, None)
        if p is not None:
            self._drop_iov(p)
            p.abort()

    async def _request(self, p: _Peer, op: str, tag: int, runs: list[Run], mode: str, timeout: float) -> None:
        hdr = {"op": op, "req": tag, "runs": runs, "mode": mode, "timeout": timeout}
        status = asyncio.ensure_future(recv_ctrl(p.ctrl, tag=tag))
        async with p.send_lock:
            await p.guard(send_ctrl(p.ctrl, hdr), f"{op} request")
        rep = await p.guard(status, f"{op} reply")
        if not rep.get("ok"):
            raise TransferError(rep.get("error", "peer refused"), invalid_argument=True)

    # ------------------------------------------------------------------ iov fast path

    def submit_pull(self, peer_addr: str, src_blocks: Any, dst_blocks: Any,
                    timeout: float | None = None) -> concurrent.futures.Future[TransferResult]:
        """Linked host peers: straight to the IovWorker from the calling thread (no hop through
        the backend's event loop, ~0.2 ms each way here); anything else: the base path."""
        p = self._linked_iov_peer(peer_addr)
        if p is None:
            return super().submit_pull(peer_addr, src_blocks, dst_blocks, timeout)
        runs = self._prepare(src_blocks, dst_blocks, local_is_dst=True)
        return self._iov_submit(p, peer_addr, "pull", runs, timeout)

    def submit_push(self, peer_addr: str, src_blocks: Any, dst_blocks: Any,
                    timeout: float | None = None) -> concurrent.futures.Future[TransferResult]:
        p = self._linked_iov_peer(peer_addr)
        if p is None:
            return super().submit_push(peer_addr, src_blocks, dst_blocks, timeout)
        runs = self._prepare(src_blocks, dst_blocks, local_is_dst=False)
        return self._iov_submit(p, peer_addr, "push", runs, timeout)

    def _linked_iov_peer(self, peer_addr: str) -> _Peer | None:
        p = self._peers.get(peer_addr)
        if p is None or p.iov_key is None or self._iov is None or p.lost.is_set() or p.ctrl.closed:
            return None
        return p

    def _iov_submit(self, p: _Peer, peer_addr: str, op: str, runs: list[Run],
                    timeout: float | None) -> concurrent.futures.Future[TransferResult]:
        """Same contract as the base ``_run_op``: TransferResult, or TransferError / TransferTimeout
        after the link was dropped (a refusal keeps the link: the connection is fine)."""
        out: concurrent.futures.Future[TransferResult] = concurrent.futures.Future()
        t = self.default_timeout_s if timeout is None else timeout
        num_blocks = sum(r[2] for r in runs)
        if not num_blocks:
            out.set_result(TransferResult(num_blocks=0, num_runs=0, num_bytes=0, seconds=0.0))
            return out
        t0 = time.perf_counter()
        inner = self._mapped_start(p.mapped, op, runs) if p.mapped is not None else self._iov_start(p, op, runs, t)

        def finish(f: concurrent.futures.Future) -> None:
            if f.cancelled() or out.done():
                return
            exc = f.exception()
            if exc is None:
                out.set_result(self._succeeded(op, runs, t0, p.path))
                return
            err = self._failed(op, peer_addr, num_blocks, t, exc)
            if err.invalid_argument:  # (as in _run_op: a refusal keeps the link)
                out.set_exception(err)
                return
            self._lt.submit(self._on_failure(peer_addr)).add_done_callback(
                lambda _: None if out.done() else out.set_exception(err))

        inner.add_done_callback(finish)
        out.add_done_callback(lambda o: inner.cancel() if o.cancelled() else None)
        return out

    def _mapped_start(self, m: _MappedPool, what: str, runs: list[Run]) -> concurrent.futures.Future:
        """A pull or push with a mapped peer: the peer's side of every run checked against its
        pool here (the peer takes no part), then one native memcpy call: on the calling thread
        up to ``_INLINE_COPY_BYTES`` (a thread hop costs more than the copy), else on our copy
        thread. A memcpy cannot hang: no deadline."""
        arr = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
        theirs = 0 if what == "pull" else 1
        err = iov_protocol.check_runs(arr, m.layout.num_blocks, theirs)
        if err is None and what == "push" and arr.shape[0] > 1:
            dst = runs_to_ids(runs)[1]
            if np.unique(dst).size != dst.size:
                err = "peer refused: duplicate destination block ids"
        if err is not None:
            f: concurrent.futures.Future = concurrent.futures.Future()
            f.set_exception(TransferError(err, invalid_argument=True))
            return f

        def copy() -> None:
            if not m.pool.acquire():
                raise TransferError("ucx: the link to the peer was closed")
            try:
                ours = self._iov_layout.chunks(arr, 1 - theirs)
                other = m.layout.chunks(arr, theirs)
                shared_memory.copy_chunks(ours, other) if what == "pull" else shared_memory.copy_chunks(other, ours)
            finally:
                m.pool.release()
            self._stats["mapped"] += 1

        if int(arr[:, 2].sum()) * self.storage.block_bytes <= _INLINE_COPY_BYTES:
            f = concurrent.futures.Future()
            try:
                copy()
                f.set_result(None)
            except Exception as e:  # noqa: BLE001
                f.set_exception(e)
            return f
        if self._copier is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-ucx-copy")
        return self._copier.submit(copy)

    def _iov_start(self, p: _Peer, what: str, runs: list[Run], timeout: float) -> concurrent.futures.Future:
        """``what``: "pull" or "push". The request is prepared here, on the caller's thread."""
        op = iov_protocol.OP_PULL if what == "pull" else iov_protocol.OP_PUSH
        req = iov_protocol.IovRequest(self._iov_layout, op, self._iov.new_req_id(), self._token, timeout,
                                      np.asarray(runs, dtype=np.int64).reshape(-1, 3))
        return self._iov_post(p.iov_key, req, iov_protocol.TASKS[op], timeout, what, f"{what} of {len(runs)} runs")

    def _iov_post(self, key: Any, req: iov_protocol.IovRequest, task: Any, timeout: float, what: str,
                  label: str) -> concurrent.futures.Future:
        """Run ``task`` for ``req`` on the IovWorker over the data endpoint of link ``key``."""
        iov = self._iov

        def make(track: list) -> Any:
            ep = iov.ep_handle(key)
            if ep is None:
                raise TransferError(f"ucx: no data endpoint to the peer for {what}")
            return task(track, iov.handle, ep, req)

        return iov.start(make, timeout, key=key, what=label)

    async def _iov_warmup(self, key: Any, peer_blocks: int, peer_addr: str) -> None:
        """``_WARMUP_PULLS`` pulls of ~1 MB of the peer's first blocks into one scratch buffer
        (read-only for the peer, which counts them as served; 10 - 40 ms here). A failure only ends the warm-up:
        the link is used as it is, and a real transfer reports any problem."""
        iov, layout = self._iov, self._iov_layout
        n = max(1, min(_WARMUP_BYTES // layout.block_bytes, peer_blocks // 2))
        shapes = (np.array([[0, 0, n]], dtype=np.int64),
                  np.array([[2 * i, i, 1] for i in range(n)], dtype=np.int64))
        scratch = np.ones(n * layout.block_bytes, dtype=np.uint8)  # (touched: no page faults in the pulls)
        t0 = time.perf_counter()
        for i in range(_WARMUP_PULLS):
            req = iov_protocol.IovRequest.scratch_pull(layout, iov.new_req_id(), self._token,
                                                       _WARMUP_TIMEOUT_S, shapes[i % 2], scratch)
            try:
                await asyncio.wrap_future(self._iov_post(key, req, iov_protocol.pull_task, _WARMUP_TIMEOUT_S,
                                                         "the warm-up", "warm-up pull"))
            except Exception as e:  # noqa: BLE001
                logger.warning("ucx: warm-up pull %d from %s failed (%s: %s); link kept", i, peer_addr,
                               type(e).__name__, e)
                return
        logger.debug("ucx: link to %s warmed up with %d pulls in %.1f ms", peer_addr, _WARMUP_PULLS,
                     (time.perf_counter() - t0) * 1e3)

    async def _iov_op(self, p: _Peer, what: str, runs: list[Run], timeout: float) -> None:
        if p.mapped is not None:
            return await asyncio.wrap_future(self._mapped_start(p.mapped, what, runs))
        await p.guard(asyncio.wrap_future(self._iov_start(p, what, runs, timeout)), what)

    async def _pull_impl(self, peer_addr: str, runs: list[Run], timeout: float) -> None:
        """Receives are posted before the request goes out: one round trip, status and data
        in flight together. A refusal completes them with empty messages (nothing written)."""
        p = await self._peer(peer_addr)
        if p.iov_key is not None:
            return await self._iov_op(p, "pull", runs, timeout)  # (mapped or iov)
        tag, mode = _new_req(), self._choose_mode(runs)
        data, commit = self._post_recv_blocks(p.ctrl, tag, runs, mode,
                                              runs_to_ids(runs)[1] if mode == "gather" else None)
        try:
            await self._request(p, "pull", tag, runs, mode, timeout)
        except TransferError as e:
            if e.invalid_argument:  # refused: the peer releases our receives
                await p.guard(data, "pull refusal")
            raise
        await p.guard(data, "pull data")
        commit()

    async def _push_impl(self, peer_addr: str, runs: list[Run], timeout: float) -> None:
        p = await self._peer(peer_addr)
        if p.iov_key is not None:
            return await self._iov_op(p, "push", runs, timeout)
        tag, mode = _new_req(), self._choose_mode(runs)
        await self._request(p, "push", tag, runs, mode, timeout)
        done = asyncio.ensure_future(recv_ctrl(p.ctrl, tag=tag))
        await p.guard(self._send_blocks(p.data, tag, runs, mode, runs_to_ids(runs)[0] if mode == "gather" else None),
                      "push data")
        rep = await p.guard(done, "push completion")
        if not rep.get("ok"):
            raise TransferError(rep.get("error", "peer failed to write"))

    async def _close_impl(self) -> None:
        peers = list(self._peers.values()) + list(self._server_eps)
        self._peers.clear()
        self._server_eps.clear()
        for p in peers:
            self._drop_iov(p)
        await asyncio.gather(*(p.close() for p in peers))
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._copier is not None:  # (copies in flight end first: their pools stay mapped till then)
            await asyncio.get_running_loop().run_in_executor(None, self._copier.shutdown)
            self._copier = None
        if self._iov is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._iov.close)
            self._iov = None
