"""HybridKVCacheManager: KV blocks per attention type (model/kv_groups.py), one pool.

Group 0 (full attention) keeps its table in `Request.block_ids` as before; groups 1..
in `Request.group_block_ids`, each as long as it (entry i: the block of positions
[i * block_size, (i + 1) * block_size)). A full-attention group holds the whole context.
A sliding group of window W holds only what the next tokens read: when a request's next
token to compute is at position p, its entries before block (p - W + 1) // block_size
are released to the pool (the entry becomes the null block 0: those positions are
masked out for these layers anyway), so a running request holds ceil(W / B) + 1 blocks
per sliding group (more only while a chunk of prompt is computed).

Per request, as KVCacheManager: get_computed_blocks (prefix hits: per group, see below)
-> allocate_slots (the need summed over groups; stale sliding blocks go first) ->
cache_full_blocks -> trim (a prefill handing its KV over keeps only the window) -> free.

Prefix cache: every group caches its blocks, group j's under the group-0 hash mixed with
j. A hit of k blocks is usable only where every full group holds blocks [0, k) and every
sliding group the blocks of the window before position k * B (the first token computed
reads them). The pool reports a hash to the service only while every group holds its
block (block_pool.py): what the service counts is always reusable.

Hand-over (PD): per group the blocks covering prompt positions [num_cached, P) that the
decode's first token (at P) reads: all of them for a full group, the window's for a
sliding one, concatenated in group order (handover_block_ids); both sides compute the
same list from their own tables.

Pure Python: no torch, no grpc.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from xllm_py.engine.block_pool import NULL_BLOCK_ID, BlockPool
from xllm_py.engine.kv_cache_manager import KVCacheManager, cdiv
from xllm_py.request import Request

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_GROUP_SALT = 0x9E3779B97F4A7C15


def group_hash(block_hash: int, group: int) -> int:
    """The hash group `group` caches a block of chain hash `block_hash` under."""
    return block_hash if group == 0 else (block_hash ^ (group * _GROUP_SALT)) & _MASK64


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, block_pool: BlockPool, group_windows: Sequence[int]) -> None:
        super().__init__(block_pool)
        if len(group_windows) < 2 or group_windows[0]:
            raise ValueError(f"a hybrid pool needs a full group 0 and more, got {group_windows}")
        if block_pool.num_groups != len(group_windows):
            raise ValueError("the block pool must be made with num_groups = the groups")
        self.group_windows = tuple(group_windows)
        self._full = [j for j, w in enumerate(self.group_windows) if not w]
        self._sliding = [j for j, w in enumerate(self.group_windows) if w]
        self._kept_from: dict[str, list[int]] = {}  # per group: entries before it are 0

    # -- queries ---------------------------------------------------------------------
    def tables(self, request: Request) -> list[list[int]]:
        return [request.block_ids, *request.group_block_ids]

    def first_kept_block(self, group: int, first_pos: int) -> int:
        """The first entry group `group` must hold while the next token computed is at
        `first_pos`."""
        window = self.group_windows[group]
        return max(0, first_pos - window + 1) // self.block_size if window else 0

    def held_blocks(self) -> dict[str, int]:
        """Blocks the live requests hold, by attention type ("full", "sliding")."""
        held = {"full": 0, "sliding": 0}
        for request in list(self._requests.values()):  # (one C call: read from other threads)
            for j, table in enumerate(self.tables(request)):
                n = len(table) - table.count(NULL_BLOCK_ID)
                held["sliding" if self.group_windows[j] else "full"] += n
        return held

    def max_tokens_for_one(self, max_chunk_tokens: int) -> int:
        """The longest context one request can hold in the whole pool."""
        bs, usable = self.block_size, self.block_pool.num_usable_blocks
        nf, ns = len(self._full), len(self._sliding)
        cap = max(cdiv(max(self.group_windows) - 1 + max_chunk_tokens, bs) + 1, 1)
        n = usable // (nf + ns)
        if n >= cap:
            n = cap + (usable - (nf + ns) * cap) // nf
        return n * bs

    def _handover_ranges(self, num_cached: int, num_prompt: int) -> list[tuple[int, int]]:
        """Per group, the [lo, hi) of its table a hand-over of the prompt's uncached
        blocks moves (sliding groups: only the blocks the window still holds)."""
        first, last = num_cached // self.block_size, cdiv(num_prompt, self.block_size)
        return [(max(first, self.first_kept_block(j, num_prompt)), last)
                for j in range(len(self.group_windows))]

    def handover_group_sizes(self, num_cached: int, num_prompt: int) -> list[int]:
        return [max(0, hi - lo) for lo, hi in self._handover_ranges(num_cached, num_prompt)]

    def handover_block_ids(self, tables: Sequence[Sequence[int]], num_cached: int,
                           num_prompt: int) -> list[int]:
        out: list[int] = []
        for table, (lo, hi) in zip(tables, self._handover_ranges(num_cached, num_prompt)):
            out.extend(table[lo:hi])
        return out

    # -- prefix hits -------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        """Per group the hit's table (sliding ones: 0 before the window) and its tokens;
        the longest hit every group can serve."""
        pool = self.block_pool
        if not pool.enable_prefix_caching:
            return [], 0
        max_hit = (request.num_tokens - 1) // self.block_size
        hashes = self._update_block_hashes(request, max_hit)
        k = 0
        limit = min(max_hit, len(hashes))
        while k < limit and all(pool.get_cached_block(group_hash(hashes[k], j)) is not None
                                for j in self._full):
            k += 1
        while k > 0 and not self._window_cached(hashes, k):
            k -= 1
        if k == 0:
            return [], 0
        out: list[list[int]] = []
        for j in range(len(self.group_windows)):
            keep = self.first_kept_block(j, k * self.block_size)
            out.append([NULL_BLOCK_ID] * keep + [pool.get_cached_block(group_hash(hashes[i], j))
                                                 for i in range(keep, k)])
        return out, k * self.block_size

    def _window_cached(self, hashes: list[int], k: int) -> bool:
        pool = self.block_pool
        for j in self._sliding:
            for i in range(self.first_kept_block(j, k * self.block_size), k):
                if pool.get_cached_block(group_hash(hashes[i], j)) is None:
                    return False
        return True

    # -- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list | None = None,
                       first_pos: int | None = None) -> list[int] | None:
        """As KVCacheManager.allocate_slots, per group; `first_pos`: the position of the
        next token this request computes (default: right after the computed ones; a
        decode taking a prompt's KV from a peer: the prompt's length)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        pool, bs, rid = self.block_pool, self.block_size, request.request_id
        hits = new_computed_blocks or []
        if hits and request.block_ids:
            raise ValueError(f"request {rid}: prefix hits only at the first allocation")
        if not request.group_block_ids:
            request.group_block_ids = [[] for _ in self.group_windows[1:]]
        tables = self.tables(request)
        num_hit = len(hits[0]) if hits else 0
        start = request.num_computed_tokens + num_hit * bs
        first_pos = start if first_pos is None else first_pos
        num_required = cdiv(start + num_new_tokens, bs)
        kept = self._kept_from.get(rid)
        if kept is not None:
            self._drop_stale(tables, kept, first_pos)
        taken: list[list[int]] = []
        num_new = num_revived = 0
        for j, table in enumerate(tables):
            keep = self.first_kept_block(j, first_pos)
            hit = [b if i >= keep else NULL_BLOCK_ID for i, b in enumerate(hits[j])] if hits else []
            taken.append(hit)
            num_new += max(0, num_required - max(len(table) + len(hit), keep))
            num_revived += sum(1 for b in hit if b and pool.ref_count(b) == 0)
        if num_new + num_revived > pool.num_free_blocks:
            return None
        # Revive the hits first: a hit freed earlier sits in the free queue (often at its
        # head), and new blocks taken before would evict it and hand it out again, to be
        # overwritten while it is read as the hit.
        for hit in taken:
            pool.touch(b for b in hit if b)
        new_blocks = pool.get_new_blocks(num_new)
        it = iter(new_blocks)
        for j, table in enumerate(tables):
            table.extend(taken[j])
            keep = self.first_kept_block(j, first_pos)
            if len(table) < keep:
                table.extend([NULL_BLOCK_ID] * (keep - len(table)))
            table.extend(next(it) for _ in range(num_required - len(table)))
        if kept is None:
            self._requests[rid] = request
            self._num_cached_blocks[rid] = num_hit
            self._kept_from[rid] = [self.first_kept_block(j, first_pos)
                                    for j in range(len(tables))]
            if pool.enable_prefix_caching:
                pool.record_prefix_lookup(request.num_tokens, num_hit * bs)
        return new_blocks

    def trim(self, request: Request, first_pos: int) -> None:
        """Release the sliding blocks the token at `first_pos` and later ones never read."""
        kept = self._kept_from.get(request.request_id)
        if kept is not None:
            self._drop_stale(self.tables(request), kept, first_pos)

    def _log_windows(self, request: Request, k: int) -> None:
        """Log each sliding group's blocks that a later hit of `k` blocks reads (the window
        before them), from the request's table or, where it let them go already, from the
        pool's cache. Logged where a hit is likely to end: the request's prompt (the same
        prompt again, a PD prefill's hand-over) and all it cached (the next turn of a
        conversation); a hit ending elsewhere finds the full groups' blocks only, and
        stops at the last of these points before it."""
        hashes, pool = request.block_hashes, self.block_pool
        for j in self._sliding:
            table = self.tables(request)[j]
            for i in range(self.first_kept_block(j, k * self.block_size), k):
                block = table[i] if i < len(table) and table[i] else None
                if block is None or pool.block_hash(block) != group_hash(hashes[i], j):
                    block = pool.get_cached_block(group_hash(hashes[i], j))
                if block is not None:
                    self._log_offload(block, j, hashes[i])

    def _drop_stale(self, tables: list[list[int]], kept: list[int], first_pos: int) -> None:
        pool = self.block_pool
        for j in self._sliding:
            table, keep = tables[j], min(self.first_kept_block(j, first_pos), len(tables[j]))
            for i in range(kept[j], keep):
                if table[i]:
                    pool.free_blocks((table[i],))
                    table[i] = NULL_BLOCK_ID
            kept[j] = max(kept[j], keep)

    def cache_full_blocks(self, request: Request) -> None:
        pool = self.block_pool
        rid = request.request_id
        if not pool.enable_prefix_caching or rid not in self._requests:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        start = self._num_cached_blocks[rid]
        if num_full <= start:
            return
        hashes = self._update_block_hashes(request, num_full)
        for j, table in enumerate(self.tables(request)):
            offload = self._offloads is not None and not self.group_windows[j]
            for i in range(start, num_full):
                if table[i] and pool.cache_block(table[i], group_hash(hashes[i], j), hashes[i]) \
                        and offload:
                    self._log_offload(table[i], j, hashes[i])
        self._num_cached_blocks[rid] = num_full
        end = request.num_prompt_tokens // self.block_size  # (a hit of the whole prompt)
        if self._offloads is not None and start < end <= num_full:
            self._log_windows(request, end)

    def truncate(self, request: Request, num_blocks: int) -> None:
        """Every group's table cut to `num_blocks` entries (the sliding groups' dropped
        entries before the window stay 0)."""
        if num_blocks < self._num_cached_blocks.get(request.request_id, 0):
            raise ValueError(f"request {request.request_id}: cannot drop cached blocks")
        tables = self.tables(request)
        tail = [t[i] for i in range(len(request.block_ids) - 1, num_blocks - 1, -1)
                for t in tables if t[i]]
        for table in tables:
            del table[num_blocks:]
        self.block_pool.free_blocks(tail, reuse_first=True)  # (never cached)

    def free(self, request: Request) -> None:
        """Release every group's blocks, the tail first (its prefix is evicted last)."""
        if self._offloads is not None and request.request_id in self._requests:
            self._log_windows(request, self._num_cached_blocks.get(request.request_id, 0))
        self._requests.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._kept_from.pop(request.request_id, None)
        tables = self.tables(request)
        if request.block_ids:
            n = len(request.block_ids)
            self.block_pool.free_blocks(t[i] for i in range(n - 1, -1, -1) for t in tables if t[i])
        for table in tables:
            table.clear()
