"""UcxKVTransferBackend: KV blocks over UCX, host or CUDA memory; picks a data path per peer.

UCXX's Python API has no one-sided get/put, so a pull is a request from the puller
answered by the owner sending the blocks (or, on the mapped path, a memcpy by the puller).

Stages of a link (requester R, owner O), over the ucxx control connection (sockaddr
endpoint, error handling: detects a dead peer):
1. R -> O hello {worker_addr, meta, iov_addr, token, pool, key}; O refuses a hello without
   its transfer key (base.py: nothing of O's is sent back, no endpoint made), checks the
   block layout, connects its IovWorker to R's, replies with its own hello (or the error).
2. R checks the layout and opens the data endpoint; on host memory, an iov endpoint to O's
   IovWorker; with mode ``auto`` and O's pool exported, maps O's pool; else warms the iov
   link up. The ``Peer`` records what it found, which chooses its data path (peer.py):
   ``mapped`` (path_mapped.py), ``iov`` (path_iov.py) or ``tag`` (path_tag.py).
3. Pulls and pushes go to that path; the owner serves tag requests on the control
   connection and iov requests on its IovWorker. A failure drops the link (base class).
4. unlink / close: drop the iov endpoint (and mapping), close the endpoints.

Linked host peers skip the event loop: ``submit_pull`` / ``submit_push`` start the
transfer from the calling thread (~0.2 ms each way saved here).

Peers of different TP or pipeline stages (pools that differ in ``num_kv_heads`` or
``num_layers``) link too; between them only slices move (every path: slices.py), a
whole-block transfer is refused.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import time
from typing import Any

from xllm_py.config import UCXConfig
from xllm_py.kv_transfer.base import (
    NOT_LINKED,
    KVTransferBackend,
    LoopThread,
    Run,
    TransferError,
    TransferResult,
    split_addr,
)
from xllm_py.kv_transfer.head_slices import Heads
from xllm_py.kv_transfer.kv_storage import KVCacheMeta, KVCacheStorage
from xllm_py.kv_transfer.ucx import iov_protocol, slices
from xllm_py.kv_transfer.ucx.env import import_ucxx, iov_worker_config
from xllm_py.kv_transfer.ucx.framing import recv_ctrl, send_ctrl
from xllm_py.kv_transfer.ucx.iov_worker import IovWorker
from xllm_py.kv_transfer.ucx.path_iov import IovPath
from xllm_py.kv_transfer.ucx.path_mapped import MappedPath
from xllm_py.kv_transfer.ucx.path_tag import TagPath
from xllm_py.kv_transfer.ucx.peer import DataPath, HostPath, Peer, abort_endpoints
from xllm_py.kv_transfer.ucx.runtime import init_ucxx, shared_loop
from xllm_py.utils.aio import wait_for

logger = logging.getLogger(__name__)


class UcxKVTransferBackend(KVTransferBackend):
    name = "ucx"
    supports_head_slices = True
    supports_layer_slices = True

    def __init__(self, storage: KVCacheStorage, default_timeout_s: float = 30.0,
                 listen_host: str = "127.0.0.1", listen_port: int = 0, mode: str = "auto",
                 config: UCXConfig | None = None, access_key: str | None = None) -> None:
        """``mode``: auto (host memory: mapped, else iov, else tag; CUDA: tag, direct or gather
        per transfer) | iov (host memory, never mapped) | direct | gather (tag path only).
        ``config``: None reads UCXConfig.from_env()."""
        if mode not in ("auto", "iov", "direct", "gather"):
            raise ValueError(f"mode must be auto|iov|direct|gather, got {mode!r}")
        if mode == "iov" and storage.is_cuda:
            raise ValueError("mode 'iov' moves host memory only; CUDA pools use auto|direct|gather")
        self._ucxx = import_ucxx(gpu=storage.is_cuda)
        super().__init__(storage, default_timeout_s, access_key)
        self.config = config if config is not None else UCXConfig.from_env()
        self._stats["mapped"] = 0  # transfers done as memcpys with a mapped peer pool
        self._listen_host = listen_host
        self._listen_port = listen_port
        self.mode = mode
        self._listener: Any = None
        self._peers: dict[str, Peer] = {}
        self._connecting: dict[str, asyncio.Future] = {}
        self._server_eps: set[Peer] = set()
        self._tag = TagPath(storage, mode, self.config, self._stats, self._check_remote_runs, default_timeout_s)
        self._use_iov = not storage.is_cuda and mode in ("auto", "iov")
        self._iov: IovWorker | None = None  # the host paths' worker, from the first start / link
        self._iov_path: IovPath | None = None
        self._mapped: MappedPath | None = None
        self._token = secrets.randbits(60)  # names our IovWorker endpoint on the peers

    def _make_loop_thread(self) -> tuple[LoopThread, bool]:
        return shared_loop(), False

    # ------------------------------------------------------------------ setup

    def _ensure_init(self) -> None:
        init_ucxx(self._ucxx, self.config)
        if self._use_iov and self._iov is None:
            self._iov = IovWorker(iov_worker_config(self.config), self._on_iov_request)
            layout = iov_protocol.IovLayout(self.storage)
            self._iov_path = IovPath(self._iov, layout, self._token, self.config, self._stats,
                                     self._check_remote_runs)
            self._mapped = MappedPath(self.storage, self._iov, layout, self.config, self._stats)

    def _on_iov_request(self, sender_tag: int, data: bytes) -> tuple | None:
        path = self._iov_path
        return None if path is None else path.on_request(sender_tag, data)

    def _hello(self) -> dict:
        return {"worker_addr": bytes(self._ucxx.get_worker_address()).hex(), "meta": self.storage.meta.to_dict(),
                "iov_addr": self._iov.address.hex() if self._iov is not None else None, "token": self._token,
                "pool": self._mapped.pool_export() if self._mapped is not None else None}

    def _check_meta(self, d: dict, peer: str) -> KVCacheMeta:
        """The peer's pool layout; it may differ from ours in its KV heads and layers only
        (another TP or pipeline stage)."""
        theirs = KVCacheMeta.from_dict(d)
        if slices.link_shape_key(theirs) != slices.link_shape_key(self.storage.meta):
            raise TransferError(f"ucx: peer {peer} has an incompatible KV block layout: "
                                f"theirs {theirs.block_shape_key()} vs ours {self.storage.meta.block_shape_key()}")
        return theirs

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

    def _drop_iov(self, peer: Peer) -> None:
        if self._iov is not None and self._iov_path is not None:
            self._iov_path.drop(peer)

    def _path(self, p: Peer) -> DataPath:
        if p.mapped is not None:
            return self._mapped
        return self._tag if p.iov_key is None else self._iov_path

    def _path_of(self, peer_addr: str) -> str:
        p = self._peers.get(peer_addr)
        return "tag" if p is None else p.path

    # ------------------------------------------------------------------ owner side of a link

    async def _on_connect(self, ep: Any) -> None:
        peer: Peer | None = None
        try:
            hello = await recv_ctrl(ep)
            if not self.admits(hello.get("key")):
                logger.warning("ucx: refused a link without our transfer key")
                await send_ctrl(ep, {"error": NOT_LINKED, "denied": True})
                try:  # the requester closes on the refusal; closing first may drop it in flight
                    await wait_for(recv_ctrl(ep), self.default_timeout_s)
                finally:
                    abort_endpoints(ep)
                return
            meta = None
            try:
                meta = self._check_meta(hello["meta"], "client")
                err = None
            except TransferError as e:
                err = str(e)
            data = await self._create_data_ep(hello["worker_addr"])
            iov_key = None
            if self._iov is not None and hello.get("iov_addr") and not err:
                iov_key = await self._iov_path.connect(("in", int(hello["token"])), hello["iov_addr"],
                                                       slices.shape_of(meta))
            peer = Peer(ep, data, iov_key, self._iov,
                        shape=None if meta is None else slices.shape_of(meta))
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
                t = asyncio.get_running_loop().create_task(self._tag.serve(peer, req))
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

    # ------------------------------------------------------------------ requester side of a link

    async def _peer(self, peer_addr: str) -> Peer:
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

    async def _connect(self, peer_addr: str) -> Peer:
        host, port = split_addr(peer_addr)
        self._ensure_init()
        ctrl = await self._ucxx.create_endpoint(host, port)
        data = None
        try:
            await send_ctrl(ctrl, {**self._hello(), "key": self.peer_key(peer_addr)})
            rep = await recv_ctrl(ctrl)
            if rep.get("error"):
                raise TransferError(f"ucx: peer {peer_addr} refused the link: {rep['error']}",
                                    denied=bool(rep.get("denied")))
            meta = self._check_meta(rep["meta"], peer_addr)
            data = await self._create_data_ep(rep["worker_addr"])
            iov_key = None
            if self._iov is not None and rep.get("iov_addr"):
                iov_key = await self._iov_path.connect(("out", peer_addr), rep["iov_addr"],
                                                       slices.shape_of(meta))
            mapped = None
            if iov_key is not None and rep.get("pool") and self.mode == "auto":
                mapped = await self._mapped.map_peer(iov_key, rep["pool"], meta, peer_addr)
            if iov_key is not None and mapped is None:
                await self._iov_path.warmup(iov_key, meta.num_blocks, peer_addr)
            return Peer(ctrl, data, iov_key, self._iov, mapped, slices.shape_of(meta))
        except BaseException:
            abort_endpoints(ctrl, data)
            raise

    async def _link_impl(self, peer_addr: str) -> None:
        await self._peer(peer_addr)

    async def _unlink_impl(self, peer_addr: str) -> None:
        p = self._peers.pop(peer_addr, None)
        if p is not None:
            self._drop_iov(p)
            p.abort()

    # ------------------------------------------------------------------ transfers

    def submit_pull(self, peer_addr: str, src_blocks: Any, dst_blocks: Any, timeout: float | None = None,
                    heads: Heads | None = None) -> concurrent.futures.Future[TransferResult]:
        """Linked host peers: straight to the host path from the calling thread (no hop through
        the backend's event loop, ~0.2 ms each way here); anything else: the base path."""
        p = self._linked_host_peer(peer_addr)
        if p is None:
            return super().submit_pull(peer_addr, src_blocks, dst_blocks, timeout, heads)
        runs = self._prepare(src_blocks, dst_blocks, local_is_dst=True, heads=heads)
        return self._host_submit(p, peer_addr, "pull", runs, timeout, heads)

    def submit_push(self, peer_addr: str, src_blocks: Any, dst_blocks: Any, timeout: float | None = None,
                    heads: Heads | None = None) -> concurrent.futures.Future[TransferResult]:
        p = self._linked_host_peer(peer_addr)
        if p is None:
            return super().submit_push(peer_addr, src_blocks, dst_blocks, timeout, heads)
        runs = self._prepare(src_blocks, dst_blocks, local_is_dst=False, heads=heads)
        return self._host_submit(p, peer_addr, "push", runs, timeout, heads)

    def _refusal(self, p: Peer, op: str, heads: Heads | None) -> TransferError | None:
        """Our check of a transfer with ``p`` (the owner checks again): whole blocks only
        between pools of equal KV heads, a head slice inside both pools."""
        err = slices.refusal(heads, slices.shape_of(self.storage.meta), p.shape,
                             1 if op == "pull" else 0)
        return None if err is None else TransferError(f"ucx: {err}", invalid_argument=True)

    def _linked_host_peer(self, peer_addr: str) -> Peer | None:
        p = self._peers.get(peer_addr)
        if p is None or p.iov_key is None or self._iov is None or p.lost.is_set() or p.ctrl.closed:
            return None
        return p

    def _host_submit(self, p: Peer, peer_addr: str, op: str, runs: list[Run], timeout: float | None,
                     heads: Heads | None = None) -> concurrent.futures.Future[TransferResult]:
        """Same contract as the base ``_run_op``: TransferResult, or TransferError / TransferTimeout
        after the link was dropped (a refusal keeps the link: the connection is fine)."""
        out: concurrent.futures.Future[TransferResult] = concurrent.futures.Future()
        t = self.default_timeout_s if timeout is None else timeout
        num_blocks = sum(r[2] for r in runs)
        if not num_blocks:
            out.set_result(TransferResult(num_blocks=0, num_runs=0, num_bytes=0, seconds=0.0))
            return out
        t0 = time.perf_counter()
        path: HostPath = self._path(p)  # type: ignore[assignment]  (mapped or iov)
        refused = self._refusal(p, op, heads)
        if refused is None:
            inner = path.start(p, op, runs, t, heads)
        else:
            inner = concurrent.futures.Future()
            inner.set_exception(refused)

        def finish(f: concurrent.futures.Future) -> None:
            if f.cancelled() or out.done():
                return
            exc = f.exception()
            if exc is None:
                out.set_result(self._succeeded(op, runs, t0, p.path, heads))
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

    async def _pull_impl(self, peer_addr: str, runs: list[Run], timeout: float,
                         heads: Heads | None = None) -> None:
        await self._transfer(peer_addr, "pull", runs, timeout, heads)

    async def _push_impl(self, peer_addr: str, runs: list[Run], timeout: float,
                         heads: Heads | None = None) -> None:
        await self._transfer(peer_addr, "push", runs, timeout, heads)

    async def _transfer(self, peer_addr: str, op: str, runs: list[Run], timeout: float,
                        heads: Heads | None) -> None:
        p = await self._peer(peer_addr)
        refused = self._refusal(p, op, heads)
        if refused is not None:
            raise refused
        await self._path(p).transfer(p, op, runs, timeout, heads)

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
        if self._mapped is not None:
            await self._mapped.close()
        if self._iov is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._iov.close)
            self._iov = None
