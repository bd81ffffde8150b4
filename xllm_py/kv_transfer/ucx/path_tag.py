"""The tag path: KV blocks as ucxx tag messages (CUDA pools, modes direct / gather, and
host peers the IovWorker cannot reach).

Per peer two endpoints (peer.py): the control endpoint (tcp, error handling) carries the
JSON headers and status replies, and every receive of *data* is also posted through it,
so a dead peer or ``abort()`` cancels them (no late write into blocks that were freed);
the data endpoint, created from the peer's UCX worker address without error handling,
lets UCX pick shared memory (cma zero-copy get) instead of tcp (see env.py for numbers).

Stages of a pull (requester R, owner O):
1. R posts receives into its storage; R -> O control: {op: pull, req, runs, mode}
   (R validated its dst ids already)
2. O validates its src ids; O -> R status {ok, error} on tag ``req``
3. O sends the data on the data endpoint with tags ``req | i``: ``direct`` = one message
   per (run, kv, layer) slice, received in place; ``gather`` = one message with all blocks
   ``index_select``ed, received into a staging buffer and scattered (fewer messages for
   fragmented lists). A refusal completes R's receives with empty messages.
Push: R -> O {op: push}; O validates dst ids, posts receives, replies ok; R sends data;
O replies done once all bytes are in place.
A slice (peers of different TP or PP; ``heads`` in the request, checked by O against its
pool) always goes ``gather``: ``gather_slice`` on the sender, ``scatter_slice`` on the receiver.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from xllm_py.config import UCXConfig
from xllm_py.kv_transfer.base import Run, TransferError, runs_to_ids
from xllm_py.kv_transfer.head_slices import Heads, gather_slice, scatter_slice, slice_bytes
from xllm_py.kv_transfer.kv_storage import KVCacheStorage, StagingPool
from xllm_py.kv_transfer.ucx import slices
from xllm_py.kv_transfer.ucx.framing import MAX_MSGS, new_req, recv_ctrl, send_ctrl, ucx_buffer
from xllm_py.kv_transfer.ucx.peer import Peer
from xllm_py.utils.aio import wait_for

logger = logging.getLogger(__name__)

CheckRuns = Callable[[list[Run], str], "tuple[np.ndarray, np.ndarray] | str"]


class TagPath:
    name = "tag"

    def __init__(self, storage: KVCacheStorage, mode: str, config: UCXConfig, stats: dict[str, int],
                 check_runs: CheckRuns, default_timeout_s: float) -> None:
        self.storage = storage
        self.mode = mode  # auto | iov (both: choose per transfer) | direct | gather
        self.config = config
        self._stats = stats
        self._check_runs = check_runs
        self._default_timeout_s = default_timeout_s
        self._bytes = storage.byte_view()  # uint8 [2, L, B, bs, H, D*itemsize]
        self._pool = StagingPool(storage.device)

    # ------------------------------------------------------------------ requester

    async def transfer(self, p: Peer, what: str, runs: list[Run], timeout: float,
                       heads: Heads | None = None) -> None:
        await (self._pull(p, runs, timeout, heads) if what == "pull" else self._push(p, runs, timeout, heads))

    async def _pull(self, p: Peer, runs: list[Run], timeout: float, heads: Heads | None) -> None:
        """Receives are posted before the request goes out: one round trip, status and data
        in flight together. A refusal completes them with empty messages (nothing written)."""
        tag, mode = new_req(), self.choose_mode(runs, heads)
        data, commit = self._post_recv_blocks(p.ctrl, tag, runs, mode,
                                              runs_to_ids(runs)[1] if mode == "gather" else None,
                                              heads)
        try:
            await self._request(p, "pull", tag, runs, mode, timeout, heads)
        except TransferError as e:
            if e.invalid_argument:  # refused: the peer releases our receives
                await p.guard(data, "pull refusal")
            raise
        await p.guard(data, "pull data")
        commit()

    async def _push(self, p: Peer, runs: list[Run], timeout: float, heads: Heads | None) -> None:
        tag, mode = new_req(), self.choose_mode(runs, heads)
        await self._request(p, "push", tag, runs, mode, timeout, heads)
        done = asyncio.ensure_future(recv_ctrl(p.ctrl, tag=tag))
        await p.guard(self._send_blocks(p.data, tag, runs, mode, runs_to_ids(runs)[0] if mode == "gather" else None,
                                        heads),
                      "push data")
        rep = await p.guard(done, "push completion")
        if not rep.get("ok"):
            raise TransferError(rep.get("error", "peer failed to write"))

    async def _request(self, p: Peer, op: str, tag: int, runs: list[Run], mode: str, timeout: float,
                       heads: Heads | None) -> None:
        hdr = {"op": op, "req": tag, "runs": runs, "mode": mode, "timeout": timeout,
               "heads": None if heads is None else [int(h) for h in heads]}
        status = asyncio.ensure_future(recv_ctrl(p.ctrl, tag=tag))
        async with p.send_lock:
            await p.guard(send_ctrl(p.ctrl, hdr), f"{op} request")
        rep = await p.guard(status, f"{op} reply")
        if not rep.get("ok"):
            raise TransferError(rep.get("error", "peer refused"), invalid_argument=True)

    # ------------------------------------------------------------------ owner

    async def serve(self, peer: Peer, req: dict) -> None:
        """A request that came in on ``peer``'s control endpoint; any failure drops the connection."""
        op, tag, runs = req.get("op"), int(req["req"]), [tuple(r) for r in req.get("runs", [])]
        timeout = float(req.get("timeout", self._default_timeout_s))
        try:
            heads = slices.parse_heads(req.get("heads"))
            refused = heads if isinstance(heads, str) else slices.refusal(
                heads, slices.shape_of(self.storage.meta), peer.shape, 0 if op == "pull" else 1)
            checked = (f"peer refused: {refused}" if refused
                       else self._check_runs(runs, "src" if op == "pull" else "dst"))
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
                                              self._send_blocks(peer.data, tag, runs, req["mode"], checked[0],
                                                                heads)),
                               timeout)
            else:
                recv = self._recv_blocks(peer.ctrl, tag, runs, req["mode"], checked[1], heads)
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

    def choose_mode(self, runs: list[Run], heads: Heads | None = None) -> str:
        """direct (zero-copy, one message per slice) only for few, large slices
        (UCXConfig.direct_max_msgs / direct_min_slice_bytes); a head slice: gather. Each
        message has a fixed cost, which dominates small slices: many small slices are
        gathered into one message, a few large ones go as they are (no copy).
        """
        if heads is not None:
            return "gather"
        if self.mode in ("direct", "gather"):
            return self.mode if len(runs) * 2 * self.storage.num_layers < MAX_MSGS else "gather"
        n_msgs = 2 * self.storage.num_layers * len(runs)
        avg_slice = sum(r[2] for r in runs) * self.storage.slice_bytes / max(len(runs), 1)
        if n_msgs <= self.config.direct_max_msgs and avg_slice >= self.config.direct_min_slice_bytes:
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

    async def _send_blocks(self, ep: Any, tag: int, runs: list[Run], mode: str, src_ids: Any,
                           heads: Heads | None = None) -> None:
        """``heads``: a slice, whose source side (ours) is gathered into one message."""
        if heads is not None:
            buf = gather_slice(self.storage, src_ids, heads).view(-1).view(torch.uint8)
            await ep.send(ucx_buffer(buf), tag=tag, force_tag=True)
        elif mode == "direct":
            slices = self._slices(runs, side=0)
            await asyncio.gather(*(ep.send(ucx_buffer(s), tag=tag | i, force_tag=True)
                                   for i, s in enumerate(slices)))
        else:
            buf = self._pool.acquire(len(src_ids) * self.storage.block_bytes)
            try:
                self.storage.read_blocks(src_ids, out=buf)
                await ep.send(ucx_buffer(buf), tag=tag, force_tag=True)
            finally:
                self._pool.release(buf)

    def _post_recv_blocks(self, ep: Any, tag: int, runs: list[Run], mode: str, dst_ids: Any,
                          heads: Heads | None = None) -> tuple[asyncio.Future, Any]:
        """Post the data receives now; returns (completion, commit). ``commit()`` scatters the
        gather staging buffer into the cache (``heads``: into the destination side (ours)
        of that slice): call it only after the peer said ok (a refusal completes the receives with
        empty messages, see ``_release_recvs``)."""
        if mode == "direct":
            slices = self._slices(runs, side=1)
            fut = asyncio.gather(*(ep.recv(ucx_buffer(s), tag=tag | i, force_tag=True)
                                   for i, s in enumerate(slices)))
            return fut, lambda: None
        block_bytes = slice_bytes(self.storage, heads)
        staging = self._pool.acquire(len(dst_ids) * block_bytes)
        fut = asyncio.ensure_future(ep.recv(ucx_buffer(staging), tag=tag, force_tag=True))

        def commit() -> None:
            if heads is None:
                self.storage.write_blocks(dst_ids, staging)
            else:
                scatter_slice(self.storage, dst_ids, heads, staging)
            # Back to the pool only after a completed receive: after a failure UCX may still
            # hold the buffer (the pending request keeps it alive), so it must not be reused.
            self._pool.release(staging)

        return fut, commit

    async def _recv_blocks(self, ep: Any, tag: int, runs: list[Run], mode: str, dst_ids: Any,
                           heads: Heads | None = None) -> None:
        fut, commit = self._post_recv_blocks(ep, tag, runs, mode, dst_ids, heads)
        await fut
        commit()

    def _num_msgs(self, runs: list[Run], mode: str) -> int:
        return 2 * self.storage.num_layers * len(runs) if mode == "direct" else 1

    async def _release_recvs(self, ep: Any, tag: int, runs: list[Run], mode: str) -> None:
        """After refusing a pull: complete the requester's pre-posted receives with empty messages."""
        empty = bytearray(0)
        await asyncio.gather(*(ep.send(empty, tag=tag | i, force_tag=True)
                               for i in range(self._num_msgs(runs, mode))))
