"""A linked peer and the one protocol every data path implements.

A ``Peer`` is the connection to one other backend: the ucxx control endpoint (links the
two, carries the tag path's requests, detects a dead peer), the ucxx data endpoint, and,
where the host paths reach the peer, its key on our IovWorker and its mapped pool.
Which ``DataPath`` moves a transfer follows from what the link found (``path``):

- ``mapped`` (path_mapped.py): the peer's pool is mapped here; a transfer is memcpys.
- ``iov``    (path_iov.py):    one iov tag message per transfer on our IovWorker.
- ``tag``    (path_tag.py):    ucxx tag messages (CUDA pools, modes direct / gather,
  peers the IovWorker cannot reach).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import TYPE_CHECKING, Any, Protocol

from xllm_py.kv_transfer.base import Run, TransferError
from xllm_py.kv_transfer.head_slices import Heads
from xllm_py.utils.aio import wait_for

if TYPE_CHECKING:
    from xllm_py.kv_transfer.ucx.iov_worker import IovWorker
    from xllm_py.kv_transfer.ucx.path_mapped import MappedPool

logger = logging.getLogger(__name__)


class DataPath(Protocol):
    """One way of moving the blocks of a pull or push with a linked peer. ``what``: "pull"
    (the peer's blocks into ours: runs are (theirs, ours, n)) or "push" ((ours, theirs, n))."""

    name: str

    async def transfer(self, p: "Peer", what: str, runs: list[Run], timeout: float,
                       heads: Heads | None = None) -> None:
        """On the backend's loop; raises TransferError (``invalid_argument``: refused).
        ``heads``: only those KV heads of the blocks (head_slices.py)."""
        ...


class HostPath(DataPath, Protocol):
    """A host-memory path that needs no event loop: started from any thread."""

    def start(self, p: "Peer", what: str, runs: list[Run], timeout: float,
              heads: Heads | None = None) -> concurrent.futures.Future:
        """The transfer, under way; its future completes with None or the error."""
        ...


class Peer:
    def __init__(self, ctrl: Any, data: Any, iov_key: Any = None, iov: IovWorker | None = None,
                 mapped: MappedPool | None = None,
                 shape: tuple[int, int] | None = None) -> None:
        self.ctrl = ctrl
        self.data = data
        # (KV heads, layers) of the peer's pool (None: not known); it differs from ours
        # between instances of other TP or pipeline stages
        self.shape = shape
        self.iov_key = iov_key  # key of this peer's endpoint on our IovWorker (None: tag path)
        self.mapped = mapped  # the peer's pool mapped here (closed with the iov endpoint)
        self.path = "tag" if iov_key is None else "mapped" if mapped is not None else "iov"
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
        abort_endpoints(self.ctrl, self.data)

    async def close(self, timeout: float = 1.0) -> None:
        """Graceful close: the peer learns that the connection is gone (abort tells it nothing)."""
        for ep in (self.ctrl, self.data):
            try:
                if ep is not None and not ep.closed:
                    await wait_for(ep.close(), timeout)
            except Exception as e:  # noqa: BLE001
                logger.debug("ucx: graceful close failed (%s), aborting", e)
        self.abort()


def abort_endpoints(*eps: Any) -> None:
    """Abort ucxx endpoints (None or already closed: skipped), e.g. of a link that failed
    before its ``Peer`` existed (a Peer cannot be made on an endpoint that is closing)."""
    for ep in eps:
        try:
            if ep is not None and not ep.closed:
                ep.abort()
        except Exception as e:  # noqa: BLE001
            logger.warning("ucx: aborting endpoint failed: %s", e)
