"""BlockPool: KV cache blocks with ref counts, an LRU free queue and a prefix-hash map.

Block lifecycle:
    free (in the free queue, maybe still cached) -> allocated (ref > 0) -> freed
    (ref 0, back at the free-queue tail, hash kept so a later prefix hit can revive it)
    -> evicted (taken from the free-queue head for a new owner; its hash is dropped).

Hybrid models (hybrid_kv.py): `num_groups` > 1 KV groups cache their blocks under
hashes of their own, each naming the group-0 hash it stands beside (`report_hash`); a
group-0 hash is reported stored (take_events) only while every group holds its block,
so the service's prefix index never counts a block some layer type lacks.

Block 0 is reserved as the null/padding block: it is never handed out, so padded block
tables and padded slot mappings may point at it without touching live KV.

Pure Python: no torch, no grpc.
"""
from __future__ import annotations

import collections
import hashlib
import logging
from collections.abc import Iterable, Sequence

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Stable (cross-process) hash of one full block, chained on its parent's hash."""
    payload = repr((parent_hash, tuple(int(t) for t in token_ids))).encode()
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "big")


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_groups: int = 1) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        # Head = next to allocate (least recently freed); tail = most recently freed.
        self._free_queue: collections.OrderedDict[int, None] = collections.OrderedDict(
            (block_id, None) for block_id in range(1, num_blocks)
        )
        self._cached: dict[int, int] = {}  # block hash -> block id
        # Net change of the hash map since the last take_events(), insertion-ordered.
        self._stored_events: dict[int, None] = {}
        self._removed_events: dict[int, None] = {}
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_groups = num_groups
        # num_groups > 1: per cached block the hash it reports; per reported hash the
        # number of groups holding it
        self._report_of: dict[int, int] = {}
        self._holders: dict[int, int] = {}

    # -- stats ---------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks with ref count > 0."""
        return self.num_used_blocks / self.num_usable_blocks

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to allocate) first."""
        return list(self._free_queue)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._block_hash[block_id]

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_query_tokens += num_query_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    def take_events(self) -> tuple[list[int], list[int]]:
        """Drain (stored, removed) block hashes: the net change since the last call."""
        stored, removed = list(self._stored_events), list(self._removed_events)
        self._stored_events.clear()
        self._removed_events.clear()
        return stored, removed

    # -- allocation ----------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` from the free-queue head (evicting cached ones), ref 1 each."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} free"
            )
        blocks = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            self._evict(block_id)
            self._ref_cnt[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (prefix hit); revive free cached ones."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_cnt[block_id] == 0:
                del self._free_queue[block_id]
            self._ref_cnt[block_id] += 1

    def free_blocks(self, block_ids: Iterable[int], reuse_first: bool = False) -> None:
        """Drop one reference each; blocks reaching 0 go to the free-queue tail in order
        (`reuse_first`: to its head, the next to be handed out: blocks with nothing worth
        keeping, so that taking and returning them does not cycle the queue through, and
        evict, the cached blocks).

        Pass a request's blocks last-first so its tail blocks (least shared) are evicted
        before its prefix.
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_cnt[block_id] <= 0:
                raise ValueError(f"block {block_id} freed more times than allocated")
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                self._free_queue[block_id] = None
                if reuse_first:
                    self._free_queue.move_to_end(block_id, last=False)

    # -- prefix cache ----------------------------------------------------------------
    def get_cached_block(self, block_hash: int) -> int | None:
        if not self.enable_prefix_caching:
            return None
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: int, report_hash: int | None = None) -> bool:
        """Register a full, computed block under its hash. False if not cached.

        A block with the same contents already cached keeps the map entry; this block
        then stays unhashed and is reused like any other once freed. `report_hash` (hybrid
        pools): the group-0 hash this block's group stands beside (default: its own).
        """
        self._check_id(block_id)
        if not self.enable_prefix_caching:
            return False
        if self._block_hash[block_id] is not None:
            return self._block_hash[block_id] == block_hash
        if block_hash in self._cached:
            return False
        self._block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        if self.num_groups > 1:
            block_hash = self._hold(block_hash, block_hash if report_hash is None else report_hash)
            if block_hash is None:
                return True
        if block_hash in self._removed_events:
            del self._removed_events[block_hash]
        else:
            self._stored_events[block_hash] = None
        return True

    def _hold(self, block_hash: int, report: int) -> int | None:
        """One more group holds `report`: it, once every group does."""
        self._report_of[block_hash] = report
        count = self._holders.get(report, 0) + 1
        self._holders[report] = count
        return report if count == self.num_groups else None

    def _release(self, block_hash: int) -> int | None:
        """One group less holds the hash `block_hash` reports: it, if all did before."""
        report = self._report_of.pop(block_hash)
        count = self._holders[report]
        if count > 1:
            self._holders[report] = count - 1
        else:
            del self._holders[report]
        return report if count == self.num_groups else None

    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is None:
            return
        self._block_hash[block_id] = None
        del self._cached[block_hash]
        if self.num_groups > 1:
            block_hash = self._release(block_hash)
            if block_hash is None:
                return
        if block_hash in self._stored_events:
            del self._stored_events[block_hash]
        else:
            self._removed_events[block_hash] = None
        logger.debug("evicted cached block %d", block_id)

    def _check_id(self, block_id: int) -> None:
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [1, {self.num_blocks})")
