"""FakeKVTransferBackend: in-process transfer between storages of one process.

For unit tests of the scheduler flow. Peers find each other through a process-wide
registry keyed by address ``fake:<n>``. Faults are injected through ``FakeFaults``
(fail probability, fail the next N ops, a delay per op); injected failures raise
``TransferError`` exactly like a real transport failure.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import threading

from xllm_py.kv_transfer.base import NOT_LINKED, KVTransferBackend, Run, TransferError
from xllm_py.kv_transfer.kv_storage import KVCacheStorage

logger = logging.getLogger(__name__)

_registry: dict[str, "FakeKVTransferBackend"] = {}
_registry_lock = threading.Lock()
_ids = itertools.count(1)


@dataclasses.dataclass
class FakeFaults:
    fail_prob: float = 0.0
    fail_next: int = 0
    delay_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.fail_prob <= 1.0:
            raise ValueError("fail_prob must be in [0, 1]")
        self._rng = random.Random(self.seed)

    def should_fail(self) -> bool:
        if self.fail_next > 0:
            self.fail_next -= 1
            return True
        return self.fail_prob > 0 and self._rng.random() < self.fail_prob


class FakeKVTransferBackend(KVTransferBackend):
    name = "fake"

    def __init__(self, storage: KVCacheStorage, default_timeout_s: float = 30.0,
                 faults: FakeFaults | None = None, access_key: str | None = None) -> None:
        super().__init__(storage, default_timeout_s, access_key)
        self.faults = faults or FakeFaults()
        self._linked: set[str] = set()

    def inject_failures(self, n: int) -> None:
        self.faults.fail_next += n

    async def _start_impl(self) -> str:
        addr = f"fake:{next(_ids)}"
        with _registry_lock:
            _registry[addr] = self
        return addr

    def _peer(self, peer_addr: str) -> "FakeKVTransferBackend":
        with _registry_lock:
            peer = _registry.get(peer_addr)
        if peer is None or peer._closed:
            raise TransferError(f"fake: no peer at {peer_addr}")
        if peer.storage.meta.block_shape_key() != self.storage.meta.block_shape_key():
            raise TransferError(f"fake: peer {peer_addr} has an incompatible KV layout")
        if not peer.admits(self.peer_key(peer_addr)):
            raise TransferError(f"fake: {NOT_LINKED}", denied=True)
        return peer

    async def _link_impl(self, peer_addr: str) -> None:
        self._peer(peer_addr)
        self._linked.add(peer_addr)

    async def _unlink_impl(self, peer_addr: str) -> None:
        self._linked.discard(peer_addr)

    async def _fault(self, op: str, peer_addr: str) -> None:
        if self.faults.delay_s:
            await asyncio.sleep(self.faults.delay_s)
        if self.faults.should_fail():
            raise TransferError(f"fake: injected failure in {op} with {peer_addr}")

    async def _pull_impl(self, peer_addr: str, runs: list[Run], timeout: float) -> None:
        await self._copy("pull", peer_addr, runs)

    async def _push_impl(self, peer_addr: str, runs: list[Run], timeout: float) -> None:
        await self._copy("push", peer_addr, runs)

    async def _copy(self, op: str, peer_addr: str, runs: list[Run]) -> None:
        """pull: peer's src blocks -> ours; push: ours -> peer's dst blocks. The peer checks
        its side of the ids, as a remote owner would."""
        peer = self._peer(peer_addr)
        await self._fault(op, peer_addr)
        checked = peer._check_remote_runs(runs, side="src" if op == "pull" else "dst")
        if isinstance(checked, str):
            raise TransferError(checked, invalid_argument=True)
        src, dst = checked
        source, dest = (peer, self) if op == "pull" else (self, peer)
        dest.storage.write_blocks(dst, source.storage.read_blocks(src).to(dest.storage.device))
        peer._stats["served"] += 1

    async def _close_impl(self) -> None:
        with _registry_lock:
            if self._address is not None:
                _registry.pop(self._address, None)
