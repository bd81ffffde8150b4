"""KVTiering: an engine's side of its KV tiers (xllm_py/kv_tiers/). Engine thread, but for
its loader thread.

Out (write-through): after each turn of the loop `flush_offloads` takes the blocks the KV
manager logged (each computed block of a full-attention group; a sliding group's window
before where a request ended), copies those the tiers lack out of the pool in one gather,
hands the copy to the stack's writer and lets the blocks go.

In: a new request whose prompt runs past what the pool holds is marked `tier_pending` and
looked up by the loader thread (`prefetch`): the longest prefix every group can be served
from (pool or tiers; a sliding group needs only the window before the hit's end), its
blocks read (host memory, disk, then the store), the request woken with a StagedPrefix.
The scheduler admits it then, setting blocks aside for the prefix; the engine writes the
bytes in before the step's forward (`scatter`: one memcpy per block, milliseconds for
thousands of tokens) and the step computes only the rest. Other requests are scheduled
meanwhile; a lookup that fails or finds nothing just lets the prompt be computed.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
from typing import TYPE_CHECKING, Callable

from xllm_py.engine.hybrid_kv import group_hash
from xllm_py.kv_tiers.keys import TierKeyspace
from xllm_py.kv_tiers.metrics import TierCollector
from xllm_py.kv_tiers.stack import TierStack
from xllm_py.request import Request

if TYPE_CHECKING:
    from xllm_py.engine.kv_cache_manager import KVCacheManager
    from xllm_py.kv_transfer.kv_storage import KVCacheStorage

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StagedPrefix:
    first_block: int  # the pool's hit when it was looked up: data starts there
    num_blocks: int  # the hit through the tiers
    data: dict[tuple[int, int], bytes]  # (group, block index) -> the block's bytes
    tiers: dict[str, int]  # blocks read per tier


@dataclasses.dataclass
class _Lookup:
    request: Request
    hashes: list[int]  # the prompt's chain, as far as a hit may go
    first_block: int


class KVTiering:
    def __init__(self, stack: TierStack, keyspace: TierKeyspace, storage: KVCacheStorage,
                 kv: KVCacheManager, wake: Callable[[], None]) -> None:
        self.stack = stack
        self.keyspace = keyspace
        self.storage = storage
        self.kv = kv
        self.block_size = kv.block_size
        self._wake = wake
        kv.enable_offload()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: collections.deque[tuple[Request, StagedPrefix | None]] = collections.deque()
        self._loader = threading.Thread(target=self._load_loop, name="kv-tier-loader", daemon=True)
        self._loader.start()
        self.num_lookups = 0
        self.num_loaded_tokens = 0
        self.num_offloaded_blocks = 0
        self._load_costs: dict[str, float] | None = None

    def close(self) -> None:
        self._jobs.put(None)
        self._loader.join(timeout=5)
        self.stack.close()

    def describe(self) -> dict:
        """What the service routes by (InstanceMeta.kv_tiers): the tiers, the store's scope
        (its master and this keyspace: the instances sharing blocks through it), and each
        tier's load cost per block, measured once."""
        if self._load_costs is None:
            self._load_costs = self.stack.measure_load_ms(self.storage.block_bytes)
        store = self.stack.store
        return {"tiers": self.stack.tiers, "load_ms_per_block": self._load_costs,
                "store_scope": f"{store.master}/{self.keyspace.namespace}" if store else ""}

    def collector(self) -> TierCollector:
        """Its Prometheus metrics (kv_tiers/metrics.py)."""
        return TierCollector(self.stack, lambda: {"loaded_tokens": self.num_loaded_tokens,
                                                  "lookups": self.num_lookups})

    def key(self, chain_hash: int, group: int) -> str:
        return self.keyspace.key(group_hash(chain_hash, group), group)

    # -- out -----------------------------------------------------------------------------
    def flush_offloads(self) -> None:
        items = self.kv.take_offloads()
        if not items:
            return
        try:
            seen: set[str] = set()
            ids, keys = [], []
            for block_id, group, chain_hash in items:
                key = self.key(chain_hash, group)
                if key not in seen and not self.stack.known(key):
                    seen.add(key)
                    ids.append(block_id)
                    keys.append(key)
            if ids:
                rows = self.storage.read_block_rows(ids).numpy()
                if self.stack.offer(keys, rows):
                    self.num_offloaded_blocks += len(ids)
        finally:
            self.kv.release_offloads(items)

    # -- in ------------------------------------------------------------------------------
    def prefetch(self, request: Request) -> bool:
        """Look `request`'s prefix up below the pool if the pool lacks some of it; whether
        the request now waits for that (tier_pending)."""
        if request.sampling_params.prompt_logprobs is not None:
            return False  # (it computes its prompt for the logits)
        _, num_cached = self.kv.get_computed_blocks(request)
        max_hit = (request.num_tokens - 1) // self.block_size
        first = num_cached // self.block_size
        if max_hit <= first:
            return False
        hashes = request.block_hashes[:max_hit]
        if self.stack.store is None and not any(
                self.stack.where([self.key(hashes[first], 0)])):
            self.stack.count_misses(1)
            return False  # (no local tier has its next block: nothing to wait for)
        request.tier_pending = True
        self.num_lookups += 1
        self._jobs.put(_Lookup(request, list(hashes), first))
        return True

    def poll(self) -> int:
        """Engine thread: hand finished lookups to their requests; how many."""
        n = 0
        while self._done:
            request, staged = self._done.popleft()
            request.tier_pending = False
            request.tier_prefix = staged
            n += 1
        return n

    def scatter(self, loads: list[tuple[int, bytes]]) -> None:
        """Write loaded blocks into the pool (engine thread, before the step's forward)."""
        if not loads:
            return
        import torch

        ids = [block_id for block_id, _ in loads]
        raw = b"".join(data for _, data in loads)
        rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(len(ids), -1)
        self.storage.write_block_rows(ids, rows)
        self.num_loaded_tokens += len(ids) * self.block_size

    def _load_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            staged = None
            try:
                staged = self._lookup(job)
            except Exception:
                logger.exception("KV tier lookup failed; the prompt is computed")
            self._done.append((job.request, staged))
            self._wake()

    def _lookup(self, job: _Lookup) -> StagedPrefix | None:
        hashes, first = job.hashes, job.first_block
        wanted = [(j, i) for j in range(len(self.kv.group_windows))
                  for i in range(first, len(hashes))]
        keys = {b: self.key(hashes[b[1]], b[0]) for b in wanted}
        where = dict(zip(wanted, self.stack.where([keys[b] for b in wanted])))
        data: dict[tuple[int, int], bytes] = {}
        tiers: dict[str, int] = {}
        for _ in range(2):  # (a block that fails to read shortens the hit once more)
            last = self._longest(first, len(hashes), lambda b: where.get(b) is not None)
            if last <= first:
                self.stack.count_misses(1)
                return None
            need = [b for b in self.kv.tier_blocks(first, last) if b not in data]
            got = self.stack.read([keys[b] for b in need], [where[b] for b in need])
            for b, raw in zip(need, got):
                if raw is None:
                    where[b] = None
                else:
                    data[b] = raw
                    tiers[where[b]] = tiers.get(where[b], 0) + 1
            if all(raw is not None for raw in got):
                return StagedPrefix(first, last, data, tiers)
        return None

    def _longest(self, first: int, limit: int, have: Callable[[tuple[int, int]], bool]) -> int:
        """The longest hit (in blocks) from `first` whose every needed block `have`s."""
        full = [j for j, w in enumerate(self.kv.group_windows) if not w]
        last = first
        while last < limit and all(have((j, last)) for j in full):
            last += 1
        while last > first and not all(have(b) for b in self.kv.tier_blocks(first, last)):
            last -= 1
        return last
