"""The iov path: host-memory transfers with a same-host peer as ONE iov tag message.

Each backend on host memory runs an ``IovWorker`` (own UCP worker, own thread,
event-driven) and moves a whole block list as one iov tag message straight between the
two caches over shared memory; request and status travel on the same endpoints (see
``iov_protocol.py``). The ucxx control connection only links the peers (hello, layout
check, worker addresses) and detects a dead peer.

Stages: ``connect`` (at link time: an endpoint on our IovWorker to the peer's, None when
its transports cannot reach it), ``warmup`` (a few scratch pulls), then ``start`` per pull
or push (prepared on the caller's thread, run on the IovWorker thread); the owner serves
requests in ``on_request`` (on its IovWorker thread); ``drop`` at unlink.

Slices (peers of different TP or PP) go as one iov message too, one entry per token slot
of each (run, kv, layer) on the side that holds more heads than the slice (slices.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import struct
import time
from typing import Any

import numpy as np

from xllm_py.config import UCXConfig
from xllm_py.kv_transfer.base import Run, TransferError
from xllm_py.kv_transfer.head_slices import Heads
from xllm_py.kv_transfer.ucx import iov_protocol, slices
from xllm_py.kv_transfer.ucx.iov_worker import IovWorker
from xllm_py.kv_transfer.ucx.path_tag import CheckRuns
from xllm_py.kv_transfer.ucx.peer import Peer

logger = logging.getLogger(__name__)


class IovPath:
    name = "iov"

    def __init__(self, worker: IovWorker, layout: iov_protocol.IovLayout, token: int, config: UCXConfig,
                 stats: dict[str, int], check_runs: CheckRuns) -> None:
        self.worker = worker
        self.layout = layout
        self.token = token  # names our IovWorker endpoint on the peers
        self.config = config
        self._stats = stats
        self._check_runs = check_runs
        # link key -> (KV heads, layers) of that peer's pool
        self._peer_shapes: dict[Any, slices.PoolShape] = {}

    # ------------------------------------------------------------------ links

    async def connect(self, key: Any, hex_addr: str, peer_shape: slices.PoolShape) -> Any:
        """Endpoint on our IovWorker to the peer's (whose pool has ``peer_shape``);
        None when its transports cannot reach it (e.g. shared memory only, peer on another
        host): that peer then uses the tag path."""
        try:
            await asyncio.wrap_future(self.worker.connect(key, bytes.fromhex(hex_addr)))
            self._peer_shapes[key] = peer_shape
            return key
        except Exception as e:  # noqa: BLE001
            logger.info("ucx: no iov data path to %s (%s: %s); using the tag path", key, type(e).__name__, e)
            return None

    def drop(self, peer: Peer) -> None:
        if peer.iov_key is not None:
            self._peer_shapes.pop(peer.iov_key, None)
            self.worker.disconnect(peer.iov_key)

    async def warmup(self, key: Any, peer_blocks: int, peer_addr: str) -> None:
        """``warmup_pulls`` pulls of ~``warmup_bytes`` of the peer's first blocks into one
        scratch buffer (read-only for the peer, which counts them as served; UCXConfig has the
        measurements; a peer of other KV heads or layers: slices of those both pools have). A failure
        only ends the warm-up: the link is used as it is, and a real transfer reports any problem."""
        cfg, layout = self.config, self.layout
        theirs = self._peer_shapes.get(key, layout.shape)
        heads = None if theirs == layout.shape else (
            0, 0, min(theirs[0], layout.num_kv_heads), 0, 0, min(theirs[1], layout.shape[1]))
        n = max(1, min(cfg.warmup_bytes // layout.block_bytes, peer_blocks // 2))
        shapes = (np.array([[0, 0, n]], dtype=np.int64),
                  np.array([[2 * i, i, 1] for i in range(n)], dtype=np.int64))
        scratch = np.ones(n * layout.block_bytes, dtype=np.uint8)  # (touched: no page faults in the pulls)
        t0 = time.perf_counter()
        for i in range(cfg.warmup_pulls):
            req = iov_protocol.IovRequest.scratch_pull(layout, self.worker.new_req_id(), self.token,
                                                       cfg.warmup_timeout_s, shapes[i % 2], scratch, heads)
            try:
                await asyncio.wrap_future(self._post(key, req, iov_protocol.pull_task, cfg.warmup_timeout_s,
                                                     "the warm-up", "warm-up pull"))
            except Exception as e:  # noqa: BLE001
                logger.warning("ucx: warm-up pull %d from %s failed (%s: %s); link kept", i, peer_addr,
                               type(e).__name__, e)
                return
        logger.debug("ucx: link to %s warmed up with %d pulls in %.1f ms", peer_addr, cfg.warmup_pulls,
                     (time.perf_counter() - t0) * 1e3)

    # ------------------------------------------------------------------ requester

    async def transfer(self, p: Peer, what: str, runs: list[Run], timeout: float,
                       heads: Heads | None = None) -> None:
        await p.guard(asyncio.wrap_future(self.start(p, what, runs, timeout, heads)), what)

    def start(self, p: Peer, what: str, runs: list[Run], timeout: float,
              heads: Heads | None = None) -> concurrent.futures.Future:
        """The request is prepared here, on the caller's thread."""
        op = iov_protocol.OP_PULL if what == "pull" else iov_protocol.OP_PUSH
        req = iov_protocol.IovRequest(self.layout, op, self.worker.new_req_id(), self.token, timeout,
                                      np.asarray(runs, dtype=np.int64).reshape(-1, 3), heads)
        return self._post(p.iov_key, req, iov_protocol.TASKS[op], timeout, what, f"{what} of {len(runs)} runs")

    def _post(self, key: Any, req: iov_protocol.IovRequest, task: Any, timeout: float, what: str,
              label: str) -> concurrent.futures.Future:
        """Run ``task`` for ``req`` on the IovWorker over the data endpoint of link ``key``."""
        iov = self.worker

        def make(track: list) -> Any:
            ep = iov.ep_handle(key)
            if ep is None:
                raise TransferError(f"ucx: no data endpoint to the peer for {what}")
            return task(track, iov.handle, ep, req)

        return iov.start(make, timeout, key=key, what=label)

    # ------------------------------------------------------------------ owner

    def on_request(self, sender_tag: int, data: bytes) -> tuple | None:
        """IovWorker thread: a peer's pull/push request; returns the task that serves it."""
        try:
            op, req_id, token, timeout, runs, heads = iov_protocol.decode_request(data)
        except (ValueError, struct.error) as e:  # (a short message: nothing to answer to)
            logger.warning("ucx: malformed iov request of %d bytes dropped: %s", len(data), e)
            return None
        key = ("in", token)
        iov = self.worker
        ep = iov.ep_handle(key)
        if ep is None:
            logger.warning("ucx: request %x from an unknown peer (token %x): dropped", req_id, token)
            return None

        def served() -> None:
            self._stats["served"] += 1

        def make(track: list) -> Any:
            return iov_protocol.serve_task(track, iov.handle, ep, self.layout, op, req_id, runs,
                                           self._check_runs, served, heads, self._peer_shapes.get(key))

        return make, timeout, key, f"serving op {op} (req {req_id:x}, {len(runs)} runs)"
